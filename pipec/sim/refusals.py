"""Why a program is not simulated: the structure pass's verdict, and the messages for what the run trips over (a
p2p order mismatch, a compute before its input, an op off its rank, a deadlock with the waits that hold it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipec.errors import ScheduleError
from pipec.ir import Action, Instruction, Kind, Program
from pipec.p2p_rule import SENDS, message_id, peer_of

if TYPE_CHECKING:
    from pipec.sim.state import Run


def structure_verdict(program: Program, p2p: str) -> str:
    """`pipec check`'s structure verdict on what the model runs ("" when sound): the whole program, or under
    ``ideal``, which ignores send/recv, its compute orders."""
    from pipec.verify import check_structure

    if p2p == "ideal" and program.has_comms:
        program = program.with_streams(program.compute_streams(), has_comms=False)
    problems = check_structure(program)
    if not problems:
        return ""
    head = "structure FAILED (as `pipec check` reports it), so the schedule is not simulated:"
    return "\n".join([head, *("  " + line for line in problems)])



def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def mismatch(program: Program, send_entry: list, recv_entry: list) -> str:
    src, dst = send_entry[2], recv_entry[2]
    send, recv = program.streams[src][send_entry[3]], program.streams[dst][recv_entry[3]]
    k = sum(1 for a in program.streams[src][: send_entry[3] + 1] if _is_send_to(program, a, src, dst))
    return (
        f"p2p order mismatch between rank {src} and rank {dst}: the {_ordinal(k)} message from rank {src} to "
        f"rank {dst} is {send} (op {send_entry[3]} on rank {src}), but the {_ordinal(k)} receive on rank {dst} "
        f"from rank {src} is {recv} (op {recv_entry[3]}); messages on one pair of ranks match in issue order"
    )


def _is_send_to(program: Program, instruction: Instruction, src: int, dst: int) -> bool:
    if not isinstance(instruction, Action) or instruction.kind not in SENDS:
        return False
    return peer_of(instruction, program.stage_to_rank) == dst


def no_receive(action: Action, rank: int, pos: int) -> None:
    stage, kind, _ = action
    what = f"activation from stage {stage - 1}" if kind is Kind.F else f"gradient from stage {stage + 1}"
    raise ScheduleError(
        f"rank {rank}: op {pos} {action} runs before its input {what} is received "
        "(no receive for it is posted before it)"
    )


def early(action: Action, rank: int, pos: int, what: str) -> None:
    raise ScheduleError(f"rank {rank}: op {pos} {action} runs before {what} has finished")


def misplaced(program: Program, rank: int, pos: int, instruction: Instruction, action: Action) -> None:
    """A compute op out of range or on a rank that does not hold its stage (the structure pass then says more)."""
    stage, _, mb = action
    if not 0 <= mb < program.microbatches:
        why = f"names micro-batch {mb}, outside 0..{program.microbatches - 1}"
    elif not 0 <= stage < program.num_stages:
        why = f"names stage {stage}, outside 0..{program.num_stages - 1}"
    else:
        why = f"runs stage {stage}, which lives on rank {program.stage_to_rank[stage]}"
    raise ScheduleError(f"rank {rank}: op {pos} {instruction} {why}")


def check_pair_order(program: Program) -> None:
    """Raise the p2p order mismatch, if any, that a deadlock kept the simulation from reaching: the k-th send from
    src to dst against the k-th receive on dst from src, over the whole streams."""
    P, where = program.ranks, program.stage_to_rank  # noqa: N806
    sent: dict[int, list] = {}
    received: dict[int, list] = {}
    for rank, stream in enumerate(program.streams):
        for pos, action in enumerate(stream):
            if type(action) is not Action or not action.kind.is_p2p:
                continue
            peer, message = peer_of(action, where), message_id(action, program.microbatches)
            if action.kind in SENDS:
                sent.setdefault(rank * P + peer, []).append((0.0, message, rank, pos, -1))
            else:
                received.setdefault(peer * P + rank, []).append((0.0, message, rank, pos, -1))
    for pair, entries in sent.items():
        for send_entry, recv_entry in zip(entries, received.get(pair, ()), strict=False):
            if send_entry[1] != recv_entry[1]:
                raise ScheduleError(mismatch(program, send_entry, recv_entry))


def deadlock_message(run: Run, stuck: list[int]) -> str:
    """The message for a run that ended with ranks ``stuck``. Each stuck rank: a send ahead of its value it cannot
    post, or the instruction its host waits at (or the end of the step) and the batch at the head of its NCCL
    stream with the ops whose counterparts never run. Raises the p2p order mismatch instead when one on a channel
    is what kept the run from reaching it (and no send ahead of its value is the cause)."""
    program, position, premature = run.program, run.position, run.premature
    unsent = [_premature_send(program, r, position[r], premature[r]) for r in stuck if premature[r] >= 0]
    if run.tagged:
        return "\n".join([f"deadlock under the tagged p2p model: rank(s) {stuck} cannot finish", *unsent])
    if not unsent:  # a send ahead of its value is the cause; a mismatch on the channel comes second
        check_pair_order(program)
    P, where = program.ranks, program.stage_to_rank  # noqa: N806
    batches, head, b_lo, b_hi, b_start = run.batches, run.head, run.b_lo, run.b_hi, run.b_start
    lines = [f"deadlock under the {run.p2p} p2p model: {len(stuck)} rank(s) cannot finish", *unsent]
    for rank in (r for r in stuck if premature[r] < 0):
        stream = program.streams[rank]
        pos = position[rank]
        at = f"is stuck at op {pos} {stream[pos]}" if pos < len(stream) else "is stuck at the end of the step"
        if head[rank] == len(batches[rank]) and pos < len(stream) and stream[pos].parts[0].kind is Kind.SYNC:
            lines.append(f"rank {rank} {at}, waiting for {_absent(run, rank, stream[pos])}")
            continue
        if head[rank] == len(batches[rank]):  # cannot happen: the host stops at a compute, a SYNC or the end
            lines.append(f"rank {rank} {at}")
            continue
        b = batches[rank][head[rank]]
        batch = " ".join(map(str, stream[b_lo[b] : b_hi[b]]))
        if b_start[b] < 0:  # cannot happen: a posted head batch always runs; kept for a clear message
            lines.append(f"rank {rank} {at}; its batch [{batch}] (op {b_lo[b]}) never starts")
            continue
        waiting = []
        for i in range(b_lo[b], b_hi[b]):
            action = stream[i]
            peer = peer_of(action, where)
            if action.kind in SENDS:
                pair = run.pair_ids[rank * P + peer]
                mine, theirs, what = run.sends[pair], run.recvs[pair], f"receive from rank {rank}"
            else:
                pair = run.pair_ids[peer * P + rank]
                mine, theirs, what = run.recvs[pair], run.sends[pair], f"send to rank {rank}"
            k = next((j for j, e in enumerate(mine) if e[2] == rank and e[3] == i), None)
            if k is not None and k >= len(theirs):
                waiting.append(f"{action} waits for rank {peer}'s {_ordinal(k + 1)} {what} to run")
        lines.append(f"rank {rank} {at}, waiting for batch [{batch}] (op {b_lo[b]}): " + "; ".join(waiting))
    return "\n".join(lines)


def _absent(run: Run, rank: int, sync: Action) -> str:
    """The members a stuck SYNC waits for: those not at their matching SYNC of the group."""
    group = sync.mb
    there = run.sync_arrived.get((group, run.sync_passed[rank].get(group, 0)), {})
    missing = sorted(q for q in run.sync_members[group] if q not in there)
    return f"rank(s) {missing} to reach their SYNC of group {group} (a collective starts when every member is there)"


def _premature_send(program: Program, rank: int, pos: int, send_pos: int) -> str:
    """The line for a rank stuck at a batch holding a send of a value it has not computed: which value, and where
    its stream computes it (later, or nowhere)."""
    stream = program.streams[rank]
    send = stream[send_pos]
    producers = (Kind.F,) if send.kind is Kind.SEND_F else (Kind.B, Kind.I)
    value = "output" if send.kind is Kind.SEND_F else "input gradient"
    what = f"stage {send.stage}'s {value} for micro-batch {send.mb}"
    later = next(
        (f"op {i} {x}" for i, x in enumerate(stream) for a in x.parts
         if a.stage == send.stage and a.mb == send.mb and a.kind in producers),
        None,
    )
    where = f"its stream computes it only later, at {later}" if later else "its stream never computes it"
    batch = "" if pos == send_pos else f" (in the batch at op {pos}, which it cannot post)"
    return f"rank {rank} is stuck at op {send_pos} {send}{batch}: it sends {what}, not computed yet; {where}"
