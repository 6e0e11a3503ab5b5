"""`pipec tune`: search for the fastest verified schedule for measured costs under a memory limit.

Costs and the limit are per rank share of the model (docs/simulator.md, --per-rank-share), so that schedules of
different V compare; docs/tuning.md walks through it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pipec.cli.common import EXIT_INVALID, EXIT_OK, amount, given_costs, integer, positive, say_error, write
from pipec.errors import ScheduleError

HELP = "search for the fastest verified schedule under a memory limit"
EXAMPLES = """examples:
  pipec tune -P 4 -M 8 --cost F=1,I=1,W=1 --memory-limit 4 -o best.pipe
  pipec tune -P 8 -M 24 --cost costs.json --memory-limit 6 --chunks 1,2 --time-budget 30
  pipec tune -P 4 -M 8 --cost F=1,I=2,W=1,comm=0.5 --memory-limit 3 --from my.pipe --format json
exit codes: 0 ok, 1 no candidate fits the memory limit, 2 bad input or usage
"""

PROGRESS_AFTER = 2.0  # seconds before the first progress line on stderr
PROGRESS_EVERY = 1.0  # at most one line a second after that
OUTPUT_RESERVE = 2.0  # seconds of --time-budget kept for start-up, the re-check and the output (at most 10%)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sizes = parser.add_argument_group("sizes")
    sizes.add_argument("--ranks", "-P", type=positive, required=True, metavar="P", help="pipeline ranks")
    sizes.add_argument("--microbatches", "-M", type=positive, required=True, metavar="M", help="micro-batches per step")
    sizes.add_argument(
        "--chunks",
        "-V",
        type=chunk_list,
        default=(1, 2, 4),
        metavar="1,2,4",
        help="the V (stages per rank) to try, comma-separated (default 1,2,4)",
    )
    parser.add_argument(
        "--cost",
        required=True,
        metavar="F=1,I=1,W=1,comm=0",
        help="measured costs per rank share of the model (one of P consecutive segments): F, B or I and W, comm, "
        "...; or a JSON cost file whose per-stage lists have P entries (as pipec simulate --cost "
        "--per-rank-share). A chunk of a V-chunk schedule takes 1/V of them (C/V with C copies of the model)",
    )
    parser.add_argument(
        "--memory-limit",
        type=amount,
        required=True,
        metavar="X",
        help="activation units a rank may hold, in micro-batches of one rank's share (1F1B's rank 0 holds P)",
    )
    parser.add_argument(
        "--from",
        dest="sources",
        action="extend",
        nargs="+",
        default=[],
        metavar="FILE.pipe",
        help="also try these schedules (over their declared parameter ranges), beside the library's",
    )
    parser.add_argument(
        "--time-budget",
        type=amount,
        metavar="SECONDS",
        help="seconds for the whole command (default 120), counted as work (seconds of an idle machine; the solver "
        "in its deterministic time), so that a loaded machine gives the same result; it ends within 2 times the "
        "budget in CPU time and 3 times in wall time however loaded, and sooner when every shape is proved. The "
        "search beyond the library stops in time; the library is always tried in full",
    )
    parser.add_argument("--seed", type=integer, default=0, metavar="S", help="seed of sampling and local moves")
    parser.add_argument(
        "--workers",
        type=positive,
        default=1,
        metavar="N",
        help="threads of the exact phase's solver (CP-SAT; default 1: deterministic; more prove faster on idle "
        "cores, with results that may differ between runs)",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text", help="text (default) or json")
    parser.add_argument("-o", "--output", metavar="best.pipe", help="write the best schedule here (atomically)")
    parser.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="progress lines on stderr for searches over 2 s: auto (default: when stderr is a terminal), always, never",
    )


def chunk_list(text: str) -> tuple[int, ...]:
    """An argparse type: V values such as 1,2,4 (each 1..64)."""
    try:
        values = tuple(sorted({positive(part.strip()) for part in text.split(",")}))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--chunks: {e}") from None
    if values[-1] > 64:
        raise argparse.ArgumentTypeError(f"--chunks: at most 64 chunks per rank, got {values[-1]}")
    return values


def input_files(args: argparse.Namespace) -> list[str]:
    """The --from files: no output may replace one of them."""
    return list(args.sources)


def run(args: argparse.Namespace) -> int:
    from pipec.compiler import parse_schedule
    from pipec.limits import check_sizes
    from pipec.sim.costs import per_rank_share
    from pipec.tune import Setting, library_sources, tune
    from pipec.tune.clock import DEFAULT_BUDGET, Clock
    from pipec.tune.output import candidates_json, recheck, schedule_text, summary_text, table_text

    clock = Clock()  # the budget's, from here: parsing the costs and the --from files counts too
    check_sizes(args.ranks, args.microbatches, max(args.chunks), "pipec tune")
    costs = given_costs(args.cost, complete=True)
    per_rank_share(costs, args.ranks, 1)  # per-stage lists of another length than P: bad input now, not per candidate
    for path in args.sources:  # a --from file that does not read or parse is bad input (exit 2), not a candidate
        parse_schedule(path)
    setting = Setting(args.ranks, args.microbatches, costs, args.memory_limit, args.chunks)
    sources = library_sources() + [(path, path) for path in args.sources]
    # the budget is for the whole command: start-up, the final re-check and the output take about a second
    budget = DEFAULT_BUDGET if args.time_budget is None else args.time_budget  # the default: tune's own
    search_budget = max(0.0, budget - min(OUTPUT_RESERVE, budget / 10))
    result = tune(setting, sources, search_budget, args.seed, _Progress(args.progress), args.workers, clock)
    if result.best is None:
        peaks = [c for c in result.candidates if c.peak is not None]
        smallest = min(peaks, key=lambda c: c.peak, default=None)  # type: ignore[arg-type, return-value]
        seen = "" if smallest is None else f"; the smallest peak seen is {smallest.peak:g} ({smallest.label()})"
        if args.format == "json":
            write(json.dumps(candidates_json(result, None), indent=2) + "\n", None)
        raise ScheduleError(
            f"no candidate fits the memory limit of {args.memory_limit:g} units per rank{seen}; raise --memory-limit"
        )
    text = schedule_text(result, args.cost, args.output or "best.pipe")
    recheck(text, result)  # the file as a user will read it must verify and match before it is written
    if args.output is not None:
        write(text, args.output, announce=False)  # summary_text says it, after the table
    if args.format == "json":
        write(json.dumps(candidates_json(result, text), indent=2) + "\n", None)
    else:
        write(table_text(result) + summary_text(result, args.output), None)
    return EXIT_OK if result.best is not None else EXIT_INVALID


class _Progress:
    """Progress lines on stderr: none for the first PROGRESS_AFTER seconds, then at most one a PROGRESS_EVERY; only
    to a terminal, so that a script's captured stderr holds errors only (and what it prints does not depend on
    how busy the machine was); `--progress always` shows them in logs too."""

    def __init__(self, when: str = "auto") -> None:
        self.start = time.monotonic()
        self.last = self.start + PROGRESS_AFTER - PROGRESS_EVERY
        try:
            terminal = sys.stderr is not None and sys.stderr.isatty()
        except (AttributeError, ValueError):  # a closed or replaced stream
            terminal = False
        self.shown = when == "always" or (when == "auto" and terminal)

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if not self.shown or now - self.last < PROGRESS_EVERY:
            return
        self.last = now
        say_error(line)
