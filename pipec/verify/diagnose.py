"""What a deadlock's explanation says first: the rank whose own order closes the cycle, the ops its author wrote
(with the `.pipe` line that emitted them) and the change that would break the cycle.

The detailed chain of waits (verify.deadlock.explain) speaks of the streams as run, send/recv included; most of those
instructions were placed by pipec, not written by anyone. So the diagnosis looks first at the *compute orders*
(the program without its send/recv), run on their data dependencies alone: F(s, m) needs F(s-1, m), B/I(s, m)
need F(s, m) and the backward of (s+1, m), W(s, m) needs I(s, m), wherever those run. When that run is stuck,
every rank on the cycle holds an op X (where it is stuck) before an op Y that the rank before it on the cycle
needs: each such rank's own order closes the cycle, and running its Y before its X would break it there. Which
of them to name first is decided, in order, by
1. the micro-batch order: a rank that takes some stage's micro-batches out of increasing order (a swap by hand);
2. the warm-up pattern: the one rank whose number of forwards before its first backward is off the straight
   line the other ranks' lie on (bundled schedules warm up along a line over the ranks);
3. a trial: a change (move Y just before X, or X just after Y) that lets the whole program run (programs of at
   most _TRIAL_OPS compute ops, so that a failure stays quick to explain);
4. the `.pipe` text: an op emitted by a line that only this rank reaches (`if r == 2: ...`);
5. the shape: a rank stuck at a backward waiting for a gradient (its warm-up too short) before one stuck at a
   forward (its warm-up too long).
The runner-up is offered as the other way to break the same cycle.

When the compute orders run, the cycle is in the placement of sends and receives (a hand-written stream file):
then the diagnosis reads the stuck run of the streams (`StreamRun`) and names the send or receive that is queued
behind another op of its own rank, or placed after the op that needs it.

Everything here runs only when the deadlock pass has failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipec.errors import Span
from pipec.ir import Action, ChainLinks, Instruction, Kind, Program, chain_links
from pipec.verify.deadlock import ComputeRun, StreamRun, run_compute_orders
from pipec.verify.diagnose_streams import Diagnosis, stream_diagnosis

# Trials rerun the compute orders once per candidate: bounded so that explaining a failure at P = 32, M = 1024
# stays a matter of seconds (beyond it the choice falls to the text and the shape).
_TRIAL_OPS = 200_000
_MAX_OTHER_CYCLES = 3  # further independent cycles, one line each
_MAX_CYCLE_SHOWN = 8  # ranks of a cycle followed in its line; a longer one shows its two ends
_BACKWARD = (Kind.B, Kind.I)


@dataclass(frozen=True)
class Link:
    """One stuck rank of the compute-order run: at `at` (index in its compute order) its op `waiting` needs
    `needed`, the op at index `needs` of rank `peer`'s compute order (its own rank when it comes later there)."""

    rank: int
    at: int
    waiting: Action
    peer: int
    needs: int
    needed: Action


@dataclass(frozen=True)
class Fix:
    """Rank `rank` holds X (index `x`, where it is stuck) before Y (index `y`), which `needer` waits for."""

    rank: int
    x: int
    y: int
    needer: Link  # the link whose needed op is Y
    own: Link  # the rank's own link: what X waits for
    completes: bool = False  # the trial: with the change below, the whole program runs
    progress: int = -1  # ... or how many instructions ran (-1: not tried)
    # the best change tried: "y before x", "x after y", "swap" (X and Y trade places) or "split" (X and Y are the
    # halves of one overlapped pair: run Y, then X)
    change: str = "y before x"


def diagnose(program: Program, run: ComputeRun | StreamRun, placed: bool | None = None) -> Diagnosis:
    """The diagnosis of a stuck run of `program` (under any model, with or without send/recv). `placed`: whether
    pipec placed the program's send/recv (None: find out, by placing them again), which decides whether positions
    are given in the compute orders or in the streams."""
    orders = program.with_streams(program.compute_streams(), False) if program.has_comms else program
    compute_run = run_compute_orders(orders, "tagged", timed=False)
    if compute_run.stuck:
        return _compute_diagnosis(program, orders, compute_run, placed)
    assert isinstance(run, StreamRun)  # compute orders that run deadlock only through their send/recv placement
    return stream_diagnosis(program, run)


# ---- the compute orders ------------------------------------------------------------------------------------------


def _inputs(action: Action, links: ChainLinks) -> list[tuple[int, tuple[Kind, ...], int]]:
    """(stage, kinds, micro-batch) of what an op reads: any one of the kinds serves (``links``: where each copy's
    chain ends, pipec.ir.chain_links)."""
    stage, kind, mb = action
    has_next, has_previous = links
    if kind is Kind.F:
        return [(stage - 1, (Kind.F,), mb)] if has_previous[stage] else []
    if kind in _BACKWARD:
        found = [(stage, (Kind.F,), mb)]
        if has_next[stage]:
            found.append((stage + 1, _BACKWARD, mb))
        return found
    if kind is Kind.W:
        return [(stage, (Kind.I,), mb)]
    return []


def _halves(waiting: Instruction, needed: Instruction, links: ChainLinks) -> tuple[Action, Action]:
    """The half of `waiting` that reads a half of `needed` (an overlapped pair is one instruction of two ops)."""
    for action in waiting.parts:
        for stage, kinds, mb in _inputs(action, links):
            for other in needed.parts:
                if other.stage == stage and other.mb == mb and other.kind in kinds:
                    return action, other
    return waiting.parts[0], needed.parts[0]  # pragma: no cover - a wait always has its input


def _links(orders: Program, run: ComputeRun) -> dict[int, Link]:
    chain = chain_links(orders.num_stages, orders.pipelines)
    links = {}
    for rank, (peer, _, needs, at) in run.blocked.items():
        waiting, needed = _halves(orders.streams[rank][at], orders.streams[peer][needs], chain)
        links[rank] = Link(rank, at, waiting, peer, needs, needed)
    return links


def _cycles(links: dict[int, Link]) -> list[list[int]]:
    """Each stuck rank waits for one rank: follow the waits to the cycles they end in (lowest rank first)."""
    done: set[int] = set()
    cycles = []
    for start in sorted(links):
        path: list[int] = []
        rank = start
        while rank not in done and rank not in path:
            path.append(rank)
            rank = links[rank].peer
        if rank in path:
            cycles.append(path[path.index(rank) :])
        done.update(path)
    return cycles


def _fixes(cycle: list[int], links: dict[int, Link]) -> list[Fix]:
    """Per rank of the cycle whose needed op comes after the op it is stuck at, or in the same overlapped pair as
    the half that waits (the pair holds it back): the fix on that rank."""
    fixes = []
    for n, rank in enumerate(cycle):
        needer = links[cycle[n - 1]]  # the rank before it on the cycle waits for it
        own = links[rank]
        if needer.needs > own.at or (needer.needs == own.at and needer.needed != own.waiting):
            fixes.append(Fix(rank, own.at, needer.needs, needer, own))
    return fixes


def _trial(orders: Program, fix: Fix) -> Fix:
    """Rerun the compute orders with Y moved just before X, with X moved just after Y, and with the two trading
    places (a swap written by mistake is undone only so); keep the change that gets furthest."""
    best, score = fix, (False, False, -1)
    stream = list(orders.streams[fix.rank])
    x, y = stream[fix.x], stream[fix.y]
    if fix.x == fix.y:  # a pair holding back the half another rank needs: split it, that half first
        changes = {"split": [*stream[: fix.x], fix.needer.needed, fix.own.waiting, *stream[fix.x + 1 :]]}
    else:
        changes = {
            "y before x": [*stream[: fix.x], y, *stream[fix.x : fix.y], *stream[fix.y + 1 :]],
            "x after y": [*stream[: fix.x], *stream[fix.x + 1 : fix.y + 1], x, *stream[fix.y + 1 :]],
            "swap": [*stream[: fix.x], y, *stream[fix.x + 1 : fix.y], x, *stream[fix.y + 1 :]],
        }
    for change, candidate in changes.items():
        if change != "y before x" and fix.y == fix.x + 1:
            break  # adjacent: the three are one change
        streams = list(orders.streams)
        streams[fix.rank] = tuple(candidate)
        changed = orders.with_streams(tuple(streams), False)
        run = run_compute_orders(changed, "tagged", timed=False)
        tried = Fix(fix.rank, fix.x, fix.y, fix.needer, fix.own, not run.stuck, sum(run.stop), change)
        # among changes that run, one that leaves the micro-batches in order (a swap undone) reads as the fix
        if (tried.completes, not _disordered(changed, fix.rank), tried.progress) > score:
            best, score = tried, (tried.completes, not _disordered(changed, fix.rank), tried.progress)
    return best


def _choose(orders: Program, fixes: list[Fix], spans: Sequence[Sequence[Span]] | None) -> list[Fix]:
    """The fixes, most likely first (see the module's docstring)."""
    if sum(len(s) for s in orders.streams) * len(fixes) <= _TRIAL_OPS and len(fixes) > 1:
        fixes = [_trial(orders, fix) for fix in fixes]
    reach = _line_reach(spans) if spans is not None else {}

    def special(fix: Fix) -> bool:
        """X or Y comes from a line that only this rank reaches (`if r == 2: ...`), among three ranks or more."""
        if spans is None or orders.ranks < 3:
            return False
        return any(reach.get((spans[fix.rank][i].file, spans[fix.rank][i].line)) == 1 for i in (fix.x, fix.y))

    outlier = _warmup_outlier(orders, fixes)
    disordered = {fix.rank: _disordered(orders, fix.rank) for fix in fixes}

    def rank_key(fix: Fix) -> tuple:
        backward_first = fix.own.waiting.kind in _BACKWARD and fix.own.peer != fix.rank
        return (
            not disordered[fix.rank], fix.rank != outlier, not fix.completes, not special(fix), not backward_first,
            fix.rank,
        )

    return sorted(fixes, key=rank_key)


def _disordered(orders: Program, rank: int) -> bool:
    """Whether the rank takes the micro-batches of some stage's forwards or backwards out of increasing order, as
    no bundled schedule does: two ops swapped by hand leave that mark on the rank that was edited."""
    return _first_disorder(orders, rank) is not None


def _first_disorder(orders: Program, rank: int) -> tuple[Action, Action] | None:
    """The first op of the rank that comes after one of a later micro-batch of the same stage and kind."""
    last: dict[tuple[int, str], Action] = {}
    for instruction in orders.streams[rank]:
        for action in instruction.parts:
            stage, kind, mb = action
            key = (stage, "F" if kind is Kind.F else "B" if kind in _BACKWARD else "W")
            before = last.get(key)
            if before is not None and before.mb > mb:
                return before, action
            last[key] = action
    return None


def _warmup(orders: Program, rank: int) -> int:
    """How many forwards a rank runs before its first backward."""
    count = 0
    for instruction in orders.streams[rank]:
        for action in instruction.parts:
            if action.kind in _BACKWARD:
                return count
            count += action.kind is Kind.F
    return count


def _warmup_outlier(orders: Program, fixes: list[Fix]) -> int | None:
    """The rank whose warm-up (forwards before its first backward) breaks the pattern of the others, when the
    candidates differ there: the commonest cycle is a rank u at a backward waiting for the gradient of rank d, d
    at a forward waiting for u's activation, u's warm-up shorter than d's; either may be the mistake (u's too
    short, d's too long). Bundled schedules warm up in a regular pattern over the ranks (1F1B: P - r,
    interleaved: a constant - 2r, GPipe and the V shapes: a constant), so the outlier is the one candidate
    without which the other ranks' warm-ups follow one. None: no candidate stands out."""
    candidates = sorted({fix.rank for fix in fixes})
    ranks, mbs = orders.ranks, orders.microbatches
    if not 2 <= len(candidates) <= _MAX_CYCLE_SHOWN:  # each candidate is a pass over the ranks: keep it small
        return None
    warm = [_warmup(orders, rank) for rank in range(ranks)]

    # The warm-ups of a bundled schedule's ranks, most telling first: 1F1B's min(P - r, M), all equal (GPipe, the
    # V shapes) or, with three ranks or more to tell, a straight line (interleaved). Only exact fits count: a
    # warm-up capped by M bends the line for every rank.
    patterns: list[Callable[[list[tuple[int, int]]], bool]] = [
        lambda points: all(w == min(ranks - r, mbs) for r, w in points),
        lambda points: len(points) >= 2 and len({w for _, w in points}) == 1,
        lambda points: len(points) >= 3 and _line_misfit(points) < 1e-9,
    ]
    for fits in patterns:
        found = [rank for rank in candidates if fits([(r, warm[r]) for r in range(ranks) if r != rank])]
        if found:
            return found[0] if len(found) == 1 else None
    return None


def _line_misfit(points: list[tuple[int, int]]) -> float:
    """The sum of squared residuals of the least-squares line through the points."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx if sxx else 0.0
    return sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in points)


def _line_reach(spans: Sequence[Sequence[Span]]) -> dict[tuple[str, int], int]:
    """(file, line) -> how many ranks emit an op from that line."""
    ranks: dict[tuple[str, int], set[int]] = {}
    for rank, rank_spans in enumerate(spans):
        for span in rank_spans:
            ranks.setdefault((span.file, span.line), set()).add(rank)
    return {line: len(found) for line, found in ranks.items()}


def placed_by_pipec(program: Program) -> bool:
    """Whether the program's send/recv are exactly what pipec would place for its compute orders (a compiled
    `.pipe`, or a stream file pipec wrote and nobody edited): then what its author wrote is the compute orders."""
    from pipec.passes.p2p import insert_p2p_ops

    orders = program.with_streams(program.compute_streams(), False)
    return insert_p2p_ops(orders).streams == program.streams


class _Where:
    """Where an op of a compute order was written: the `.pipe` line, or its position in the rank's stream as its
    author wrote it (the compute order when pipec placed the send/recv, else the stream with them)."""

    def __init__(self, program: Program, spans: Sequence[Sequence[Span]] | None, placed: bool | None) -> None:
        self.program = program
        self.spans = spans
        self._positions: dict[int, list[int]] = {}
        if spans is not None or not program.has_comms:
            self.in_stream = False
        else:
            self.in_stream = not (placed if placed is not None else placed_by_pipec(program))

    def __call__(self, rank: int, index: int, after: tuple[int, int] | None = None) -> str:
        """`after`: the (rank, index) named just before, so that a second op of the same line says so briefly."""
        if self.spans is not None:
            span = self.spans[rank][index]
            if after is not None:
                before = self.spans[after[0]][after[1]]
                if before.file == span.file:
                    return "same line" if before.line == span.line else f"line {span.line}"
            return f"line {span.line} of {span.file}"
        if not self.in_stream:
            return f"op {index}"
        if rank not in self._positions:  # compute index -> index in the stream with send/recv
            stream = self.program.streams[rank]
            self._positions[rank] = [
                i for i, ins in enumerate(stream) if not (type(ins) is Action and ins.kind.is_comm)
            ]
        return f"op {self._positions[rank][index]}"


def _role(reader: Action, read: Action) -> str:
    """What `read` is to `reader`, in the words of the explanation."""
    if read.kind is Kind.F and reader.kind is Kind.F:
        return "its input"
    if read.kind is Kind.F:
        return "its forward"
    if reader.kind is Kind.W:
        return "its I"
    return "its gradient"


def _compute_diagnosis(program: Program, orders: Program, run: ComputeRun, placed: bool | None) -> Diagnosis:
    spans = orders.op_spans()  # the `.pipe` lines that emitted the ops, when the program came from one
    where = _Where(program, spans, placed)
    links = _links(orders, run)
    cycles = _cycles(links)
    explained = []
    for cycle in cycles:
        fixes = _fixes(cycle, links)
        explained.append((cycle, _choose(orders, fixes, spans) if fixes else []))
    # the cycle to lead with: one with a fix, lowest rank first (cycles come sorted by their lowest rank)
    explained.sort(key=lambda item: not item[1])
    cycle, fixes = explained[0]
    if not fixes:  # pragma: no cover - data dependencies alone never form a cycle
        link = links[cycle[0]]
        return Diagnosis(f"rank {link.rank}'s {link.waiting} waits for rank {link.peer}'s {link.needed}", link.rank)
    best = fixes[0]
    summary = _sentence(orders, best, where)
    other = next((f for f in fixes[1:] if f.rank != best.rank), None)
    if other is not None:
        summary += f", or on rank {other.rank} {_change(orders, other)}"
    details = []
    if len(cycle) > 1:
        details.append("the cycle in the compute orders: " + _cycle_text(orders, cycle, links, best.rank))
    for _, other_fixes in explained[1 : 1 + _MAX_OTHER_CYCLES]:
        if other_fixes:
            details.append(f"also: {_sentence(orders, other_fixes[0], where)}")
    hidden = len(explained) - 1 - _MAX_OTHER_CYCLES
    if hidden > 0:
        details.append(f"... and {hidden} more {'cycle' if hidden == 1 else 'cycles'} like these")
    return Diagnosis(summary, best.rank, tuple(details))


def _text(instruction: Instruction) -> str:
    """An instruction as a `.pipe` writes it: an overlapped pair as `0F1&3B0` (the stream files' long form,
    `(0F1;3B0)OVERLAP_F_B`, is for the detailed chain)."""
    return str(instruction) if type(instruction) is Action else "&".join(map(str, instruction.parts))


def _change(orders: Program, fix: Fix) -> str:
    stream = orders.streams[fix.rank]
    if fix.x == fix.y:
        return f"split the pair: {fix.needer.needed} first, then {fix.own.waiting}"
    x, y = _text(stream[fix.x]), _text(stream[fix.y])
    if fix.y == fix.x + 1 or fix.change == "swap":
        return f"swap {x} and {y}"
    return f"run {x} after {y}" if fix.change == "x after y" else f"run {y} before {x}"


def _sentence(orders: Program, fix: Fix, where: _Where) -> str:
    """rank R's X (where) comes before Y (where), which ... needs; <the change> (<the shape>)."""
    rank, own, needer = fix.rank, fix.own, fix.needer
    x, y = own.waiting, needer.needed
    head = f"rank {rank}'s {x} ({where(rank, fix.x)}) comes before {y} ({where(rank, fix.y, (rank, fix.x))})"
    if fix.x == fix.y:
        pair = _text(orders.streams[rank][fix.x])
        head = f"rank {rank}'s {pair} ({where(rank, fix.x)}) holds {y} back until {x} can run"
    if needer.rank == rank:  # the rank waits for an op of its own that comes later
        text = f"{head}, {_role(x, y)}, which it needs"
    else:
        reader = f"rank {needer.rank}'s {needer.waiting}"
        source = own.needed if own.peer == needer.rank else f"rank {own.peer}'s {own.needed}"
        which = f", but {reader} needs {y}" if fix.x == fix.y else f", which {reader} needs"
        text = f"{head}{which} as {_role(needer.waiting, y)} before {source} can send {x} {_role(x, own.needed)}"
    text += f"; {_change(orders, fix)}"
    shape = _shape(orders, fix)
    return text + (f" ({shape})" if shape else "")


def _shape(orders: Program, fix: Fix) -> str:
    """A known shape of mistake, in words: micro-batches out of order, a warm-up too short or too long."""
    if fix.x == fix.y:
        return ""
    disorder = _first_disorder(orders, fix.rank)
    if disorder is not None:
        return f"rank {fix.rank} runs {disorder[0]} before {disorder[1]}: micro-batches out of order"
    stream = orders.streams[fix.rank]
    x, y = fix.own.waiting, fix.needer.needed
    before_x = [a for ins in stream[: fix.x] for a in ins.parts]
    if any(a.kind in _BACKWARD for a in before_x):
        return ""  # not the first backward: a mistake in the steady state, not in the warm-up
    forwards = sum(1 for a in before_x if a.kind is Kind.F)
    if x.kind in _BACKWARD and y.kind is Kind.F:  # its first backward before a forward it or its peer needs
        return f"rank {fix.rank} warms up with {_count(forwards, 'forward')} before its first backward, too few"
    if x.kind is Kind.F and y.kind in _BACKWARD and fix.own.peer != fix.rank:
        between = [a for ins in stream[fix.x : fix.y] for a in ins.parts]
        if not any(a.kind in _BACKWARD for a in between):
            forwards += sum(1 for a in between if a.kind is Kind.F)
            return f"rank {fix.rank} warms up with {_count(forwards, 'forward')} before its first backward, too many"
    return ""


def _cycle_text(orders: Program, cycle: list[int], links: dict[int, Link], start: int) -> str:
    """X waits for Y on rank p, which rank p runs after X_p, which waits for ... , back to the start."""
    n = cycle.index(start)
    ordered = cycle[n:] + cycle[:n]
    first = links[start]
    parts = [f"{first.waiting} (rank {start}) waits for {first.needed} (rank {first.peer})"]
    half, long = _MAX_CYCLE_SHOWN // 2, len(ordered) > _MAX_CYCLE_SHOWN
    for hop, rank in enumerate([*ordered[1:], start], 1):
        needed = links[ordered[hop - 1]]  # the link that waits for this rank
        if long and half <= hop < len(ordered) - half:
            continue  # a cycle through many ranks: its two ends say how it closes
        if long and hop == len(ordered) - half:
            parts.append(f"... through {len(ordered) - 2 * half} more ranks to {needed.needed} (rank {rank})")
        own = links[rank]
        if needed.needs > own.at:
            parts.append(f"which rank {rank} runs after {own.waiting}")
        elif needed.needs == own.at and needed.needed != own.waiting:
            parts.append(f"which rank {rank} runs in one pair with {own.waiting}")
        if rank == start:
            break
        parts.append(f"which waits for {own.needed} (rank {own.peer})")
    return ", ".join(parts)


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")
