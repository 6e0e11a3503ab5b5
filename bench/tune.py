"""`pipec tune` benchmark: time to a result, and tune against the best library schedule.

    python bench/tune.py                           # (4,8), (8,24), (16,64); F=I=W=1, limit P, tune's default budget
    python bench/tune.py --sizes 8,24 --cost F=1,I=2,W=1,comm=0.5 --limit-factor 0.75 --time-budget 60
    python bench/tune.py --grid                    # the issue's grid: worst case of tune / best library schedule
    python bench/tune.py --gap-grid --gap-ranks 4  # tune's gap to the proven optimum, without and with CP-SAT
    python bench/tune.py --gap-grid --gap-ranks 4 --gap-factors 1 2 --gap-scales 0.5 1 --gap-chunks 2  # V=2

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

from pipec.tune.clock import DEFAULT_BUDGET

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


def gap_grid_mode(args: argparse.Namespace) -> None:
    """tune's gap to the solver's proven optimum, today's tune (no solver: the branch and bound at small sizes)
    against tune with the CP-SAT phase, on the issue's V=1 grid (P in --gap-ranks, M in {P, 2P, 3P}, X in {0.5,
    1, 1.5, 2}·P, the mixes F:I:W = 1:1:1, 1:2:1, 1:1:2, 2:1:1 and a last stage twice as slow, comm=--comm;
    --gap-factors, --gap-scales and --gap-chunks take a part of it or other V, e.g. V=2 at P=4, M in {4, 8}, X in
    {2, 4}).
    With comm > 0 a third run, `unplaced`, keeps the solver but places send/recv by place_p2p only (tune before
    pipec.tune.placement); `tune s` is the wall time of the three runs (and their CPU time, the solver's threads
    included: on a shared machine the one to compare); `check` the exit code of `pipec check` on the winner's file
    (0: it verifies from its file)."""
    from pipec.sim.costs import parse_costs
    from pipec.tune import Setting, cpsat, library_sources, search, tune

    mixes = args.gap_mixes or (*MIXES, "2:1:1")
    chunks = ",".join(map(str, args.gap_chunks))
    print(f"gap grid: V={chunks}, comm={args.comm:g}, --grid-budget {args.grid_budget:g} s per tune call")
    print(
        f"{'case':<34} {'before':>8} {'unplaced':>9} {'after':>8} {'bound':>8} {'gap before':>10} {'gap after':>9} "
        f"{'proof s':>7}  tune s"
    )
    worst_after = 0.0
    worst_before: float | None = None  # None: that run was left out (--gap-skip-before, or comm = 0 for unplaced)
    worst_unplaced: float | None = None
    placed = search._placed
    available = cpsat.available
    for ranks in args.gap_ranks:
        for factor in args.gap_factors:
            for scale in args.gap_scales:
                for mix in mixes:
                    microbatches, limit = factor * ranks, scale * ranks
                    began, began_cpu = time.monotonic(), time.process_time()
                    costs = parse_costs({**cost_map(mix, ranks), "comm": args.comm})
                    setting = Setting(ranks, microbatches, costs, limit, args.gap_chunks)
                    before = None
                    if not args.gap_skip_before:
                        cpsat.available = lambda: "off for the 'before' column"  # type: ignore[assignment]
                        try:
                            before = tune(setting, library_sources(), time_budget=args.grid_budget).best
                        finally:
                            cpsat.available = available  # type: ignore[assignment]
                    unplaced = None
                    if (
                        args.comm > 0 and not args.gap_skip_before
                    ):  # the solver with pipec's cost-timed placement only (tune before #23 round 2)
                        search._placed = lambda candidate, *_: (candidate, True)  # type: ignore[assignment]
                        try:
                            unplaced = tune(setting, library_sources(), time_budget=args.grid_budget).best
                        finally:
                            search._placed = placed  # type: ignore[assignment]
                    result = tune(setting, library_sources(), time_budget=args.grid_budget)
                    after, cert = result.best, result.certificate
                    if after is None or cert is None or cert.bound is None:
                        print(f"P={ranks} M={microbatches} X={limit:g} {mix}: nothing fits or no bound")
                        continue
                    checked = f" check {recheck(result, {**cost_map(mix, ranks), 'comm': args.comm})}"
                    bound = cert.bound
                    gap_a = after.makespan / bound - 1  # type: ignore[operator]
                    worst_after = max(worst_after, gap_a)
                    shown_before = shown_gap_b = middle = "-"
                    if before is not None:
                        gap_b = before.makespan / bound - 1  # type: ignore[operator]
                        worst_before = max(worst_before or 0.0, gap_b)
                        shown_before, shown_gap_b = f"{before.makespan:g}", f"{gap_b:.2%}"
                    if unplaced is not None:
                        worst_unplaced = max(worst_unplaced or 0.0, unplaced.makespan / bound - 1)  # type: ignore[operator]
                        middle = f"{unplaced.makespan:g}"
                    proof = f"{sum(p.seconds for p in cert.proofs):.1f}" if all(p.solved for p in cert.proofs) else "-"
                    print(
                        f"{f'P={ranks} M={microbatches} X={limit:g} {mix}':<34} {shown_before:>8} "
                        f"{middle:>9} {after.makespan:>8g} {bound:>8g} {shown_gap_b:>10} {gap_a:>9.2%} {proof:>7}  "
                        f"{time.monotonic() - began:.1f} (CPU {time.process_time() - began_cpu:.1f}){checked}",
                        flush=True,
                    )
    before_part = "" if worst_before is None else f"before {worst_before:.2%}, after "
    unplaced_part = "" if worst_unplaced is None else f" (solver with place_p2p only: {worst_unplaced:.2%})"
    print(f"worst gap to the bound: {before_part}{worst_after:.2%}{unplaced_part}")


def recheck(result, costs_map: dict) -> int:
    """`pipec check FILE --per-rank-share --cost COSTS.json --memory-limit X` on tune's winner written as tune
    writes it: its exit code (0: it verifies from its file)."""
    import tempfile

    from pipec.tune import schedule_text

    with tempfile.TemporaryDirectory() as scratch:
        cost_file, out = Path(scratch) / "costs.json", Path(scratch) / "best.pipe"
        cost_file.write_text(json.dumps(costs_map))
        out.write_text(schedule_text(result, str(cost_file), str(out)))
        argv = [sys.executable, "-m", "pipec", "check", str(out), "--per-rank-share", "--cost", str(cost_file)]
        argv += ["--memory-limit", repr(result.setting.limit)]
        return subprocess.run(argv, capture_output=True, cwd=ROOT, check=False).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["4,8", "8,24", "16,64"], metavar="P,M")
    parser.add_argument("--cost", default="F=1,I=1,W=1")
    parser.add_argument("--limit-factor", type=float, default=1.0, help="the memory limit as a multiple of P")
    parser.add_argument("--time-budget", type=float, default=DEFAULT_BUDGET, help="default: tune's own")
    parser.add_argument("--chunks", default="1,2,4")
    parser.add_argument("--grid", action="store_true", help="run the issue's grid instead")
    parser.add_argument(
        "--grid-budget",
        type=float,
        help="seconds of budget per grid case (default: 1 for --grid; tune's own default for --gap-grid, the budget "
        "the issue's certificate is asked within)",
    )
    parser.add_argument("--gap-grid", action="store_true", help="tune's gap to the solver's bound, before and after")
    parser.add_argument("--gap-ranks", type=int, nargs="+", default=[4, 8], metavar="P")
    parser.add_argument("--comm", type=float, default=0.0, help="--gap-grid: the message time")
    parser.add_argument("--gap-mixes", nargs="+", metavar="MIX", help="--gap-grid: these mixes only (1:2:1 ...)")
    parser.add_argument(
        "--gap-skip-before", action="store_true", help="--gap-grid: tune with the solver only (no 'before' runs)"
    )
    parser.add_argument(
        "--gap-factors", type=int, nargs="+", default=[1, 2, 3], metavar="K", help="--gap-grid: M = K·P only"
    )
    parser.add_argument(
        "--gap-scales",
        type=float,
        nargs="+",
        default=[0.5, 1.0, 1.5, 2.0],
        metavar="K",
        help="--gap-grid: memory limits K·P only",
    )
    parser.add_argument(
        "--gap-chunks", type=int, nargs="+", default=[1], metavar="V", help="--gap-grid: tune's --chunks (default 1)"
    )
    args = parser.parse_args()
    args.sizes = [tuple(int(x) for x in s.split(",")) for s in args.sizes]
    args.chunks_t = tuple(int(x) for x in args.chunks.split(","))
    if args.grid_budget is None:
        args.grid_budget = DEFAULT_BUDGET if args.gap_grid else 1.0
    if args.gap_grid:
        gap_grid_mode(args)
    else:
        grid_mode(args) if args.grid else sizes_mode(args)


if __name__ == "__main__":
    main()
