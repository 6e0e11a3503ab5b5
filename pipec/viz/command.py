"""`pipec viz`: draw a schedule's simulated timeline as an SVG Gantt chart and/or write a Chrome trace."""

from __future__ import annotations

import argparse
import json

from pipec.errors import PipecInputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipec.sim.command import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("-o", "--output", metavar="PICTURE.svg", help="write the SVG Gantt chart here")
    parser.add_argument("--trace", metavar="PATH", help="also (or only) write a Chrome/Perfetto trace JSON here")
    parser.add_argument("--arrows", action="store_true", help="draw an arrow from each send to its receive")
    parser.add_argument("--width", type=int, default=1100, help="picture width in pixels (default 1100)")


def main(args: argparse.Namespace) -> int:
    from pipec.cli import _write
    from pipec.sim.command import run_simulation
    from pipec.viz.svg import render_svg
    from pipec.viz.timeline import sim_trace

    if not args.output and not args.trace:
        raise PipecInputError("pipec viz needs -o PICTURE.svg and/or --trace TRACE.json")
    if args.width < 200:
        raise PipecInputError(f"--width {args.width} is too narrow (at least 200)")
    result = run_simulation(args, record=True)
    if args.output:
        _write(render_svg(result, arrows=args.arrows, width=args.width), args.output)
    if args.trace:
        _write(json.dumps(sim_trace(result)), args.trace)
    return 0
