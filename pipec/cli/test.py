"""`pipec test SCHEDULE`: the property suite of pipec.testing on one schedule (pipec.testing.runner), with its
flags bounded up front (pipec.limits, TEST_MAX_*): each example compiles and checks a schedule of up to
max-ranks * max-microbatches * max-chunks stages and micro-batches, and the parameter space is enumerated before
the first example, so `--max-ranks 100000` would run for hours instead of failing.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from pipec.cli.common import integer, schedule_args
from pipec.errors import PipecInputError

HELP = "property-based check of a schedule over many (P, M, V)"
DESCRIPTION = (
    "Compile and verify a schedule for many sizes (P, M, V and its named parameters) drawn at random, and check "
    "that each compiled program is complete, deadlock-free and within its memory bound. The --max-* flags bound "
    "the sizes drawn and are checked up front, so that a size that would take hours is refused at once."
)
EXAMPLES = """examples:
  pipec test my_schedule.pipe                       # 100 parameter sets drawn from what the schedule accepts
  pipec test zbv --max-ranks 16 --examples 500
  pipec test 1f1b --ranks 3                         # P fixed at 3, M and V drawn
  pipec test order.csv                              # a stream file is tested at its own size
--ranks, --microbatches, --chunks and --set NAME=VALUE fix that parameter; the others are drawn from the values the
schedule accepts. A stream file (.csv, .txt, .json) is tested at its own size.
exit codes: 0 every set passes, 1 one fails (the smallest failing set is printed), 2 bad input or usage
"""
_FLAG_OF = {"P": "--ranks", "M": "--microbatches", "V": "--chunks"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    schedule_args(parser)
    parser.add_argument(
        "--examples", type=integer, default=100, metavar="N", help="parameter sets to try (default 100)"
    )
    parser.add_argument("--max-ranks", type=integer, default=8, metavar="P", help="largest P to try (default 8)")
    parser.add_argument("--max-microbatches", type=integer, default=24, metavar="M", help="largest M (default 24)")
    parser.add_argument("--max-chunks", type=integer, default=4, metavar="V", help="largest V (default 4)")
    parser.add_argument("--seed", type=integer, default=0, help="random seed, for repeatable runs (default 0)")


def run(args: argparse.Namespace) -> int:
    from pipec.library import resolve
    from pipec.testing.runner import check_schedule, check_stream_file

    fixed = _fixed_values(args)
    maxima = _checked_maxima(args, fixed)
    kind, _, _ = resolve(args.schedule)
    if kind != "pipe":
        return check_stream_file(args.schedule, fixed)
    return check_schedule(args.schedule, maxima, fixed, args.examples, args.seed)


def _fixed_values(args: argparse.Namespace) -> dict[str, int]:
    fixed = {key: value for key, value in (("P", args.ranks), ("M", args.microbatches), ("V", args.chunks)) if value}
    for name, value in args.set:
        if name in _FLAG_OF:
            raise PipecInputError(f"set {name} with {_FLAG_OF[name]}, not --set")
        if name in fixed:
            raise PipecInputError(f"--set {name} is given twice")
        fixed[name] = value
    return fixed


def _checked_maxima(args: argparse.Namespace, fixed: Mapping[str, int]) -> dict[str, int]:
    """The largest P, M, V to draw (a fixed value stands for its maximum), each within pipec test's limits."""
    from pipec.limits import (
        TEST_MAX_CHUNKS,
        TEST_MAX_EXAMPLES,
        TEST_MAX_MICROBATCHES,
        TEST_MAX_RANKS,
        TEST_MAX_SIZE,
    )

    flags = {
        "--examples": (args.examples, TEST_MAX_EXAMPLES),
        "--max-ranks": (args.max_ranks, TEST_MAX_RANKS),
        "--max-microbatches": (args.max_microbatches, TEST_MAX_MICROBATCHES),
        "--max-chunks": (args.max_chunks, TEST_MAX_CHUNKS),
        "--ranks": (fixed.get("P", 1), TEST_MAX_RANKS),
        "--microbatches": (fixed.get("M", 1), TEST_MAX_MICROBATCHES),
        "--chunks": (fixed.get("V", 1), TEST_MAX_CHUNKS),
    }
    for flag, (value, limit) in flags.items():
        if value < 1:
            raise PipecInputError(f"{flag} must be at least 1")
        if value > limit:
            raise PipecInputError(f"{flag} {value:,} is over the limit of {limit:,}")
    maxima = {"P": args.max_ranks, "M": args.max_microbatches, "V": args.max_chunks}
    maxima.update({name: value for name, value in fixed.items() if name in maxima})
    size = maxima["P"] * maxima["M"] * maxima["V"]
    if size > TEST_MAX_SIZE:
        raise PipecInputError(
            f"P * M * V up to {maxima['P']:,} * {maxima['M']:,} * {maxima['V']:,} = {size:,} is over the limit of "
            f"{TEST_MAX_SIZE:,} (--max-ranks, --max-microbatches, --max-chunks or the fixed values): each example "
            "would compile and check schedules that large"
        )
    return maxima


