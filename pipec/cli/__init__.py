"""The `pipec` command line: argument parsing and printing only; the work happens in the phase modules.

One module a command (compile, check, listing, simulate, viz, show, run, test), each with HELP, EXAMPLES,
`add_arguments(parser)` and `run(args) -> exit code`; what they share is in `common`. Only the command the user
asked for is imported: `run` needs torch, and `pipec compile` must start fast without it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from collections.abc import Sequence
from types import ModuleType

from pipec.cli.common import (
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    flush_stdout,
    say_error,
    silence_stdout,
)
from pipec.cli.parser import Parser
from pipec.errors import PipecError
from pipec.outputs import check_outputs, input_paths

# name -> one line for `pipec --help` (kept here so that listing the commands imports none of them)
COMMANDS = {
    "compile": "compile a schedule to per-rank instruction streams",
    "check": "verify a schedule and print per-pass verdicts",
    "list": "the bundled schedules with their parameters",
    "simulate": "simulate a schedule with a cost model: makespan, bubble, memory",
    "show": "print a schedule's simulated timeline as a compact grid",
    "viz": "draw a schedule (SVG Gantt chart) or write a Chrome/Perfetto trace",
    "test": "property-based check of a schedule over many (P, M, V)",
    "run": "train a model with the schedule on torch.distributed",
    "tune": "search for the fastest verified schedule under a memory limit",
}

# Flags that name files a command writes, and flags that name files it reads: checked against each other before
# any work, so that `-o my.pipe` cannot replace the schedule it was compiled from.
OUTPUT_FLAGS = (("output", "-o"), ("trace", "--trace"), ("save", "--save"), ("report", "--report"))
INPUT_FLAGS = ("schedule", "cost")


# Modules named after their command, but for `list`: a submodule is bound in this package's namespace on import,
# where `list` would hide the builtin.
MODULE_OF = {"list": "listing"}


def command_module(command: str) -> ModuleType:
    return importlib.import_module(f"pipec.cli.{MODULE_OF.get(command, command)}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"pipec {version('pipec')}"
    except PackageNotFoundError:
        return "pipec (not installed as a package)"


def _description(module: ModuleType, help_text: str) -> str:
    """DESCRIPTION, wrapped, where the docstring's first paragraph speaks of pipec's modules (of no use to a user),
    else that paragraph after its `pipec NAME ...:` lead."""
    if hasattr(module, "DESCRIPTION"):
        return textwrap.fill(module.DESCRIPTION, width=100)
    return (module.__doc__ or help_text).split("\n\n")[0].split(": ", 1)[-1]


def build_parser(command: str | None = None) -> Parser:
    parser = Parser(
        prog="pipec",
        description="A compiler for pipeline-parallel training schedules.",
        epilog=f"Run 'pipec COMMAND --help' for a command's options and examples.\n{EXIT_CODES}, "
        "3 pipec run failed after its workers started",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-V", "--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for name, help_text in COMMANDS.items():
        if name != command:
            commands.add_parser(name, help=help_text)
            continue
        module = command_module(name)  # import only the command the user asked for: its imports may be heavy
        sub = commands.add_parser(
            name,
            help=help_text,
            # DESCRIPTION where the docstring's first paragraph speaks of pipec's modules, which a user has no use for
            description=_description(module, help_text),
            epilog=module.EXAMPLES + ("" if "exit codes" in module.EXAMPLES else EXIT_CODES + "\n"),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
        parser.command_parser = sub
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args: argparse.Namespace | None = None
    try:
        Parser.typed = argv
        try:
            parser = build_parser(command if command in COMMANDS else None)
            args, unknown = parser.parse_known_args(argv)
            if unknown:  # the command's parser says it, with its own usage and a suggestion, not the top level's
                parser.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        except SystemExit as e:  # argparse has printed the usage error (2), or --help/--version (0)
            return e.code if isinstance(e.code, int) else EXIT_USAGE
        module = command_module(args.command)
        given = [getattr(args, name, None) for name in INPUT_FLAGS]  # `pipec simulate A B C`: a list
        inputs = [path for value in given for path in (value if isinstance(value, list) else [value])]
        if hasattr(module, "input_files"):  # files only the command knows it reads (run: the --model module's)
            inputs += module.input_files(args)
        check_outputs({flag: getattr(args, name, None) for name, flag in OUTPUT_FLAGS}, input_paths(*inputs))
        code = args.handler(args)
        flush_stdout()
        return code
    except PipecError as e:
        say_error(e.render())
        return e.exit_code
    except BrokenPipeError:  # `pipec compile ... | head`: the reader has what it wanted
        silence_stdout()
        return EXIT_OK
    except KeyboardInterrupt:
        say_error("error: interrupted")
        return EXIT_INTERRUPTED
    except OSError as e:  # the machine refused a read or write we did not expect to fail (stdout on a full disk)
        silence_stdout()
        where = f" ({e.filename})" if e.filename else ""
        say_error(f"error: input/output failed{where}: {e.strerror or e}")
        return EXIT_USAGE
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "torch":
            return _internal_error(e)
        # `pip install -e .` installs the compiler only; the runtime's dependency is an extra
        say_error(TORCH_MISSING.format(command=getattr(args, "command", None) or "this command"))
        return EXIT_USAGE
    except MemoryError:
        say_error("error: out of memory; the input asks for more than this machine has (try smaller -P/-M/-V)")
        return EXIT_USAGE
    except RecursionError:
        say_error("error: the input is nested too deeply to process")
        return EXIT_USAGE
    except Exception as e:  # a bug in pipec, not the user's fault: one line with what to report, no traceback
        return _internal_error(e)


TORCH_MISSING = (
    "error: pipec {command} needs PyTorch, which is not installed here; install pipec with its torch extra: "
    "pip install -e '.[torch]' (or pip install 'torch>=2.4'). compile, check, simulate, show, viz, test and tune "
    "need no torch"
)


def _internal_error(e: Exception) -> int:
    if os.environ.get("PIPEC_TRACEBACK"):
        raise e
    say_error(
        f"pipec: internal error: {type(e).__name__}: {e}\n"
        "  this is a bug in pipec; please report it with the command line (PIPEC_TRACEBACK=1 shows where)"
    )
    return EXIT_USAGE


def entry_point() -> None:
    sys.exit(main())
