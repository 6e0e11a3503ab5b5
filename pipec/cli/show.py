"""`pipec show`: print a schedule's simulated timeline as a compact grid in the terminal."""

from __future__ import annotations

import argparse
import shutil
import sys

from pipec.cli.common import positive, schedule_args, write
from pipec.cli.simulate import add_model_arguments, run_simulation

HELP = "print a schedule's simulated timeline as a compact grid"
EXAMPLES = """examples:
  pipec show 1f1b -P 4 -M 8
  pipec show zbv -P 4 -M 8 -V 2 --cost F=1,I=1,W=1
  pipec show zbv -P 8 -M 32 -V 2 --width 100       # fit 100 characters: a column covers more time
exit codes: 0 ok, 1 the schedule is invalid, 2 bad input or usage
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    schedule_args(parser)
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", metavar="PATH", help="write here (atomically) instead of standard output")
    parser.add_argument(
        "--width",
        type=positive,
        metavar="CHARS",
        help="fit the grid's rows in this many characters (default: the terminal's width on a terminal, else up "
        f"to {MAX_COLUMNS} columns); a column then covers more time",
    )


MAX_COLUMNS = 400  # render_grid's default
PREFIX = len("rank 0  |")


def run(args: argparse.Namespace) -> int:
    width = args.width
    if width is None and args.output is None and sys.stdout is not None and sys.stdout.isatty():
        width = shutil.get_terminal_size().columns
    write(fitted_grid(run_simulation(args, record=True), width), args.output)
    return 0


def fitted_grid(result, width: int | None) -> str:
    """The grid with as many columns as fit `width` characters a row (None: MAX_COLUMNS at most). A column's
    text width depends on the labels, so the grid is drawn, measured and narrowed until it fits."""
    from pipec.viz.grid import render_grid

    columns = MAX_COLUMNS
    while True:
        text = render_grid(result, columns)
        rows = text.splitlines()[1 : 1 + result.program.ranks]
        longest = max((len(row) for row in rows), default=0)
        if width is None or longest <= width or columns <= 1:
            return text
        # each column takes (longest - PREFIX) / columns characters; take what fits, at least one fewer
        columns = max(1, min(columns - 1, columns * max(1, width - PREFIX) // max(1, longest - PREFIX)))
