"""What every command shares: strict numbers, the SCHEDULE arguments, verification options, writing outputs."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from pipec.errors import PipecInputError
from pipec.ir import DEFAULT_INPUT_FRACTION
from pipec.outputs import write_text

if TYPE_CHECKING:  # for the hints only: a command that needs neither need not load them
    from pipec.ir import Program
    from pipec.sim.costs import Costs

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_CODES = "exit codes: 0 ok, 1 the schedule is invalid, 2 bad input or usage"


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


def amount(text: str) -> float:
    value = number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def assignment(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name.strip(), integer(value.strip())
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{name.strip()}: expected an integer value, got {value!r}") from None


def schedule_args(parser: argparse.ArgumentParser) -> None:
    """SCHEDULE and the sizes: P, M, V and named parameters (a .pipe file may give defaults; a stream file fixes
    them, and a flag that disagrees with it is an error)."""
    parser.add_argument(
        "schedule", metavar="SCHEDULE", help="a bundled name (pipec list), a .pipe file or a .csv/.txt/.json stream"
    )
    sizes = parser.add_argument_group("sizes", "needed unless the schedule gives a default or the stream file fixes it")
    sizes.add_argument("--ranks", "-P", type=positive, metavar="P", help="pipeline ranks")
    sizes.add_argument("--microbatches", "-M", type=positive, metavar="M", help="micro-batches per step")
    sizes.add_argument(
        "--chunks", "-V", type=positive, metavar="V", help="stages per rank (default: the schedule's, see pipec list)"
    )
    sizes.add_argument(
        "--set", action="append", type=assignment, default=[], metavar="NAME=VALUE", help="a named parameter"
    )


def verify_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--p2p",
        choices=("nccl", "tagged", "torch"),
        default="nccl",
        help="point-to-point model: nccl (pipec's runtime; default), tagged (buffered sends) or torch (torch's "
        "_PipelineScheduleRuntime: each send/recv posted on its own); --format torch-csv-comms is checked under torch",
    )
    parser.add_argument(
        "--memory-limit", type=amount, metavar="N", help="activation units a rank may hold (default: declared bound)"
    )
    parser.add_argument(
        "--input-fraction",
        type=amount,
        default=DEFAULT_INPUT_FRACTION,
        metavar="X",
        help="share of a micro-batch's activations that I frees; W frees the rest (default 0.5)",
    )
    parser.add_argument(
        "--stage-sizes", type=sizes, metavar="A,B,...", help="activation units of a micro-batch, per stage (default 1)"
    )


def placement_args(parser: argparse.ArgumentParser) -> None:
    """--cost for `pipec compile` and `pipec check`: where the send/recv go (the emitted or checked streams)."""
    parser.add_argument(
        "--cost",
        metavar="F=1,B=2,W=1,comm=0",
        help="place send/recv for these costs (as pipec simulate --cost: NAME=VALUE pairs or a JSON file); "
        "default F=1,B=2,W=1, messages free. A stream file that has send/recv keeps them",
    )


def placement_costs(args: argparse.Namespace):
    """The Costs of --cost, or None for the default placement (without loading the cost model)."""
    if getattr(args, "cost", None) is None:
        return None
    return given_costs(args.cost)


def given_costs(spec: str | None, complete: bool = False) -> Costs:
    """The Costs of a --cost argument. Defaults fill what it leaves out, and that is said (on standard error):
    `--cost F=1.5,B=3` silently took W=1. With ``complete`` (pipec tune, whose search depends on the backward's
    split) a --cost without two of B, I, W is refused instead."""
    from pipec.sim.costs import DEFAULT_COSTS, parse_costs

    costs = parse_costs(spec)
    missing = costs.defaulted_compute
    if spec is None or not missing:
        return costs
    split = [k for k in missing if k != "F"]
    if complete and split:
        raise PipecInputError(
            f"--cost {spec[:60]}: give the backward's split, B and W or I and W (it has "
            f"{' and '.join(k for k in ('B', 'I', 'W') if k in costs.given) or 'none of B, I, W'}); the schedules "
            "tune finds depend on it"
        )
    if costs.given & {"F", "B", "I", "W"}:  # some compute given, the rest assumed: say what was assumed
        filled = ", ".join(f"{k}={getattr(costs, k) if k == 'I' else getattr(DEFAULT_COSTS, k):g}" for k in missing)
        named = ", ".join(missing[:-1]) + " or " + missing[-1] if len(missing) > 1 else missing[0]
        say_error(f"note: --cost gives no {named}; using {filled} (give F and two of B, I, W)")
    return costs


def share_args(parser: argparse.ArgumentParser) -> None:
    """--per-rank-share, shared by `pipec simulate`, `show`, `viz` and `check` (docs/simulator.md, "Units that
    compare across V")."""
    parser.add_argument(
        "--per-rank-share",
        action="store_true",
        help="costs and memory are per rank share of the model (the model as P segments): a chunk of a V-chunk "
        "schedule takes 1/V of F, B, I, W and holds 1/V of an activation unit (C/V with C copies of the model, "
        "`pipelines C`); per-stage lists (cost file, "
        "--stage-sizes) have P entries; --memory-limit and peaks count whole micro-batches of a rank's share",
    )


def compile_schedule(
    args: argparse.Namespace, costs: Costs | None, comms: bool = True
) -> tuple[Program, Costs | None]:
    """The schedule of the common arguments, compiled with send/recv placed for ``costs`` (``comms``: False stops
    at the compute orders), and the costs in the program's own stage units. A `choose` schedule is ordered with
    the same costs and the verifier's memory model (--input-fraction, --stage-sizes, --memory-limit), so every
    command that takes --cost orders it the same way. Under --per-rank-share the costs are rescaled
    (per_rank_share) once P and V are known, before the placement, so that it is timed with what is simulated; the
    schedule's declared memory bound (in stage units, a stage holding 1) becomes C/V as much in the flag's units (1/V
    with one copy of the model)."""
    from pipec.compiler import compute_orders, place_p2p
    from pipec.gcpause import without_cyclic_gc

    share = getattr(args, "per_rank_share", False)
    with without_cyclic_gc():  # as compile_program: the phases allocate many small acyclic tuples
        program = compute_orders(
            args.schedule,
            args.ranks,
            args.microbatches,
            args.chunks,
            params(args),
            costs=costs,
            input_fraction=getattr(args, "input_fraction", DEFAULT_INPUT_FRACTION),
            stage_sizes=getattr(args, "stage_sizes", None),
            memory_limit=getattr(args, "memory_limit", None),
            per_rank_share=share,
        )
        if share:
            from pipec.sim.costs import per_rank_share

            if program.num_stages != program.ranks * program.chunks:  # segment s // V needs V stages on every rank
                raise PipecInputError(
                    f"--per-rank-share needs P*V stages; {program.name} has {program.num_stages} for "
                    f"P={program.ranks}, V={program.chunks}"
                )
            # None (check without --cost): the default costs scaled by 1/V with free messages are the default
            # placement's costs in another time unit, so the placement is the default one either way
            copies = program.pipelines  # a stage is C/V of a rank's share (1/V with one copy)
            costs = None if costs is None else per_rank_share(costs, program.ranks, program.chunks, copies)
            if program.memory_bound is not None:
                bound = tuple(b * copies / program.chunks for b in program.memory_bound)
                program = replace(program, memory_bound=bound)
        if comms and not program.has_comms:
            program = place_p2p(program, costs)
    return program, costs


def sizes(text: str) -> tuple[float, ...]:
    return tuple(amount(part.strip()) for part in text.split(","))


def verify_options(args: argparse.Namespace, program: Program | None = None) -> dict:
    """verify()'s keyword arguments; under --per-rank-share (with the program, for P and V) the stage sizes are
    given per segment and spread over the stages (pipec.verify.memory.share_stage_sizes)."""
    stage_sizes = args.stage_sizes
    if program is not None and getattr(args, "per_rank_share", False):
        from pipec.verify.memory import share_stage_sizes

        stage_sizes = share_stage_sizes(stage_sizes, program.ranks, program.chunks, program.pipelines)
    return {
        "p2p": args.p2p,
        "memory_limit": args.memory_limit,
        "input_fraction": args.input_fraction,
        "stage_sizes": stage_sizes,
    }


def params(args: argparse.Namespace) -> dict[str, int]:
    params: dict[str, int] = {}
    for name, value in args.set:
        if name in params:
            raise PipecInputError(f"--set {name} is given twice")
        params[name] = value
    return params


def write(text: str, output: str | None, announce: bool = True) -> None:
    """Print to standard output, or write the file atomically (pipec.outputs) and, with ``announce``, say so on
    standard output (`wrote zbv.svg`: the command would otherwise end without a word; not for /dev/stdout)."""
    if output is None:
        if sys.stdout is None:
            raise PipecInputError("standard output is closed; give -o FILE")
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            silence_stdout()
            raise PipecInputError(f"cannot write to standard output: {e.strerror or e}") from None
        return
    write_text(output, text)
    if announce and os.path.isfile(output) and sys.stdout is not None:
        sys.stdout.write(f"wrote {output}\n")


def say_error(text: str) -> None:
    """`text` and its newline in one write: workers under torchrun share stderr, and print's two writes (the
    text, then the newline, when stderr is unbuffered) interleave with theirs."""
    if sys.stderr is not None:
        try:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except OSError:
            pass  # stderr itself is gone; the exit code still tells


def flush_stdout() -> None:
    if sys.stdout is None:
        return
    try:
        sys.stdout.flush()
    except OSError as e:
        silence_stdout()
        if isinstance(e, BrokenPipeError):
            return
        raise PipecInputError(f"cannot write to standard output: {e.strerror or e}") from None


def silence_stdout() -> None:
    """Point stdout at /dev/null so that Python's own flush at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):
        pass


