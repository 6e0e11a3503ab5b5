"""`pipec tune` benchmark: time to a result, and tune against the best library schedule.

    python bench/tune.py                           # (4,8), (8,24), (16,64); F=I=W=1, limit P, tune's 60 s budget
    python bench/tune.py --sizes 8,24 --cost F=1,I=2,W=1,comm=0.5 --limit-factor 0.75 --time-budget 60
    python bench/tune.py --grid                    # the issue's grid: worst case of tune / best library schedule

Default mode: for each (P, M) it runs `pipec tune -P P -M M --cost COST --memory-limit factor*P --format json`
as a subprocess (what a user waits for, start-up included) and prints the wall time, tune's makespan, the best
library candidate's makespan at the same limit, their ratio, the solver's lower bound, tune's gap to it and the
solver's time to the proof (when every V and placement was proved), and whether the search ran to its end (a
local optimum) or to the time budget.

--grid: P in 2..8, M in {P, 2P, 3P}, limit in {0.5, 1, 1.5, 2} x P, cost mixes F:I:W = 1:1:1, 1:2:1, 1:1:2 and a
last stage twice as slow (chunks 1,2,4), through pipec.tune.tune in-process with --grid-budget seconds each. It
prints each mix's worst ratio tune / best library (1.0: no gain; tune is never worse by construction), the cases
where no library schedule fits but tune found one, and the overall worst and best. Minutes on 2 cores.
Never used by the tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIXES = ("1:1:1", "1:2:1", "1:1:2", "last-slow")


def cost_map(mix: str, ranks: int) -> dict:
    if mix == "last-slow":
        per = [1.0] * (ranks - 1) + [2.0]
        return {"F": per, "I": per, "W": per}
    f, i, w = (float(x) for x in mix.split(":"))
    return {"F": f, "I": i, "W": w}


def timed(ranks: int, microbatches: int, cost: str, limit: float, budget: float, chunks: str) -> tuple[float, dict]:
    argv = [
        sys.executable,
        "-m",
        "pipec",
        "tune",
        "-P",
        str(ranks),
        "-M",
        str(microbatches),
        "--cost",
        cost,
        "--memory-limit",
        f"{limit:g}",
        "--time-budget",
        f"{budget:g}",
        "--chunks",
        chunks,
        "--format",
        "json",
    ]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pipec tune failed ({done.returncode}): {done.stderr.strip()}")
    return elapsed, json.loads(done.stdout)


def sizes_mode(args: argparse.Namespace) -> None:
    print(
        f"cost {args.cost}, limit {args.limit_factor:g} x P, chunks {args.chunks}, --time-budget {args.time_budget:g}"
    )
    print(
        f"{'P':>3} {'M':>4} {'seconds':>8} {'tune':>9} {'library':>9} {'ratio':>6} {'bound':>9} {'gap':>7} "
        f"{'proof s':>8}  best (library best)  complete"
    )
    for ranks, microbatches in args.sizes:
        limit = args.limit_factor * ranks
        elapsed, data = timed(ranks, microbatches, args.cost, limit, args.time_budget, args.chunks)
        lib = data["library_best"]
        lib_span = lib["makespan"] if lib else None
        ratio = f"{data['makespan'] / lib_span:.4f}" if lib_span else "-"
        shown = f"{data['name']} V={data['chunks']}" + (f" +{data['moves']} moves" if data["moves"] else "")
        lib_name = f"{lib['name']} V={lib['chunks']}" if lib else "none fits"
        bound, gap, proof = certificate_columns(data)
        print(
            f"{ranks:>3} {microbatches:>4} {elapsed:>8.1f} {data['makespan']:>9g} "
            f"{lib_span if lib_span is not None else '-':>9} {ratio:>6} {bound:>9} {gap:>7} {proof:>8}  "
            f"{shown} ({lib_name})  {data['complete']}"
        )


def certificate_columns(data: dict) -> tuple[str, str, str]:
    """The lower bound, the gap to it and the solver's time to the proof (the sum over the V and placements, when
    every one of them was proved; '-' otherwise), from tune's JSON."""
    bound = data.get("lower_bound")
    gap = data.get("gap")
    proofs = (data.get("bound") or {}).get("proofs") or []
    proved = proofs and all(p["solved"] for p in proofs)
    return (
        "-" if bound is None else f"{bound:g}",
        "-" if gap is None else f"{gap:.2%}",
        f"{sum(p['seconds'] for p in proofs):.1f}" if proved else "-",
    )


def grid_mode(args: argparse.Namespace) -> None:
    from pipec.sim.costs import parse_costs
    from pipec.tune import Setting, library_sources, tune

    stats: dict[str, list[tuple[float, str]]] = {mix: [] for mix in MIXES}
    best_gain = (1.0, "")
    only_tune, none_fit = [], 0
    start = time.perf_counter()
    for mix in MIXES:
        for ranks in range(2, 9):
            for factor in (1, 2, 3):
                microbatches = factor * ranks
                for scale in (0.5, 1.0, 1.5, 2.0):
                    limit = scale * ranks
                    setting = Setting(ranks, microbatches, parse_costs(cost_map(mix, ranks)), limit, args.chunks_t)
                    result = tune(setting, library_sources(), time_budget=args.grid_budget, seed=0)
                    case = f"P={ranks} M={microbatches} X={limit:g}"
                    lib = result.library_best
                    if result.best is None:
                        none_fit += 1
                        continue
                    if lib is None:
                        only_tune.append(f"{mix} {case}: tune {result.best.makespan:g} ({result.best.label()})")
                        continue
                    ratio = result.best.makespan / lib.makespan
                    if ratio > 1 + 1e-9:
                        print(f"WORSE: {mix} {case}: {ratio}")
                    stats[mix].append((ratio, case))
                    if ratio < best_gain[0]:
                        best_gain = (
                            ratio,
                            f"{mix} {case}: {result.best.makespan:g} ({result.best.label()}) vs "
                            f"{lib.makespan:g} ({lib.label()})",
                        )
    print(
        f"grid: {len(MIXES) * 7 * 3 * 4} cases, chunks {args.chunks}, {args.grid_budget:g} s budget each, "
        f"{time.perf_counter() - start:.0f} s"
    )
    print(f"  {'mix':<9} {'compared':>8} {'improved':>8} {'worst':>7} {'mean':>7} {'best':>7}  (tune / best library)")
    everything = []
    for mix, rows in stats.items():
        ratios = [r for r, _ in rows]
        everything += ratios
        if not ratios:
            continue
        improved = sum(r < 1 - 1e-9 for r in ratios)
        print(
            f"  {mix:<9} {len(ratios):>8} {improved:>8} {max(ratios):>7.4f} {sum(ratios) / len(ratios):>7.4f} "
            f"{min(ratios):>7.4f}"
        )
    if everything:
        print(f"  overall worst: {max(everything):.4f}; largest gain: {best_gain[0]:.4f} ({best_gain[1]})")
    print(f"  no library schedule fits, tune found one: {len(only_tune)}; nothing fits at all: {none_fit}")
    for line in only_tune[:10]:
        print(f"    {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["4,8", "8,24", "16,64"], metavar="P,M")
    parser.add_argument("--cost", default="F=1,I=1,W=1")
    parser.add_argument("--limit-factor", type=float, default=1.0, help="the memory limit as a multiple of P")
    parser.add_argument("--time-budget", type=float, default=60.0)
    parser.add_argument("--chunks", default="1,2,4")
    parser.add_argument("--grid", action="store_true", help="run the issue's grid instead")
    parser.add_argument("--grid-budget", type=float, default=1.0, help="seconds of search per grid case")
    args = parser.parse_args()
    args.sizes = [tuple(int(x) for x in s.split(",")) for s in args.sizes]
    args.chunks_t = tuple(int(x) for x in args.chunks.split(","))
    grid_mode(args) if args.grid else sizes_mode(args)


if __name__ == "__main__":
    main()
