"""Replicated pipelines (docs/design/replicated.md) on random schedules: the verifier's verdicts equal the independent
executor's (tests/support/executor.py, which finds a copy's chain ends on its own), and the simulator's equal the
verifier's, as tests/verify/test_verify_properties.py and tests/sim/test_sim_properties.py check for one pipeline.

Random valid orders of 2 or 3 copies, each micro-batch routed to a random copy, must be accepted under every model
and lowered (send/recv, then the copies' SYNCs) to streams that run to the end; random mistakes on them (ops
swapped, dropped, duplicated, misplaced, sends reordered, SYNCs moved with the rest) get the executor's verdict.
"""

from __future__ import annotations

import executor
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.errors import ScheduleError
from pipec.passes.p2p import insert_p2p_ops
from pipec.passes.sync import with_copy_syncs
from pipec.sim import simulate
from pipec.testing.orders import STRUCTURAL, broken_programs, valid_programs
from pipec.verify import verify
from pipec.verify.deadlock import IN_ORDER, MODELS

VALID = settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
BROKEN = settings(
    max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
COPIES = st.sampled_from((2, 3))


@VALID
@given(COPIES.flatmap(lambda copies: valid_programs(pipelines=copies)))
def test_valid_replicated_orders_are_accepted_and_run(program) -> None:
    assert program.pipelines > 1
    for model in MODELS:
        report = verify(program, p2p=model)
        assert report.ok, report.render()
    lowered = with_copy_syncs(insert_p2p_ops(program))
    assert lowered.forward_only or len(lowered.sync_groups) == lowered.stages_per_pipeline
    for model in MODELS:
        outcome = executor.run(lowered, model)
        assert outcome.completed and not outcome.mismatches, (model, outcome)
        assert verify(lowered, p2p=model).ok
        simulate(lowered, p2p=model)  # raises on a fault


@BROKEN
@given(COPIES.flatmap(lambda copies: broken_programs(pipelines=copies)))
def test_replicated_verdicts_equal_the_executor_and_the_simulator(case) -> None:
    program, mutation = case
    for model in MODELS:
        report = verify(program, p2p=model)
        checked = report.program
        structure = report.verdict("structure")
        if mutation in STRUCTURAL:
            assert not structure.ok, f"{mutation} went unnoticed:\n{report.render()}"
        if not structure.ok:
            with pytest.raises(ScheduleError, match="structure FAILED"):
                simulate(program, p2p=model)
            continue
        outcome = executor.run(checked, model)
        deadlock = report.verdict("deadlock")
        assert deadlock.ok == outcome.completed, (model, mutation, outcome, report.render())
        accepted = deadlock.ok and (model not in IN_ORDER or report.verdict("p2p order").ok)
        try:
            simulate(program, p2p=model)
            completes = True
        except ScheduleError:
            completes = False
        assert completes == accepted, (model, mutation, report.render())
