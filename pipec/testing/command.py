"""`pipec test SCHEDULE`: run the property suite of pipec.testing on one schedule and report.

Hypothesis draws valid parameter sets; each is compiled and checked with assert_schedule_ok. On a failure,
Hypothesis shrinks to the smallest failing parameters, which are printed with the failing check's explanation.
"""

from __future__ import annotations

import argparse

from pipec.errors import PipecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--examples", type=int, default=100, metavar="N", help="parameter sets to try (default 100)")
    parser.add_argument("--max-ranks", type=int, default=8, metavar="P", help="largest P to try (default 8)")
    parser.add_argument("--max-microbatches", type=int, default=24, metavar="M", help="largest M (default 24)")
    parser.add_argument("--max-chunks", type=int, default=4, metavar="V", help="largest V (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="random seed, for repeatable runs (default 0)")


def main(args: argparse.Namespace) -> int:
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st

    from pipec.compiler import parse_schedule
    from pipec.errors import PipecInputError
    from pipec.testing.assertions import ScheduleCheckError, assert_schedule_ok, describe
    from pipec.testing.strategies import as_compile_args, schedule_params

    for flag in ("examples", "max_ranks", "max_microbatches", "max_chunks"):
        if getattr(args, flag) < 1:
            raise PipecInputError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.ranks or args.microbatches or args.chunks or args.set:
        raise PipecInputError("pipec test draws P, M, V itself: use --max-ranks, --max-microbatches, --max-chunks")
    schedule = parse_schedule(args.schedule)
    try:
        strategy = schedule_params(schedule, args.max_ranks, args.max_microbatches, args.max_chunks)
    except ValueError as e:
        raise PipecInputError(str(e)) from None

    tried: list[dict[str, int]] = []
    last: dict[str, dict[str, int]] = {}

    @seed(args.seed)
    @settings(
        max_examples=args.examples,
        deadline=None,
        database=None,
        derandomize=False,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        print_blob=False,
    )
    @given(strategy)
    def property_suite(params: dict[str, int]) -> None:
        tried.append(params)
        last["params"] = params
        try:
            assert_schedule_ok(args.schedule, **as_compile_args(params))
        except ScheduleCheckError:
            raise
        except PipecError as e:  # compiling failed for valid parameters: that is a bug in the schedule too
            raise ScheduleCheckError(f"{schedule.name} {describe(params)}: {e.render()}", params) from None

    try:
        property_suite()
    except ScheduleCheckError as failure:
        print(f"{schedule.name}: FAILED after {len(tried)} parameter sets")
        print(f"smallest failing parameters: {describe(failure.params)}")
        print(str(failure))
        return 1
    distinct = {tuple(sorted(p.items())) for p in tried}
    largest = max(tried, key=lambda p: (p["P"] * p["V"] * p["M"], p["P"], p["M"]))
    print(
        f"{schedule.name}: ok, {len(distinct)} distinct parameter sets ({len(tried)} examples), "
        f"largest P={largest['P']} M={largest['M']} V={largest['V']}"
        + ("".join(f" {k}={v}" for k, v in largest.items() if k not in ("P", "M", "V")))
    )
    del st
    return 0
