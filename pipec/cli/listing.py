"""`pipec list`: the bundled schedules with their parameters and descriptions."""

from __future__ import annotations

import argparse

from pipec.cli.common import EXIT_OK

HELP = "the bundled schedules with their parameters"
EXAMPLES = """examples:
  pipec list
exit codes: 0 ok, 2 bad input or usage
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No arguments."""


def run(args: argparse.Namespace) -> int:
    from pipec.frontend.parser import parse
    from pipec.library import bundled_names, bundled_source

    rows = []
    for name in bundled_names():
        schedule = parse(bundled_source(name), f"{name}.pipe")
        params = ", ".join(p.name + ("" if p.default is None else f"={_expr_text(p.default)}") for p in schedule.params)
        rows.append((name, params, schedule.description))
    width = max(len(r[0]) for r in rows)
    pwidth = max(len(r[1]) for r in rows)
    for name, params, description in rows:
        print(f"{name:<{width}}  {params:<{pwidth}}  {description}")
    return EXIT_OK


def _expr_text(expr: object) -> str:
    from pipec.frontend import ast

    if isinstance(expr, ast.Int):
        return str(expr.value)
    if isinstance(expr, ast.Var):
        return expr.name
    return "..."


