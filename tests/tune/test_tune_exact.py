"""The exact search of `pipec tune` (pipec/tune/exact.py) against a brute force written here.

The brute force enumerates, rank by rank, every order of the rank's ops that respects the micro-batch order of
each (stage, kind) (the space the search covers: the language's counters), the rank's own data dependencies
(F before I before W of one micro-batch) and the memory limit (pipec.verify.memory.memory_profile, the
verifier's model); takes every combination of the ranks' orders; simulates each with pipec.sim in the two models
the search optimises, `ideal` (compute orders alone, messages taking `comm`) and `nccl` (send/recv placed for the
costs, what tune ranks), skipping the ones that deadlock; and keeps the least makespan of each. One case also
lifts the micro-batch order, to show on it that the counters lose nothing. Then tune itself: it lists the exact
candidate, equal to the brute force's nccl optimum, and is never worse than it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from pipec.errors import PipecError
from pipec.ir import Action, Kind, Program, loop_placement
from pipec.sim.costs import parse_costs
from pipec.sim.simulate import simulate
from pipec.tune import Setting, cpsat, library_sources, tune
from pipec.tune.clock import Clock
from pipec.tune.exact import exact_candidates, exact_orders, small_enough
from pipec.tune.greedy import listed_orders
from pipec.verify.memory import memory_profile

KINDS = (Kind.F, Kind.I, Kind.W)


def rank_orders(stages: tuple[int, ...], microbatches: int, limit: float, counters: bool = True) -> Iterator[tuple]:
    """Every order of one rank's ops (see the module docstring), built op by op."""
    ops = [Action(s, k, m) for s in stages for k in KINDS for m in range(microbatches)]

    def allowed(op: Action, placed: set) -> bool:
        s, k, m = op
        if counters and m > 0 and Action(s, k, m - 1) not in placed:
            return False
        return k is Kind.F or Action(s, Kind.F if k is Kind.I else Kind.I, m) in placed

    def grow(prefix: list[Action], placed: set) -> Iterator[tuple]:
        if len(prefix) == len(ops):
            yield tuple(prefix)
            return
        for op in ops:
            if op in placed or not allowed(op, placed):
                continue
            prefix.append(op)
            if memory_profile(prefix)[-1] <= limit + 1e-9:
                placed.add(op)
                yield from grow(prefix, placed)
                placed.discard(op)
            prefix.pop()

    yield from grow([], set())


def brute_force(
    ranks: int, microbatches: int, cost: str | dict, limit: float, counters: bool = True, nccl: bool = True
) -> tuple[float | None, float | None]:
    """The least makespan over the space in the ideal model and (when `nccl`) in the nccl model, send/recv placed
    for the costs as pipec.sim places them for a compute-only program; each combination runs no faster under
    nccl than in the ideal model (the search's bound rests on it)."""
    costs = parse_costs(cost)
    where = loop_placement(ranks, ranks)
    per_rank = [list(rank_orders((r,), microbatches, limit, counters)) for r in range(ranks)]
    best_ideal = best_nccl = None
    for streams in itertools.product(*per_rank):
        program = Program("brute", ranks, microbatches, 1, where, tuple(streams))
        try:
            ideal = simulate(program, costs, p2p="ideal").makespan
        except PipecError:  # a combination that deadlocks
            continue
        best_ideal = ideal if best_ideal is None else min(best_ideal, ideal)
        if nccl:
            try:
                span = simulate(program, costs, p2p="nccl").makespan
            except PipecError:
                continue
            assert span >= ideal - 1e-9
            best_nccl = span if best_nccl is None else min(best_nccl, span)
    return best_ideal, best_nccl


def exact_makespan(
    ranks: int, microbatches: int, cost: str | dict, limit: float, model: str
) -> tuple[float | None, Program | None]:
    template = Program("t", ranks, microbatches, 1, loop_placement(ranks, ranks), ((),) * ranks)
    costs = parse_costs(cost)
    found = exact_orders(template, costs, limit, costs.input_fraction, deadline=30, model=model)
    assert found.optimal, "the search should end at these sizes"
    return found.makespan, found.orders


CASES = [  # P, M, costs (per stage at V = 1: the same as per rank share), limit
    (2, 2, "F=1,I=1,W=1", 2),
    (2, 3, "F=1,I=2,W=1", 3),
    (2, 3, "F=1,I=1,W=2", 1.5),
    (2, 3, "F=1,I=1,W=1,comm=0.5", 2),
    (3, 2, "F=1,I=2,W=1,comm=0.5", 2),
    (3, 2, "F=1,I=1,W=2", 1),
    (2, 4, "F=1,I=1,W=1,comm=0.5", 1.5),
    (3, 2, "F=1,I=1,W=1,comm=1,overlap=1", 2),  # nccl 14, ideal 13
    (2, 3, "F=1,I=1,W=2,comm=1", 2),  # nccl 17, ideal 16
    (2, 4, "F=1,I=1,W=1", 2),
    (3, 3, "F=1,I=1,W=2", 2),
    (3, 4, "F=1,I=1,W=1", 1.5),
    (3, 3, {"F": [1, 1, 2], "I": [1, 1, 2], "W": [1, 1, 2]}, 2),  # the last stage twice as slow
    (2, 3, "F=1,I=1,W=1", 0.5),  # nothing fits: no forward within half a unit
]


@pytest.mark.parametrize(("ranks", "microbatches", "cost", "limit"), CASES)
def test_exact_equals_the_brute_force(ranks: int, microbatches: int, cost: str | dict, limit: float) -> None:
    heavy = len(list(rank_orders((0,), microbatches, limit))) ** ranks > 3000  # nccl: only where it stays quick
    expected = brute_force(ranks, microbatches, cost, limit, nccl=not heavy)
    for model, want in zip(("ideal", "nccl"), expected, strict=True):
        if model == "nccl" and heavy:
            continue
        makespan, orders = exact_makespan(ranks, microbatches, cost, limit, model)
        assert makespan == pytest.approx(want) if want is not None else makespan is None, model
        if orders is not None:  # the orders it returns are what it claims: their time, within the limit
            assert simulate(orders, parse_costs(cost), p2p=model).makespan == pytest.approx(makespan)
            assert all(max(memory_profile(s)) <= limit + 1e-9 for s in orders.streams)


def test_the_counters_lose_nothing_where_every_order_is_enumerated() -> None:
    # any micro-batch order within a (stage, kind), not only the counters': the same optimum, in both models
    for cost, limit in (("F=1,I=2,W=1,comm=0.5", 2), ("F=1,I=1,W=2", 1.5)):
        everything = brute_force(2, 2, cost, limit, counters=False)
        assert everything == pytest.approx(brute_force(2, 2, cost, limit))
        assert everything[1] == pytest.approx(exact_makespan(2, 2, cost, limit, "nccl")[0])


@pytest.mark.parametrize(("cost", "limit"), [("F=1,I=1,W=2", 1.5), ("F=1,I=2,W=1,comm=0.5", 2)])
def test_never_slower_than_the_list_schedules_in_its_model(cost: str, limit: float) -> None:
    # tune's phase 2 orders are points of the space searched, timed in the same model (nccl, send/recv placed)
    setting = Setting(3, 4, parse_costs(cost), limit, (1,))
    ((_, _, found),) = exact_candidates(setting, Clock(), 30)
    assert found.optimal and found.orders is not None
    listed = [orders for _, _, orders in listed_orders(setting) if isinstance(orders, Program)]
    assert listed
    for orders in listed:
        assert found.makespan <= simulate(orders, setting.stage_costs(1), p2p="nccl").makespan + 1e-9


def test_budget_stops_it_cleanly_and_says_so() -> None:
    template = Program("t", 4, 5, 1, loop_placement(4, 4), ((),) * 4)
    costs = parse_costs("F=1,I=2,W=1")
    found = exact_orders(template, costs, 2, costs.input_fraction, max_nodes=200)
    assert not found.optimal and found.nodes <= 201
    again = exact_orders(template, costs, 2, costs.input_fraction, max_nodes=200)
    assert again == found  # deterministic: the same cap gives the same orders
    assert found.orders is not None  # the first leaf comes within the cap (a list schedule's depth)
    assert simulate(found.orders, costs, p2p="nccl").makespan == pytest.approx(found.makespan)
    # a deadline already passed stops it as cleanly
    late = exact_orders(template, costs, 2, costs.input_fraction, deadline=-1)
    assert not late.optimal and late.nodes <= 256


def test_sizes_over_the_bound_are_not_searched() -> None:
    assert small_enough(4, 5, 1) and not small_enough(4, 6, 1) and not small_enough(3, 4, 2)
    setting = Setting(4, 8, parse_costs("F=1,I=1,W=1"), 4, (1, 2))
    assert list(exact_candidates(setting, Clock(), 5)) == []


def test_zero_durations_are_skipped_once_with_the_reason() -> None:
    setting = Setting(2, 2, parse_costs("F=1,I=1,W=0"), 2, (1, 2))
    ((name, _, why),) = exact_candidates(setting, Clock(), 5)
    assert name == "exact" and "zero duration" in why


@pytest.mark.parametrize(("cost", "limit"), [("F=1,I=1,W=1", 2), ("F=1,I=2,W=1,comm=0.5", 1.5)])
def test_tune_lists_the_exact_candidate_and_is_never_worse(
    cost: str, limit: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the branch and bound is tune's exact phase where OR-tools is missing: here as if it were
    monkeypatch.setattr(cpsat, "available", lambda: "OR-tools is not installed (as the test pretends)")
    setting = Setting(2, 3, parse_costs(cost), limit, (1,))
    result = tune(setting, library_sources(), time_budget=4)
    assert result.certificate is not None and "not installed" in result.certificate.skipped
    exact = [c for c in result.candidates if c.name == "exact" and c.phase == 4]
    assert len(exact) == 1 and exact[0].ok, exact
    assert result.best is not None and result.best.makespan <= exact[0].makespan + 1e-9
    # as tune judged it (placed, verified, simulated under nccl): the optimum of the space
    assert exact[0].makespan == pytest.approx(brute_force(2, 3, cost, limit)[1])
