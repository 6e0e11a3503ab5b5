"""Readable counterexamples for a deadlock: the chain of waits and a step-by-rank grid around the stuck point.

`explain_stuck_compute_orders` explains a stuck `run_compute_orders` (a program without send/recv), and
`explain_stuck_streams` a stuck `run_streams` (with send/recv); both start with pipec.verify.diagnose's verdict in
the terms of the ops the author wrote. Every instruction is written in its one text form, ``str(instruction)``
(torch's `1RECV_F3`), as everywhere else.
"""

from __future__ import annotations

from pipec.ir import Program
from pipec.verify.deadlock.runs import Blocked, ComputeRun, StreamRun, Wait
from pipec.verify.diagnose import diagnose

GRID_STEPS = 12  # rows of the grid, ending at the stuck point
GRID_MAX_RANKS = 8  # above this, the grid shows only the ranks named in the explanation
MAX_LISTED = 16  # stuck ranks named in the first line, and "also stuck" lines: at P = 10,000 all of them would be
# 20,000 lines that say the same thing
MAX_CHAIN = 12  # links of the chain of waits shown before the rest are counted in one line (then its last link): a
# cycle through thousands of ranks would otherwise print thousands of lines that say the same thing


def _head(program: Program, run: ComputeRun | StreamRun, placed: bool | None) -> tuple[list[str], int]:
    """The first lines: who cannot finish and why, in the terms of the ops the author wrote (pipec.verify.diagnose),
    then the header of the detailed chain. Returns them and the rank the chain starts at: the one whose own order
    closes the cycle, not merely the lowest stuck rank."""
    stuck = run.stuck
    diagnosis = diagnose(program, run, placed)
    lines = [
        f"deadlock under the {run.model} model: {_plural(len(stuck), 'rank')} cannot finish: {diagnosis.summary}",
        *(f"  {line}" for line in diagnosis.details),
        f"  the waits {'in the streams ' if program.has_comms else ''}as run, "
        f"from rank {diagnosis.start if diagnosis.start in stuck else stuck[0]} "
        f"(stuck: {'rank' if len(stuck) == 1 else 'ranks'} {_rank_list(stuck)}):",
    ]
    return lines, diagnosis.start if diagnosis.start in stuck else stuck[0]


def explain_stuck_compute_orders(program: Program, run: ComputeRun, placed: bool | None = None) -> str:
    """A deadlock of compute orders run on their data dependencies (`placed`: see pipec.verify.diagnose)."""
    stuck = run.stuck
    lines, start = _head(program, run, placed)
    chain, closes = _chain(run, start)
    for n in _shown_links(len(chain)):
        if n < 0:
            lines.append(_hidden_links(len(chain)))
            continue
        rank = chain[n]
        wait = run.blocked[rank]
        head = f"rank {rank} at op" if n == 0 else f"rank {rank} is stuck at op"
        link = " waits for" if n == 0 else ", which waits for"
        lines.append(
            f"    {head} {_op(program, rank, wait[3])}{_batch(program, run, rank)}{link} "
            f"{_target(program, run, rank, wait)};"
        )
    if run.blocked[chain[-1]][0] == chain[-1]:
        lines.append(f"    rank {chain[-1]} can never reach that op: it waits for itself")
    else:
        lines.append(f"    and rank {closes} is on this chain already: the waits form a cycle, no rank on it can move")
    others = [r for r in stuck if r not in chain]
    for rank in others[:MAX_LISTED]:
        wait = run.blocked[rank]
        lines.append(f"    also stuck: rank {rank} at op {_op(program, rank, wait[3])}, waiting for "
                     f"{_target(program, run, rank, wait)}")
    lines.extend(_more(others))
    lines.append("")
    lines.extend(grid(program, run, _grid_ranks(program, chain, others)))
    return "\n".join(lines)


def _shown_links(length: int) -> list[int]:
    """The indices of the links of a chain of `length` that are printed, -1 where the hidden ones are counted: the
    first MAX_CHAIN and the last, the one that closes the cycle; all of them when at most one would be hidden (the
    line that counts it would take its place)."""
    if length <= MAX_CHAIN + 2:
        return list(range(length))
    return [*range(MAX_CHAIN), -1, length - 1]


def _hidden_links(length: int) -> str:
    return f"    ... {length - MAX_CHAIN - 1} more ranks, each waiting for the next ..."


def _grid_ranks(program: Program, chain: list[int], others: list[int]) -> list[int]:
    """The grid's columns: every rank of a small program, else the ranks of the chain's printed links (at most
    GRID_MAX_RANKS of them, the last link's included) and the first few others stuck."""
    if program.ranks <= GRID_MAX_RANKS:
        return list(range(program.ranks))
    printed = [chain[n] for n in _shown_links(len(chain)) if n >= 0]
    if len(printed) > GRID_MAX_RANKS:
        printed = [*printed[: GRID_MAX_RANKS - 1], printed[-1]]
    return sorted(set(printed) | set(others[:4]))


def _rank_list(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:MAX_LISTED]))
    return shown if len(ranks) <= MAX_LISTED else f"{shown}, ..."


def _more(others: list[int]) -> list[str]:
    hidden = len(others) - MAX_LISTED
    return [f"    ... and {hidden} more stuck {'rank' if hidden == 1 else 'ranks'}"] if hidden > 0 else []


def _chain(run: ComputeRun, start: int) -> tuple[list[int], int]:
    """Follow each stuck rank's blocking wait until a rank repeats. Returns the ranks in order and the repeat."""
    chain: list[int] = []
    rank = start
    while rank not in chain:
        chain.append(rank)
        rank = run.blocked[rank][0]
    return chain, rank


def _op(program: Program, rank: int, index: int) -> str:
    return f"{index} {program.streams[rank][index]}"


def _batch(program: Program, run: ComputeRun, rank: int) -> str:
    ops = run.units.ops(rank, run.stop[rank])
    if len(ops) < 2:
        return ""
    stream = program.streams[rank]
    return f" (in the batch of ops {ops[0]}-{ops[-1]}: {' '.join(str(stream[i]) for i in ops)})"


def _target(program: Program, run: ComputeRun, rank: int, wait: Wait) -> str:
    q, threshold, j, _ = wait
    posted = threshold == run.units.unit_of[q][j]
    what = f"op {j} {program.streams[q][j]}"
    if q == rank:
        return f"its own {what}, which comes later in its stream"
    return f"rank {q} {what} {'to be posted' if posted else 'to complete'}"


def explain_stuck_streams(program: Program, run: StreamRun, placed: bool | None = None) -> str:
    """A deadlock of streams with send/recv: each stuck rank waits at a compute for a batch, at the end of the step
    for its batches, or at an op for one of its own later ops; a batch waits behind the rank's earlier batch or for
    a counterpart that the peer never posts or never gets running. The chain follows those waits to a cycle."""
    stuck = run.stuck
    lines, closes = _head(program, run, placed)
    chain: list[int] = []
    while closes >= 0 and closes not in chain:
        chain.append(closes)
        why = run.blocked[closes]
        closes = why.peer if why.peer_state in ("posted", "queued", "run") and why.peer in run.blocked else -1
    for n in _shown_links(len(chain)):
        if n < 0:
            lines.append(_hidden_links(len(chain)))
            continue
        lines.append(("    " if n == 0 else "    then ") + _reason(program, run, run.blocked[chain[n]]) + ";")
    last = run.blocked[chain[-1]]
    if closes >= 0:
        lines.append(f"    and rank {closes} is on this chain already: the waits form a cycle, no rank on it can move")
    elif last.peer_state == "later":
        lines.append(f"    rank {last.rank} can never reach that op: it waits for itself")
    elif last.peer_state == "none":
        lines.append("    and no rank will ever post that counterpart")
    others = [r for r in stuck if r not in chain]
    for rank in others[:MAX_LISTED]:
        lines.append(f"    also stuck: {_reason(program, run, run.blocked[rank])}")
    lines.extend(_more(others))
    lines.append("")
    lines.extend(grid(program, run, _grid_ranks(program, chain, others)))
    return "\n".join(lines)


def _batch_text(program: Program, run: StreamRun, rank: int, batch: int) -> str:
    ops = run.units.ops(rank, run.batch_units[rank][batch])
    stream = program.streams[rank]
    span = f"op {ops[0]}" if len(ops) == 1 else f"ops {ops[0]}-{ops[-1]}"
    return f"its batch of {span} ({' '.join(str(stream[i]) for i in ops)})"


def _reason(program: Program, run: StreamRun, why: Blocked) -> str:
    rank, stream = why.rank, program.streams[why.rank]
    if why.state == "local":
        where = f"rank {rank} at op {_op(program, rank, why.op)}"
        if why.peer_state == "later":
            return f"{where} waits for its own op {_op(program, rank, why.peer_op)}, which comes later in its stream"
        return f"{where} waits for rank {why.peer} op {_op(program, why.peer, why.peer_op)} to run"
    if why.state == "sync" and why.batch < 0:
        where = f"rank {rank} at op {_op(program, rank, why.at)} waits for"
        group = stream[why.at].mb
        if why.peer_state == "none":
            return f"{where} rank {why.peer}'s SYNC of group {group}, which rank {why.peer} never issues"
        target = f"rank {why.peer} op {_op(program, why.peer, why.peer_op)}"
        if why.peer_state == "posted":
            return f"{where} {target} to be reached (a SYNC completes when every member of its group is there)"
        return f"{where} {target}, reached but queued behind an earlier batch of rank {why.peer}"
    if why.state in ("compute", "sync"):
        text = f"rank {rank} at op {_op(program, rank, why.at)} waits for {_batch_text(program, run, rank, why.batch)}"
    else:
        text = f"rank {rank} at the end of the step waits for {_batch_text(program, run, rank, why.batch)}"
    if why.behind >= 0:
        text += f", queued behind {_batch_text(program, run, rank, why.behind)}"
    text += f", whose op {why.op} {stream[why.op]} "
    if why.peer_state == "none":
        return text + "has no counterpart any rank will post"
    target = f"rank {why.peer} op {_op(program, why.peer, why.peer_op)}"
    if why.peer_state == "posted":
        return text + f"needs {target} to be posted"
    return text + f"needs {target}, posted but queued behind an earlier batch of rank {why.peer}"


def grid(program: Program, run: ComputeRun | StreamRun, ranks: list[int]) -> list[str]:
    """The last GRID_STEPS steps up to the stuck point, one column per rank; `*` marks where a rank is stuck.

    Steps come from the run's lockstep timing: an instruction takes one step, a batch's ops take consecutive
    steps, and a unit starts no earlier than the step after the ops it waits for.
    """
    cells: dict[tuple[int, int], str] = {}
    top = 0
    units = run.units
    for rank in ranks:
        stream, finish, stop = program.streams[rank], run.finish[rank], run.stop[rank]
        reach = finish[stop - 1] if stop else 0
        if stop < len(units.starts[rank]) - 1:
            for k, index in enumerate(units.ops(rank, stop)):
                cells[(reach + k, rank)] = f"{stream[index]}*"
                top = max(top, reach + k + 1)
        elif rank in run.blocked:  # a run of the streams: at the end of the step, waiting for its batches
            cells[(reach, rank)] = "end*"
            top = max(top, reach + 1)
        else:
            top = max(top, reach)
    low = max(0, top - GRID_STEPS)
    for rank in ranks:
        stream, finish = program.streams[rank], run.finish[rank]
        for unit in range(run.stop[rank] - 1, -1, -1):
            begin = finish[unit - 1] if unit else 0
            if finish[unit] <= low:
                break
            for k, index in enumerate(units.ops(rank, unit)):
                if low <= begin + k < top:
                    cells[(begin + k, rank)] = str(stream[index])
    width = max([len(v) for v in cells.values()] + [len(f"rank {r}") for r in ranks])
    out = ["step  " + "  ".join(f"{'rank ' + str(r):<{width}}" for r in ranks).rstrip()]
    for step in range(low, top):
        out.append(f"{step:>4}  " + "  ".join(f"{cells.get((step, r), '.'):<{width}}" for r in ranks).rstrip())
    out.append("(* = the rank is stuck here; . = idle or waiting)")
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")
