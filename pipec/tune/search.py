"""The search of `pipec tune`: evaluate candidates, rank them, improve the best by local moves.

Every candidate is judged the same way before it can win (`evaluate`): send/recv placed for the user's costs
(pipec.compiler.place_p2p, in the schedule's stage units after per_rank_share), then the full verifier
(structure, p2p order, deadlock under nccl, memory within the limit with the share stage sizes), then the
simulator under nccl. Verdicts: ok, over-memory, invalid (a failed check), error (it does not compile) and
skipped. Only ok candidates rank: makespan, then peak memory, then name.

Phases: 1, every library schedule and `--from` file over its V and parameters (always completes, so tune is never
worse than the library); 2, list-scheduled orders (pipec.passes.list_schedule) under the costs and the limit, for
each V of `--chunks` and placement loop or v; 3, local moves on the best few orders (move one W past a neighbour on
its rank, either way, or pull one F earlier), a move kept when the result verifies, fits, is not slower and moves
work earlier (the makespan, then the sum of the ops' end times, decreases: plateaus of the makespan are common, and
crossing them is what finds the faster orders), in a seeded order, first improvement, until no move helps or its
time runs out; 4, the exact phase: with OR-tools, a CP-SAT model per V and placement (pipec.tune.cpsat),
warm-started from the best order of its shape so far, whose lower bounds make the certificate (`Certificate`:
proved optimal, or within a gap; a shape behind tune's best refutes the gap first: pipec.tune.refutation);
without it, for small sizes (3·P·M·V <= 64), the branch and bound (pipec.tune.exact). Without the solver the order
is 1, 2, 4, 3 (tune before the solver). With it, 1, 2, 3 on the best orders of phases 1 and 2 (tune without the
solver, as it runs alone: so tune is never worse than it when those moves end), then 4, then 3 again on the
solver's orders not at its bound. A solver order that runs slower under nccl than in the model, tune's own best and
the winner at the end get their send/recv placed again from the timing (pipec.tune.placement; `_closer`,
`_placed`), kept when that verifies and runs faster, and a solver order still slower at the end goes on being
placed in the time left; such a candidate is written with its send/recv (`own_placement`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import pipec.tune.cpsat as cpsat
import pipec.tune.placement as send_recv
from pipec.compiler import compute_orders
from pipec.errors import PipecError
from pipec.ir import Action, Program, loop_placement, v_placement
from pipec.tune.candidates import (
    ERROR,
    SKIPPED,
    Candidate,
    Certificate,
    Proof,
    evaluate,
    proves_optimal,
)
from pipec.tune.clock import DEFAULT_BUDGET, LIST_SECONDS_PER_OP, Clock
from pipec.tune.exact import ExactResult, exact_candidates
from pipec.tune.greedy import listed_orders
from pipec.tune.instance import KINDS, exact_times
from pipec.tune.moves import local_moves
from pipec.tune.refutation import gap_first
from pipec.tune.relaxation import shape_bound
from pipec.tune.setting import Setting
from pipec.tune.space import Draw, draws

KEEP = 3  # phase 3 improves this many of the best distinct orders
SOLVER_SHARE = 0.5  # of the time left after phase 2, for phase 4 (with the solver: after tune's own local moves)
SOLVER_AFTER_MOVES = 0.9  # of the time left after the solver's start, for the solver (the rest: moves on its orders)
RESOLVES = 2  # the most times a shape not proved is solved again with the time its first solve left
RESOLVE_SECONDS = 2.0  # the least time for a solve again (less gets no further than the last one)
OWN_SHARE = 0.5  # of a shape's share left after its proof that it cannot win, for its own optimum (_solve_shape)
LATE_SEEDS = 4  # the most `late` re-solves (one a seed) that _closer tries for an order nccl runs slower
LATE_SECONDS = 3.0  # the least time for one of them (measured: 1 s often stops short of the latest orders)
RELAXATION_SHARE = 0.2  # of a shape's share at V > 1, for its one-rank bound before its solve (pipec.tune.relaxation)
PLACEMENT_SHARE = 0.1  # of the budget, kept from phase 3 for placing the best order's send/recv (_placed)
_EPSILON = 1e-9  # a makespan gain below it is no gain

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TuneResult:
    setting: Setting
    candidates: tuple[Candidate, ...]  # ok ones ranked first, then the rest in the order tried
    best: Candidate | None
    library_best: Candidate | None  # the best phase-1 candidate (library and --from files)
    complete: bool  # False when the time budget cut phase 2, 3 or 4
    certificate: Certificate | None = None  # the solver's bound (None: tune ran without it)


def tune(
    setting: Setting,
    sources: Sequence[tuple[str, str]],
    time_budget: float = DEFAULT_BUDGET,
    seed: int = 0,
    progress: Progress | None = None,
    workers: int = cpsat.WORKERS,
    clock: Clock | None = None,
) -> TuneResult:
    """Phases 1 to 4 (module docstring). Phase 1 always completes; `time_budget` seconds of `clock` (the work
    done, in seconds it takes on an idle machine, with caps in CPU and wall time: pipec.tune.clock), counted from
    the clock's start (default: a clock started now), bound the others."""
    clock = clock or Clock()
    deadline = time_budget
    say = progress or (lambda text: None)
    tried: list[Candidate] = []

    best: list[Candidate] = []  # the best ok candidate so far, for the progress line

    def note(candidate: Candidate, phase: str, keep: bool = True) -> None:
        if keep:
            tried.append(candidate)
        if candidate.ok and (not best or candidate.key() < best[0].key()):
            best[:] = [candidate]
        shown = f"best {best[0].makespan:g} ({best[0].label()})" if best else "nothing fits yet"
        say(f"tune: {phase}: {len(tried)} candidates, {shown}, {clock.now():.1f} s of {time_budget:g} s")

    for draw in draws(sources, setting.ranks, setting.microbatches, setting.chunks, setting.limit, seed):
        note(_from_draw(draw, setting, clock), "library")
    library_best = min((c for c in tried if c.ok), key=Candidate.key, default=None)

    complete = True
    for name, v, orders in listed_orders(setting):
        clock.charge(_list_seconds(setting, v))
        if clock.passed(deadline):
            complete = False
            break
        if isinstance(orders, str):
            note(Candidate(name, (), v, None, None, None, ERROR, orders, phase=2), "list scheduling")
        else:
            note(evaluate(name, (), orders, setting, clock=clock, phase=2), "list scheduling")

    # with messages, a share of the budget is kept for placing the winner's send/recv from its timing
    moves_end = deadline - (PLACEMENT_SHARE * time_budget if setting.costs.message_time > 0 else 0.0)
    why_not = cpsat.available() or cpsat.refuses(setting.stage_costs(1), setting.ranks)
    if why_not is not None:
        # without the solver: the branch and bound (exact.py) at small sizes, at most SOLVER_SHARE of the time
        # left, then the local moves on the best orders of every phase (tune before the solver)
        certificate = Certificate((), cpsat.MODEL_IDEAL, False, skipped=why_not)
        until = clock.after(clock.left(deadline) * SOLVER_SHARE)
        for name, v, found in exact_candidates(setting, clock, until):
            note(_from_exact(name, v, found, setting, clock), "exact search")
            complete = complete and (isinstance(found, str) or found.optimal)  # a skip is no budget cut
        complete = local_moves(_distinct_best(tried, KEEP), setting, clock, moves_end, seed, 0, note) and complete
        own_best, unclosed = None, []
    else:
        # with it, tune without the solver runs first, as it would alone (the local moves on the best orders of
        # phases 1 and 2), within 1 - SOLVER_SHARE of the time left: what it finds stays a candidate, so tune with
        # the solver is never worse than tune without it when those moves end (a local optimum; the budget cut
        # shows as `complete` false), and the solver starts warm from orders already improved. Then phase 4,
        # then the local moves on the solver's orders that are not yet at its bound.
        today = _distinct_best(tried, KEEP)
        until = min(moves_end, clock.after(clock.left(moves_end) * (1 - SOLVER_SHARE)))
        complete = local_moves(today, setting, clock, until, seed, 0, note) and complete
        own_best = min((c for c in tried if c.ok), key=Candidate.key, default=None)
        until = clock.after(clock.left(moves_end) * SOLVER_AFTER_MOVES)
        certificate, solved, unclosed = _solver_phase(setting, tried, clock, until, seed, note, workers)
        complete = complete and solved
        solved_orders = _distinct_best([c for c in tried if c.phase == 4], KEEP)
        solver_orders = [c for c in solved_orders if not proves_optimal(c.makespan, c.bound)]
        complete = local_moves(solver_orders, setting, clock, moves_end, seed, KEEP, note) and complete
    # the send/recv of tune's own best (what tune without the solver places) and of the leader, when another,
    # placed from their timing; phase 4 placed its own (_solver_phase), and the best solver order it left slower
    # under nccl than in the model, its model makespan still below the leader's, goes on from its placement and
    # its solve's timing in what the budget has left (measured at P=8, M=16, X=8, F=I=W=1, comm=0.5: the solver's
    # 74 ran at 75.5 after _closer's 31 s; 18 s were left, and they reach 75)
    leader = min((c for c in tried if c.ok), key=Candidate.key, default=None)
    chosen: list[tuple[Candidate, cpsat.SolverResult | None]] = [
        (c, None) for c in (own_best, leader) if c is not None and c.phase != 4
    ]
    if len(chosen) == 2 and chosen[0][0] is chosen[1][0]:
        chosen.pop()
    hopeful = [(c, found) for c, found in unclosed if leader is None or found.makespan < leader.makespan - _EPSILON]
    if hopeful:
        chosen.append(min(hopeful, key=lambda pair: (pair[1].makespan, pair[0].key())))
    for index, (candidate, found) in enumerate(chosen):
        timing, target = (None, None) if found is None else (found.timing, found.makespan)
        share = clock.share(deadline, len(chosen) - index)
        placed, finished = _placed(candidate, setting, clock, share, timing, target)
        complete = complete and finished
        if placed is not candidate:
            note(placed, "send/recv placement")
    ranked = sorted((c for c in tried if c.ok), key=Candidate.key)
    rest = [c for c in tried if not c.ok]
    return TuneResult(setting, (*ranked, *rest), ranked[0] if ranked else None, library_best, complete, certificate)


def _solver_phase(
    setting: Setting,
    tried: list[Candidate],
    clock: Clock,
    deadline: float,
    seed: int,
    note: Callable[..., None],
    workers: int,
) -> tuple[Certificate, bool, list[tuple[Candidate, cpsat.SolverResult]]]:
    """Phase 4 with CP-SAT: one model per V of --chunks and placement (loop; v too at V > 1), each warm-started
    from the best verified order of its shape so far and cut off at tune's best makespan (with messages a shape
    behind it gap first, pipec.tune.refutation), the time to `deadline` shared among the solves left by weight
    1/V^2 (one that proves early leaves its rest to the next). What is left after them goes to the shapes not
    proved, solved again from the best order then known (up to RESOLVES times; a shape's bound is the greatest of
    its solves'). Returns the certificate, whether every solve ended, and the solver orders noted still slower
    under nccl than in the model, each with its solve."""
    jobs = [(v, placement) for v in setting.chunks for placement in (("loop", "v") if v > 1 else ("loop",))]
    shapes = {_placed_as(setting.ranks, v, placement) for v, placement in jobs}
    # within a V, the placement whose best order is faster first: the cutoff of the other is then the tighter
    jobs.sort(key=lambda job: (job[0], _shape_best(tried, _placed_as(setting.ranks, *job))))
    proofs: dict[tuple[int, str], Proof] = {}
    model = cpsat.MODEL_IDEAL
    starved = False  # a solve found no order in its share: the larger models after it would not either
    placed_all = True  # every send/recv placement ran its moves to the end
    pending = list(jobs)
    unclosed: list[tuple[Candidate, cpsat.SolverResult]] = []
    first: dict[int, tuple[int, str]] = {}  # per V, its placement solved first
    for job in jobs:
        first.setdefault(job[0], job)
    for again in range(RESOLVES + 1):
        for index, (v, placement) in enumerate(pending):
            # the time left, shared by weight 1/V^2 among the solves left: a smaller model is likelier to be
            # proved (the model grows with V, and its proofs harder still); within a V, twice that for the
            # placement solved first (its best is faster: its bound is likelier the run's, the other's cutoff tighter)
            weights = [(2 if job == first[job[0]] else 1) / job[0] ** 2 for job in pending[index:]]
            fraction = weights[0] / sum(weights)
            if again and clock.left(deadline) * fraction < RESOLVE_SECONDS:
                continue  # too little for a solve again to get further than the last
            # a solve again has only the time that the first round left: a starved round does not skip it
            solved_as, finished, starving = _solve_shape(
                setting,
                tried,
                (v, placement),
                shapes,
                fraction,
                clock,
                deadline,
                seed,
                note,
                workers,
                proofs,
                again,
                starved and not again,
                unclosed,
            )
            model = solved_as or model
            placed_all = placed_all and finished
            starved = starved or starving
        pending = [job for job in jobs if not proofs[job].solved and proofs[job].seconds > 0]
        if not pending:
            break
    certificate = Certificate(tuple(proofs[job] for job in jobs), model, relaxed=setting.costs.message_time > 0)
    return certificate, placed_all and all(p.solved for p in proofs.values()), unclosed


def _solve_shape(
    setting: Setting,
    tried: list[Candidate],
    job: tuple[int, str],
    shapes: set[tuple[int, ...]],
    fraction: float,
    clock: Clock,
    deadline: float,
    seed: int,
    note: Callable[..., None],
    workers: int,
    proofs: dict[tuple[int, str], Proof],
    again: int,
    starved: bool,
    unclosed: list[tuple[Candidate, cpsat.SolverResult]],
) -> tuple[str | None, bool, bool]:
    """One solve of `_solver_phase` (its `again`-th for this shape), in `fraction` of the time to `deadline` (as
    much again for placing the send/recv of an order that nccl runs slower): records the shape's proof (the
    greatest bound of its solves) and notes its candidate (on a solve again, only one faster than the shape had),
    adding it to `unclosed` with the solve when nccl still runs it slower than the model.
    Returns the solver's model (None: no solve ran), whether the placement ran to its end, and whether the solve
    starved (found no order from its own best)."""
    v, placement = job
    name = "cpsat" if placement == "loop" else "cpsat-v"
    where = _placed_as(setting.ranks, v, placement)
    template = Program("tuned", setting.ranks, setting.microbatches, v, where, ((),) * setting.ranks)
    # of one copy only: a replicated schedule placed alike (dualpipe, placement v) is another model's order
    shape = [c for c in tried if _one_copy_placed_as(c, where)]
    hint = min(shape, key=Candidate.key).program.compute_streams() if shape else None  # type: ignore[union-attr]
    costs, sizes = setting.stage_costs(v), setting.stage_sizes(v)
    before = proofs.get(job)

    def cheap_bound() -> float:  # per rank, memory: without solving
        return cpsat.cheap_bound(template, costs, setting.limit, setting.costs.input_fraction, sizes)

    if starved:  # its time goes to the local moves; its bound is the cheap one
        bound = cheap_bound()
        proofs[job] = Proof(v, placement, bound, False)
        why = "not solved: a smaller model found no order in its share of the time budget"
        note(Candidate(name, (), v, None, None, None, SKIPPED, why, phase=4, bound=bound), "solver")
        return None, True, False
    # no order slower than tune's best of the solver's shapes can win: the solve looks only below it
    cutoff = min((_shape_best(tried, other) for other in shapes), default=math.inf)
    share_end = clock.after(clock.left(deadline) * fraction)
    relaxed = before.bound if before is not None and before.bound is not None else 0.0
    relaxed_model, relaxed_in = None, 0.0
    if not again and v > 1:  # the bound of one rank at a time, a part of the share (measured where it pays: V > 1)
        began, problem = clock.now(), (template, costs, setting.limit, setting.costs.input_fraction, sizes)
        relaxed, relaxed_model = shape_bound(*problem, clock.left(share_end) * RELAXATION_SHARE, clock)
        relaxed_in = clock.now() - began

    def solve_below(limit: float, share: float) -> cpsat.SolverResult:  # in `share` of the share's time left
        return cpsat.solve(
            template,
            costs,
            setting.limit,
            setting.costs.input_fraction,
            sizes,
            clock.left(share_end) * share,
            hint,
            seed + again,
            workers,
            cutoff=None if math.isinf(limit) else limit,
            clock=clock,
            known=relaxed,
        )

    def known() -> float:  # the shape's bound so far: its last solve's, or the cheap or one-rank one
        return max(relaxed, cheap_bound())

    scale = exact_times(costs, len(where), KINDS)[0]
    own = _shape_best(tried, where)  # the shape's best so far (nothing is noted until the end)
    if relaxed_model is not None and relaxed > cutoff + _EPSILON:  # no order of it reaches tune's best: proved
        found = cpsat.SolverResult(None, None, relaxed, True, False, relaxed_model, 0.0)
    elif setting.costs.message_time > 0:
        found = gap_first(solve_below, lambda: clock.left(share_end), cutoff, own, known, scale)
    else:  # the ideal model: its optimum is sought at once (pipec.tune.refutation says why)
        found = solve_below(cutoff, 1.0)
    took = found.seconds + relaxed_in + (before.seconds if before is not None else 0.0)
    if found.infeasible:
        proofs[job] = Proof(v, placement, math.inf, True, took)
        note(Candidate(name, (), v, None, None, None, ERROR, "no order fits the limit (proved)", phase=4), "solver")
        return found.model, True, False
    cannot_win = found.orders is None and found.optimal  # proved: no order of it is faster than the cutoff
    own_optimum = False  # found: the shape's own best, not an order that could win
    if cannot_win and not again and cutoff + _EPSILON < own < math.inf:
        # proved unable to win: its own optimum is still worth knowing (a user who keeps this V reads its row),
        # sought from its own best in at most OWN_SHARE of the share left, the rest passing on as before
        mine = solve_below(own, OWN_SHARE)
        if mine.orders is not None:
            found = replace(mine, bound=max(found.bound, mine.bound or 0.0))  # type: ignore[type-var]
            own_optimum = True
        took += mine.seconds
    bounds = [b for b in (found.bound, before.bound if before is not None else None) if b is not None]
    solved = cannot_win or found.optimal or (before is not None and before.solved)
    proofs[job] = Proof(v, placement, max(bounds) if bounds else None, solved, took)
    bound = proofs[job].bound
    if found.orders is None:
        if again:
            return found.model, True, False
        if found.optimal:
            why = f"proved: no order of this shape is faster than {found.bound:g} (tune has {cutoff:g})"
        else:
            why = "the time budget ended before the solver found an order"
        note(Candidate(name, (), v, None, None, None, SKIPPED, why, phase=4, bound=bound), "solver")
        # starved: with its own best as the hint it found none; one only cut off below another shape's best
        # says nothing of the larger models
        return found.model, True, not found.optimal and own <= cutoff + _EPSILON
    candidate = evaluate(name, (), found.orders, setting, clock=clock, phase=4, bound=bound)
    finished = True
    # an order nccl runs slower than the model brought closer, unless it is a shape's own best that cannot win
    slower = candidate.ok and found.makespan is not None and candidate.makespan > found.makespan + _EPSILON  # type: ignore[operator]
    if slower and not own_optimum:
        until = clock.after(clock.left(deadline) * fraction)
        candidate, finished = _closer(candidate, found, template, setting, clock, until, seed, workers)
    if not again or (candidate.ok and candidate.makespan < own - _EPSILON):  # type: ignore[operator]
        note(candidate, "solver")
        if slower and not own_optimum and candidate.makespan > found.makespan + _EPSILON:  # type: ignore[operator]
            unclosed.append((candidate, found))
    return found.model, finished, False


def _placed_as(ranks: int, chunks: int, placement: str) -> tuple[int, ...]:
    stages = ranks * chunks
    return loop_placement(ranks, stages) if placement == "loop" else v_placement(ranks, stages)


def _shape_best(tried: Sequence[Candidate], where: Sequence[int]) -> float:
    """The least makespan of an ok candidate placed as `where` (inf: none)."""
    spans = [c.makespan for c in tried if _one_copy_placed_as(c, where)]
    return min(spans, default=math.inf)  # type: ignore[type-var, arg-type]


def _one_copy_placed_as(candidate: Candidate, where: Sequence[int]) -> bool:
    """An ok candidate of one copy placed as `where`: the solver's shapes model one copy (the cutoff and the
    hint must not come from a replicated schedule that happens to be placed alike)."""
    program = candidate.program
    return candidate.ok and program is not None and program.stage_to_rank == where and program.pipelines == 1


def _closer(
    candidate: Candidate,
    found: cpsat.SolverResult,
    template: Program,
    setting: Setting,
    clock: Clock,
    deadline: float,
    seed: int,
    workers: int,
) -> tuple[Candidate, bool]:
    """A solver order that runs slower under nccl than in the model (`found.makespan`), brought closer: first its
    send/recv placed from the solver's timing (pipec.tune.placement), in half the time; then, while the best is
    still slower, at V=1 with messages an order of the `executed` restriction (half what is left), and the same
    makespan with every op as late as it allows (cpsat.solve's `late`) under LATE_SEEDS seeds, each placed the same
    way: each seed gives other optimal orders, and which of them nccl's batches leave at the model's makespan is
    found by trying (measured at P=4, M=8, X=8, I=2F, comm=0.5: two of four seeds reach 43, the others 43.5 to 44.5).
    Returns the best and whether every placement ran its moves to the end."""
    assert found.orders is not None and found.makespan is not None
    v = found.orders.chunks
    serial = v == 1 and setting.costs.message_time > 0  # an `executed` solve is tried (below)
    # the solver's own order first, with half the time: its placement solve ends when it has proved its best
    # (measured at P=4, M=8, X=4, V=2, comm=0.5: 50.5 in 4 s of the solve; a fifth of the time, under load, 52)
    first = clock.after(clock.left(deadline) / 2)
    best, finished = _placed(candidate, setting, clock, first, found.timing, found.makespan)
    if serial and best.makespan > found.makespan + _EPSILON and not clock.passed(deadline):  # type: ignore[operator]
        # orders timed with each rank moving one message at a time, as nccl's one stream does (measured at V=1:
        # they reach the model's makespan where the relaxation's optimal orders lose half a unit with any
        # placement; at V=2 the restriction costs more than it saves)
        until = clock.after(clock.left(deadline) / 2)  # the other half: the `late` seeds
        executed = cpsat.solve(
            template,
            setting.stage_costs(v),
            setting.limit,
            setting.costs.input_fraction,
            setting.stage_sizes(v),
            clock.left(until) / 2,
            found.orders.streams,
            seed,
            workers,
            cutoff=best.makespan,
            hint_timing=found.timing,
            clock=clock,
            executed=True,
        )
        if executed.orders is not None:
            best, finished = _tried(executed, best, finished, candidate, found, setting, clock, until)
    for index in range(LATE_SEEDS):
        if best.makespan <= found.makespan + _EPSILON or clock.passed(deadline):  # type: ignore[operator]
            break
        left = clock.left(deadline)
        later = cpsat.solve(
            template,
            setting.stage_costs(v),
            setting.limit,
            setting.costs.input_fraction,
            setting.stage_sizes(v),
            min(left / 2, max(LATE_SECONDS, found.seconds)),
            found.orders.streams,
            seed + index,
            workers,
            late=found.makespan,
            hint_timing=found.timing,
            clock=clock,
        )
        if later.orders is None:
            continue
        until = clock.share(deadline, LATE_SEEDS - index)
        best, finished = _tried(later, best, finished, candidate, found, setting, clock, until)
    return best, finished


def _tried(
    other: cpsat.SolverResult,
    best: Candidate,
    finished: bool,
    candidate: Candidate,
    found: cpsat.SolverResult,
    setting: Setting,
    clock: Clock,
    deadline: float,
) -> tuple[Candidate, bool]:
    """`_closer`'s step for another solve's orders of `found`'s makespan: judged as they are and placed from that
    solve's timing (and transfers), the better of them and `best`; and whether the placement's moves ended."""
    assert other.orders is not None
    option = evaluate(candidate.name, (), other.orders, setting, clock=clock, phase=4, bound=found.bound)
    placed, done = _placed(option, setting, clock, deadline, other.timing, found.makespan, other.transfers)
    best = min((c for c in (best, option, placed) if c.ok), key=Candidate.key, default=best)
    return best, finished and done


def _placed(
    candidate: Candidate,
    setting: Setting,
    clock: Clock,
    deadline: float,
    timing: Mapping[Action, tuple[float, float | None]] | None = None,
    target: float | None = None,
    transfers: Mapping[Action, float] | None = None,
) -> tuple[Candidate, bool]:
    """The candidate with its send/recv placed by pipec.tune.placement (from `timing`, the solver's, or the
    earliest; receives posted ahead, then local moves of single sends and receives; for a solver order, while it
    runs slower than `target`, its makespan in the model, then the placement solve around the best) when that
    verifies and runs faster under nccl, else the candidate itself; and whether the placement's moves ended
    before `deadline`."""
    if not candidate.ok or candidate.program is None or candidate.makespan is None:
        return candidate, True
    if candidate.program.pipelines > 1:
        # its placement would leave out the copies' SYNCs, and a .pipe cannot list them: the compiler's own
        # placement (place_p2p, with the SYNCs) is the one tune judged it with and pipec check re-creates
        return candidate, True
    costs = setting.stage_costs(candidate.chunks)
    orders = candidate.program.with_streams(candidate.program.compute_streams(), has_comms=False)
    placed = send_recv.place(
        orders, candidate.program, candidate.makespan, costs, clock, deadline, timing, target, transfers
    )
    if placed is None:
        return candidate, True
    better, finished = placed
    trial = evaluate(
        candidate.name,
        candidate.params,
        orders,
        setting,
        placed=better,
        clock=clock,
        own_placement=True,
        moves=candidate.moves,
        phase=candidate.phase,
        bound=candidate.bound,
    )
    if trial.ok and trial.makespan < candidate.makespan - _EPSILON:  # type: ignore[operator]
        return trial, finished
    return candidate, finished


def _list_seconds(setting: Setting, chunks: int) -> float:
    """The clock's charge for one list-scheduled order of V = `chunks` (phase 2, or a library `choose` schedule)."""
    return LIST_SECONDS_PER_OP * 3 * setting.microbatches * setting.ranks * chunks


def _from_draw(draw: Draw, setting: Setting, clock: Clock) -> Candidate:
    if draw.problem:
        verdict = SKIPPED if draw.skipped else ERROR
        return Candidate(draw.name, draw.params, draw.chunks, None, None, None, verdict, draw.problem)
    try:
        if draw.choose:  # a cost-aware schedule is list-scheduled under the costs and the limit, per rank share
            clock.charge(_list_seconds(setting, draw.chunks))
            orders = compute_orders(
                draw.source,
                setting.ranks,
                setting.microbatches,
                draw.chunks,
                dict(draw.params),
                costs=setting.costs,
                input_fraction=setting.costs.input_fraction,
                stage_sizes=setting.segment_sizes(),
                per_rank_share=True,  # its own `memory` (its `limit` parameter, within X: see space.py) binds it
            )
        else:
            orders = compute_orders(draw.source, setting.ranks, setting.microbatches, draw.chunks, dict(draw.params))
    except PipecError as e:
        return Candidate(draw.name, draw.params, draw.chunks, None, None, None, ERROR, e.message.splitlines()[0])
    return evaluate(draw.name, draw.params, orders, setting, clock=clock)


def _from_exact(name: str, v: int, found: ExactResult | str, setting: Setting, clock: Clock) -> Candidate:
    if isinstance(found, str):
        return Candidate(name, (), v, None, None, None, SKIPPED, found, phase=4)
    if found.orders is None:
        why = "no order fits the limit" if found.optimal else "the time budget ended before an order was found"
        return Candidate(name, (), v, None, None, None, ERROR if found.optimal else SKIPPED, why, phase=4)
    candidate = evaluate(name, (), found.orders, setting, clock=clock, phase=4)
    if candidate.ok and not found.optimal:
        return replace(candidate, reason="not proved optimal: the time budget ended the search")
    return candidate


def _distinct_best(candidates: Sequence[Candidate], count: int) -> list[Candidate]:
    """The best `count` ok candidates with different compute orders."""
    out: list[Candidate] = []
    seen: set = set()
    for c in sorted((c for c in candidates if c.ok), key=Candidate.key):
        assert c.program is not None
        streams = c.program.compute_streams()
        if streams in seen:
            continue
        seen.add(streams)
        out.append(c)
        if len(out) == count:
            break
    return out
