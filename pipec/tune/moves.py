"""Phase 3 of `pipec tune`: local moves on an order (pipec/tune/search.py's module docstring says where they run).

Move one W past a neighbour on its rank (either way) or pull one F earlier, in a seeded order, first improvement:
a move is kept when the result verifies, fits, is not slower and moves work earlier (the makespan, then the sum of
the ops' end times, decreases: plateaus of the makespan are common, and crossing them is what finds the faster
orders), until no move helps or the budget's deadline passes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from pipec.errors import PipecError
from pipec.ir import MEMORY_TOLERANCE, Action, Kind, Program, activation_deltas
from pipec.passes.p2p import insert_p2p_ops
from pipec.passes.sync import copy_orders, with_copy_syncs
from pipec.sim.costs import Costs
from pipec.sim.simulate import simulate
from pipec.tune.candidates import Candidate, evaluate
from pipec.tune.clock import SCORE_SECONDS_PER_OP, Clock, simulation_seconds
from pipec.tune.setting import Setting
from pipec.verify.memory import memory_profile

_EPSILON = 1e-9  # a makespan gain below it is no gain


def local_moves(
    starts: Sequence[Candidate],
    setting: Setting,
    clock: Clock,
    deadline: float,
    seed: int,
    first: int,
    note: Callable[..., None],
) -> bool:
    """Phase 3 on `starts`: an equal share of the time to `deadline` to each (one that ends early leaves its rest
    to the next), start number `first + index` seeded as tune always seeded it. Returns whether every start's
    moves ended (a local optimum) before the deadline."""
    finished_all = True
    for index, candidate in enumerate(starts):
        rng = random.Random(seed * 1009 + first + index)
        until = min(deadline, clock.share(deadline, len(starts) - index))
        on_try = lambda c: note(c, "local moves", keep=False)  # noqa: E731
        improved, finished = improve(candidate, setting, clock, until, rng, on_try)
        finished_all = finished_all and finished
        if improved is not candidate:
            note(improved, "local moves")
    return finished_all


def improve(
    start: Candidate,
    setting: Setting,
    clock: Clock,
    deadline: float,
    rng: random.Random,
    on_try: Callable[[Candidate], None] | None = None,
) -> tuple[Candidate, bool]:
    """First-improvement local search from `start`'s order. Returns (the best candidate, whether it stopped at a
    local optimum rather than at the deadline)."""
    assert start.program is not None and start.makespan is not None
    orders = copy_orders(start.program)  # SYNCs out: each trial is placed with its own
    v = orders.chunks
    costs = setting.stage_costs(v, orders.pipelines)
    sizes = setting.stage_sizes(v, orders.pipelines)
    deltas = activation_deltas(setting.costs.input_fraction)
    streams = [list(s) for s in orders.streams]
    best, moves = start, 0
    # None when only the default placement runs this order (place_p2p chose it): any trial that runs is progress
    each = simulation_seconds(SCORE_SECONDS_PER_OP, orders)  # the clock's charge for one score
    clock.charge(each)
    current = _quick_score(orders, costs) or (start.makespan, math.inf)
    while True:
        options = _moves(streams)
        rng.shuffle(options)
        # live memory after each op, per rank: valid for the whole pass (a rejected swap is undone, an accepted one
        # starts a new pass)
        profiles = [memory_profile(stream, setting.costs.input_fraction, sizes) for stream in streams]
        for rank, i in options:
            if clock.passed(deadline):
                return best, False
            stream = streams[rank]
            a, b = stream[i], stream[i + 1]
            between = (profiles[rank][i - 1] if i else 0.0) + deltas[b.kind] * sizes[b.stage]
            if between > setting.limit + MEMORY_TOLERANCE:
                continue
            stream[i], stream[i + 1] = b, a
            trial = orders.with_streams(tuple(map(tuple, streams)), has_comms=False)
            score = _quick_score(trial, costs)
            clock.charge(each)
            if score is not None and _better(score, current):
                found = evaluate(start.name, start.params, trial, setting, clock=clock, moves=moves + 1, phase=3)
                if on_try is not None:
                    on_try(found)
                if found.ok and found.makespan <= best.makespan + _EPSILON:  # type: ignore[operator]
                    current, moves = score, moves + 1
                    if found.makespan < best.makespan - _EPSILON:  # type: ignore[operator]
                        best = found
                    break
            stream[i], stream[i + 1] = a, b
        else:
            return best, True


def _moves(streams: Sequence[Sequence]) -> list[tuple[int, int]]:
    """(rank, i): swap ops i and i+1 of the rank, where that moves a W either way or pulls an F earlier, and the
    two are not the same micro-batch of one stage (an order their data fixes)."""
    out = []
    for rank, stream in enumerate(streams):
        for i in range(len(stream) - 1):
            a, b = stream[i], stream[i + 1]
            if type(a) is not Action or type(b) is not Action:
                continue
            if a.stage == b.stage and a.mb == b.mb:
                continue
            if a.kind is Kind.W or b.kind is Kind.W or b.kind is Kind.F:
                out.append((rank, i))
    return out


def _quick_score(orders: Program, costs: Costs) -> tuple[float, float] | None:
    """(makespan, the sum of every compute op's end time) under nccl with send/recv placed for the costs (the timed
    placement only: place_p2p may still pick the default one, only ever faster), or None when the order does not
    run. The second term breaks the plateaus of the makespan: a move that lets work end sooner without delaying
    the last op is progress, and the pair strictly decreases, so the search ends."""
    try:
        sim = simulate(with_copy_syncs(insert_p2p_ops(orders, costs)), costs, p2p="nccl", record=True)
    except PipecError:
        return None
    return sim.makespan, sum(op.end for line in sim.timeline for op in line if not op.is_comm)


def _better(score: tuple[float, float], than: tuple[float, float]) -> bool:
    if score[0] < than[0] - _EPSILON:
        return True
    return abs(score[0] - than[0]) <= _EPSILON and score[1] < than[1] - _EPSILON


__all__ = ["improve", "local_moves"]
