"""tune and replicated pipelines (dualpipe, chimera): their costs and memory per rank share take a stage as C/V
of a share (pipec.sim.costs.per_rank_share), so they compete with the one-copy schedules at the model's costs;
the copies' SYNCs are placed and charged (`sync`) in every candidate, moved ones included; a replicated winner's
file is a .pipe (`pipelines`, `route`, literal compute orders; the compiler re-inserts the SYNCs) that `pipec
check` and `pipec simulate` re-read to the same figures."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from cli_capture import run_main

import pipec
from pipec.ir import Kind
from pipec.sim.costs import parse_costs
from pipec.tune import Setting, schedule_text, tune
from pipec.tune.output import candidates_json, certificate_text
from pipec.tune.search import evaluate
from pipec.tune.space import draws, library_sources

COST = "F=1,B=2,W=1,comm=0.25,sync=1.5"


def simulated(*args: str) -> float:
    code, out, err = run_main(["simulate", *args, "--format", "json"])
    assert code == 0, err
    return json.loads(out)["makespan"]


def syncs(program: pipec.Program) -> int:
    return sum(1 for stream in program.streams for i in stream if getattr(i, "kind", None) is Kind.SYNC)


def test_replicated_library_schedules_are_drawn_at_the_v_they_accept() -> None:
    sources = [source for source in library_sources() if source[0] in ("dualpipe", "chimera", "dualpipev")]
    found = {(draw.name, draw.chunks) for draw in draws(sources, 4, 8, (1, 2, 4), 6.0, seed=0) if not draw.problem}
    assert {("dualpipe", 2), ("chimera", 2), ("chimera", 4), ("dualpipev", 2)} <= found


def test_a_moved_order_of_copies_is_placed_with_its_syncs() -> None:
    # a placed program carries the copies' sync groups; tune's orders taken from it must drop them with the
    # SYNCs, or placing the changed order would keep the groups and place no SYNC (none charged, and verified)
    setting = Setting(4, 8, parse_costs(COST), 6.0, (2,))
    placed = pipec.compile("dualpipe", 4, 8, 2, costs=setting.stage_costs(2, 2))
    assert syncs(placed) == 8  # 4 logical stages, a SYNC on each of their 2 ranks
    judged = evaluate("dualpipe", (), placed, setting)
    assert judged.ok and judged.program is not None and syncs(judged.program) == 8
    assert judged.makespan == simulated("dualpipe", "-P", "4", "-M", "8", "--per-rank-share", "--cost", COST)


@pytest.mark.parametrize(("name", "chunks"), [("dualpipe", 2), ("chimera", 2), ("chimera", 4)])
def test_a_replicated_winner_is_a_pipe_that_checks_and_simulates_as_found(
    tmp_path: Path, name: str, chunks: int
) -> None:
    setting = Setting(4, 8, parse_costs(COST), 6.0, (chunks,))
    result = tune(setting, [(name, name)], time_budget=1.5, seed=0)
    library = simulated(name, "-P", "4", "-M", "8", "-V", str(chunks), "--per-rank-share", "--cost", COST)
    assert result.library_best is not None and result.library_best.makespan == library  # the fair figure
    assert result.best is not None and result.best.makespan is not None and result.best.makespan <= library
    # written as the winner, whether or not a one-copy order beat it here (chimera V=2 is beaten)
    best = min((c for c in result.candidates if c.ok and c.name == name), key=lambda c: c.key())
    result = replace(result, best=best)
    out = tmp_path / "best.pipe"
    text = schedule_text(result, COST, str(out))
    out.write_text(text)
    assert "\npipelines " in text and "\nsync " not in text and "SYNC" not in text
    check = next(line for line in text.splitlines() if line.startswith("# check: "))
    code, report, err = run_main(shlex.split(check.removeprefix("# check: "))[1:])
    assert code == 0, report + err
    assert simulated(str(out), "--per-rank-share", "--cost", COST) == pytest.approx(best.makespan)


@pytest.mark.parametrize("cost", ["F=1,B=2,W=1", "F=1,B=2,W=1,comm=0.5"])
def test_the_one_copy_bound_is_not_claimed_for_copies(cost: str) -> None:
    setting = Setting(4, 8, parse_costs(cost), 6.0, (4,))
    result = tune(setting, [("chimera", "chimera")], time_budget=3.0, seed=0)
    assert result.best is not None and result.best.name == "chimera"  # 24: no bubble, four copies
    text = certificate_text(result)
    assert "proved optimal" not in text and "optimal under nccl" not in text  # the relaxation's line says neither
    data = candidates_json(result, None)
    assert data["optimal"] is False and data["gap"] is None
    if result.certificate is not None and not result.certificate.skipped and result.certificate.bound is not None:
        assert "for one copy of the model" in text and "runs 4 copies" in text


TWO_WAYS = """schedule two_ways "two copies, one down and one up, a memory limit it declares"
params P, M, V = 2, limit = 2 in 1 .. 8
pipelines 2
placement v
route m -> m % C
memory limit
per rank r:
    repeat M // C: F[0] F[1]
    repeat M // C: B[1] B[0]
"""


@pytest.mark.parametrize(("copies", "tried"), [(2, {1, 2}), (1, {1, 2, 3, 4})])
def test_a_limit_parameter_is_fitted_at_x_times_v_over_c(tmp_path: Path, copies: int, tried: set[int]) -> None:
    path = tmp_path / "two_ways.pipe"
    path.write_text(TWO_WAYS.replace("pipelines 2", f"pipelines {copies}"))
    found = draws([("two_ways", str(path))], 4, 8, (2,), 2.0, seed=0)
    # X = 2 shares: a stage of 2 copies at V = 2 is a whole share (limit <= 2), of one copy half of one (<= 4)
    assert {dict(draw.params)["limit"] for draw in found} == tried
