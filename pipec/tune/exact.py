"""Phase 4 of `pipec tune`: an exact search of the compute orders for small sizes (3·P·M·V <= 64 ops).

A branch and bound over every per-rank order, under the costs and the memory limit, for the least makespan in
one of two of the simulator's models (pipec.sim): ``nccl``, what tune ranks (send/recv placed for the costs by
pipec.compiler.place_p2p, then run in order; search.evaluate), or ``ideal`` (each op starts once its rank is free
and its inputs exist, plus ``message_time`` from another rank; send/recv ignored). The search itself is timed in
the ideal model, which never exceeds nccl for the same orders (a message completes at least ``message_time``
after its producer ends, and a rank's ops still run in order): so ideal times bound nccl's from below, and under
``nccl`` each complete order set is simulated there to score it. With ``comm`` 0 the two mostly agree.

- **The space**: per rank, any interleaving of its stages' F, I and W in which each (stage, kind) runs its
  micro-batches in order (the language's counters, as the list scheduler runs them), each op after its inputs
  (F(s, m) after F(s-1, m); I(s, m) after F(s, m) and I(s+1, m); W(s, m) after I(s, m)), and every prefix within
  the limit (verify/memory.py's deltas and float sums, so the verifier sees the same profile). A rank may wait for
  an op that is not ready while another is: the search is not limited to non-delay schedules.
- **Canonical order**: an order set has one timing (each op as early as its order allows); the search places ops
  one at a time in increasing (start, rank), so each order set is built exactly once and every op's start is known
  when it is placed (its producers ended before it starts: durations must be positive, else the phase is skipped).
- **Bound**: a node is cut when max(the (ideal) makespan so far, the longest remaining path: an op's earliest
  start plus its duration plus the longest chain of work after it, and per rank its remaining work run from the
  earliest starts in order) is not below the best found. Children are tried earliest start first, I before F
  before W, so the first leaf is a list schedule and the bound bites early.
- **Budget**: a deadline and a node cap stop it cleanly; the result then says it is not proved optimal. Same input
  and a search that ends (or the same node cap): same output (times are exact, integers in a unit that divides
  every duration; children come in a fixed order).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pipec.errors import PipecError, PipecInputError
from pipec.ir import MEMORY_TOLERANCE, Action, Program, activation_deltas, loop_placement, v_placement
from pipec.sim.simulate import simulate
from pipec.tune.clock import NODE_SECONDS, Clock
from pipec.tune.instance import F_INDEX, I_INDEX, KINDS, W_INDEX, exact_times

if TYPE_CHECKING:
    from pipec.sim.costs import Costs
    from pipec.tune.setting import Setting

MAX_OPS = 64  # 3·P·M·V: beyond it the tree is too large for the bound to close in a tune budget
MAX_NODES = 2_000_000  # a deterministic cap besides the deadline
_EPSILON = 1e-9  # a makespan gain below it is no gain
MODELS = ("nccl", "ideal")
_TRY = (I_INDEX, F_INDEX, W_INDEX)  # the order children of equal start are tried in: the list scheduler's priorities


@dataclass(frozen=True)
class ExactResult:
    orders: Program | None  # the best compute orders found (None: none found, or none fits)
    makespan: float | None  # their makespan in the model searched
    optimal: bool  # the search ended: no order of the space is faster (or, with orders None, none fits)
    nodes: int


def small_enough(ranks: int, microbatches: int, chunks: int) -> bool:
    return 3 * ranks * microbatches * chunks <= MAX_OPS


def exact_candidates(setting: Setting, clock: Clock, deadline: float) -> Iterator[tuple[str, int, ExactResult | str]]:
    """(name, V, result or why it was not run) for each V of the setting small enough, placements loop and v;
    the time to `deadline` of `clock` is shared among the searches left."""
    ranks, microbatches = setting.ranks, setting.microbatches
    jobs = [
        (v, placement)
        for v in setting.chunks
        if small_enough(ranks, microbatches, v)
        for placement in (("loop", "v") if v > 1 else ("loop",))
    ]
    for index, (v, placement) in enumerate(jobs):
        name = "exact" if placement == "loop" else "exact-v"
        until = clock.share(deadline, len(jobs) - index)
        stages = ranks * v
        where = loop_placement(ranks, stages) if placement == "loop" else v_placement(ranks, stages)
        template = Program(
            name="tuned", ranks=ranks, microbatches=microbatches, chunks=v, stage_to_rank=where, streams=((),) * ranks
        )
        costs = setting.stage_costs(v)
        if min(min(costs.per_stage(stages)[k]) for k in KINDS) <= 0:  # the same at every V: said once
            yield name, v, "an op of zero duration (the exact search needs positive durations)"
            return
        yield (
            name,
            v,
            exact_orders(
                template,
                costs,
                setting.limit,
                setting.costs.input_fraction,
                setting.stage_sizes(v),
                until,
                model="nccl",
                clock=clock,
            ),
        )


def exact_orders(
    template: Program,
    costs: Costs,
    limit: float | None,
    input_fraction: float,
    stage_sizes: Sequence[float] | None = None,
    deadline: float | None = None,
    max_nodes: int = MAX_NODES,
    model: str = "nccl",
    clock: Clock | None = None,
) -> ExactResult:
    """The compute orders of least makespan in `model` (nccl or ideal) for `template`'s P, M, V and placement
    (module docstring), until `deadline` of `clock` (pipec.tune.clock; a new one: seconds from this call).
    Durations must be positive."""
    if model not in MODELS:
        raise ValueError(f"model {model!r}: expected one of {MODELS}")
    search = _Search(template, costs, limit, input_fraction, stage_sizes, clock or Clock(), deadline, max_nodes, model)
    finished = search.run()
    if search.best is None:
        return ExactResult(None, None, finished, search.nodes)
    program = replace(template, streams=search.best, has_comms=False)
    return ExactResult(program, search.best_makespan, finished, search.nodes)


class _BudgetEndedError(Exception):
    """The budget ran out."""


class _Search:
    def __init__(
        self,
        template: Program,
        costs: Costs,
        limit: float | None,
        input_fraction: float,
        stage_sizes: Sequence[float] | None,
        clock: Clock,
        deadline: float | None,
        max_nodes: int,
        model: str,
    ) -> None:
        if template.pipelines != 1:  # its counters run every micro-batch down one chain
            raise PipecInputError("the exact search orders one pipeline; it has no routes for replicated copies")
        self.template, self.costs, self.model = template, costs, model
        self.ranks, self.n_mb = template.ranks, template.microbatches
        self.where = template.stage_to_rank
        self.last = template.num_stages - 1
        # times in integer units of 1/scale (every duration a whole number of them): exact, and fast to add
        self.scale, exact, message = exact_times(costs, self.last + 1, KINDS)
        self.dur = [[int(exact[k][s] * self.scale) for k in KINDS] for s in range(self.last + 1)]
        self.delay = int(message * self.scale)
        deltas = activation_deltas(input_fraction)
        sizes = [1.0] * (self.last + 1) if stage_sizes is None else [float(x) for x in stage_sizes]
        self.delta = [[deltas[k] * sizes[s] for k in KINDS] for s in range(self.last + 1)]
        # under nccl without overlap a rank also spends message_time posting each send (pipec.sim): F sends to the
        # next stage, I to the previous one, when it lives on another rank. Only the per-rank bound counts it.
        charged = model == "nccl" and not costs.overlap
        self.post = [
            [
                self.delay if charged and 0 <= t < self.last + 1 and self.where[t] != self.where[s] else 0
                for t in (s + 1, s - 1, -1)
            ]
            for s in range(self.last + 1)
        ]
        self.limit = limit
        self.stages = [template.stages_of(r) for r in range(self.ranks)]
        self.clock, self.deadline, self.max_nodes = clock, deadline, max_nodes
        # per (stage, kind): the next micro-batch; per op: its end (None until placed)
        self.count = [[0, 0, 0] for _ in range(self.last + 1)]
        self.end: list[list[list[int | None]]] = [[[None] * self.n_mb for _ in KINDS] for _ in range(self.last + 1)]
        self.free = [0] * self.ranks
        self.live = [0.0] * self.ranks
        self.streams: list[list[Action]] = [[] for _ in range(self.ranks)]
        self.best: tuple[tuple[Action, ...], ...] | None = None
        self.best_makespan: float | None = None
        self.cut: float | None = None
        self.nodes = 0
        self.topo = [(s, F_INDEX, m) for s in range(self.last + 1) for m in range(self.n_mb)]
        self.topo += [(s, I_INDEX, m) for s in range(self.last, -1, -1) for m in range(self.n_mb)]
        self.topo += [(s, W_INDEX, m) for s in range(self.last + 1) for m in range(self.n_mb)]
        self.tail = self._tails()

    # -- the static dependency graph ------------------------------------------------------------------------------

    def _inputs(self, s: int, k: int, m: int) -> list[tuple[int, int, int]]:
        """The ops (stage, kind, mb) that must end before this one starts: data, and the counter's previous mb."""
        if k == F_INDEX:
            out = [(s - 1, F_INDEX, m)] if s > 0 else []
        elif k == I_INDEX:
            out = [(s, F_INDEX, m)] + ([(s + 1, I_INDEX, m)] if s < self.last else [])
        else:
            out = [(s, I_INDEX, m)]
        return out + ([(s, k, m - 1)] if m > 0 else [])

    def _gap(self, a: int, b: int) -> int:
        return self.delay if self.where[a] != self.where[b] else 0

    def _tails(self) -> dict[tuple[int, int, int], int]:
        """Per op, the longest chain of work that must follow its end (edges across ranks add message_time)."""
        tail: dict[tuple[int, int, int], int] = {op: 0 for op in self.topo}
        for op in reversed(self.topo):
            s, k, m = op
            for p in self._inputs(s, k, m):
                through = self._gap(p[0], s) + self.dur[s][k] + tail[op]
                if through > tail[p]:
                    tail[p] = through
        return tail

    # -- the search -----------------------------------------------------------------------------------------------

    def run(self) -> bool:
        """True when the search ended, False when the budget stopped it."""
        try:
            self._branch(0, 0, 0, (self.last + 1) * len(KINDS) * self.n_mb)
        except _BudgetEndedError:
            return False
        return True

    def _children(self, last_start: int, last_rank: int) -> list[tuple[int, int, int, int, int]]:
        """(start, rank, stage, kind, mb) of every op placeable next: inputs placed, within memory, not before the
        last op placed in (start, rank)."""
        out = []
        for rank in range(self.ranks):
            for s in self.stages[rank]:
                for k in _TRY:
                    m = self.count[s][k]
                    if m >= self.n_mb:
                        continue
                    start = self.free[rank]
                    for p in self._inputs(s, k, m):
                        at = self.end[p[0]][p[1]][p[2]]
                        if at is None:
                            break
                        at += self._gap(p[0], s)
                        if at > start:
                            start = at
                    else:
                        if (start, rank) < (last_start, last_rank):
                            continue
                        delta = self.delta[s][k]
                        over = self.limit is not None and self.live[rank] + delta > self.limit + MEMORY_TOLERANCE
                        if delta > 0 and over:
                            continue
                        out.append((start, rank, s, k, m))
        out.sort(key=lambda c: (c[0], _TRY.index(c[3]), c[1], c[2]))
        return out

    def _bound(self, last_start: int, makespan: int) -> int:
        """A lower bound on the makespan of every completion of this node (module docstring)."""
        early: dict[tuple[int, int, int], int] = {}
        bound = makespan
        per_rank: list[list[tuple[int, ...]]] = [[] for _ in range(self.ranks)]
        for op in self.topo:
            s, k, m = op
            if self.end[s][k][m] is not None:
                continue
            rank = self.where[s]
            start = max(self.free[rank], last_start)
            for p in self._inputs(s, k, m):
                at = self.end[p[0]][p[1]][p[2]]
                at = (early[p] + self.dur[p[0]][p[1]]) if at is None else at
                at += self._gap(p[0], s)
                if at > start:
                    start = at
            early[op] = start
            d = self.dur[s][k]
            bound = max(bound, start + d + self.tail[op])
            per_rank[rank].append((start, d, self.post[s][k], self.tail[op]))
        for rank, ops in enumerate(per_rank):
            if not ops:
                continue
            ops.sort()
            # the rank runs its ops one at a time, none before its earliest start: with the tail of its last op
            # after them, or with its posts (which may come last)
            t = posted = self.free[rank]
            for start, d, post, _ in ops:
                t = max(t, start) + d
                posted = max(posted, start) + d + post
            bound = max(bound, t + min(q for *_, q in ops), posted)
        return bound

    def _score(self, streams: tuple[tuple[Action, ...], ...], ideal: int) -> float | None:
        """The makespan of a complete order set in the model searched; None when it does not run there."""
        if self.model == "ideal":
            return ideal / self.scale
        try:  # send/recv placed for the costs, as search.evaluate does
            return simulate(replace(self.template, streams=streams, has_comms=False), self.costs, p2p="nccl").makespan
        except PipecError:
            return None

    def _branch(self, last_start: int, last_rank: int, makespan: int, left: int) -> None:
        self.nodes += 1
        if self.nodes % 256 == 0:
            self.clock.charge(256 * NODE_SECONDS)
            if self.deadline is not None and self.clock.passed(self.deadline):
                raise _BudgetEndedError
        if self.nodes > self.max_nodes:
            raise _BudgetEndedError
        if left == 0:
            streams = tuple(tuple(s) for s in self.streams)
            score = self._score(streams, makespan)
            if score is not None and (self.best_makespan is None or score < self.best_makespan - _EPSILON):
                self.best_makespan, self.best = score, streams
                self.cut = (score - _EPSILON) * self.scale  # what a node's bound must stay under, in scaled units
            return
        if self.cut is not None and self._bound(last_start, makespan) >= self.cut:
            return
        for start, rank, s, k, m in self._children(last_start, last_rank):
            end = start + self.dur[s][k]
            if self.cut is not None and end + self.tail[(s, k, m)] >= self.cut:
                continue
            free, live = self.free[rank], self.live[rank]
            self.end[s][k][m] = end
            self.count[s][k] += 1
            self.free[rank] = end
            self.live[rank] = live + self.delta[s][k]
            self.streams[rank].append(Action(s, KINDS[k], m))
            self._branch(start, rank, max(makespan, end), left - 1)
            self.streams[rank].pop()
            self.live[rank] = live
            self.free[rank] = free
            self.count[s][k] -= 1
            self.end[s][k][m] = None


__all__ = ["MAX_OPS", "ExactResult", "exact_candidates", "exact_orders", "small_enough"]
