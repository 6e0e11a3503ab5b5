"""list_schedule: per-rank compute orders chosen by simulated time (docs/design/cost_aware.md, section 3).

An event-driven list scheduler over all ranks at once. When a rank is free it runs the best of its candidates that
is ready and fits in memory; the result is an ordinary compute-only Program, so place_p2p, verify and simulate treat
it as any other. The rules are Python callables (a `choose` section compiles to them: frontend/choose.py).

- Candidates of a rank: per chunk c, the next micro-batch of F[c]'s counter, of the backward counter (B or I, one
  kind per schedule) and the oldest pending W of chunk c (the queue I fills), as counters run in programs.
- Readiness is passes/p2p.py's replay rule: F(s, m) after F(s-1, m); B/I(s, m) after F(s, m) and the backward of
  (s+1, m); W(s, m) after I(s, m); an input from another rank arrives ``message_time`` after its producer ends, and
  without overlap the sender stays busy ``message_time`` per send it posts.
- Memory is verify/memory.py's model (ir.activation_deltas times the stage size, the same float sums and the same
  tolerance), so the live profile the scheduler admits by is exactly ``memory_profile`` of its output.
- Times are Fractions (``Fraction(str(x))``), so equal costs tie exactly and the output is deterministic.
- Overlapped pairs (``Rules.overlap``, a section's `overlap` line): with the costs' FB, the chosen F (or B/I) runs
  with the best ready op of the other side of another micro-batch (the guard's and the limit's, their deltas
  added) as one instruction, when pipec.p2p_rule.pair_duration makes it shorter than its halves.
- At each moment the free ranks choose in rank order, and the pass repeats until none starts anything: a start
  makes its output's arrival known, which a waiting rank's ``gap`` reads.
- Besides the op itself, a Candidate carries what the library's cost-aware rules read (pipec/schedules/zb_auto.pipe,
  v_half.pipe, v_min.pipe, zbv_mem.pipe): ``gap`` (fill a wait with a W only if it fits), ``inflight`` (1F1B's depth),
  ``work`` (the steady period, to pace new micro-batches), ``owed`` (the memory a rank's started micro-batches
  will still claim, to reserve it and avoid a memory deadlock) and ``bound`` (the limit, in the units of ``live``).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import partial
from typing import NamedTuple

from pipec.errors import PipecInputError
from pipec.ir import (
    DEFAULT_INPUT_FRACTION,
    MEMORY_TOLERANCE,
    Action,
    ChainLinks,
    Kind,
    Overlap,
    Program,
    activation_deltas,
    chain_links,
)
from pipec.limits import MAX_SECONDS, MAX_STEPS, check_sizes
from pipec.p2p_rule import DEFAULT_DURATION, CostModel, pair_duration, receiving_ranks

NEVER = Fraction(10**18)  # the gap when no waiting input of the rank is known to be on its way


class Candidate(NamedTuple):
    """One op a rank may start now, with what the rules may look at (the names of the design's table)."""

    rank: int
    kind: Kind
    chunk: int
    stage: int
    mb: int
    now: Fraction  # when the rank became free (the decision time)
    ready: Fraction  # when its inputs exist on this rank (<= now)
    dur: Fraction
    live: float  # the rank's live activation units before it
    after: float  # ... and after it
    idle: bool  # no F/B/I candidate of the rank is ready and fits in memory
    blocked: bool  # a ready F is refused by the memory limit
    gap: Fraction  # until the earliest known readiness of a waiting F/B/I (its producer started); NEVER if none
    inflight: int  # the rank's forwards whose backward has not run, all chunks (count(F) - count(B or I))
    wpending: int  # the rank's W waiting in the queues, all chunks
    work: Fraction  # the rank's busy time per micro-batch (all its ops of one micro-batch): the steady period
    owed: float  # units the rank's later chunks will still add for micro-batches its first chunk has forwarded
    bound: float  # the rank's memory limit in the units of live (NEVER when memory does not restrict the choice)


@dataclass(frozen=True)
class Rules:
    """The rule spec. ``takes``: the kinds ranks run, in tie-break order (F, then B, or I and W). ``priority``:
    a key, higher first. ``admit``: a guard (the design's `if`). ``limit``: a rank's memory limit, None for the
    program's declared bound (or none). Remaining ties: chunk ascending, kind in ``takes`` order, mb ascending."""

    takes: tuple[Kind, ...]
    priority: Callable[[Candidate], tuple] = lambda c: ()
    admit: Callable[[Candidate], bool] | None = None
    limit: Callable[[int], float | None] | None = None
    # run the chosen F (or backward) overlapped with the best ready backward (or F) of another micro-batch, as one
    # instruction, when the costs give the pair its own duration (FB) and it is shorter than its halves
    overlap: bool = False


class Timeline(NamedTuple):
    program: Program  # the compute orders
    starts: tuple[tuple[Fraction, ...], ...]  # per rank, each op's start
    live: tuple[tuple[float, ...], ...]  # per rank, live units after each op (memory_profile of the stream)
    makespan: Fraction


def list_schedule(
    template: Program,
    rules: Rules,
    costs: CostModel | None = None,
    input_fraction: float = DEFAULT_INPUT_FRACTION,
    stage_sizes: Sequence[float] | None = None,
    max_steps: int = MAX_STEPS,
) -> Program:
    """The compute orders ``rules`` choose under ``costs`` (None: the defaults, F=1, B=2, I=W=1, messages free) for
    ``template``'s P, M, V, placement and forward_only (its streams are ignored). ``input_fraction`` and
    ``stage_sizes`` are the verifier's memory model; ``max_steps`` bounds the work (candidate evaluations)."""
    return schedule_timeline(template, rules, costs, input_fraction, stage_sizes, max_steps).program


def schedule_timeline(
    template: Program,
    rules: Rules,
    costs: CostModel | None = None,
    input_fraction: float = DEFAULT_INPUT_FRACTION,
    stage_sizes: Sequence[float] | None = None,
    max_steps: int = MAX_STEPS,
) -> Timeline:
    """list_schedule with its timeline: each op's start, the live memory after it, the makespan."""
    run = _start_run(template, rules, costs, input_fraction, stage_sizes, max_steps)
    events = run.events
    while run.left:
        if not events:  # nothing runs and nothing will arrive: no rank can ever pick again
            raise PipecInputError(
                _stuck(run.ranks, run.now, run.live, run.limits, partial(_candidates, run), partial(_fits, run))
            )
        now = run.now = events[0][0]
        while events and events[0][0] == now:  # every completion and wake-up at this time, before any choice
            _, _, rank, action = heapq.heappop(events)
            if action is None:
                run.busy[rank] = False
        # a start can make a waiting rank's gap known (done is recorded at the start), so the pass repeats at this
        # time until no rank starts anything; a rank picks at most once a pass, and a busy one never
        started = True
        while started:
            started = False
            for rank in range(run.ranks):
                if run.busy[rank]:
                    continue
                best, ready = _pick(run, rank)
                if best is not None:
                    _start(run, rank, *_paired(run, best, ready))
                    started = True
    makespan = max((t for t, _, _, action in events if action is None), default=run.now)  # the last ops' ends
    program = replace(template, streams=tuple(tuple(s) for s in run.out), has_comms=False)
    return Timeline(program, tuple(map(tuple, run.starts)), tuple(map(tuple, run.lives)), makespan)


@dataclass
class _Run:
    """One list-scheduling run: the problem as the scheduler reads it, and its state (per rank: the counters of
    each chunk, the W queues, busy, live memory, the ops chosen so far). Made per call; nothing outlives it."""

    ranks: int
    n_mb: int
    where: tuple[int, ...]  # stage -> rank
    links: ChainLinks  # per stage, whether its forward / backward hands on (pipec.ir.chain_links)
    rules: Rules
    back: Kind  # I when the rules split the backward, else B
    order: dict[Kind, int]  # tie-break rank of each kind the rules take
    table: dict[Kind, list[float]]  # the costs' durations, per kind, per stage
    dur: dict[Kind, list[Fraction]]  # the same as exact fractions, for the kinds the rules take
    pair_row: list[float] | None  # an overlapped pair's own duration per stage (FB), when the rules pair ops
    forward_to: Sequence[int | None]  # where each stage's output goes
    backward_to: Sequence[int | None]  # where each stage's input gradient goes
    delay: Fraction  # message time
    post: Fraction  # what posting one send costs its rank (the message time unless sends overlap compute)
    deltas: dict[Kind, float]
    sizes: list[float]
    stages: list[tuple[int, ...]]  # per rank, its stages in chunk order
    work: list[Fraction]  # per rank, busy time per micro-batch
    limits: list[float | None]
    max_steps: int
    # per rank, per chunk: the micro-batches of its stage's copy, in order (the k-th F or backward of a chunk is
    # the k-th of them; one pipeline: range(M))
    routed: list[list[Sequence[int]]] = field(default_factory=list)
    fwd: list[list[int]] = field(default_factory=list)
    bwd: list[list[int]] = field(default_factory=list)
    queue: list[list[deque[int]]] = field(default_factory=list)  # per chunk, mbs whose W is pending
    done: dict[tuple[int, str, int], Fraction] = field(default_factory=dict)  # (stage, F/G/I, mb) -> producer's end
    busy: list[bool] = field(default_factory=list)
    live: list[float] = field(default_factory=list)
    out: list[list[Action]] = field(default_factory=list)
    starts: list[list[Fraction]] = field(default_factory=list)
    lives: list[list[float]] = field(default_factory=list)
    events: list[tuple[Fraction, int, int, Action | None]] = field(default_factory=list)
    seq: int = 0
    steps: int = 0
    left: int = 0
    now: Fraction = Fraction(0)
    deadline: float = 0.0
    clock: int = 1024


def _start_run(
    template: Program,
    rules: Rules,
    costs: CostModel | None,
    input_fraction: float,
    stage_sizes: Sequence[float] | None,
    max_steps: int,
) -> _Run:
    """The run's problem, checked, and its empty state: every rank free at time 0."""
    ranks, n_mb, where, last = template.ranks, template.microbatches, template.stage_to_rank, template.num_stages - 1
    check_sizes(ranks, n_mb, template.chunks)
    back = Kind.I if Kind.I in rules.takes else Kind.B
    needed = {Kind.F} if template.forward_only else {Kind.F, back} | ({Kind.W} if back is Kind.I else set())
    if set(rules.takes) != needed:  # any other set of kinds could never finish (or would run an op twice)
        raise PipecInputError(
            f"the rules take {[k.value for k in rules.takes]}; this schedule needs exactly "
            f"{sorted(k.value for k in needed)}"
        )
    table = {k: [d] * (last + 1) for k, d in DEFAULT_DURATION.items()} if costs is None else costs.per_stage(last + 1)
    dur = {k: [Fraction(str(x)) for x in table[k]] for k in rules.takes}
    pair_row = costs.pair_per_stage(last + 1) if costs is not None and rules.overlap else None
    forward_to, backward_to = receiving_ranks(where, template.pipelines)
    links = chain_links(last + 1, template.pipelines)
    delay = Fraction(str(costs.message_time)) if costs is not None else Fraction(0)
    post = Fraction(0) if costs is None or costs.overlap else delay
    # forward-only: each activation is freed once sent on (peak_activations' model), so memory never binds
    deltas = {k: 0.0 for k in Kind} if template.forward_only else activation_deltas(input_fraction)
    sizes = [1.0] * (last + 1) if stage_sizes is None else [float(x) for x in stage_sizes]
    if len(sizes) != last + 1:
        raise PipecInputError(f"{len(sizes)} stage sizes given for {last + 1} stages")
    stages = [template.stages_of(r) for r in range(ranks)]
    work = [sum((dur[k][s] for s in st for k in rules.takes), Fraction(0)) for st in stages]
    limits = [rules.limit(r) if rules.limit else None for r in range(ranks)]
    limits = [
        b if b is not None else (template.memory_bound[r] if template.memory_bound else None)
        for r, b in enumerate(limits)
    ]
    routed = [[_routed(template, s) for s in st] for st in stages]
    return _Run(
        ranks, n_mb, where, links, rules, back, {k: i for i, k in enumerate(rules.takes)}, table, dur, pair_row,
        forward_to, backward_to, delay, post, deltas, sizes, stages, work, limits, max_steps,
        routed=routed,
        fwd=[[0] * len(s) for s in stages],
        bwd=[[0] * len(s) for s in stages],
        queue=[[deque() for _ in s] for s in stages],
        busy=[False] * ranks,
        live=[0.0] * ranks,
        out=[[] for _ in range(ranks)],
        starts=[[] for _ in range(ranks)],
        lives=[[] for _ in range(ranks)],
        events=[(Fraction(0), 0, r, None) for r in range(ranks)],
        seq=ranks,
        left=sum(len(mbs) for rank_routed in routed for mbs in rank_routed) * len(rules.takes),
        deadline=time.monotonic() + MAX_SECONDS,
    )  # fmt: skip


def _routed(template: Program, stage: int) -> Sequence[int]:
    """The micro-batches that pass ``stage``, in order: those routed to its copy."""
    if template.pipelines == 1:
        return range(template.microbatches)
    copy = template.pipeline_of(stage)
    return [mb for mb in range(template.microbatches) if template.route_of(mb) == copy]


def _ready_at(run: _Run, rank: int, kind: Kind, stage: int, mb: int) -> Fraction | None:
    """When the op's inputs are on this rank (a message from another rank adds its time); None: not yet known."""
    done = run.done
    if kind is Kind.W:
        return done[(stage, "I", mb)]  # it is in the queue: its I ran on this rank
    has_next, has_previous = run.links
    keys = (
        ([(stage - 1, "F", mb)] if has_previous[stage] else [])
        if kind is Kind.F
        else ([(stage, "F", mb)] + ([(stage + 1, "G", mb)] if has_next[stage] else []))
    )
    at = Fraction(0)
    for key in keys:
        if key not in done:
            return None
        at = max(at, done[key] + (run.delay if run.where[key[0]] != rank else 0))
    return at


def _candidates(run: _Run, rank: int) -> list[tuple[Kind, int, int, int, Fraction | None, float]]:
    """(kind, chunk, stage, mb, ready or None, after) for every counter with work left."""
    found = []
    fwd, bwd, queue, n_mb, live, deltas = run.fwd[rank], run.bwd[rank], run.queue[rank], run.n_mb, run.live, run.deltas
    for c, s in enumerate(run.stages[rank]):
        mine = run.routed[rank][c]
        forward = mine[fwd[c]] if fwd[c] < len(mine) else n_mb
        backward = mine[bwd[c]] if bwd[c] < len(mine) else n_mb
        for kind, mb in ((Kind.F, forward), (run.back, backward), (Kind.W, queue[c][0] if queue[c] else n_mb)):
            if kind in run.order and mb < n_mb:
                after = live[rank] + deltas[kind] * run.sizes[s]
                found.append((kind, c, s, mb, _ready_at(run, rank, kind, s, mb), after))
    return found


def _fits(run: _Run, rank: int, kind: Kind, after: float) -> bool:
    limit = run.limits[rank]
    return run.deltas[kind] <= 0 or limit is None or after <= limit + MEMORY_TOLERANCE  # frees always fit


def _pick(run: _Run, rank: int) -> tuple[Candidate | None, list[tuple]]:
    """The op the rules choose for a free rank now (None: none is ready, fits and is admitted), within the budget,
    and the rank's ready candidates (a pair's other half is one of them)."""
    found = _candidates(run, rank)
    now = run.now
    run.steps += len(found) + 1
    steps = run.steps
    if steps > run.max_steps or (steps > run.clock and time.monotonic() > run.deadline):
        raise PipecInputError(
            f"list scheduling stopped after {steps:,} steps at t={now}, over pipec's "
            f"limit of {run.max_steps:,} steps or {MAX_SECONDS:g} s"
        )
    run.clock = steps + 1024 if steps > run.clock else run.clock  # the clock is read every 1024 steps or so
    now_ready = [f for f in found if f[4] is not None and f[4] <= now]
    idle = not any(f[0] is not Kind.W and _fits(run, rank, f[0], f[5]) for f in now_ready)
    blocked = any(f[0] is Kind.F and not _fits(run, rank, f[0], f[5]) for f in now_ready)
    # ready_at is known once the producer has started (done is recorded at its start), so a later time is an
    # input on its way: the gap a W may fill without delaying it
    gap = min((f[4] - now for f in found if f[0] is not Kind.W and f[4] is not None and f[4] > now), default=NEVER)
    fwd, bwd, queue, stages = run.fwd[rank], run.bwd[rank], run.queue[rank], run.stages[rank]
    deltas, sizes = run.deltas, run.sizes
    inflight, wpending = sum(fwd) - sum(bwd), sum(map(len, queue))
    # what a reservation must keep free so that every started micro-batch can finish its forwards here
    owed = sum((fwd[0] - n) * deltas[Kind.F] * sizes[s] for n, s in zip(fwd, stages, strict=True))
    limit = run.limits[rank]
    rules, order, dur, live, work = run.rules, run.order, run.dur, run.live[rank], run.work[rank]
    best, best_key = None, None
    for kind, c, s, mb, ready, after in now_ready:
        if not _fits(run, rank, kind, after):
            continue
        cand = Candidate(
            rank, kind, c, s, mb, now, ready, dur[kind][s], live, after, idle, blocked, gap, inflight, wpending, work,
            owed, float(NEVER) if limit is None else limit,
        )  # fmt: skip
        if rules.admit is not None and not rules.admit(cand):
            continue
        key = (tuple(rules.priority(cand)), (-c, -order[kind], -mb))
        if best_key is None or key > best_key:
            best, best_key = cand, key
    return best, now_ready


def _paired(run: _Run, best: Candidate, ready: list[tuple]) -> tuple[list[Candidate], Fraction]:
    """The instruction to start: ``best`` alone, or overlapped with its partner when the pair is shorter than its
    halves (the rules pair ops and the costs give the pair its own duration); and how long it takes."""
    if run.pair_row is None or best.kind is Kind.W:
        return [best], best.dur
    partner = _partner(best, ready, run)
    if partner is None:
        return [best], best.dur
    forward, backward = (best, partner) if best.kind is Kind.F else (partner, best)
    parts = (Action(forward.stage, Kind.F, forward.mb), Action(backward.stage, backward.kind, backward.mb))
    serial = run.table[Kind.F][forward.stage] + run.table[backward.kind][backward.stage]
    paired = Fraction(str(pair_duration(parts, serial, run.table, run.pair_row)))
    return ([forward, backward], paired) if paired < best.dur + partner.dur else ([best], best.dur)


def _partner(best: Candidate, ready: list[tuple], run: _Run) -> Candidate | None:
    """The op to overlap with ``best``: the highest-priority ready candidate of the other side (a backward, B or I,
    for a forward; a forward for a backward) of another micro-batch that the guard admits and that fits in memory
    run together with ``best`` (their deltas added: the pair's profile is the one memory_profile sums)."""
    rules, order, deltas, sizes, dur = run.rules, run.order, run.deltas, run.sizes, run.dur
    chosen, chosen_key = None, None
    for kind, c, s, mb, when, _ in ready:
        if kind is Kind.W or (kind is Kind.F) == (best.kind is Kind.F) or mb == best.mb:
            continue
        after = best.after + deltas[kind] * sizes[s]
        if not _fits(run, best.rank, kind, after):
            continue
        cand = best._replace(
            kind=kind, chunk=c, stage=s, mb=mb, ready=when, dur=dur[kind][s], live=best.after, after=after
        )
        if rules.admit is not None and not rules.admit(cand):
            continue
        key = (tuple(rules.priority(cand)), (-c, -order[kind], -mb))
        if chosen_key is None or key > chosen_key:
            chosen, chosen_key = cand, key
    return chosen


def _start(run: _Run, rank: int, halves: list[Candidate], length: Fraction) -> None:
    """Start the chosen instruction (one op, or an overlapped pair's halves in order): count each op, record the
    start and the memory after it, and queue its end (the rank free again, its sends posted) and the wake-up of
    each peer its outputs go to."""
    now = run.now
    end = now + length
    sends = 0
    for half in halves:
        kind, c, s, mb = half.kind, half.chunk, half.stage, half.mb
        if kind is Kind.F:
            run.fwd[rank][c] += 1
        elif kind is Kind.W:
            run.queue[rank][c].popleft()
        else:
            run.bwd[rank][c] += 1
        if len(halves) > 1:  # the pair's halves in their order, as memory_profile sums them
            run.live[rank] += run.deltas[kind] * run.sizes[s]
        made = (
            [(s, "F", mb)]
            if kind is Kind.F
            else [(s, "G", mb)]
            if kind is Kind.B
            else [(s, "G", mb), (s, "I", mb)]
            if kind is Kind.I
            else []
        )
        if kind is Kind.I:
            run.queue[rank][c].append(mb)
        for key in made:
            run.done[key] = end  # recorded now, but nothing reads it before `end` (readiness is checked <= now)
            peer = run.forward_to[s] if key[1] == "F" else run.backward_to[s] if key[1] == "G" else None
            if peer is not None and peer != rank:
                # wakes the peer when the message arrives; a consumer on this rank waits for this rank anyway
                sends += 1
                run.seq += 1
                heapq.heappush(run.events, (end + run.delay, run.seq, peer, Action(s, kind, mb)))
        run.left -= 1
    if len(halves) == 1:
        best = halves[0]
        run.live[rank] = best.after  # the same float the candidate was admitted by (memory_profile's sums)
        run.out[rank].append(Action(best.stage, best.kind, best.mb))
    else:
        run.out[rank].append(Overlap(*(Action(h.stage, h.kind, h.mb) for h in halves)))
    run.starts[rank].append(now)
    run.lives[rank].append(run.live[rank])
    run.busy[rank] = True
    run.seq += 1
    heapq.heappush(run.events, (end + run.post * sends, run.seq, rank, None))  # free again, its sends posted


def _stuck(ranks: int, now: Fraction, live: list[float], limits: list, candidates: Callable, fits: Callable) -> str:
    """The no-progress error: each rank with work left, its live memory and limit, and why each candidate waits."""
    lines = []
    for rank in range(ranks):
        why = []
        for kind, c, s, mb, ready, after in candidates(rank):
            reason = (
                "waits for its inputs"
                if ready is None
                else (f"needs {after - live[rank]:g} more" if not fits(rank, kind, after) else "refused by its guard")
            )
            why.append(f"{kind.value}[{c}] mb {mb} (stage {s}) {reason}")
        if why:
            limit = "no limit" if limits[rank] is None else f"limit {limits[rank]:g}"
            lines.append(f"rank {rank} at t={now}: live {live[rank]:g} of {limit}; " + "; ".join(why))
    return "the list schedule cannot finish, no rank can run an op: " + " | ".join(lines)
