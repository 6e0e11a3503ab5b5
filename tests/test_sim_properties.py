"""The simulator's verdict (runs to the end, or raises ScheduleError) equals the verifier's on random broken
programs (tests/strategies.py), under every p2p model (nccl, tagged, torch).

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
from strategies import broken_programs

import pipec
from pipec.errors import ScheduleError
from pipec.ir import Action, Kind
from pipec.sim import simulate
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
