"""The exact phase of `pipec tune` on a real solver: a CP-SAT model (Google OR-tools) of pipec's own cost model.

CP-SAT fits the problem as stated: each op is an interval of fixed length, a rank runs one at a time
(no-overlap), the data dependencies are precedences with the message time, and the memory a rank holds along its
order is a cumulative (each activation an interval from its forward to its free). Its lower bound is what makes
the certificate.
The solver is an optional dependency of tune only (`pip install pipec[tune]`); without it `available()` says
why and tune runs its branch and bound (pipec.tune.exact) at small sizes instead.

The model, per (V, placement), ops (stage s, kind k in F/I/W, micro-batch m) of the P·V stages:

- **variables**: the start of each op, an integer in a unit that divides every duration and the message time
  (exact: no float rounding); with `comm > 0` and `overlap=0`, also the start of each message's *post*: the
  sender's rank spends `message_time` on it (pipec.sim: posting holds the host), after the producer ends;
- **no-overlap** per rank over its ops and its posts (any order: a rank may wait while another op is ready;
  the batched model below holds each send apart from its post);
- **precedences**: F(s, m) after F(s-1, m); I(s, m) after F(s, m) and I(s+1, m); W(s, m) after I(s, m); across
  ranks the consumer starts `message_time` after the producer ends (or after the post starts, with posts);
- **memory**, exactly as pipec/verify/memory.py counts it along each rank's order: F adds the stage's size, I
  frees `input_fraction` of it and W the rest, each at its start; with positive durations no two ops of a rank
  start together, so the live count at each start is the verifier's count after that op, and it stays within
  the limit (sizes and limit scaled to integers; a cumulative, `_memory`). Redundant cuts make the memory bite
  in the bound: each activation lives at least as long as the chain of work between its forward and its free;
  the memory-time of a rank fits under limit x makespan; the precedences the limit implies for one stage alone
  (F(s, m) waits for some I and W of earlier micro-batches); and the stage's live count after each forward as
  a sum of "before" Booleans, which the LP sees (measured at P=8, M=24, limit 4: root bound 104 with the
  cumulative alone, 162 with the cuts; the optimum is 170);
- **symmetry**: each stage runs its F, its I and its W in micro-batch order (pipec's counters), without loss:
  micro-batches are interchangeable, and relabelling every schedule so that the k-th F (I, W) a stage runs is
  micro-batch k keeps it valid (by the start of its k-th op a stage has consumed k distinct inputs, so the k-th
  of them has ended) and keeps every rank's memory profile (the deltas depend on stage and kind only); so the
  bound holds for every order, not only for counter orders. Likewise a stage posts its sends of one kind in
  micro-batch order: swapping two posts' times keeps the rank's host intervals, each post after its producer
  (the later micro-batch's producer ends later) and each consumer after its message (the later consumer starts
  after the earlier one ends); measured on the V shape of P=4, M=8, V=2, I=2F, comm=0.5, limit 2 (optimum
  62.5), one worker, CP-SAT's deterministic time to the proof: 54 against more than 60 (seed 0) and 50 against
  68 (seed 1); elsewhere within a few per cent either way;
- **objective**: the makespan (every op ends by it), warm-started from the best order tune found so far, and cut
  off at tune's best makespan (`solve`'s `cutoff`: an order slower in the model is slower under nccl, so the cut
  loses nothing tune could return; a solve with no order under it proves that bound).

What is exact and what is relaxed: the model is pipec's `ideal` p2p model (with the posting cost when
`overlap=0`). Without posting costs it never times a compute order later than `nccl` does (nccl also waits for
whole batches and runs a rank's batches in order), so the solver's bound is a lower bound on the nccl makespan
of every schedule of that V and placement; at `comm = 0` it is the ideal model's optimum and nccl reaches it
when the send/recv placement adds no wait; with messages it is the bound of a relaxation (free batching of sends
and receives). With posting costs each message of this *posted* model leaves at its own send's post, where nccl
posts a run of sends and receives as one batch and moves every message of it from the batch's post while the
host posts the sends in turn: a batch of several sends can beat the posted model (measured, docs/tuning.md's
fourteenth round: 34.5 under nccl against 35 proved). So with posting costs the orders come from the posted
model and the bound from a *batched* one (`solve`): each message leaves at its send's post, and the send holds
its rank for `message_time` at or after the post (that hold in the rank's no-overlap, so the rank's work stays
exact), no op of the rank running between the post and the hold's end (a cumulative: an op takes the whole
capacity, a send's span from its post to its hold's end one unit, so spans overlap one another). Every nccl
schedule is one of it (each send posted at its batch's post, held where nccl's host posts it, the batch holding
only sends and receives), so its bound holds for nccl.
An `executed` solve restricts it towards nccl to find orders, never a bound (`_transfers`): each message moves
on an interval of message_time that a rank's other messages do not overlap (nccl runs a rank's batches in order
on one stream); tune tries it at V=1 for an optimal order nccl runs slower than the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from pipec.ir import Action, Program
from pipec.sim.costs import Costs
from pipec.tune.clock import Clock, compute_ops
from pipec.tune.instance import F_INDEX, I_INDEX, KINDS, MODEL_IDEAL, MODEL_POSTED, W_INDEX, Instance

WINDOW = 16  # the most Booleans per forward in the counted memory cut (_counted)
PROBING_MAX_OPS = 600  # the largest model (3·P·M·V ops) whose presolve probes (_solver says why)
SEARCH_SHARE = 0.75  # with posting costs, the most of a solve's time the posted model searches in (`solve`)
WORKERS = 1  # CP-SAT's default here: one worker is deterministic (the same input, the same orders); more are not


@dataclass(frozen=True)
class SolverResult:
    """One solve: the best orders found and what the solver proved about them."""

    orders: Program | None  # the best compute orders found (None: none found in time, or none fits)
    makespan: float | None  # their makespan in the model (the solver's objective)
    bound: float | None  # a lower bound on the model's makespan of every order of this V and placement
    optimal: bool  # the solver proved makespan == bound
    infeasible: bool  # the solver proved that no order fits the memory limit
    model: str  # MODEL_IDEAL or MODEL_POSTED
    seconds: float  # the seconds of the budget it took, the model built and solved (pipec.tune.clock: deterministic)
    # the solver's timing of `orders`, in the costs' units: per compute op its start and, for an op whose output
    # goes to another rank, when its send is posted (the producer's end without posting costs); the send/recv
    # placement follows it (pipec.tune.placement)
    timing: Mapping[Action, tuple[float, float | None]] | None = None
    # an `executed` solve's transfers: per op whose output goes to another rank, when its message starts moving
    transfers: Mapping[Action, float] | None = None


def available() -> str | None:
    """None when CP-SAT can be imported, else why not (for the table and the summary)."""
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError:
        return "OR-tools is not installed (pip install 'pipec[tune]' for the exact phase)"
    return None


def refuses(costs: Costs, ranks: int) -> str | None:
    """Why the model cannot take these costs (P stages at V = 1; a V divides them all alike), or None."""
    table = costs.per_stage(ranks)
    if min(min(table[k]) for k in KINDS) <= 0:
        return "an op of zero duration (the exact phase needs positive durations)"
    return None


def _timing(inst: Instance, solver, start: dict, posts: dict) -> dict[Action, tuple[float, float | None]]:
    """SolverResult.timing of a solve: per op its start and, for an op whose output goes to another rank, when
    its send is posted (its post's start, or the producer's end without posting costs)."""
    timing: dict[Action, tuple[float, float | None]] = {}
    for op in inst.ops():
        s, k, m = op
        at = solver.value(start[op])
        if not inst.sends(op):
            sent = None
        elif op in posts:
            sent = solver.value(posts[op]) / inst.scale
        else:
            sent = (at + inst.dur[s][k]) / inst.scale
        timing[Action(s, KINDS[k], m)] = (at / inst.scale, sent)
    return timing


def _transfers(model, inst: Instance, ready: dict, horizon: int) -> dict[tuple[int, int, int], object]:
    """The `executed` restriction: each message moves for `message_time` on its own interval, from when it is
    ready to go (its post, or its producer's end) to its consumer's earliest start (`ready` is rewired to its
    end), and a rank moves one message at a time, sending or receiving (a no-overlap per rank over the messages
    it sends and receives). nccl runs a rank's batches in order on one stream and a pair moves only when both
    sides' batches run; the relaxation lets every message move at once. Returns each sender's transfer start."""
    moving = {}
    per_rank: list[list] = [[] for _ in range(inst.ranks)]
    for op, at in list(ready.items()):
        if not inst.sends(op):
            continue
        s, k, _ = op
        go = model.new_int_var(0, horizon, f"t{op}")
        model.add(go >= at - inst.delay)
        interval = model.new_fixed_size_interval_var(go, inst.delay, f"x{op}")
        target = s + 1 if k == F_INDEX else s - 1
        per_rank[inst.where[s]].append(interval)
        per_rank[inst.where[target]].append(interval)
        ready[op] = go + inst.delay
        moving[op] = go
    for intervals in per_rank:
        model.add_no_overlap(intervals)
    return moving


def _memory(model, inst: Instance, start: dict, makespan, orders: list[tuple]) -> list[tuple]:
    """Each rank's live activations within the limit, as a cumulative: micro-batch m of stage s holds the part I
    frees from F's start to I's start and the rest from F's start to W's start. At the start of any op the sum
    is the verifier's count after that op (an interval ends where its free starts), and between starts it is
    constant. Each interval is at least as long as the chain of work between its ends (F through the later
    stages and back): that is what lets the solver bound the makespan by memory (Little's law: M micro-batches,
    each holding memory for at least that long, through a limit). A reservoir says the same, but CP-SAT expands
    it into a Boolean for every pair of a rank's ops: measured far slower."""
    demands: list[tuple[list, list, list]] = [([], [], []) for _ in range(inst.ranks)]
    lengths = []  # (variable, the forward, the op that frees): to hint
    for s in range(inst.stages):
        rank = inst.where[s]
        for k in (I_INDEX, W_INDEX):
            demand = -inst.change[s][k]
            if demand <= 0:
                continue
            least = inst.chain(s, k)
            for m in range(inst.n_mb):
                lo, hi = start[(s, F_INDEX, m)], start[(s, k, m)]
                length = model.new_int_var(least, 10**9, f"h{s},{k},{m}")
                lengths.append((length, (s, F_INDEX, m), (s, k, m)))
                demands[rank][0].append(model.new_interval_var(lo, length, hi, f"l{s},{k},{m}"))
                demands[rank][1].append(demand)
                demands[rank][2].append(demand * length)
    _implied_precedences(model, inst, start, orders)
    for rank, (intervals, amounts, areas) in enumerate(demands):
        if intervals:
            model.add_cumulative(intervals, amounts, inst.limit)
            # the same as a sum the LP sees: the memory-time a rank's intervals cover fits under the limit between
            # its first forward's earliest start and its last W (a cut, redundant with the cumulative)
            first = min(inst.chain_to(s) for s in range(inst.stages) if inst.where[s] == rank)
            last = min(inst.dur[s][W_INDEX] for s in range(inst.stages) if inst.where[s] == rank)
            model.add(sum(areas) <= inst.limit * (makespan - first - last))
    return lengths


def _implied_precedences(model, inst: Instance, start: dict, orders: list[tuple]) -> None:
    """What the limit implies for one stage alone, as precedences (redundant, but they propagate at once): after
    F(s, m) the stage holds (m + 1 - f·i - (1 - f)·w) of its size, i and w being the I and W it has run
    (w <= i <= m, f the input fraction), and the rank's other stages hold no less than nothing; so F(s, m) waits
    for the stage's I number ceil(m + 1 - L/size) - 1 and W number ceil((m + 1 - f·m - L/size) / (1 - f)) - 1."""
    assert inst.limit is not None
    limit = Fraction(inst.limit, inst.memory_scale)
    for s in range(inst.stages):
        size = Fraction(inst.change[s][F_INDEX], inst.memory_scale)
        if size <= 0:
            continue
        room = limit / size
        free_i = Fraction(-inst.change[s][I_INDEX], inst.change[s][F_INDEX])  # the input fraction, exactly
        for m in range(inst.n_mb):
            f = start[(s, F_INDEX, m)]
            need_i = math.ceil(m + 1 - room)
            if 0 < need_i <= m:
                model.add(f >= start[(s, I_INDEX, need_i - 1)] + inst.dur[s][I_INDEX])
            need_w = 0
            if free_i < 1:
                need_w = math.ceil((m + 1 - free_i * m - room) / (1 - free_i))
                if 0 < need_w <= m:
                    model.add(f >= start[(s, W_INDEX, need_w - 1)] + inst.dur[s][W_INDEX])
            _counted(model, inst, start, s, m, max(0, need_i), max(0, need_w), orders)


def _counted(model, inst: Instance, start: dict, s: int, m: int, sure_i: int, sure_w: int, orders: list[tuple]) -> None:
    """The stage's own live count after F(s, m) as a sum the LP sees: a Boolean per I and W of the stage that
    may or may not come before F(s, m) (the first `sure_i` I and `sure_w` W surely do, micro-batches m and later
    surely not), ordered as the counters run them. Redundant with the cumulative, which bounds the makespan
    through memory only weakly."""
    assert inst.limit is not None
    if m - sure_i + m - sure_w > WINDOW:
        return
    f = start[(s, F_INDEX, m)]
    before = {}
    for k, sure in ((I_INDEX, sure_i), (W_INDEX, sure_w)):
        previous = None
        for j in range(sure, m):
            b = model.new_bool_var(f"c{s},{k},{j},{m}")
            op = start[(s, k, j)]
            model.add(op + inst.dur[s][k] <= f).only_enforce_if(b)
            model.add(f + inst.dur[s][F_INDEX] <= op).only_enforce_if(~b)
            if previous is not None:
                model.add_implication(b, previous)  # the counters: micro-batch j before j + 1
            previous = b
            before[(k, j)] = b
            orders.append((b, (s, k, j), (s, F_INDEX, m)))
    for (k, j), b in before.items():
        if k == W_INDEX and (I_INDEX, j) in before:
            model.add_implication(b, before[(I_INDEX, j)])  # W(s, j) after I(s, j)
    live = inst.change[s][F_INDEX] * (m + 1) + inst.change[s][I_INDEX] * sure_i + inst.change[s][W_INDEX] * sure_w
    model.add(live + sum(inst.change[s][k] * b for (k, _), b in before.items()) <= inst.limit)


def _hinted_times(
    inst: Instance, hint, timing
) -> tuple[dict[tuple[int, int, int], int], dict[tuple[int, int, int], int]] | None:
    """The starts and posts (in the model's units) that `_hint` gives: `timing`'s when given, else the earliest
    timing of the orders `hint` (posts right after their producer); None when the orders cannot run. A `late`
    solve needs the timing: the solver may post a send after a later compute, so the earliest timing of its
    orders alone can exceed its makespan and be no solution (measured at P=4, M=8, X=4, V=2, comm=0.5: 53
    against 50, and every `late` solve so hinted found nothing in its time)."""
    if timing is None:
        times = inst.earliest(hint)
        return None if times is None else (times, {})
    index = {kind: i for i, kind in enumerate(KINDS)}

    def op(a: Action) -> tuple[int, int, int]:
        return a.stage, index[a.kind], a.mb

    starts = {op(a): round(at * inst.scale) for a, (at, _) in timing.items()}
    sent = {op(a): round(post * inst.scale) for a, (_, post) in timing.items() if post is not None}
    return starts, sent


def _hint(
    model, inst: Instance, hint, timing, limit_units: int | None, start, posts, lengths, befores, makespan
) -> None:
    """Warm-start the solve from per-rank compute orders (their earliest timing in the model), or from `timing`
    (a solve's own, SolverResult.timing: each op's start and post): every op's start, each post, memory interval
    and "before" Boolean, and the makespan. A hint beyond the cutoff is no solution and is left out (the solver
    then searches on its own)."""
    hinted = _hinted_times(inst, hint, timing)
    if hinted is None:
        return
    times, sent = hinted
    span = max(at + inst.dur[s][k] for (s, k, _), at in times.items())
    if limit_units is not None and span > limit_units:
        return
    for op, at in times.items():
        model.add_hint(start[op], at)
        if op in posts:
            model.add_hint(posts[op], sent.get(op, at + inst.dur[op[0]][op[1]]))
    for length, lo, hi in lengths:
        model.add_hint(length, times[hi] - times[lo])
    for b, first, then in befores:
        model.add_hint(b, times[first] < times[then])
    model.add_hint(makespan, span)


def cheap_bound(
    template: Program,
    costs: Costs,
    limit: float | None = None,
    input_fraction: float = 0.5,
    stage_sizes: Sequence[float] | None = None,
) -> float:
    """A lower bound on the makespan without solving (`Instance.cheap_bound`: per rank, its first forward's
    earliest start plus all its work; what the memory limit implies; and the idle time the limit forces at the
    ends of a one-stage rank's order), for a shape the solver is not given time for or finds nothing in."""
    inst = Instance(template, costs, limit, input_fraction, stage_sizes)
    return inst.cheap_bound() / inst.scale


def model_times(orders: Program, costs: Costs) -> dict[Action, tuple[float, float]] | None:
    """Each compute op's (start, end) when every rank runs `orders` as early as the model allows (posts right
    after their producer), in the costs' units; None when the order cannot run."""
    streams = orders.compute_streams()
    if any(type(op) is not Action or op.kind not in KINDS for stream in streams for op in stream):
        return None  # a B or an overlapped pair: not in the model
    inst = Instance(orders, costs, None, 0.5, None)
    start = inst.earliest(streams)
    if start is None:
        return None
    return {
        Action(s, KINDS[k], m): (at / inst.scale, (at + inst.dur[s][k]) / inst.scale) for (s, k, m), at in start.items()
    }


def _sequences(model, inst: Instance, start: dict, ready: dict, posts: dict, per_rank: list, apart: int) -> None:
    """The order constraints: each op after its inputs (across ranks when its message is `ready`), one op or post
    of a rank at a time, and each stage's ops of one kind and its posts of one kind in micro-batch order, `apart`
    units apart (without loss, module docstring "symmetry")."""
    for op in inst.ops():
        for p in inst.inputs(*op):
            model.add(start[op] >= (ready[p] if inst.crosses(p, op) else start[p] + inst.dur[p[0]][p[1]]))
    for intervals in per_rank:
        model.add_no_overlap(intervals)
    for s, k, m in inst.ops():
        if m + 1 < inst.n_mb:
            model.add(start[(s, k, m + 1)] >= start[(s, k, m)] + inst.dur[s][k])
    for (s, k, m), posted in posts.items():
        if (s, k, m + 1) in posts:
            model.add(posts[(s, k, m + 1)] >= posted + apart)


def _stopper(cp_model, stop_at: int):
    """A CP-SAT solution callback that stops the search at an order of makespan `stop_at` (in the model's units) or
    less: a lower bound the model does not hold, so that order is optimal. The idle bound (Instance.idle_bound) is
    that, not a constraint: as one it changed the search's path (measured at P=8, M=16, X=8, I=2F, comm=0.5:
    tune's 96.5 became 97 against the bound 96) and raised no bound the solve proved."""

    class Stopper(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            if self.objective_value <= stop_at:
                self.stop_search()

    return Stopper()


def _solver(cp_model, ops: int, workers: int, seed: int):
    """A CP-SAT solver for a model of `ops` ops: `workers` threads, `seed`; probing in presolve only up to
    PROBING_MAX_OPS. Above it probing costs CPU time that CP-SAT's deterministic time hardly counts, so a solve
    limited by it ran out its wall-clock cap in presolve and returned no order, not even its hint (measured at
    P=8, M=24, X=4, I=2F, V=2 placement v, warm-started from v_min at 146.5 in the model: probing 17.5 s for 0.57
    deterministic units; without it the hint is the first solution at once, and 6 s of budget give 146.5 and the
    bound 103 at 0.53 units a CPU second; P=8, M=16, X=8, I=2F, comm=0.5, V=2 placement v, 768 ops: no order in 8 s
    with probing, 0.44 units for 7 CPU seconds; without it the hint's 107.5 at 0.72 units a CPU second). At P=8,
    M=24, V=1 (576 ops) probing pays: 170 proved in 8.7 units with it, 14.9 without, for the same CPU time."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    if ops > PROBING_MAX_OPS:
        solver.parameters.cp_model_probing_level = 0
    return solver


def solve(
    template: Program,
    costs: Costs,
    limit: float | None,
    input_fraction: float,
    stage_sizes: Sequence[float] | None,
    seconds: float,
    hint: Sequence[Sequence[Action]] | None = None,
    seed: int = 0,
    workers: int = WORKERS,
    late: float | None = None,
    cutoff: float | None = None,
    hint_timing: Mapping[Action, tuple[float, float | None]] | None = None,
    clock: Clock | None = None,
    executed: bool = False,
    known: float = 0.0,
) -> SolverResult:
    """The least-makespan compute orders for `template`'s P, M, V and placement (module docstring), within
    `seconds` of the budget. `hint`: per-rank compute orders to start from (the best tune has). `workers`:
    CP-SAT's parallel portfolio (faster proofs on idle cores, but then not deterministic). Durations must
    be positive (the memory intervals read a rank's order from distinct start times). `late`: instead, among
    the orders of makespan at most `late`, one that runs every op as late as it allows (the greatest sum of
    starts): an optimal order with slack left early can lose time under nccl, where a receive posted with
    slack joins a batch that a later input holds back. `cutoff`: only orders of model makespan at most this (the
    best nccl makespan tune has, of any shape): one slower in the model is slower under nccl too, so nothing tune
    could win is cut; a solve with no order within it proves the bound `cutoff` plus one unit (a result without
    orders, `optimal` true: the bound is proved; `infeasible` stays for the memory limit's own). `hint_timing`:
    a solve's own timing (SolverResult.timing) to start from instead, for `late` (`_hinted_times` says why).
    `clock`: the budget's (pipec.tune.clock), charged for the model built and solved, the same idle or loaded.
    `executed`: the model restricted towards nccl's, to find orders nccl runs as timed (`_transfers`); its bound
    is of that restriction, never of every schedule, so the result has none. `known`: a lower bound already
    proved for this V and placement (pipec.tune.relaxation's): the search stops there, and the bound is at least it.

    With posting costs the orders come from the posted-sends model and the bound from the batched one (module
    docstring): first the posted solve in at most SEARCH_SHARE of `seconds`, then the batched one, warm from its
    best and cut off there, in what is left; a result's `bound` and `optimal` are the batched solve's."""
    clock = clock or Clock()
    inst = Instance(template, costs, limit, input_fraction, stage_sizes)
    ask = _Ask(hint, seed, workers, late, cutoff, hint_timing, clock, executed, known, together=False)
    if inst.model != MODEL_POSTED or late is not None or executed:
        return _solve_model(inst, template, seconds, ask)
    end = clock.after(seconds)
    found = _solve_model(inst, template, seconds * SEARCH_SHARE, ask)
    if found.infeasible:  # the memory limit alone: no order of either model fits
        return found
    best = cutoff if found.makespan is None else found.makespan  # a found order is within the cutoff
    if found.orders is not None:  # the batched solve starts from the posted one's best
        ask = replace(ask, hint=found.orders, hint_timing=found.timing)
    bound = _solve_model(inst, template, clock.left(end), replace(ask, cutoff=best, together=True))
    took = found.seconds + bound.seconds
    if found.orders is None:  # the posted solve found nothing: the batched one's orders, if any, are the result
        return replace(bound, seconds=took)
    proved = bound.bound is not None and found.makespan <= bound.bound + 1e-9
    return replace(found, bound=bound.bound, optimal=proved, seconds=took)


@dataclass(frozen=True)
class _Ask:
    """What one solve of the model is asked (`solve`'s arguments past the problem, and `together`)."""

    hint: Sequence[Sequence[Action]] | None
    seed: int
    workers: int
    late: float | None
    cutoff: float | None
    hint_timing: Mapping[Action, tuple[float, float | None]] | None
    clock: Clock
    executed: bool
    known: float
    together: bool  # the batched model (module docstring): the sends of one batch post together


def _solve_model(inst: Instance, template: Program, seconds: float, ask: _Ask) -> SolverResult:
    """One solve of `solve`'s model (its docstring) for `inst`, the numbers of `template`."""
    from ortools.sat.python import cp_model

    hint, seed, workers, late, cutoff = ask.hint, ask.seed, ask.workers, ask.late, ask.cutoff
    hint_timing, clock, executed, known, together = ask.hint_timing, ask.clock, ask.executed, ask.known, ask.together
    if min(min(row) for row in inst.dur) <= 0:
        raise ValueError("the CP-SAT model needs positive durations")
    model = cp_model.CpModel()
    ops = inst.ops()
    post = inst.delay if inst.model == MODEL_POSTED else 0
    # a horizon every order's earliest timing meets: its critical path is a chain of ops, posts and messages
    horizon = sum(inst.dur[s][k] for s, k, _ in ops) + sum((inst.delay + post) for op in ops if inst.sends(op))
    start = {op: model.new_int_var(0, horizon, f"s{op}") for op in ops}
    per_rank: list[list] = [[] for _ in range(inst.ranks)]
    for op in ops:
        s, k, _ = op
        rank = inst.where[s]
        per_rank[rank].append(model.new_fixed_size_interval_var(start[op], inst.dur[s][k], f"i{op}"))
    # when a consumer on another rank may start after each producer's end: + message_time, after its post
    ready: dict[tuple[int, int, int], object] = {}
    posts: dict[tuple[int, int, int], object] = {}
    batched: list[list] = [[] for _ in range(inst.ranks)]  # `together`: each send's span, its post to its hold
    op_intervals = [list(intervals) for intervals in per_rank]  # each rank's ops, before its posts join them
    for op in ops:
        s, k, _ = op
        end = start[op] + inst.dur[s][k]
        if inst.sends(op) and post:
            posted = model.new_int_var(0, horizon, f"p{op}")
            model.add(posted >= end)
            held = posted
            if together:  # its message goes at `posted`; its rank holds it later, no op running in between
                held = model.new_int_var(0, horizon, f"h{op}")
                model.add(held >= posted)
                span = model.new_int_var(post, horizon, f"z{op}")
                batched[inst.where[s]].append(model.new_interval_var(posted, span, held + post, f"b{op}"))
            per_rank[inst.where[s]].append(model.new_fixed_size_interval_var(held, post, f"q{op}"))
            posts[op] = posted
            ready[op] = posted + inst.delay
        else:
            ready[op] = end + (inst.delay if inst.sends(op) else 0)
    moving = _transfers(model, inst, ready, horizon) if executed and inst.delay > 0 else {}
    _sequences(model, inst, start, ready, posts, per_rank, 0 if together else post)
    for ops_of, spans in zip(op_intervals, batched, strict=True):
        if spans:  # an op takes the whole capacity, a send's span one unit: spans overlap spans, never an op
            model.add_cumulative(ops_of + spans, [len(spans)] * len(ops_of) + [1] * len(spans), len(spans))
    makespan = model.new_int_var(0, horizon, "makespan")
    # the LP lacks these (at loose memory its bound stayed far below); the search stops at the cheap one (_stopper)
    floor, cheap = inst.bounds()
    cheap = max(cheap, math.ceil(known * inst.scale - 1e-6))
    model.add(makespan >= floor)
    befores: list[tuple] = []  # (Boolean, op a, op b): a starts before b, to hint
    lengths = _memory(model, inst, start, makespan, befores) if inst.limit is not None else []
    for op in ops:
        if op[1] == W_INDEX:  # every op is followed by a W of its stage and micro-batch (posts by their consumers)
            model.add(makespan >= start[op] + inst.dur[op[0]][W_INDEX])
    limit_units = None if cutoff is None else math.floor(cutoff * inst.scale + 1e-6)
    if limit_units is not None:
        model.add(makespan <= limit_units)
    if late is None:
        model.minimize(makespan)
    else:
        model.add(makespan <= round(late * inst.scale))
        model.maximize(sum(start.values()))
    if hint is not None or hint_timing is not None:
        _hint(model, inst, hint, hint_timing, limit_units, start, posts, lengths, befores, makespan)
    solver = _solver(cp_model, compute_ops(template), workers, seed)
    stopper = _stopper(cp_model, cheap) if late is None else None
    status, took = clock.run_solver(solver, model, seconds, compute_ops(template), stopper)
    if executed and status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):  # a restriction proves nothing
        return SolverResult(None, None, None, False, False, inst.model, took)
    if status == cp_model.INFEASIBLE and late is None:
        if limit_units is not None:  # no order within the cutoff: every one is slower in the model
            beyond = max(limit_units + 1, cheap) / inst.scale
            return SolverResult(None, None, beyond, True, False, inst.model, took)
        return SolverResult(None, None, None, False, True, inst.model, took)
    # a solve stopped before its own bound passed the cheap one (per rank, memory) still has that one
    bound = max(math.ceil(solver.best_objective_bound - 1e-6), cheap) / inst.scale
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        known = bound if status == cp_model.UNKNOWN and late is None else None  # `late` maximises: no makespan bound
        return SolverResult(None, None, known, False, False, inst.model, took)
    streams = []
    for rank in range(inst.ranks):
        mine = sorted((solver.value(start[op]), op) for op in ops if inst.where[op[0]] == rank)
        streams.append(tuple(Action(s, KINDS[k], m) for _, (s, k, m) in mine))
    orders = replace(template, streams=tuple(streams), has_comms=False)
    timing = _timing(inst, solver, start, posts)
    transfers = {Action(s, KINDS[k], m): solver.value(at) / inst.scale for (s, k, m), at in moving.items()}
    if late is not None or executed:
        value = solver.value(makespan) / inst.scale
        return SolverResult(orders, value, None, False, False, inst.model, took, timing, transfers or None)
    value = solver.objective_value / inst.scale
    proved = status == cp_model.OPTIMAL or value <= bound  # stopped at the idle bound: optimal as well
    return SolverResult(orders, value, bound, proved, False, inst.model, took, timing)


__all__ = [
    "KINDS",
    "MODEL_IDEAL",
    "MODEL_POSTED",
    "WORKERS",
    "SolverResult",
    "available",
    "cheap_bound",
    "model_times",
    "refuses",
    "solve",
]
