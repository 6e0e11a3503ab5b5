"""Compile-time benchmark: pipec against torch.distributed.pipelining's schedule construction.

    python bench/compile.py                                  # the default grid, a few minutes on 2 cores
    python bench/compile.py --sizes 4,8,2 16,256,4 --schedules zbv interleaved_1f1b --repeat 9

For every schedule pipec shares with torch, at each (P, M, V), it prints the median time (CPU time of this
process by default, `--clock wall` for elapsed time) of

- pipec: `pipec.compile(name, P, M, V)` (parse the bundled .pipe file, expand it to per-rank orders, insert
  send/recv) plus emitting the text format: parse to emitted streams. The Lark grammar is built once per
  process (reported on its own, not in the table), exactly as it is for a user who compiles in a loop;
- torch: constructing the schedule object for one rank. Its multi-stage classes (Interleaved1F1B, LoopedBFS,
  InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) generate every rank's order and run their lowering passes
  (validation, unshard/reshard, reduce-grad, send/recv) in the constructor: "gen+lower". GPipe and 1F1B are
  single-stage classes whose constructor only generates the compute orders of every rank (no send/recv lowering;
  their `_step_microbatches` communicates on the fly): "gen only". For those rows pipec still does more work
  (it inserts send/recv too), so the ratio is an upper bound; the "orders" column is pipec without send/recv.

`parse ms` is the parse alone (part of both pipec columns): a fixed cost per compile, which is what dominates
the smallest sizes. Each cell runs `--repeat` times or until `--budget` seconds are spent on it, whichever
comes first (pipec at least 3 times, torch at least once), so the largest torch constructions run once and
small ones many times. `ops` counts compute actions (F, B, I, W; an overlapped pair counts as two); `us/op` is
pipec's time per op, flat when growth is linear. On a shared machine, rerun a row (`--sizes`, `--schedules`)
before trusting an outlier.
Never used by the tests; timing belongs here, not in assertions.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pipec
from pipec.compiler import parse_schedule
from pipec.emit import dump_text
from pipec.errors import PipecError
from pipec.frontend.parser import parse

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
SIZES = ((4, 8, 2), (8, 64, 2), (16, 256, 4), (32, 1024, 4))
FIXED_CHUNKS = {"gpipe": 1, "1f1b": 1, "zbv": 2, "dualpipev": 2}  # what these schedules (and torch's) accept
SINGLE_STAGE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}  # torch classes that build orders only


class Timing(NamedTuple):
    median: float
    runs: int


class Row(NamedTuple):
    schedule: str
    ranks: int
    microbatches: int
    chunks: int
    ops: int | None = None
    pipec: Timing | None = None
    orders: Timing | None = None
    parse: Timing | None = None
    cached: Timing | None = None
    torch: Timing | None = None
    torch_what: str = ""
    note: str = ""


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = time.process_time  # set by --clock


def measure(fn: Callable[[], object], repeat: int, budget: float, at_least: int = 1) -> Timing:
    """Median of up to `repeat` runs, stopping early once `budget` seconds are spent (`at_least` runs)."""
    times: list[float] = []
    start = time.perf_counter()
    while True:
        gc.collect()  # each run starts from a clean heap; the run's own collections still count
        t0 = clock()
        result = fn()
        times.append(clock() - t0)
        del result  # free a large schedule before the next run allocates another
        if len(times) >= repeat or (len(times) >= at_least and time.perf_counter() - start >= budget):
            return Timing(statistics.median(times), len(times))


def pipec_compile(name: str, ranks: int, microbatches: int, chunks: int) -> str:
    """Parse to emitted streams, through the public API (parse cache cleared: a cold compile)."""
    parse.cache_clear()
    return dump_text(pipec.compile(name, ranks, microbatches, chunks))


def pipec_compile_cached(name: str, ranks: int, microbatches: int, chunks: int) -> str:
    """The same with the schedule already parsed, as in a loop over (P, M, V) such as `pipec test`."""
    return dump_text(pipec.compile(name, ranks, microbatches, chunks))


def pipec_orders(name: str, ranks: int, microbatches: int, chunks: int) -> str:
    """Parse to emitted compute orders, without send/recv: what torch's single-stage constructors produce."""
    parse.cache_clear()
    return dump_text(pipec.load(name, ranks, microbatches, chunks))


def count_ops(program: pipec.Program) -> int:
    return sum(len(instruction.parts) for stream in program.compute_streams() for instruction in stream)


def torch_builder(name: str, ranks: int, microbatches: int, chunks: int) -> tuple[Callable[[], object], str]:
    """A function constructing torch's schedule object, and what it covers."""
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch_reference import _stage, torch_schedule

    if name in SINGLE_STAGE:
        cls = getattr(torch_schedules, SINGLE_STAGE[name])
        # one stage per rank: stage 0's object computes pipeline_order for all P ranks
        return (lambda: cls(_stage(0, 0, ranks, ranks), microbatches)), "gen only"
    return (lambda: torch_schedule(name, ranks, microbatches, chunks)), "gen+lower"


def bench_one(name: str, size: tuple[int, int, int], args: argparse.Namespace) -> Row:
    ranks, microbatches, chunks = size
    chunks = FIXED_CHUNKS.get(name, chunks)
    row = Row(name, ranks, microbatches, chunks)
    try:
        ops = count_ops(pipec.compile(name, ranks, microbatches, chunks))
    except PipecError as e:
        return row._replace(note=f"pipec refuses: {e.message}")
    # pipec's cells always get a real median (at least 3 runs); torch's largest take a minute, so may run once
    least = min(3, args.repeat)
    timing = measure(lambda: pipec_compile(name, ranks, microbatches, chunks), args.repeat, args.budget, least)
    orders = measure(lambda: pipec_orders(name, ranks, microbatches, chunks), args.repeat, args.budget, least)
    cached = measure(lambda: pipec_compile_cached(name, ranks, microbatches, chunks), args.repeat, args.budget, least)

    def parse_cold() -> object:
        parse.cache_clear()
        return parse_schedule(name)

    parse_time = measure(parse_cold, args.repeat, args.budget, least)
    row = row._replace(ops=ops, pipec=timing, orders=orders, parse=parse_time, cached=cached)
    if args.no_torch:
        return row
    build, what = torch_builder(name, ranks, microbatches, chunks)
    try:
        build()  # warm-up, and the refusal check
    except Exception as e:  # torch raises ValueError, AssertionError, ... for sizes it does not support
        return row._replace(note=f"torch refuses: {type(e).__name__}: {_first_line(e)}")
    return row._replace(torch=measure(build, args.repeat, args.budget), torch_what=what)


def _first_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text[:90] + ("..." if len(text) > 90 else "")


HEADER = (
    "| schedule         |  P |    M | V |     ops |  pipec ms |  us/op | n | parse ms | orders ms |  torch ms | n "
    "| torch timed | pipec/torch | cached ms | cached/torch |"
)
RULE = (
    "|------------------|---:|-----:|--:|--------:|----------:|-------:|--:|---------:|----------:|----------:|--:"
    "|-------------|------------:|----------:|-------------:|"
)


def format_row(row: Row) -> str:
    head = f"| {row.schedule:<16} | {row.ranks:>2} | {row.microbatches:>4} | {row.chunks} |"
    if row.pipec is None or row.orders is None or row.parse is None or row.ops is None:
        return f"{head} {row.note}"
    us_per_op = 1e6 * row.pipec.median / row.ops
    text = (
        f"{head} {row.ops:>7} | {1e3 * row.pipec.median:>9.2f} | {us_per_op:>6.2f} | {row.pipec.runs} "
        f"| {1e3 * row.parse.median:>8.2f} | {1e3 * row.orders.median:>9.2f} |"
    )
    if row.torch is None:
        return f"{text} {'-':>9} | - | {'-':<11} | {'-':>11} | {row.note}".rstrip()
    ratio = row.pipec.median / row.torch.median
    cached = row.cached.median if row.cached is not None else float("nan")
    return (
        f"{text} {1e3 * row.torch.median:>9.2f} | {row.torch.runs} | {row.torch_what:<11} | {ratio:>11.3f} "
        f"| {1e3 * cached:>9.2f} | {cached / row.torch.median:>12.3f} |"
    )


def parse_size(text: str) -> tuple[int, int, int]:
    try:
        ranks, microbatches, chunks = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P,M,V such as 16,256,4, got {text!r}") from None
    if min(ranks, microbatches, chunks) < 1:
        raise argparse.ArgumentTypeError(f"P, M and V must be at least 1, got {text!r}")
    return ranks, microbatches, chunks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=list(SIZES), metavar="P,M,V")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES), metavar="NAME")
    parser.add_argument("--repeat", type=int, default=7, help="most runs per cell (default 7)")
    parser.add_argument(
        "--budget", type=float, default=5.0, help="seconds per cell after which no new run starts (default 5)"
    )
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="cpu",
        help="cpu: this process's CPU time (default; both sides are single-threaded, and on a shared machine wall "
        "time mostly measures the neighbours); wall: elapsed time",
    )
    parser.add_argument("--no-torch", action="store_true", help="time pipec only (no torch import)")
    return parser


def main(argv: list[str] | None = None) -> int:
    global clock
    args = build_parser().parse_args(argv)
    clock = CLOCKS[args.clock]
    if args.repeat < 1:
        print("--repeat must be at least 1", file=sys.stderr)
        return 2
    # one-time costs, kept out of the table: building pipec's Lark grammar, importing torch's pipelining
    start = time.perf_counter()
    pipec_compile("1f1b", 2, 2, 1)
    cold = time.perf_counter() - start
    notes = [f"pipec first compile in this process (grammar build + 1f1b P=2 M=2): {cold:.3f} s wall"]
    if not args.no_torch:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
        start = time.perf_counter()
        import torch_reference  # noqa: F401 - imports torch.distributed.pipelining and quiets its logger

        notes.append(f"import torch.distributed.pipelining: {time.perf_counter() - start:.3f} s wall")
        logging.getLogger("torch.distributed.pipelining").setLevel(logging.ERROR)
    # Move everything imported so far out of the collector's reach: otherwise every full collection during a
    # pipec run would also scan torch's ~300k import-time objects (a cost `pipec compile` never pays), and each
    # gc.collect() between runs would take ~0.1 s.
    gc.freeze()
    python = sys.version.split()[0]
    print(f"# pipec {pipec.__version__}, Python {python}; {args.clock} time, medians of n runs (gc on, imports frozen)")
    for note in notes:
        print(f"# {note}")
    print(HEADER)
    print(RULE)
    for size in args.sizes:
        for name in args.schedules:
            print(format_row(bench_one(name, size, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
