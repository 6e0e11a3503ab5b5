"""`pipec show`: print a schedule's simulated timeline as a compact grid in the terminal."""

from __future__ import annotations

import argparse

from pipec.cli.common import schedule_args, write
from pipec.cli.simulate import add_model_arguments, run_simulation

HELP = "print a schedule's simulated timeline as a compact grid"
EXAMPLES = """examples:
  pipec show 1f1b -P 4 -M 8
  pipec show zbv -P 4 -M 8 -V 2 --cost F=1,I=1,W=1
exit codes: 0 ok, 1 the schedule is invalid, 2 bad input or usage
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    schedule_args(parser)
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", metavar="PATH", help="write here (atomically) instead of standard output")


def run(args: argparse.Namespace) -> int:
    from pipec.viz.grid import render_grid

    write(render_grid(run_simulation(args, record=True)), args.output)
    return 0
