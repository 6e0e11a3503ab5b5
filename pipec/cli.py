"""`pipec` command line: argument parsing and printing only; the work happens in the phase modules."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import ModuleType

from pipec.errors import PipecError, PipecInputError

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _assignment(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name.strip(), int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name.strip()}: expected an integer value, got {value!r}") from None


def _schedule_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("schedule", metavar="SCHEDULE", help="bundled name, .pipe file, torch .csv, .txt or .json")
    parser.add_argument("--ranks", "-P", type=_positive, metavar="P", help="pipeline ranks")
    parser.add_argument("--microbatches", "-M", type=_positive, metavar="M", help="micro-batches per step")
    parser.add_argument("--chunks", "-V", type=_positive, metavar="V", help="stages per rank (default 1)")
    parser.add_argument(
        "--set", action="append", type=_assignment, default=[], metavar="NAME=VALUE", help="a named parameter"
    )


def _verify_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--p2p", choices=("nccl", "tagged"), default="nccl", help="point-to-point model (default nccl)")
    parser.add_argument(
        "--memory-limit", type=_amount, metavar="N", help="activation units a rank may hold (default: declared bound)"
    )
    parser.add_argument(
        "--input-fraction",
        type=_amount,
        default=0.5,
        metavar="X",
        help="share of a micro-batch's activations that I frees; W frees the rest (default 0.5)",
    )
    parser.add_argument(
        "--stage-sizes", type=_sizes, metavar="A,B,...", help="activation units of a micro-batch, per stage (default 1)"
    )


def _amount(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _sizes(text: str) -> tuple[float, ...]:
    return tuple(_amount(part.strip()) for part in text.split(","))


def _verify_options(args: argparse.Namespace) -> dict:
    return {
        "p2p": args.p2p,
        "memory_limit": args.memory_limit,
        "input_fraction": args.input_fraction,
        "stage_sizes": args.stage_sizes,
    }


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipec", description="A compiler for pipeline-parallel training schedules.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    compile_cmd = commands.add_parser("compile", help="compile a schedule to per-rank instruction streams")
    _schedule_args(compile_cmd)
    _verify_args(compile_cmd)
    compile_cmd.add_argument("--format", choices=("json", "text", "torch-csv", "torch-csv-comms"), default="text")
    compile_cmd.add_argument("-o", "--output", metavar="PATH", help="write here instead of standard output")
    compile_cmd.add_argument(
        "--emit",
        choices=("ast", "orders", "ir", "streams"),
        help="stop after this phase and print its result (ast, compute orders, IR graph, streams)",
    )
    compile_cmd.add_argument("--no-verify", action="store_true", help="emit without running the verification passes")

    check_cmd = commands.add_parser("check", help="verify a schedule and print per-pass verdicts")
    _schedule_args(check_cmd)
    _verify_args(check_cmd)

    commands.add_parser("list", help="the bundled schedules with their parameters")

    for name, (module_name, help_text) in COMMAND_MODULES.items():
        sub = commands.add_parser(name, help=help_text)
        if name == command:  # import only the phase the user asked for: its imports may be heavy
            module = _command_module(name, module_name)
            _schedule_args(sub)
            module.add_arguments(sub)
            sub.set_defaults(handler=module.main)
    return parser


# Commands implemented in their phase's package. Each module offers `add_arguments(parser)` (the SCHEDULE,
# --ranks, --microbatches, --chunks and --set arguments are already there) and `main(args) -> exit code`,
# and must not import torch at module level: `pipec --help` and `pipec compile` stay fast.
COMMAND_MODULES = {
    "simulate": ("pipec.sim.command", "simulate a schedule with a cost model: makespan, bubble, memory"),
    "viz": ("pipec.viz.command", "draw a schedule (SVG Gantt chart) or write a Chrome/Perfetto trace"),
    "run": ("pipec.runtime.command", "train a model with the schedule on torch.distributed"),
    "test": ("pipec.testing.command", "property-based check of a schedule over many (P, M, V)"),
    "show": ("pipec.viz.show", "print a schedule's simulated timeline as a compact grid"),
}


def _command_module(command: str, module_name: str) -> ModuleType:
    import importlib

    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise PipecInputError(f"'pipec {command}' is not available in this version of pipec") from None
        raise


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = build_parser(command).parse_args(argv)
        handler = getattr(args, "handler", None) or {"compile": _compile, "check": _check, "list": _list}[args.command]
        return handler(args)
    except PipecError as e:
        print(e.render(), file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # `pipec compile ... | head`
        return EXIT_OK


def _params(args: argparse.Namespace) -> dict[str, int]:
    params: dict[str, int] = {}
    for name, value in args.set:
        if name in params:
            raise PipecInputError(f"--set {name} is given twice")
        params[name] = value
    return params


def _write(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    try:
        Path(output).write_text(text)
    except OSError as e:
        raise PipecInputError(f"cannot write {output}: {e.strerror or e}") from None


def _compile(args: argparse.Namespace) -> int:
    from pipec.compiler import compile_program, compute_orders, parse_schedule
    from pipec.emit import dump_text, emit

    if args.emit == "ast":
        _write(dump_ast(parse_schedule(args.schedule)) + "\n", args.output)
        return EXIT_OK
    if args.emit == "orders":
        program = compute_orders(args.schedule, args.ranks, args.microbatches, args.chunks, _params(args))
        _write(dump_text(program), args.output)
        return EXIT_OK
    program = compile_program(args.schedule, args.ranks, args.microbatches, args.chunks, _params(args))
    if args.emit == "ir":
        _write(dump_graph(program), args.output)
        return EXIT_OK
    if not args.no_verify:
        from pipec.verify import verify

        report = verify(program, **_verify_options(args))
        if not report.ok:
            print(report.render(), file=sys.stderr)
            return EXIT_INVALID
    _write(emit(program, "text" if args.emit == "streams" else args.format), args.output)
    return EXIT_OK


def _check(args: argparse.Namespace) -> int:
    from pipec.compiler import compile_program
    from pipec.verify import verify

    program = compile_program(args.schedule, args.ranks, args.microbatches, args.chunks, _params(args))
    report = verify(program, **_verify_options(args))
    p = program
    print(f"{p.name}: P={p.ranks} M={p.microbatches} V={p.chunks}, {p.num_stages} stages, p2p model {args.p2p}")
    print(report.render())
    return EXIT_OK if report.ok else EXIT_INVALID


def _list(args: argparse.Namespace) -> int:
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


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
