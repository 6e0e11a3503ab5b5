"""`pipec compile`: SCHEDULE to verified per-rank instruction streams (or stop after a phase with --emit)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, is_dataclass

from pipec.cli.common import (
    EXIT_INVALID,
    EXIT_OK,
    compile_schedule,
    placement_args,
    placement_costs,
    schedule_args,
    verify_args,
    verify_options,
    write,
)

HELP = "compile a schedule to per-rank instruction streams"
EXAMPLES = """examples:
  pipec compile 1f1b -P 4 -M 8                          # text streams on standard output
  pipec compile zbv -P 4 -M 8 --format json -o zbv.json
  pipec compile my.pipe -P 4 -M 8 --emit ast           # stop after a phase: ast, orders, ir, streams
  pipec compile interleaved_1f1b -P 4 -M 8 -V 2 --format torch-csv-comms -o order.csv   # checked under torch's rule
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    schedule_args(parser)
    verify_args(parser)
    placement_args(parser)
    parser.add_argument(
        "--format",
        choices=("text", "json", "torch-csv", "torch-csv-comms"),
        default="text",
        help="text (default), json, torch-csv (compute actions, torch's compute_only) or torch-csv-comms (with "
        "send/recv and REDUCE_GRAD, for torch's _PipelineScheduleRuntime)",
    )
    parser.add_argument("-o", "--output", metavar="PATH", help="write here (atomically) instead of standard output")
    parser.add_argument(
        "--emit",
        choices=("ast", "orders", "ir", "streams"),
        help="stop after this phase and print its result (ast, compute orders, IR graph, streams)",
    )
    parser.add_argument("--no-verify", action="store_true", help="emit without running the verification passes")


def run(args: argparse.Namespace) -> int:
    from pipec.compiler import parse_schedule
    from pipec.emit import dump_text, emit

    if args.emit == "ast":
        write(dump_ast(parse_schedule(args.schedule)) + "\n", args.output)
        return EXIT_OK
    costs = placement_costs(args)
    if args.emit == "orders":
        program, _ = compile_schedule(args, costs, comms=False)
        write(dump_text(program), args.output)
        return EXIT_OK
    program, _ = compile_schedule(args, costs)
    if args.emit == "ir":
        write(dump_graph(program), args.output)
        return EXIT_OK
    if not args.no_verify:
        from pipec.verify import verify

        options = verify_options(args)
        if args.format == "torch-csv-comms" and args.emit != "streams":
            options["p2p"] = "torch"  # the file is for torch's runtime: what matters is whether it runs there
        report = verify(program, **options)
        if not report.ok:
            print(report.render(), file=sys.stderr)
            return EXIT_INVALID
    write(emit(program, "text" if args.emit == "streams" else args.format), args.output)
    return EXIT_OK


def dump_ast(node: object) -> str:
    """An indented, diff-friendly dump of the AST (spans left out)."""
    return "\n".join(_ast_lines(node))


def _ast_lines(value: object) -> list[str]:
    if isinstance(value, tuple):
        if not value:
            return ["()"]
        lines = []
        for item in value:
            first, *rest = _ast_lines(item)
            lines += [f"- {first}", *(f"  {line}" for line in rest)]
        return lines
    if not is_dataclass(value) or type(value).__name__ == "Span":
        return [repr(value)]
    lines = [type(value).__name__]
    for field in fields(value):
        if field.name == "span":
            continue
        child = _ast_lines(getattr(value, field.name))
        if len(child) == 1 and not is_dataclass(getattr(value, field.name)):
            lines.append(f"  {field.name}: {child[0]}")
        else:
            lines += [f"  {field.name}:", *(f"    {line}" for line in child)]
    return lines


def dump_graph(program: object) -> str:
    """The IR DAG as a table: one node a line with its rank, position and incoming edges by kind."""
    from pipec.ir import build_graph

    graph = build_graph(program)  # type: ignore[arg-type]
    lines = [f"# {graph.number_of_nodes()} nodes, {graph.number_of_edges()} edges", "rank  index  node        inputs"]
    order = sorted(graph.nodes(data=True), key=lambda item: (item[1]["rank"], item[1]["index"]))
    for node, data in order:
        inputs = ", ".join(f"{pred}({graph.edges[pred, node]['kind']})" for pred in graph.predecessors(node))
        lines.append(f"{data['rank']:>4}  {data['index']:>5}  {node!s:<10}  {inputs}")
    return "\n".join(lines) + "\n"


