"""`pipec viz`: draw a schedule's simulated timeline as an SVG Gantt chart and/or write a Chrome trace."""

from __future__ import annotations

import argparse
import json
import os

from pipec.cli.common import integer, schedule_args, write
from pipec.cli.simulate import add_model_arguments, run_simulation
from pipec.errors import PipecInputError

HELP = "draw a schedule (SVG Gantt chart) or write a Chrome/Perfetto trace"
EXAMPLES = """examples:
  pipec viz zbv -P 4 -M 8 -V 2 -o zbv.svg
  pipec viz 1f1b -P 4 -M 8 --trace trace.json       # open in ui.perfetto.dev or chrome://tracing
exit codes: 0 ok, 1 the schedule is invalid, 2 bad input or usage
"""

MAX_WIDTH = 1_000_000  # pixels; wider is a typo (the coordinates would only get longer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    schedule_args(parser)
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", metavar="PICTURE.svg", help="write the SVG Gantt chart here")
    parser.add_argument("--trace", metavar="PATH", help="also (or only) write a Chrome/Perfetto trace JSON here")
    parser.add_argument("--arrows", action="store_true", help="draw an arrow from each send to its receive")
    parser.add_argument("--width", type=integer, default=1100, help="picture width in pixels (default 1100)")


def run(args: argparse.Namespace) -> int:
    from pipec.viz.svg import render_svg
    from pipec.viz.timeline import sim_trace

    if not args.output and not args.trace:
        raise PipecInputError("pipec viz needs -o PICTURE.svg and/or --trace TRACE.json")
    suffix = os.path.splitext(args.output or "")[1]
    if suffix and suffix.lower() != ".svg":  # SVG text under a .png name opens as a broken picture
        stem = args.output[: -len(suffix)]
        raise PipecInputError(
            f"-o {args.output}: pipec viz draws SVG; name it {stem}.svg (then e.g. `rsvg-convert {stem}.svg -o "
            f"{stem}{suffix}` converts it)"
        )
    if not 200 <= args.width <= MAX_WIDTH:
        raise PipecInputError(f"--width {args.width} must be between 200 and {MAX_WIDTH} pixels")
    result = run_simulation(args, record=True)
    if args.output:
        write(render_svg(result, arrows=args.arrows, width=args.width), args.output)
    if args.trace:
        write(json.dumps(sim_trace(result)), args.trace)
    return 0
