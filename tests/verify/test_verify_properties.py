"""The verifier's verdicts equal an independent executor's (tests/support/executor.py) on random schedules, every model.

Random valid compute orders (tests/support/strategies.py) must be accepted under every model (nccl, tagged and torch's
runtime rule), and insert_p2p_ops must lower them to streams that run to the end under each. Random broken ones
(ops swapped, dropped, duplicated, misplaced, sends reordered, receives placed naively) must get the executor's
verdict: deadlock-free iff the executor completes, stuck at the same op on every rank, p2p order sound iff no send
meets the wrong receive (in a run that completes; a stalled run may stop before the wrong pair meets); mistakes
that break the structure must be caught by the structure pass. What passes under torch passes under nccl, and
what passes under nccl passes under tagged.
"""

from __future__ import annotations

import executor
from hypothesis import HealthCheck, given, settings
from strategies import STRUCTURAL, broken_programs, valid_programs

from pipec.passes.p2p import insert_p2p_ops
from pipec.verify import verify
from pipec.verify.deadlock import IN_ORDER, MODELS, run_compute_orders, run_streams, streams_finish

# fixed example counts, no deadline, derandomized: the suite is stable and takes a few seconds
VALID = settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
BROKEN = settings(
    max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)


def _stops(program, model: str) -> tuple[int, ...]:
    run = run_streams(program, model) if program.has_comms else run_compute_orders(program, model)
    return tuple(run.units.starts[r][u] for r, u in enumerate(run.stop))


@VALID
@given(valid_programs())
def test_valid_orders_are_accepted_and_run(program) -> None:
    for model in MODELS:
        report = verify(program, p2p=model)
        assert report.ok, report.render()
    assert executor.run(program, "tagged").completed
    lowered = insert_p2p_ops(program)
    for model in MODELS:
        outcome = executor.run(lowered, model)
        assert outcome.completed and not outcome.mismatches, (model, outcome)


@BROKEN
@given(broken_programs())
def test_verdicts_equal_the_executor(case) -> None:
    program, mutation = case
    verdicts = {}
    for model in MODELS:
        report = verify(program, p2p=model)
        checked = report.program  # lowered by insert_p2p_ops when nccl or torch meets a compute-only program
        structure = report.verdict("structure")
        if mutation in STRUCTURAL:
            assert not structure.ok, f"{mutation} went unnoticed:\n{report.render()}"
        if not structure.ok:
            continue
        outcome = executor.run(checked, model)
        deadlock = report.verdict("deadlock")
        verdicts[model] = deadlock.ok and (model not in IN_ORDER or report.verdict("p2p order").ok)
        assert deadlock.ok == outcome.completed, (model, mutation, outcome, report.render())
        assert _stops(checked, model) == outcome.positions, (model, mutation)
        if model in IN_ORDER:  # a stalled run may stop before the mismatched pair meets
            order_ok = report.verdict("p2p order").ok
            if outcome.completed:
                assert order_ok == (not outcome.mismatches), (mutation, outcome.mismatches)
            else:
                assert not (order_ok and outcome.mismatches), (mutation, outcome.mismatches)
    if verdicts.get("nccl") and not program.has_comms:  # nccl checked the lowered program: compare like with like
        verdicts["tagged"] = verify(insert_p2p_ops(program), p2p="tagged").verdict("deadlock").ok
    if verdicts.get("nccl"):  # with the channel order right, nccl only adds waits to tagged
        assert verdicts["tagged"], mutation
    if verdicts.get("torch"):  # one op per batch only delays ops that nccl's batches start together
        assert verdicts["nccl"], mutation


@settings(
    max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(broken_programs())
def test_the_fast_verdict_equals_the_full_run(case) -> None:
    """check_deadlock decides with streams_finish (gates and bisects) and explains with run_streams: they must
    agree."""
    program, mutation = case
    lowered = program if program.has_comms else insert_p2p_ops(program)
    if verify(lowered, p2p="tagged").verdict("structure").ok:
        for model in MODELS:
            assert streams_finish(lowered, model) == (not run_streams(lowered, model).blocked), (model, mutation)
