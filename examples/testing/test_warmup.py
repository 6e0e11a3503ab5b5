"""A property test for a user's schedule with pipec.testing: run it with `pytest examples/testing`."""

from pathlib import Path

from hypothesis import given, settings

from pipec.testing import as_compile_args, assert_schedule_ok, schedule_params

SCHEDULE = str(Path(__file__).parents[1] / "tutorial" / "step3_warmup.pipe")


@settings(max_examples=50, deadline=None)
@given(schedule_params(SCHEDULE, max_ranks=6, max_microbatches=16))
def test_warmup_schedule_is_valid_everywhere(params: dict[str, int]) -> None:
    assert_schedule_ok(SCHEDULE, **as_compile_args(params))
