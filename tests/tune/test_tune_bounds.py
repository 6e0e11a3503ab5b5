"""The bounds an instance gives without a solver (pipec/tune/instance.py: per rank, memory, idle at the ends)
against test_tune_exact.py's brute force, which enumerates every order within the verifier's memory profile and
simulates each with pipec.sim, knowing nothing of the bounds. A bound must never exceed the least makespan of
any schedule: the ideal model's without messages, nccl's with them (the posting time the bound counts is
nccl's too). Where the idle bound is the larger, it is what tune's certificate and its solver's floor rest on.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_tune_exact import brute_force

from pipec.ir import Program, loop_placement
from pipec.sim.costs import parse_costs
from pipec.tune import Setting, cpsat
from pipec.tune.clock import Clock
from pipec.tune.instance import Instance
from pipec.tune.relaxation import one_rank_bound


def instance(ranks: int, microbatches: int, cost: str, limit: float) -> Instance:
    template = Program("t", ranks, microbatches, 1, loop_placement(ranks, ranks), ((),) * ranks)
    costs = parse_costs(cost)
    return Instance(template, costs, limit, costs.input_fraction, None)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    ranks=st.integers(2, 3),
    microbatches=st.integers(2, 4),
    f=st.sampled_from([1, 2]),
    i=st.sampled_from([1, 2]),
    w=st.sampled_from([1, 2]),
    comm=st.sampled_from([0, 0.5]),
    limit=st.sampled_from([1, 1.5, 2, 3]),
)
@example(ranks=3, microbatches=3, f=1, i=2, w=1, comm=0.5, limit=2)  # idle 23.5 against the rest's 16.5
@example(ranks=2, microbatches=2, f=1, i=1, w=1, comm=0, limit=3)  # every forward fits: the windows overlap
def test_no_bound_exceeds_the_least_makespan_of_any_schedule(
    ranks: int, microbatches: int, f: int, i: int, w: int, comm: float, limit: float
) -> None:
    if ranks == 3 and microbatches >= 3 and limit >= 2:
        microbatches = 2  # keeps the brute force's product of per-rank orders small
    cost = f"F={f},I={i},W={w},comm={comm}"
    inst = instance(ranks, microbatches, cost, limit)
    ideal, nccl = brute_force(ranks, microbatches, cost, limit)
    if ideal is None:
        return
    least = ideal if comm == 0 else nccl
    for bound in (inst.rank_bound(), inst.memory_bound(), inst.idle_bound(), inst.cheap_bound()):
        assert bound / inst.scale <= least + 1e-9


@pytest.mark.parametrize(
    ("ranks", "microbatches", "cost", "limit"),
    [
        (3, 2, "F=2,I=2,W=2", 1.5),  # one forward fits before the first I: rank 0 waits out the round trip
        (2, 4, "F=1,I=1,W=2", 1.5),  # and the last forward's round trip, more than the I and W left can fill
        (3, 3, "F=1,I=2,W=1", 2),
    ],
)
def test_the_idle_bound_is_the_optimum_where_the_others_fall_short(
    ranks: int, microbatches: int, cost: str, limit: float
) -> None:
    inst = instance(ranks, microbatches, cost, limit)
    ideal, _ = brute_force(ranks, microbatches, cost, limit, nccl=False)
    assert inst.idle_bound() / inst.scale == pytest.approx(ideal)
    assert max(inst.rank_bound(), inst.memory_bound()) / inst.scale < ideal - 1e-9
    assert inst.cheap_bound() == inst.idle_bound()
    if cpsat.available() is None:  # the solver's model holds only the others; it stops at the idle bound, proved
        setting = Setting(ranks, microbatches, parse_costs(cost), limit, (1,))
        found = cpsat.solve(inst.template, setting.stage_costs(1), limit, setting.costs.input_fraction, None, 20)
        assert (found.makespan, found.bound, found.optimal) == (pytest.approx(ideal), pytest.approx(ideal), True)


@pytest.mark.skipif(cpsat.available() is not None, reason="needs OR-tools")
@pytest.mark.parametrize(
    ("ranks", "microbatches", "cost", "limit"),
    [
        (3, 3, "F=1,I=2,W=1", 1),  # the one-rank bound 30, the cheap one 25
        (3, 3, "F=1,I=1,W=2,comm=0.5", 1),  # 30 against 24.5
        (2, 4, "F=1,I=2,W=1,comm=0.5", 1),  # 32 against 25
        (2, 4, "F=1,I=1,W=1,comm=0.5", 1.5),  # 21 against 18
        (3, 3, "F=1,I=1,W=1,comm=0.5", 1.5),  # 25 against 20.5 (of 160 such settings it is never above, 149 equal)
    ],
)
def test_the_one_rank_bound_is_the_optimum_where_the_cheap_ones_fall_short(
    ranks: int, microbatches: int, cost: str, limit: float
) -> None:
    inst = instance(ranks, microbatches, cost, limit)
    ideal, nccl = brute_force(ranks, microbatches, cost, limit, nccl="comm" in cost)
    least = nccl if "comm" in cost else ideal
    assert one_rank_bound(inst, 20, Clock()) / inst.scale == pytest.approx(least)
    assert inst.cheap_bound() / inst.scale < least - 1e-9
