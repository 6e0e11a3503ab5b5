"""The verifier's verdicts equal an independent executor's (tests/executor.py) on random schedules, both models.

Random valid compute orders (tests/strategies.py) must be accepted under both models, and insert_p2p_ops must
lower them to streams that run to the end under the nccl rule. Random broken ones (ops swapped, dropped,
duplicated, misplaced, sends reordered, receives placed naively) must get the executor's verdict: deadlock-free
iff the executor completes, stuck at the same op on every rank, p2p order sound iff no send meets the wrong
receive (in a run that completes; a stalled run may stop before the wrong pair meets); mistakes that break the
structure must be caught by the structure pass.
"""

from __future__ import annotations

import executor
from hypothesis import HealthCheck, given, settings
from strategies import STRUCTURAL, broken_programs, valid_programs

from pipec.passes.p2p import insert_p2p_ops
from pipec.verify import verify
from pipec.verify.deadlock import execute, execute2, finishes2

# fixed example counts, no deadline, derandomized: the suite is stable and takes a few seconds
VALID = settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
BROKEN = settings(
    max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)


def _stops(program, model: str) -> tuple[int, ...]:
    run = execute(program, model)
    return tuple(run.units.starts[r][u] for r, u in enumerate(run.stop))


@VALID
@given(valid_programs())
def test_valid_orders_are_accepted_and_run(program) -> None:
    for model in ("tagged", "nccl"):
        report = verify(program, p2p=model)
        assert report.ok, report.render()
    assert executor.run(program, "tagged").completed
    lowered = insert_p2p_ops(program)
    for model in ("tagged", "nccl"):
        outcome = executor.run(lowered, model)
        assert outcome.completed and not outcome.mismatches, (model, outcome)


@BROKEN
@given(broken_programs())
def test_verdicts_equal_the_executor(case) -> None:
    program, mutation = case
    verdicts = {}
    for model in ("tagged", "nccl"):
        report = verify(program, p2p=model)
        checked = report.program  # lowered by insert_p2p_ops when nccl meets a compute-only program
        structure = report.verdict("structure")
        if mutation in STRUCTURAL:
            assert not structure.ok, f"{mutation} went unnoticed:\n{report.render()}"
        if not structure.ok:
            continue
        outcome = executor.run(checked, model)
        deadlock = report.verdict("deadlock")
        verdicts[model] = deadlock.ok and (model == "tagged" or report.verdict("p2p order").ok)
        assert deadlock.ok == outcome.completed, (model, mutation, outcome, report.render())
        assert _stops(checked, model) == outcome.positions, (model, mutation)
        if model == "nccl":  # a stalled run may stop before the mismatched pair meets
            order_ok = report.verdict("p2p order").ok
            if outcome.completed:
                assert order_ok == (not outcome.mismatches), (mutation, outcome.mismatches)
            else:
                assert not (order_ok and outcome.mismatches), (mutation, outcome.mismatches)
    if verdicts.get("nccl") and not program.has_comms:  # nccl checked the lowered program: compare like with like
        verdicts["tagged"] = verify(insert_p2p_ops(program), p2p="tagged").verdict("deadlock").ok
    if verdicts.get("nccl"):  # with the channel order right, nccl only adds waits to tagged
        assert verdicts["tagged"], mutation


@settings(
    max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(broken_programs())
def test_the_fast_verdict_equals_the_full_run(case) -> None:
    """check_deadlock decides with finishes2 (gates and bisects) and explains with execute2: they must agree."""
    program, mutation = case
    lowered = program if program.has_comms else insert_p2p_ops(program)
    if verify(lowered, p2p="tagged").verdict("structure").ok:
        for model in ("tagged", "nccl"):
            assert finishes2(lowered, model) == (not execute2(lowered, model).blocked), (model, mutation)
