"""`pipec check`: verify a schedule and print each pass's verdict (exit 1 when invalid)."""

from __future__ import annotations

import argparse

from pipec.cli.common import (
    EXIT_INVALID,
    EXIT_OK,
    compile_schedule,
    placement_args,
    placement_costs,
    schedule_args,
    share_args,
    verify_args,
    verify_options,
)

HELP = "verify a schedule and print per-pass verdicts"
EXAMPLES = """examples:
  pipec check 1f1b -P 4 -M 8
  pipec check zbv -P 4 -M 8 -V 2 --memory-limit 4      # hold at most 4 activation units per rank
  pipec check order.csv --p2p torch                     # a comms CSV, under torch's execution rule
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    schedule_args(parser)
    verify_args(parser)
    placement_args(parser)
    share_args(parser)


def run(args: argparse.Namespace) -> int:
    from pipec.verify import verify

    program, _ = compile_schedule(args, placement_costs(args))
    report = verify(program, **verify_options(args, program))
    p = program
    print(f"{p.name}: P={p.ranks} M={p.microbatches} V={p.chunks}, {p.num_stages} stages, p2p model {args.p2p}")
    print(report.render())
    return EXIT_OK if report.ok else EXIT_INVALID


