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
    from pipec.verify.memory import stage_units_note

    program, costs = compile_schedule(args, placement_costs(args))
    options = verify_options(args, program)
    if costs is not None and args.stage_sizes is None and costs.activation is not None:
        # a cost file's memory (as pipec simulate reads it): `costs` are in stage units, --per-rank-share applied
        sizes = costs.activation
        options["stage_sizes"] = sizes if isinstance(sizes, tuple) else (sizes,) * program.num_stages
        if "input_fraction" in costs.given:
            options["input_fraction"] = costs.input_fraction
    report = verify(program, **options)
    p = program
    print(f"{p.name}: P={p.ranks} M={p.microbatches} V={p.chunks}, {p.num_stages} stages, p2p model {args.p2p}")
    print(report.render())
    if (p.chunks > 1 or p.pipelines > 1) and not args.per_rank_share:
        print(stage_units_note(p.chunks, max(report.peak_memory, default=0.0), p.pipelines))
    return EXIT_OK if report.ok else EXIT_INVALID


