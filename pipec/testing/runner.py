"""Testing one schedule over its valid parameter sets (what `pipec test` runs): the verdict printed, the exit code
returned.

The schedule's valid parameter sets (pipec.testing.space) are tested: all of them when there are no more than
`examples`, otherwise Hypothesis draws `examples` of them and, on a failure, shrinks to the smallest failing
parameters. Either way the report names the smallest failing set and prints the failing check's explanation.
Fixed values (P, M, V or named parameters) stay fixed while the others are drawn. A stream file (torch CSV, text,
JSON) has one size, its own, and is tested at it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from pipec.errors import PipecError, PipecInputError

if TYPE_CHECKING:
    from pipec.testing.assertions import ScheduleCheckError
    from pipec.testing.space import ParamSpace

EXIT_OK, EXIT_FAILED = 0, 1
SIZE_NAMES = ("P", "M", "V")


def check_stream_file(path: str, fixed: Mapping[str, int]) -> int:
    """A stream file has one size, its own: check it there under both p2p models, as `pipec check` would."""
    from pipec.testing.assertions import ScheduleCheckError, assert_schedule_ok, describe

    named = {k: v for k, v in fixed.items() if k not in SIZE_NAMES}
    try:
        program = assert_schedule_ok(path, fixed.get("P"), fixed.get("M"), fixed.get("V"), **named)
    except ScheduleCheckError as failure:
        print(f"{path}: FAILED at its own size {describe(failure.params)} (a stream file is tested at that size)")
        print(str(failure))
        return EXIT_FAILED
    sizes = describe(dict(program.params))
    print(f"{path}: ok at its own size {sizes} (a stream file has one size; checked under the nccl and tagged models)")
    return EXIT_OK


def check_schedule(
    schedule_arg: str, maxima: Mapping[str, int], fixed: Mapping[str, int], examples: int, seed: int
) -> int:
    """Test a .pipe schedule over its valid parameter sets; prints the verdict and returns the exit code."""
    from pipec.compiler import parse_schedule
    from pipec.testing.assertions import describe
    from pipec.testing.space import ParamSpace

    schedule = parse_schedule(schedule_arg)
    space = ParamSpace(schedule, maxima, fixed)
    notes = list(space.notes)
    refused = space.refused_chunks()
    if refused:
        values = [v for v, _ in refused]
        notes.append(
            f"V = {_span_text(values)} not drawn: {refused[0][1]} (if the schedule is meant only for the other V, "
            "say so with a 'require' on V; if not, fix the placement)"
        )
    sets = space.all_params(limit=examples + 1)
    if not sets:
        raise PipecInputError(f"{schedule.name}: no valid parameter set to test: {space.why_empty()}")
    check = _checker(schedule_arg, schedule.name)
    exhaustive = len(sets) <= examples  # a small space is tested whole: its first failure is the smallest
    tried, failure = _check_all(sets, check) if exhaustive else _check_drawn(space, check, examples, seed)
    if failure is not None:
        print(f"{schedule.name}: FAILED after {len(tried)} parameter set{'' if len(tried) == 1 else 's'}")
        print(f"smallest failing parameters: {describe(failure.params)}")
        for note in notes:
            print(f"note: {note}")
        print(str(failure))
        return EXIT_FAILED
    print(_verdict(schedule.name, tried, exhaustive))
    for note in notes:
        print(f"note: {note}")
    return EXIT_OK


def _checker(schedule_arg: str, name: str) -> Callable[[dict[str, int]], None]:
    from pipec.testing.assertions import ScheduleCheckError, assert_schedule_ok, describe
    from pipec.testing.strategies import as_compile_args

    def check(params: dict[str, int]) -> None:
        try:
            assert_schedule_ok(schedule_arg, **as_compile_args(params))
        except ScheduleCheckError:
            raise
        except PipecError as e:  # compiling failed for valid parameters: that is a bug in the schedule too
            raise ScheduleCheckError(f"{name} {describe(params)}: {e.render()}", params) from None

    return check


Outcome = tuple[list[dict[str, int]], "ScheduleCheckError | None"]  # the sets tried, and the failure if one failed


def _check_all(sets: Sequence[dict[str, int]], check: Callable[[dict[str, int]], None]) -> Outcome:
    from pipec.testing.assertions import ScheduleCheckError

    tried: list[dict[str, int]] = []
    for params in sets:
        tried.append(params)
        try:
            check(params)
        except ScheduleCheckError as failure:
            return tried, failure
    return tried, None


def _check_drawn(space: ParamSpace, check: Callable[[dict[str, int]], None], examples: int, seed_value: int) -> Outcome:
    """Hypothesis draws `examples` sets; after a failure it shrinks, and the error it re-raises is the smallest."""
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from pipec.testing.assertions import ScheduleCheckError
    from pipec.testing.strategies import space_params

    tried: list[dict[str, int]] = []

    @seed(seed_value)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        print_blob=False,
    )
    @given(space_params(space))
    def property_suite(params: dict[str, int]) -> None:
        tried.append(params)
        check(params)

    try:
        property_suite()
    except ScheduleCheckError as failure:
        return tried, failure
    return tried, None


def _verdict(name: str, tried: Sequence[dict[str, int]], exhaustive: bool) -> str:
    from pipec.testing.assertions import describe

    largest = max(tried, key=lambda p: (p["P"] * p["V"] * p["M"], p["P"], p["M"]))
    if len(tried) == 1:
        return f"{name}: ok at {describe(largest)}, its only valid parameter set"
    if exhaustive:
        return f"{name}: ok, all {len(tried)} valid parameter sets, largest {describe(largest)}"
    distinct = {tuple(sorted(p.items())) for p in tried}
    return f"{name}: ok, {len(distinct)} distinct parameter sets ({len(tried)} examples), largest {describe(largest)}"


def _span_text(values: Sequence[int]) -> str:
    """[2, 3, 4] -> '2..4', [2, 4] -> '2, 4'."""
    if len(values) > 2 and values[-1] - values[0] == len(values) - 1:
        return f"{values[0]}..{values[-1]}"
    return ", ".join(map(str, values))
