"""`pipec run --report` measures the model's costs: per-stage F, I, W in the cost-file format, which `pipec
simulate --cost report.json` (and `pipec tune`) read as they are; the numbers follow the model (a last stage four
times as heavy measures clearly heavier); the trace's compute slices add up to the reported compute time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paths import SUPPORT
from torch import nn

from pipec.cli import main as cli_main
from pipec.runtime.workload import Workload

HIDDEN, ROWS, M, STEPS = 256, 64, 4, 8


def heavy_last() -> Workload:
    """Stage 0: two Linear(H, H); stage 1 (--partition 4,3): Linear(H, 4H) and Linear(4H, H), four times the
    multiply-adds, plus the loss. Micro-batches of 64 rows keep each op well above the interpreter's cost."""
    h = HIDDEN
    layers = nn.Sequential(
        nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 4 * h), nn.ReLU(), nn.Linear(4 * h, h)
    )  # fmt: skip
    batches = [(torch.randn(ROWS * M, h), torch.randn(ROWS * M, h)) for _ in range(2)]
    return Workload(layers, nn.functional.mse_loss, batches)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One run of zb_h1 (split backward: F, I and W measured) on 2 gloo ranks, with a report and a trace."""
    where = tmp_path_factory.mktemp("costs")
    here = str(Path(__file__).resolve().parent)  # the workload is this module's
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    command = [
        sys.executable, "-m", "pipec", "run", "zb_h1", "-P", "2", "-M", str(M), "--model",
        "test_runtime_costs:heavy_last", "--partition", "4,3", "--steps", str(STEPS), "--backend", "gloo",
        "--report", "run.json", "--trace", "trace.json",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return where, json.loads((where / "run.json").read_text())


def test_the_report_is_a_cost_file_for_simulate(measured: tuple[Path, dict]) -> None:
    where, report = measured
    costs = report["costs"]
    assert report["format"] == "pipec-run-report"
    assert set(costs) == {"F", "I", "W"} and all(len(costs[k]) == 2 for k in costs)
    assert all(v > 0 for k in costs for v in costs[k])
    path = str(where / "run.json")
    assert cli_main(["simulate", "zb_h1", "-P", "2", "-M", "4", "--cost", path]) == 0
    assert cli_main(["simulate", "1f1b", "-P", "2", "-M", "8", "--cost", path]) == 0
    # V=2 in the units that compare across V: the report's lists describe P segments of the model
    assert cli_main(["simulate", "zbv", "-P", "2", "-M", "4", "--cost", path, "--per-rank-share"]) == 0


def test_tune_takes_the_report_as_it_is(measured: tuple[Path, dict], capsys: pytest.CaptureFixture) -> None:
    where, _ = measured
    args = ["-P", "2", "-M", "4", "--cost", str(where / "run.json"), "--memory-limit", "2", "--time-budget", "5"]
    assert cli_main(["tune", *args, "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["makespan"] > 0 and result["candidates"]


def test_the_measured_costs_follow_the_model(measured: tuple[Path, dict]) -> None:
    """Stage 1 does four times stage 0's multiply-adds: ratios, not times, with room for a noisy machine."""
    _, report = measured
    f, i, w = (report["costs"][k] for k in "FIW")
    assert f[1] > 1.5 * f[0], f
    assert i[1] + w[1] > 1.5 * (i[0] + w[0]), (i, w)
    # each rank's medians are its stages' (one stage per rank here), the same numbers as the costs
    assert report["ranks"][1]["stage_ms"]["1"]["F"] == pytest.approx(f[1], abs=1e-6)
    assert {r["timing"] for r in report["ranks"]} == {"host clock"}


def test_the_trace_adds_up_to_the_reported_compute(measured: tuple[Path, dict]) -> None:
    where, report = measured
    events = json.loads((where / "trace.json").read_text())["traceEvents"]
    for row in report["ranks"]:
        slices = [e for e in events if e["ph"] == "X" and e["tid"] == row["rank"] and e["cat"] in "FBIW"]
        assert len(slices) == STEPS * M * 3  # F, I and W of each micro-batch of its stage, every step
        traced_s = sum(e["dur"] for e in slices) / 1e6  # the trace is in microseconds
        assert traced_s == pytest.approx(row["compute_s"], rel=1e-3)  # the optimizer step is not in compute_s
        assert 0 < row["optimizer_s"] < row["compute_s"]


def test_a_report_without_costs_is_refused_as_a_cost_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"format": "pipec-run-report", "schedule": "1f1b", "step_times": []}))
    assert cli_main(["simulate", "1f1b", "-P", "2", "-M", "4", "--cost", str(path)]) == 2
    assert "holds no measured costs" in capsys.readouterr().err


def test_stages_merge_into_segments_and_b_splits_in_halves() -> None:
    """The cost file describes P segments: at V=2, segment k sums stages 2k and 2k+1 (along the model, whatever
    ranks run them); a B-only schedule gives I = W = B / 2; replicas' medians are pooled."""
    import pipec
    from pipec.runtime.costs import measured_costs

    zbv = pipec.compile("zbv", 2, 4, 2)  # stages 0 and 3 on rank 0, 1 and 2 on rank 1
    rows = [
        {"stage_ms": {"0": {"F": 1.0, "I": 2.0, "W": 3.0}, "3": {"F": 40.0, "I": 50.0, "W": 60.0}}},
        {"stage_ms": {"1": {"F": 10.0, "I": 20.0, "W": 30.0}, "2": {"F": 4.0, "I": 5.0, "W": 6.0}}},
    ]
    assert measured_costs(zbv, rows) == {"F": [11.0, 44.0], "I": [22.0, 55.0], "W": [33.0, 66.0]}
    one = pipec.compile("1f1b", 2, 4)
    replicas = [
        {"stage_ms": {"0": {"F": 1.0, "B": 4.0}}},
        {"stage_ms": {"1": {"F": 2.0, "B": 6.0}}},
        {"stage_ms": {"0": {"F": 3.0, "B": 8.0}}},
        {"stage_ms": {"1": {"F": 2.0, "B": 6.0}}},
    ]
    assert measured_costs(one, replicas) == {"F": [2.0, 2.0], "I": [3.0, 3.0], "W": [3.0, 3.0]}
    assert measured_costs(one, replicas[:1]) is None  # a stage nobody measured (no step ran): no costs


def test_a_step_is_summed_per_stage_and_kind() -> None:
    from pipec.ir import Action, Kind
    from pipec.runtime.costs import per_op

    timed = [(Action(0, Kind.F, 0), 0.0, 1.0), (Action(0, Kind.F, 1), 2.0, 3.0), (Action(1, Kind.W, 0), 5.0, 0.5)]
    assert per_op(timed) == (4.5, {(0, "F"): 2.0, (1, "W"): 0.5})
