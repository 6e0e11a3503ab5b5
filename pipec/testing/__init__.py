"""pipec.testing: property-based testing of schedules, for pipec's own tests and for users' test suites.

    from hypothesis import given
    from pipec.testing import assert_schedule_ok, as_compile_args, schedule_params

    @given(schedule_params("my_schedule.pipe", max_ranks=6))
    def test_my_schedule(params):
        assert_schedule_ok("my_schedule.pipe", **as_compile_args(params))

Also: `valid_programs()` (random compute orders valid by construction) and `broken_programs()` / `mutated()`
(one random mistake: ops swapped, dropped, duplicated or moved to another rank, sends reordered, receives
sunk), to test verifiers, simulators and other tools that read instruction streams.

Needs hypothesis (installed with pipec).
"""

from pipec.testing.assertions import ScheduleCheckError, assert_schedule_ok
from pipec.testing.orders import broken_programs, mutated, naive_lowering, valid_programs
from pipec.testing.space import ParamSpace
from pipec.testing.strategies import as_compile_args, schedule_params, space_params

__all__ = [
    "ParamSpace",
    "ScheduleCheckError",
    "as_compile_args",
    "assert_schedule_ok",
    "broken_programs",
    "mutated",
    "naive_lowering",
    "schedule_params",
    "space_params",
    "valid_programs",
]
