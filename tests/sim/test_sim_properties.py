"""The simulator's verdict (runs to the end, or raises ScheduleError) equals the verifier's on random broken
programs (tests/support/strategies.py), under every p2p model (nccl, tagged, torch).

A program whose structure the verifier refuses is refused by the simulator too, with the structure pass's own
lines (a dropped backward used to simulate without a word). On the others, the simulator must complete exactly
when the verifier finds no deadlock and, under nccl and torch, no p2p order mismatch. A send placed before its
rank computes the value it sends is one of the mistakes drawn (`swap`, `duplicate`, `reorder_comms` move sends
up): the rank is stuck there.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import broken_programs, valid_programs

import pipec
from pipec.compiler import place_p2p
from pipec.errors import ScheduleError
from pipec.ir import Action, Kind, Program
from pipec.passes.p2p import insert_p2p_ops
from pipec.sim import Costs, parse_costs, simulate
from pipec.verify import verify
from pipec.verify.deadlock import IN_ORDER, MODELS

BROKEN = settings(
    max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)


def _completes(program, model: str) -> bool:
    try:
        simulate(program, p2p=model)
    except ScheduleError:
        return False
    return True


@BROKEN
@given(broken_programs())
def test_simulator_verdicts_equal_the_verifier(case) -> None:
    program, mutation = case
    for model in MODELS:
        report = verify(program, p2p=model)
        structure = report.verdict("structure")
        if not structure.ok:
            with pytest.raises(ScheduleError) as error:
                simulate(program, p2p=model)
            lines = str(error.value).splitlines()
            assert lines[0].startswith("error: structure FAILED"), (model, mutation, lines)
            assert lines[1:] == ["  " + line for line in structure.explanation.splitlines()], (model, mutation)
            continue
        accepted = report.verdict("deadlock").ok and (model not in IN_ORDER or report.verdict("p2p order").ok)
        assert _completes(program, model) == accepted, (model, mutation, report.render())


def _send_moved_up(name: str, ranks: int, mbs: int, send: Action, before: Action):
    """The compiled program with ``send`` taken out of its rank's stream and put back just before ``before``."""
    program = pipec.compile(name, ranks, mbs, 1)
    rank = program.stage_to_rank[send.stage]
    stream = [x for x in program.streams[rank] if x != send]
    stream.insert(stream.index(before), send)
    streams = list(program.streams)
    streams[rank] = tuple(stream)
    return replace(program, streams=tuple(streams))


@pytest.mark.parametrize("model", MODELS)
def test_a_send_before_its_value_is_computed_is_a_deadlock(model) -> None:
    # rank 0 runs 0F0 0SEND_F0 0SEND_F2 0F1 ...: 0F2 comes later, so the batch [0SEND_F0 0SEND_F2] (torch: the post
    # of 0SEND_F2) never happens
    program = _send_moved_up("1f1b", 2, 3, Action(0, Kind.SEND_F, 2), Action(0, Kind.F, 1))
    assert not verify(program, p2p=model).verdict("deadlock").ok
    with pytest.raises(ScheduleError) as error:
        simulate(program, p2p=model)
    text = str(error.value)
    assert "deadlock" in text
    assert "rank 0 is stuck at op 2 0SEND_F2" in text
    assert "stage 0's output for micro-batch 2" in text
    assert f"op {program.streams[0].index(Action(0, Kind.F, 2))} 0F2" in text


def test_a_gradient_sent_before_its_backward_is_a_deadlock() -> None:
    # the last rank sends the input gradient of micro-batch 0 before running its backward
    program = _send_moved_up("1f1b", 2, 2, Action(1, Kind.SEND_B, 0), Action(1, Kind.B, 0))
    expected = r"rank 1 is stuck at op \d+ 1SEND_B0 .*: it sends stage 1's input gradient"
    with pytest.raises(ScheduleError, match=expected):
        simulate(program)


# ---- send/recv placed for the user's costs (insert_p2p_ops(program, costs)) -----------------------------------

COSTED = settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)


@st.composite
def costed_programs(draw) -> tuple[Program, Costs]:
    """A random valid compute-only program and random valid costs: numbers or per-stage lists, zeros included
    (an op of length 0 must still sort before the sends it makes), comm > 0 with and without overlap."""
    program = draw(valid_programs())
    stages = program.num_stages
    amount = st.sampled_from((0.0, 0.5, 1.0, 1.5, 3.0)) | st.floats(1e-3, 4.0)
    value = amount | st.lists(amount, min_size=stages, max_size=stages).map(tuple)
    f, i, w = draw(value), draw(value), draw(value)
    b = tuple(x + y for x, y in zip(*(v if isinstance(v, tuple) else (v,) * stages for v in (i, w)), strict=True))
    comm = draw(st.sampled_from((0.0, 0.5)) | st.floats(0.0, 2.0))
    return program, Costs(F=f, B=b, I=i, W=w, comm=comm, overlap=draw(st.booleans()))


@COSTED
@given(costed_programs())
def test_streams_placed_for_any_costs_are_accepted_and_run(case) -> None:
    # The inequality "placed for c is never slower under c than placed for the defaults" does NOT hold in general
    # (on 1500 random cases about 18% are slower under nccl, by up to a few units, comm = 0 included: a receive
    # posted late by its busy rank holds the sender's NCCL stream, rule 4, which the replay does not model; 59% are
    # faster). What holds, and is asserted: the placement keeps the compute orders, verify accepts it under every
    # model, the simulator runs it to the end, and no placement beats the compute order's own (ideal) timeline.
    program, costs = case
    placed = insert_p2p_ops(program, costs)
    assert placed.compute_streams() == program.compute_streams()
    ideal = simulate(program, costs, p2p="ideal").makespan
    for model in MODELS:
        report = verify(placed, p2p=model)
        assert report.ok, (model, costs, report.render())
        assert simulate(placed, costs, p2p=model).makespan >= ideal - 1e-9
    # what `pipec simulate --cost` and `compile --cost` use: the better of the two placements under nccl, so
    # saying what the costs are never gives a slower schedule than the default placement
    chosen = place_p2p(program, costs)
    default = insert_p2p_ops(program)
    assert chosen.streams in (placed.streams, default.streams)
    assert simulate(chosen, costs, p2p="nccl").makespan <= simulate(default, costs, p2p="nccl").makespan + 1e-9


def test_placing_for_the_costs_reaches_the_compute_order_where_the_default_placement_did_not() -> None:
    # zb_h1 at F=2,I=2,W=1: placed for the defaults, rank 1 batches [1RECV_F4 1RECV_B2], whose data come at 19 and
    # 20 under these costs (53 against 49); placed for these costs, nccl runs the compute order's timeline
    costs = parse_costs("F=2,I=2,W=1")
    default = simulate(pipec.compile("zb_h1", 4, 8), costs).makespan
    placed = pipec.compile("zb_h1", 4, 8, costs=costs)
    assert (default, simulate(placed, costs).makespan, simulate(placed, costs, p2p="ideal").makespan) == (53, 49, 49)
    # and the default costs given explicitly place exactly as None does (the byte-identical fast path)
    assert insert_p2p_ops(pipec.load("zbv", 4, 8, 2), parse_costs("F=1,B=2,W=1")) == pipec.compile("zbv", 4, 8, 2)
