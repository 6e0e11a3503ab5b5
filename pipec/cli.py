"""`pipec` command line: argument parsing and printing only; the work happens in the phase modules."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from types import ModuleType

from pipec.errors import PipecError, PipecInputError
from pipec.outputs import check_outputs, input_paths, write_text

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


# Numbers on the command line: ASCII digits only (int() and float() also take '٤', '1_000' and ' 4 '), a bounded
# length (int() of a 5,000-digit string raises deep inside Python), and finite amounts.
_INTEGER = re.compile(r"[+-]?[0-9]{1,18}")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?")


def integer(text: str) -> int:
    """An argparse type: a decimal integer of at most 18 digits."""
    if not _INTEGER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected an integer (ASCII digits, at most 18), got {text!r}")
    return int(text)


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def number(text: str) -> float:
    """An argparse type: a finite decimal number (no inf, nan or overflow)."""
    if not _NUMBER.fullmatch(text) or not math.isfinite(float(text)):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return float(text)


def _amount(text: str) -> float:
    value = number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _assignment(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name.strip(), integer(value.strip())
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{name.strip()}: expected an integer value, got {value!r}") from None


def _schedule_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("schedule", metavar="SCHEDULE", help="bundled name, .pipe file, torch .csv, .txt or .json")
    parser.add_argument("--ranks", "-P", type=positive, metavar="P", help="pipeline ranks")
    parser.add_argument("--microbatches", "-M", type=positive, metavar="M", help="micro-batches per step")
    parser.add_argument("--chunks", "-V", type=positive, metavar="V", help="stages per rank (default 1)")
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


# Flags that name files a command writes, and flags that name files it reads: checked against each other before
# any work, so that `-o my.pipe` cannot replace the schedule it was compiled from.
OUTPUT_FLAGS = (("output", "-o"), ("trace", "--trace"), ("save", "--save"), ("report", "--report"))
INPUT_FLAGS = ("schedule", "cost")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = build_parser(command).parse_args(argv)
        handler = getattr(args, "handler", None) or {"compile": _compile, "check": _check, "list": _list}[args.command]
        check_outputs(
            {flag: getattr(args, name, None) for name, flag in OUTPUT_FLAGS},
            input_paths(*(getattr(args, name, None) for name in INPUT_FLAGS)),
        )
        code = handler(args)
        _flush_stdout()
        return code
    except PipecError as e:
        _say_error(e.render())
        return e.exit_code
    except BrokenPipeError:  # `pipec compile ... | head`: the reader has what it wanted
        _silence_stdout()
        return EXIT_OK
    except KeyboardInterrupt:
        _say_error("error: interrupted")
        return EXIT_INTERRUPTED
    except OSError as e:  # the machine refused a read or write we did not expect to fail (stdout on a full disk)
        _silence_stdout()
        where = f" ({e.filename})" if e.filename else ""
        _say_error(f"error: input/output failed{where}: {e.strerror or e}")
        return EXIT_USAGE
    except MemoryError:
        _say_error("error: out of memory; the input asks for more than this machine has (try smaller -P/-M/-V)")
        return EXIT_USAGE
    except RecursionError:
        _say_error("error: the input is nested too deeply to process")
        return EXIT_USAGE
    except Exception as e:  # a bug in pipec, not the user's fault: one line with what to report, no traceback
        if os.environ.get("PIPEC_TRACEBACK"):
            raise
        _say_error(
            f"pipec: internal error: {type(e).__name__}: {e}\n"
            "  this is a bug in pipec; please report it with the command line (PIPEC_TRACEBACK=1 shows where)"
        )
        return EXIT_USAGE


def _say_error(text: str) -> None:
    if sys.stderr is not None:
        try:
            print(text, file=sys.stderr, flush=True)
        except OSError:
            pass  # stderr itself is gone; the exit code still tells


def _flush_stdout() -> None:
    if sys.stdout is None:
        return
    try:
        sys.stdout.flush()
    except OSError as e:
        _silence_stdout()
        if isinstance(e, BrokenPipeError):
            return
        raise PipecInputError(f"cannot write to standard output: {e.strerror or e}") from None


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that Python's own flush at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):
        pass


def _params(args: argparse.Namespace) -> dict[str, int]:
    params: dict[str, int] = {}
    for name, value in args.set:
        if name in params:
            raise PipecInputError(f"--set {name} is given twice")
        params[name] = value
    return params


def _write(text: str, output: str | None) -> None:
    """Print to standard output, or write the file atomically (pipec.outputs)."""
    if output is None:
        if sys.stdout is None:
            raise PipecInputError("standard output is closed; give -o FILE")
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            _silence_stdout()
            raise PipecInputError(f"cannot write to standard output: {e.strerror or e}") from None
        return
    write_text(output, text)


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
