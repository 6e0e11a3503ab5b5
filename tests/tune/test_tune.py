"""`pipec tune`: its JSON and table, the file it writes (re-checked by `pipec check` and `pipec simulate` as a user
would run them), the limit parameter of a --from file, exit codes for bad input and for a limit nothing fits."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from cli_capture import run_main
from paths import ROOT

COST = "F=1,I=1,W=1"


def tune_json(tmp_path: Path, *extra: str, limit: str = "4", cost: str = COST) -> tuple[dict, Path]:
    out = tmp_path / "best.pipe"
    code, stdout, err = run_main(
        [
            "tune",
            "-P",
            "4",
            "-M",
            "8",
            "--cost",
            cost,
            "--memory-limit",
            limit,
            "--chunks",
            "1,2",
            "--time-budget",
            "2",
            "--format",
            "json",
            "-o",
            str(out),
            *extra,
        ],
        tmp_path,
    )
    assert code == 0, err
    return json.loads(stdout), out


def test_json_fields_and_the_written_file_checks_as_found(tmp_path: Path) -> None:
    data, out = tune_json(tmp_path)
    for key in ("makespan", "bubble_fraction", "peak_memory", "schedule", "chunks", "candidates", "complete"):
        assert key in data
    assert data["units"] == "per-rank-share" and data["memory_limit"] == 4
    for c in data["candidates"]:
        assert {"name", "params", "makespan", "peak_memory", "verdict"} <= c.keys()
        assert c["verdict"] in ("ok", "over-memory", "invalid", "error", "skipped")
    ok = [c for c in data["candidates"] if c["verdict"] == "ok"]
    assert ok and data["makespan"] == min(c["makespan"] for c in ok)
    assert all(c["peak_memory"] <= 4 + 1e-9 for c in ok)
    assert data["peak_memory"] <= 4 + 1e-9 and data["chunks"] in (1, 2)
    # zb_h1 fits 4 units at P=4 with makespan 27 (docs/simulator.md's table): tune is at least as good
    assert data["makespan"] <= 27
    assert out.read_text() == data["schedule"]
    code, report, err = run_main(
        ["check", str(out), "--per-rank-share", "--cost", COST, "--memory-limit", "4"], tmp_path
    )
    assert code == 0, report + err
    code, sim, err = run_main(["simulate", str(out), "--per-rank-share", "--cost", COST, "--format", "json"], tmp_path)
    assert code == 0, err
    assert json.loads(sim)["makespan"] == pytest.approx(data["makespan"])
    # ... and with a smaller limit the same file is refused: the memory line and the lists are what was checked
    code, _, _ = run_main(["check", str(out), "--per-rank-share", "--cost", COST, "--memory-limit", "1"], tmp_path)
    assert code == 1


def test_header_names_sizes_costs_limit_and_the_library_candidate(tmp_path: Path) -> None:
    data, out = tune_json(tmp_path, limit="3", cost="F=1,I=2,W=1,comm=0.25")
    header = [line for line in out.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(header)
    assert f"P=4 M=8 V={data['chunks']}" in text
    assert "F=1,B=3,I=2,W=1,comm=0.25" in text
    assert "memory limit: 3 activation units per rank" in text and "per rank share" in text
    assert f"makespan {data['makespan']:g}" in text and "bubble" in text and "peak memory" in text
    assert "beat:" in text or "best library candidate:" in text
    assert "# check: pipec check" in text
    assert "rank 0:" in out.read_text() and "placement [" in out.read_text()


def test_text_table_ranks_ok_candidates_first(tmp_path: Path) -> None:
    code, out, err = run_main(
        ["tune", "-P", "3", "-M", "6", "--cost", COST, "--memory-limit", "3", "--chunks", "1", "--time-budget", "1"],
        tmp_path,
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["#", "name", "params"]
    rows = [line for line in lines[1:] if line.strip() and line.split()[0].isdigit()]
    # the makespan column ends where its header does (params and verdicts may hold several words)
    end = lines[0].index("makespan") + len("makespan")
    spans = [float(row[:end].split()[-1]) for row in rows]
    assert spans == sorted(spans) and rows[0].split()[0] == "1"
    assert any("over-memory" in line for line in lines)  # gpipe holds M = 6 > 3
    assert any(line.startswith("best: ") for line in lines)


def test_same_seed_same_result(tmp_path: Path) -> None:
    first, _ = tune_json(tmp_path, "--seed", "7")
    second, _ = tune_json(tmp_path, "--seed", "7")
    if first["complete"] and second["complete"]:  # a budget cut may stop at different points; a full search may not
        assert first["schedule"] == second["schedule"]

    # the library and the list schedules do not depend on time; the solver's and the local moves' rows may (a
    # budget cut under load), and so may the send/recv placements tune made itself, so they are left out of the
    # comparison unless the search completed
    def timeless(data: dict) -> list[dict]:
        return [
            c
            for c in data["candidates"]
            if not c["name"].startswith("cpsat") and not c["moves"] and not c["own_placement"]
        ]

    assert timeless(first) == timeless(second)


def test_a_limit_parameter_of_a_from_file_takes_the_values_within_the_limit(tmp_path: Path) -> None:
    source = ROOT / "tests" / "zbv_limited.pipe"  # limit in 2 .. 2P + 1, in chunk units
    data, _ = tune_json(tmp_path, "--from", str(source), limit="2.5")
    mine = [c for c in data["candidates"] if c["name"] == str(source) and not c["moves"]]
    assert sorted(c["params"]["limit"] for c in mine) == [2, 3, 4, 5]  # 2.5 share units at V = 2: 5 stage units
    assert all(c["verdict"] == "ok" and c["peak_memory"] <= 2.5 for c in mine)


def test_nothing_fits_exits_1_naming_the_smallest_peak(tmp_path: Path) -> None:
    code, _, err = run_main(
        ["tune", "-P", "4", "-M", "8", "--cost", COST, "--memory-limit", "0.1", "--chunks", "1", "--time-budget", "0"],
        tmp_path,
    )
    assert code == 1
    assert "no candidate fits the memory limit of 0.1" in err and "smallest peak seen" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["-P", "4", "-M", "8", "--cost", COST],  # no --memory-limit
        ["-P", "4", "-M", "8", "--cost", COST, "--memory-limit", "4", "--chunks", "0"],
        ["-P", "4", "-M", "8", "--cost", COST, "--memory-limit", "4", "--chunks", "a,b"],
        ["-P", "4", "-M", "8", "--cost", "F=x", "--memory-limit", "4"],
        ["-P", "4", "-M", "8", "--cost", COST, "--memory-limit", "-1"],
        ["-P", "4", "-M", "8", "--cost", COST, "--memory-limit", "4", "--time-budget", "nan"],
        ["-P", "4", "-M", "8", "--cost", COST, "--memory-limit", "4", "--from", "missing.pipe"],
    ],
)
def test_bad_input_exits_2_in_one_line(argv: list[str], tmp_path: Path) -> None:
    code, _, err = run_main(
        ["tune", *argv, "--time-budget", "0"] if "--time-budget" not in argv else ["tune", *argv], tmp_path
    )
    assert code == 2, err
    assert "Traceback" not in err and err.strip()


def test_output_may_not_replace_a_from_file(tmp_path: Path) -> None:
    mine = tmp_path / "mine.pipe"
    mine.write_text((ROOT / "tests" / "zbv_limited.pipe").read_text())
    code, _, err = run_main(
        ["tune", "-P", "4", "-M", "8", "--cost", COST, "--memory-limit", "4", "--from", str(mine), "-o", str(mine)],
        tmp_path,
    )
    assert code == 2 and "mine.pipe" in err
    assert mine.read_text() == (ROOT / "tests" / "zbv_limited.pipe").read_text()


@pytest.mark.parametrize("when, shown", [("always", True), ("never", False), ("auto", False)])
def test_progress_lines_after_two_seconds_when_asked(when: str, shown: bool, tmp_path: Path) -> None:
    """A search longer than 2 s reports on stderr: always, never, or (auto) only on a terminal; the captured
    stderr of this test is not one."""
    argv = ["tune", "-P", "8", "-M", "24", "--cost", COST, "--memory-limit", "8", "--chunks", "1"]
    code, out, err = run_main([*argv, "--time-budget", "4", "--progress", when], tmp_path)
    assert code == 0 and "best:" in out
    lines = [line for line in err.splitlines() if line.startswith("tune: ")]
    assert bool(lines) == shown, err
    assert all("candidates, best" in line for line in lines)


def test_the_tuning_walkthroughs_partitions_make_a_last_stage_twice_as_heavy() -> None:
    """docs/tuning.md's workload: `--partition 3,2,2,6` gives stages of 2, 2, 2, 4 blocks (parameters as a proxy
    of work), and `2,1,1,1,1,1,2,4` cuts each of those segments in two for V = 2 (stages 2k and 2k + 1 make
    segment k)."""
    from pipec.runtime.stages import parse_partition
    from pipec.runtime.workload import build

    layers = list(build(f"{ROOT / 'examples' / 'workload.py'}:heavy_last_transformer", seed=0).layers)

    def stage_params(text: str, stages: int) -> list[int]:
        sizes, start, out = parse_partition(text, len(layers), stages), 0, []
        for size in sizes:
            out.append(sum(p.numel() for layer in layers[start : start + size] for p in layer.parameters()))
            start += size
        return out

    one = stage_params("3,2,2,6", 4)
    assert all(1.8 < one[3] / part < 2.3 for part in one[1:3]), one
    two = stage_params("2,1,1,1,1,1,2,4", 8)
    assert [two[2 * k] + two[2 * k + 1] for k in range(4)] == one


def test_the_help_states_the_default_budget_tune_uses(capsys: pytest.CaptureFixture) -> None:
    # the CLI names the default in its help without importing pipec.tune (the parser of every command is built
    # before one runs), and takes tune's own when --time-budget is not given
    from pipec.cli import main as cli_main
    from pipec.tune.clock import DEFAULT_BUDGET
    from pipec.tune.search import tune

    assert cli_main(["tune", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {DEFAULT_BUDGET:g})" in text
    assert inspect.signature(tune).parameters["time_budget"].default == DEFAULT_BUDGET
