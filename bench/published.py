"""`pipec tune` beside the published figures: the Zero Bubble paper's ZB-1p/ZB-2p, V-Half and V-Min (issue 9).

    python bench/published.py                        # the default rows: about 2.5 minutes on 2 cores
    python bench/published.py --rows all             # every row of Table 5; P=32 takes minutes per tune call
    python bench/published.py --rows 1.5B:24 6.2B:64 --time-budget 20

For each published setting it runs `pipec tune` in-process (pipec.tune.tune, what the command runs, with
--chunks 1 for the one-chunk ZB rows and 1,2 for the V rows and --time-budget seconds per call) under the
published costs and memory, and prints the published schedule's bubble beside tune's winner and the best library
schedule at the same limit (tune's phase 1).

Sources (every number below is copied from them, none from memory):
- Zero Bubble Pipeline Parallelism, Qi et al., arXiv 2401.10241v1: Table 9 (Appendix D, "Profiled time of T_F,
  T_B, T_W and T_comm", measured in the ZB-2p runs: Table 6 of the ICLR version) gives the costs; Table 5 (section
  5.3, "Bubble rates of 1F1B, 1F1B-I, ZB-H1, ZB-H2, ZB-1p, ZB-2p") the bubbles. ZB-1p and ZB-2p are the paper's
  automatic schedules with the activation memory limited to p M_B and 2p M_B (section 5.1): limits P and 2P here.
  The paper's T_B is the input gradient, pipec's I.
- The issue (filed in this project, measured with the ZB repository's heuristic, not a paper figure): at P=8,
  M=24, F=I=W=1 and memory P the heuristic reaches 79 (bubble 0.0886); the reference code's squeezed V-Half at
  P=4, M=8, F=I=W=1 reaches 53 chunk units with a peak of 6 chunk units.
- Pipeline Parallelism with Controllable Memory, Qi et al., arXiv 2405.15362: no per-setting table of V-Half or
  V-Min was found; the ZB repository's README (sail-sg/zero-bubble-pipeline-parallelism) gives them in closed
  form at T_F = T_B = T_W: bubble B/2 (V-Half) and 2B/3 plus an O(n) overhead (V-Min), B = (p-1)/(m+p-1) being
  1F1B's, with 1/2 and 1/3 of 1F1B's activation memory; the controllable-memory scheduler playground (Hugging
  Face space sail/pipeline-parallelism-with-controllable-memory) gives the memory as (p+2)//2 and (p+4)//3
  micro-batches. Those formulas are the "published" V figures below, marked "formula".

Two tables. "In the paper's definition": the paper's bubble rate (section 5.3), (cost - m(T_F+T_B+T_W)) / cost,
cost being the longest per-stage execution time (a rank's first compute to its last: its post-validation lets
steps overlap), in the paper's model, which calculates rather than runs ("based on theoretical calculations
instead of real experiments"), every message taking T_comm beside compute: pipec's `ideal` p2p model with
overlap=1. The calibration block checks that both sides then agree: the library's 1F1B, ZB-H1 and ZB-H2 against
the same table. tune/pub compares tune's winner, best/pub the best of all the candidates tune verified (any
phase) on those terms. "As tune ranks them": what tune optimizes and reports, the step's makespan under `nccl`
(send/recv placed and run in order on one stream, the runtime's rule), beside the best library schedule at the
same limit (tune's phase 1). The two rankings differ: a schedule whose last rank starts late can have a short
longest span and a long makespan. Never used by the tests.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from pipec.sim.costs import Costs, parse_costs
from pipec.sim.simulate import simulate
from pipec.tune import Candidate, Setting, TuneResult, library_sources, tune


@dataclass(frozen=True)
class ZbRow:
    """One row of the Zero Bubble paper's Table 9 (costs) and Table 5 (bubble rates)."""

    model: str
    ranks: int
    microbatches: int
    f: float
    b: float  # T_B: the input gradient (pipec's I)
    w: float
    comm: float
    published: dict[str, float]  # schedule -> bubble rate (Table 5)

    @property
    def key(self) -> str:
        return f"{self.model}:{self.microbatches}"

    @property
    def input_fraction(self) -> float:
        """The share of a stage's activations freed by B (pipec's I) in the paper's memory model: B needs
        sb(34h + 5as), W keeps 32sbh (Table 1), with h and a of Table 3 and s = 1024."""
        hidden, heads = TABLE3[self.model]
        return 1 - 32 * hidden / (34 * hidden + 5 * heads * 1024)


# hidden size and attention heads of Table 3 (sequence length 1024 for all)
TABLE3 = {"1.5B": (2304, 24), "6.2B": (4096, 32), "14.6B": (5120, 40), "28.3B": (6144, 48)}
_TABLE5_COLUMNS = ("1F1B", "1F1B-I", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p")


def _row(model: str, p: int, m: int, costs: tuple[float, ...], bubbles: tuple[float, ...]) -> ZbRow:
    return ZbRow(model, p, m, *costs, dict(zip(_TABLE5_COLUMNS, bubbles, strict=True)))


# (T_F, T_B, T_W, T_comm) from Table 9; the bubbles from Table 5, in the order of _TABLE5_COLUMNS.
ZB_ROWS = (
    _row("1.5B", 8, 24, (18.522, 18.086, 9.337, 0.601), (0.2431, 0.1055, 0.1585, 0.1083, 0.1585, 0.0433)),
    _row("1.5B", 8, 32, (18.513, 18.086, 9.331, 0.626), (0.1985, 0.0818, 0.1242, 0.0837, 0.1242, 0.0039)),
    _row("1.5B", 8, 64, (18.546, 18.097, 9.321, 0.762), (0.1240, 0.0443, 0.0674, 0.0444, 0.0674, 0.0026)),
    _row("6.2B", 8, 24, (29.718, 29.444, 19.927, 0.527), (0.2347, 0.0808, 0.1323, 0.0698, 0.1323, 0.0029)),
    _row("6.2B", 8, 32, (29.802, 29.428, 19.530, 0.577), (0.1898, 0.0628, 0.1045, 0.0559, 0.1045, 0.0022)),
    _row("6.2B", 8, 64, (29.935, 29.621, 19.388, 0.535), (0.1091, 0.0320, 0.0554, 0.0294, 0.0554, 0.0010)),
    _row("14.6B", 16, 48, (11.347, 11.248, 8.132, 0.377), (0.2552, 0.1104, 0.1397, 0.0672, 0.1397, 0.0066)),
    _row("14.6B", 16, 64, (11.307, 11.254, 8.101, 0.379), (0.2082, 0.0852, 0.1088, 0.0516, 0.1088, 0.0054)),
    _row("14.6B", 16, 128, (11.325, 11.308, 8.109, 0.378), (0.1251, 0.0445, 0.0576, 0.0266, 0.0576, 0.0028)),
    _row("28.3B", 32, 96, (10.419, 10.207, 7.715, 0.408), (0.2646, 0.1493, 0.1421, 0.0641, 0.1421, 0.0038)),
    _row("28.3B", 32, 128, (10.408, 10.204, 7.703, 0.408), (0.2168, 0.1164, 0.1106, 0.0490, 0.1106, 0.0029)),
    _row("28.3B", 32, 256, (10.402, 10.248, 7.698, 0.460), (0.1352, 0.0624, 0.0594, 0.0257, 0.0594, 0.0018)),
)
# P=32 takes minutes per tune call (the library alone: about 4 minutes at M=96 on 2 cores), so it is opt-in.
DEFAULT_ROWS = ("1.5B:24", "1.5B:32", "1.5B:64", "6.2B:24", "6.2B:32", "6.2B:64", "14.6B:48")
# the library's handcrafted schedules that Table 5 also gives: they calibrate the definitions
CALIBRATION = (("1f1b", "1F1B"), ("zb_h1", "ZB-H1"), ("zb_h2", "ZB-H2"))


@dataclass(frozen=True)
class Timing:
    """One compute order timed under one p2p model."""

    makespan: float
    cost: float  # the paper's cost: the longest per-rank span of compute
    work: float  # the largest per-rank compute: m (T_F + T_B + T_W) for uniform stages

    @property
    def bubble(self) -> float:
        """The paper's bubble rate (section 5.3)."""
        return 1 - self.work / self.cost

    @property
    def makespan_bubble(self) -> float:
        """The same with the step's makespan in place of the longest span (pipec's bubble_fraction when stages
        are uniform)."""
        return 1 - self.work / self.makespan


def timing(candidate: Candidate, setting: Setting, p2p: str) -> Timing:
    assert candidate.program is not None
    sim = simulate(candidate.program, setting.stage_costs(candidate.chunks), record=True, p2p=p2p)
    spans = []
    for ops in sim.timeline:
        compute = [op for op in ops if not op.is_comm]
        spans.append(max(op.end for op in compute) - min(op.start for op in compute))
    return Timing(sim.makespan, max(spans), max(sim.busy))


def run_tune(
    ranks: int, microbatches: int, costs: Costs, limit: float, chunks: tuple[int, ...], args: argparse.Namespace
) -> TuneResult:
    setting = Setting(ranks, microbatches, costs, limit, chunks)
    return tune(setting, library_sources(), time_budget=args.time_budget, seed=args.seed)


def library(result: TuneResult, name: str, params: dict[str, int] | None = None) -> Candidate | None:
    """The phase-1 candidate of one library schedule (any verdict, as long as it was timed)."""
    for c in result.candidates:
        if c.name == name and c.phase == 1 and c.moves == 0 and c.program is not None:
            if params is None or dict(c.params) == params:
                return c
    return None


# ---- one tune call beside one published figure ------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    setting: str
    memory: str
    published: str
    pub_bubble: float  # in the paper's definition
    result: TuneResult

    def best_by_paper(self) -> tuple[Candidate, Timing] | None:
        """The verified candidate (any phase) with the least bubble in the paper's definition: what pipec found and
        verified that competes on the paper's terms, though tune ranks by the step's makespan."""
        timed = [(c, timing(c, self.result.setting, "ideal")) for c in self.result.candidates if c.ok]
        return min(timed, key=lambda ct: (ct[1].cost, ct[0].key()), default=None)


def _label(c: Candidate | None) -> str:
    if c is None:
        return "none fits"
    params = ",".join(f"{k}={v}" for k, v in c.params)
    text = c.name + (f"({params})" if params else "") + (f" V={c.chunks}" if c.chunks > 1 else "")
    return text + (f" +{c.moves}" if c.moves else "")


def _ratio(published: float, mine: float) -> str:
    # equal work on both sides, so the ratio of the costs is (1 - published bubble) / (1 - our bubble)
    return f"{(1 - published) / (1 - mine):.4f}"


def tune_table(outcomes: list[Outcome]) -> list[str]:
    lines = [
        "as tune ranks them: nccl p2p model, bubble = 1 - work / the step's makespan",
        f"{'setting':<22} {'memory':<7} {'tune':<24} {'makespan':>9} {'bubble':>6}   {'best library':<20} "
        f"{'makespan':>9} {'bubble':>6}  {'tune/lib':>8}",
    ]
    for o in outcomes:
        best, lib = o.result.best, o.result.library_best
        if best is None:
            lines.append(f"{o.setting:<22} {o.memory:<7} nothing fits")
            continue
        mine = timing(best, o.result.setting, "nccl")
        if lib is None:
            lib_cols = f"{'none fits':<20} {'-':>9} {'-':>6}  {'-':>8}"
        else:
            theirs = timing(lib, o.result.setting, "nccl")
            ratio = f"{mine.makespan / theirs.makespan:.4f}"
            lib_cols = f"{_label(lib):<20} {theirs.makespan:>9.6g} {theirs.makespan_bubble:>6.4f}  {ratio:>8}"
        lines.append(
            f"{o.setting:<22} {o.memory:<7} {_label(best):<24} {mine.makespan:>9.6g} {mine.makespan_bubble:>6.4f}   "
            f"{lib_cols}"
        )
    return lines


def paper_table(outcomes: list[Outcome]) -> list[str]:
    lines = [
        "in the paper's definition: ideal p2p model, bubble = 1 - work / the longest per-stage span",
        f"{'setting':<22} {'memory':<7} {'published':<16} {'bubble':>6} | {'tune':>6} {'library':>7} | "
        f"{'best verified candidate':<24} {'bubble':>6} | {'tune/pub':>8} {'best/pub':>8}",
    ]
    for o in outcomes:
        best, lib = o.result.best, o.result.library_best
        head = f"{o.setting:<22} {o.memory:<7} {o.published:<16} {o.pub_bubble:>6.4f} |"
        found = o.best_by_paper()
        if best is None or found is None:
            lines.append(f"{head} nothing fits")
            continue
        mine = timing(best, o.result.setting, "ideal").bubble
        theirs = f"{timing(lib, o.result.setting, 'ideal').bubble:.4f}" if lib is not None else "-"
        top, top_timing = found
        lines.append(
            f"{head} {mine:>6.4f} {theirs:>7} | {_label(top):<24} {top_timing.bubble:>6.4f} | "
            f"{_ratio(o.pub_bubble, mine):>8} {_ratio(o.pub_bubble, top_timing.bubble):>8}"
        )
    return lines


def say(text: str = "") -> None:
    print(text, flush=True)


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- the settings -----------------------------------------------------------------------------------------------


def zb_outcomes(rows: list[ZbRow], args: argparse.Namespace) -> list[Outcome]:
    outcomes = []
    for row in rows:
        fraction = f",input_fraction={row.input_fraction:.4f}" if args.paper_memory else ""
        costs = parse_costs(f"F={row.f},I={row.b},W={row.w},comm={row.comm},overlap=1{fraction}")
        for factor, name in ((1, "ZB-1p"), (2, "ZB-2p")):
            started = time.monotonic()
            result = run_tune(row.ranks, row.microbatches, costs, factor * row.ranks, (1,), args)
            progress(f"  {row.key} {name}: {time.monotonic() - started:.0f} s")
            setting = f"{row.model} P={row.ranks} M={row.microbatches}"
            outcomes.append(Outcome(setting, f"{factor}p={factor * row.ranks}", name, row.published[name], result))
    return outcomes


def heuristic_outcome(args: argparse.Namespace) -> Outcome:
    """The issue's measurement of the ZB repository's heuristic: 79 at P=8, M=24, F=I=W=1, memory P."""
    result = run_tune(8, 24, parse_costs("F=1,I=1,W=1"), 8, (1,), args)
    progress("  ZB heuristic line: done")
    return Outcome("P=8 M=24 F=I=W=1", "1p=8", "ZB heuristic=79", 1 - 72 / 79, result)


def v_outcomes(args: argparse.Namespace) -> list[Outcome]:
    # P=4, M=8 in chunk units: F=I=W=2 per rank share is 1 per chunk at V=2, as the issue measured (53, peak 6 chunk
    # units = 3 per-rank-share units). The other published figures are the closed forms at T_F = T_B = T_W:
    # V-Half B/2, V-Min 2B/3 (plus an O(n) overhead, so a lower bound), B = 1F1B's (p-1)/(m+p-1).
    cases = (
        (4, 8, 2.0, "V-Half=53 issue", 3),
        (4, 8, 2.0, "V-Min formula", 2),
        (8, 24, 1.0, "V-Half formula", 5),
        (8, 24, 1.0, "V-Min formula", 4),
    )
    outcomes = []
    for ranks, microbatches, unit, name, limit in cases:
        one_f_one_b = (ranks - 1) / (microbatches + ranks - 1)
        if name.endswith("issue"):
            published = 1 - 6 * microbatches / 53  # 48 units of work per rank in 53
        else:
            published = one_f_one_b / 2 if name.startswith("V-Half") else 2 * one_f_one_b / 3
        started = time.monotonic()
        costs = parse_costs(f"F={unit:g},I={unit:g},W={unit:g}")
        result = run_tune(ranks, microbatches, costs, limit, (1, 2), args)
        progress(f"  P={ranks} M={microbatches} {name}: {time.monotonic() - started:.0f} s")
        outcomes.append(Outcome(f"P={ranks} M={microbatches} F=I=W={unit:g}", f"{limit}", name, published, result))
    return outcomes


def calibration(outcomes: list[Outcome], rows: list[ZbRow]) -> list[str]:
    lines = [
        "calibration: the library's handcrafted schedules in the paper's definition, Table 5 / pipec",
        f"{'setting':<22} " + " ".join(f"{shown:>17}" for _, shown in CALIBRATION),
    ]
    for row, o in zip(rows, outcomes[::2], strict=True):  # the 1p call of each row holds every library candidate
        cells = []
        for name, shown in CALIBRATION:
            c = library(o.result, name)
            ours = f"{timing(c, o.result.setting, 'ideal').bubble:.4f}" if c is not None else "-"
            cells.append(f"{row.published[shown]:.4f} / {ours:>6}".rjust(17))
        lines.append(f"{o.setting:<22} " + " ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        nargs="+",
        default=list(DEFAULT_ROWS),
        metavar="MODEL:M",
        help=f"Table 5 rows to run, or 'all' (default: {' '.join(DEFAULT_ROWS)})",
    )
    parser.add_argument("--time-budget", type=float, default=8.0, help="seconds per tune call (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--paper-memory",
        action="store_true",
        help="free the paper's share of the activations at I (1 - 32h/(34h+5as), Tables 1 and 3) instead of "
        "pipec's default input_fraction 0.5",
    )
    parser.add_argument("--no-extra", action="store_true", help="only the Table 5 rows (no heuristic, V rows)")
    args = parser.parse_args()
    known = {row.key: row for row in ZB_ROWS}
    wanted = list(known) if args.rows == ["all"] else args.rows
    unknown = [key for key in wanted if key not in known]
    if unknown:
        parser.error(f"unknown row {unknown[0]!r}; rows are {', '.join(known)} or 'all'")
    started = time.monotonic()
    rows = [known[key] for key in wanted]
    zb = zb_outcomes(rows, args)
    extra = [] if args.no_extra else [heuristic_outcome(args), *v_outcomes(args)]
    memory = "the paper's (--paper-memory)" if args.paper_memory else "pipec's (input_fraction 0.5)"
    say(
        f"Zero Bubble paper (arXiv 2401.10241v1): Table 9 costs, Table 5 bubbles; V=1, overlap=1, memory model {memory}"
    )
    if extra:
        say("then the issue's line for the ZB repository's heuristic, and V-Half/V-Min (--chunks 1,2)")
    say()
    for text in paper_table(zb + extra):
        say(text)
    say()
    for text in tune_table(zb + extra):
        say(text)
    say()
    for text in calibration(zb, rows):
        say(text)
    say()
    say(
        "tune/pub: tune's cost over the published one (< 1: faster); best/pub: the same for the best verified "
        f"candidate; tune/lib: makespans. --time-budget {args.time_budget:g} s per tune call, "
        f"{time.monotonic() - started:.0f} s in all"
    )


if __name__ == "__main__":
    main()
