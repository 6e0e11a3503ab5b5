"""The simulator charges SYNC (cost key `sync`): a collective starts when its last member is there and ends on
every member at once; checked against closed forms, against the verifier's verdicts, and through the pictures."""

import random

import pytest
from sync_programs import random_syncs, sync_after_last_backward

import pipec
from pipec.errors import ScheduleError
from pipec.ir import Action, Kind, Program
from pipec.passes.sync import insert_syncs
from pipec.sim.costs import parse_costs
from pipec.sim.simulate import simulate
from pipec.sim.waits import critical_waits, find_waits
from pipec.verify.deadlock.check import check_deadlock
from pipec.viz.grid import render_grid
from pipec.viz.svg import render_svg
from pipec.viz.timeline import sim_trace

MODELS = ("nccl", "tagged", "torch")


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 2), (3, 5), (4, 8)])
@pytest.mark.parametrize("sync", [0.0, 0.5, 3.0])
@pytest.mark.parametrize("model", MODELS)
def test_1f1b_tied_takes_its_closed_form_plus_the_sync(ranks: int, microbatches: int, sync: float, model: str) -> None:
    # 1F1B with F=1, B=2 and free messages ends at (M + P - 1)(F + B) on rank 0, the last member to reach its
    # SYNC: the tied pair (0, S-1) then takes `sync` more, on rank 0 and rank P-1 alike
    program = insert_syncs(pipec.compile("1f1b", ranks, microbatches), [(0, ranks - 1)])
    result = simulate(program, parse_costs(f"F=1,B=2,sync={sync}"), p2p=model)
    closed = (microbatches + ranks - 1) * 3
    assert result.makespan == closed + sync
    assert result.finish[0] == result.finish[ranks - 1] == closed + sync
    # rank P-1 finished its last backward at closed - 2 (P - 1) and waits for rank 0, then syncs
    assert result.comm[ranks - 1] >= 2 * (ranks - 1) + sync


def test_a_sync_at_the_start_delays_everything_after_it_by_its_cost() -> None:
    # both members there at time 0: the step shifts by `sync` on the members, and the others follow them
    base = pipec.compile("zb_h1", 4, 8)
    streams = list(base.streams)
    streams[0] = (Action(0, Kind.SYNC, 0), *streams[0])
    streams[3] = (Action(3, Kind.SYNC, 0), *streams[3])
    program = Program(
        base.name, base.ranks, base.microbatches, base.chunks, base.stage_to_rank, tuple(streams),
        has_comms=True, sync_groups=((0, 3),),
    )
    assert program.check().ok
    before = simulate(base, parse_costs("F=1,B=2,W=1")).makespan
    after = simulate(program, parse_costs("F=1,B=2,W=1,sync=2.5"), record=True)
    assert after.makespan == before + 2.5
    assert after.timeline[0][0].start == 0 and after.timeline[0][0].end == 2.5


def test_per_stage_sync_costs_take_the_largest_member() -> None:
    program = insert_syncs(pipec.compile("1f1b", 4, 4), [(0, 3)])
    costs = parse_costs({"F": 1, "B": 2, "sync": [0.25, 9, 9, 1.5]})
    assert simulate(program, costs).makespan == 7 * 3 + 1.5  # max(sync[0], sync[3]); stages 1, 2 hold no SYNC
    with pytest.raises(pipec.PipecInputError, match="cost 'sync' has 2 entries"):
        simulate(program, parse_costs({"sync": [1, 2]}))


def test_costs_describe_sync_only_when_set() -> None:
    assert "sync" not in parse_costs("F=1").describe()
    assert parse_costs("F=1,sync=0.5").describe().endswith(",sync=0.5")


def test_a_deadlocked_sync_is_refused_naming_the_member_it_waits_for() -> None:
    program = insert_syncs(pipec.compile("interleaved_1f1b", 4, 8, 2), [(0, 7)])
    with pytest.raises(ScheduleError, match=r"rank 3 is stuck at op 68 7SYNC0, waiting for rank\(s\) \[0\]"):
        simulate(sync_after_last_backward(program, 3, 7))


def test_the_simulator_finishes_exactly_when_the_verifier_accepts() -> None:
    rng = random.Random(22)
    program = pipec.compile("1f1b", 3, 4)
    outcomes = set()
    for _ in range(40):
        placed = random_syncs(program, [(0, 2)], rng)
        for model in MODELS:
            accepted = not check_deadlock(placed, model)
            try:
                simulate(placed, p2p=model)
                finished = True
            except ScheduleError:
                finished = False
            assert finished == accepted
            outcomes.add(accepted)
    assert outcomes == {True, False}


def test_pictures_and_waits_show_the_sync() -> None:
    program = insert_syncs(pipec.compile("interleaved_1f1b", 4, 8, 2), [(0, 7)])
    result = simulate(program, parse_costs("F=1,B=2,comm=0.2,sync=1"), record=True)
    assert "7SYNC0" in render_svg(result)
    assert "~" in render_grid(result).splitlines()[-5]  # the collective drawn as communication
    names = [event["name"] for event in sim_trace(result)["traceEvents"] if "name" in event]
    assert "0SYNC0" in names and "7SYNC0" in names
    # the waits walk past the SYNCs: a collective is no p2p wait of its rank
    for wait in find_waits(result) + critical_waits(result):
        assert "SYNC" not in wait.text
