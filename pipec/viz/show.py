"""`pipec show`: print a schedule's simulated timeline as a compact grid in the terminal."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipec.sim.command import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("-o", "--output", metavar="PATH", help="write here instead of standard output")


def main(args: argparse.Namespace) -> int:
    from pipec.cli import _write
    from pipec.sim.command import run_simulation
    from pipec.viz.grid import render_grid

    _write(render_grid(run_simulation(args, record=True)), args.output)
    return 0
