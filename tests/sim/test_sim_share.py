"""Units that compare across V (`--per-rank-share`, docs/simulator.md): the transformation of the costs and stage
sizes from (P, V), the documented table, and the flag's errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_capture import run_main
from paths import ROOT

from pipec.errors import PipecInputError
from pipec.sim.costs import parse_costs, per_rank_share
from pipec.verify.memory import share_stage_sizes, spread_segments


def simulate_json(*args: str) -> dict:
    code, out, err = run_main(["simulate", *args, "--format", "json"])
    assert code == 0, err
    return json.loads(out)


# --- the transformation ------------------------------------------------------------------------------------------


def test_stage_s_lies_in_segment_s_div_v() -> None:
    # P=2 segments, V=3: stages 0..2 cover segment 0, stages 3..5 segment 1, each 1/3 of it
    assert spread_segments((3.0, 6.0), 2, 3, "x") == (1.0, 1.0, 1.0, 2.0, 2.0, 2.0)
    assert spread_segments((3.0, 6.0), 2, 3, "x", divide=False) == (3.0, 3.0, 3.0, 6.0, 6.0, 6.0)
    assert spread_segments(2.0, 3, 2, "x") == (1.0,) * 6


def test_per_stage_lists_of_p_entries_become_p_times_v_stages() -> None:
    costs = parse_costs(
        {"F": [1, 2, 3, 4], "I": 2, "W": [4, 4, 4, 8], "scale": [1, 1, 1, 3], "activation": [2, 2, 2, 4]}
    )
    shared = per_rank_share(costs, 4, 2)
    assert shared.F == (0.5, 0.5, 1.0, 1.0, 1.5, 1.5, 2.0, 2.0)
    assert shared.I == 1.0  # a number stays a number, 1/V of it
    assert shared.W == (2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 4.0, 4.0)
    assert shared.B == tuple(i + w for i, w in zip((1.0,) * 8, shared.W, strict=True))  # B = I + W still holds
    assert shared.scale == (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0)  # a factor: not divided
    assert shared.activation == (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0)
    assert shared.per_stage(8)  # consistent with an 8-stage schedule
    # messages do not depend on V
    assert (shared.comm, shared.input_fraction) == (costs.comm, costs.input_fraction)


def test_chunk_costs_one_vth_and_v1_is_the_identity() -> None:
    costs = parse_costs("F=2,B=4,W=1,comm=0.5")
    at4 = per_rank_share(costs, 3, 4)
    assert (at4.F, at4.B, at4.I, at4.W, at4.activation) == (0.5, 1.0, 0.75, 0.25, 0.25)
    assert at4.message_time == 0.5
    assert per_rank_share(costs, 3, 1) == costs  # at V=1 a stage is a segment: nothing to do


def test_stage_sizes_default_to_one_vth_of_a_unit() -> None:
    assert share_stage_sizes(None, 2, 2) == (0.5, 0.5, 0.5, 0.5)
    assert share_stage_sizes((1.0, 3.0), 2, 2) == (0.5, 0.5, 1.5, 1.5)


def test_a_list_of_the_wrong_length_names_the_key_and_asks_for_p_entries() -> None:
    costs = parse_costs({"F": [1] * 8})  # 8 entries: the stages of V=2, not the 4 segments
    with pytest.raises(PipecInputError, match=r"cost 'F' has 8 entries; .*--per-rank-share.*: 4 entries expected"):
        per_rank_share(costs, 4, 2)
    with pytest.raises(PipecInputError, match=r"--stage-sizes has 3 entries; .*4 entries expected \(P=4\)"):
        share_stage_sizes((1.0, 1.0, 1.0), 4, 2)


def test_the_flag_refuses_a_cost_file_with_a_list_per_stage(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text('{"F": [1, 1, 1, 1, 1, 1, 1, 2], "I": 1, "W": 1}')
    for command in ("simulate", "show"):
        code, _, err = run_main([command, "zbv", "-P", "4", "-M", "8", "--cost", str(path), "--per-rank-share"])
        assert code == 2
        assert "cost 'F' has 8 entries" in err and "4 entries expected (P=4)" in err
    # the same file is right without the flag: one entry per stage
    assert simulate_json("zbv", "-P", "4", "-M", "8", "--cost", str(path))["makespan"] > 0
    code, _, err = run_main(["check", "zbv", "-P", "4", "-M", "8", "--per-rank-share", "--stage-sizes", "1,1,1"])
    assert code == 2 and "--stage-sizes has 3 entries" in err


def test_a_heavy_last_segment_is_heavy_in_both_of_its_stages(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text('{"F": [1, 1, 1, 3], "I": 1, "W": 1}')
    data = simulate_json("zbv", "-P", "4", "-M", "8", "--cost", str(path), "--per-rank-share")
    # ZB-V puts stages 0 and 7 on rank 0, 3 and 4 on rank 3: segment 3 (stages 6, 7) is on ranks 0 and 1
    busy = [r["busy"] for r in data["ranks"]]
    assert busy == [8 * (0.5 + 1.5 + 2), 8 * (0.5 + 1.5 + 2), 24, 24]
    assert data["costs"].startswith("F=[0.5,0.5,0.5,0.5,0.5,0.5,1.5,1.5]")


# --- the documented table ----------------------------------------------------------------------------------------

P, M = 4, 8
TABLE = {  # docs/simulator.md, "Units that compare across V": (schedule, V) -> (makespan, peak per rank)
    ("1f1b", 1): (33, (4, 3, 2, 1)),
    ("zb_h1", 1): (27, (4, 3.5, 3, 2.5)),
    ("zb_h2", 1): (27, (7, 6, 5, 4)),
    ("interleaved_1f1b", 2): (28.5, (5.5, 4.5, 3.5, 2.5)),
    ("interleaved_1f1b", 4): (26.25, (4.75, 4.25, 3.75, 3.25)),
    ("interleaved_zb", 2): (25.5, (4, 3.75, 3.5, 3.25)),
    ("zbv", 2): (25.5, (4, 4, 4, 4)),
    ("dualpipev", 2): (27, (4, 4, 4, 4.5)),
    ("dualpipe", 2): (26, (4, 5, 5, 4)),  # copies: a stage is C/V of a share, here a whole one
    ("chimera", 2): (30, (3, 4, 4, 3)),
    ("chimera", 4): (24, (4, 4, 4, 4)),
}


def shared_run(schedule: str, chunks: int) -> dict:
    return simulate_json(schedule, "-P", str(P), "-M", str(M), "-V", str(chunks), "--cost", "F=1,I=1,W=1",
                         "--per-rank-share")


@pytest.mark.parametrize(("schedule", "chunks"), sorted(TABLE))
def test_table_row(schedule: str, chunks: int) -> None:
    data = shared_run(schedule, chunks)
    makespan, peaks = TABLE[(schedule, chunks)]
    assert data["makespan"] == pytest.approx(makespan)
    assert tuple(r["peak_memory"] for r in data["ranks"]) == pytest.approx(peaks)
    # the same model whatever V: 3 time units of compute per micro-batch on each rank's share
    assert data["ideal"] == pytest.approx(3 * M)
    assert data["units"] == "per-rank-share"


def test_the_table_in_the_docs_is_the_one_checked() -> None:
    text = (ROOT / "docs" / "simulator.md").read_text()
    section = text.split("## Units that compare across V", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| ([\d.]+) \| ([\d., ]+) \|$", section, re.M)
    documented = {(s, int(v)): (float(m), tuple(float(x) for x in p.split(", "))) for s, v, m, p in rows}
    assert documented == {k: (float(m), tuple(map(float, p))) for k, (m, p) in TABLE.items()}


@pytest.mark.parametrize(("ranks", "micro"), [(4, 8), (3, 6), (5, 10)])
def test_1f1b_and_zbv_peaks_in_model_units(ranks: int, micro: int) -> None:
    args = ["-P", str(ranks), "-M", str(micro), "--cost", "F=1,I=1,W=1", "--per-rank-share"]
    one = simulate_json("1f1b", *args)
    assert [r["peak_memory"] for r in one["ranks"]] == [ranks - r for r in range(ranks)]  # rank 0 holds P
    zbv = simulate_json("zbv", *args)
    assert [r["peak_memory"] for r in zbv["ranks"]] == [ranks] * ranks  # 2P chunks of 1/2


@pytest.mark.parametrize(("ranks", "chunks"), [(4, 2), (4, 4), (3, 2), (2, 3)])
def test_interleaved_1f1b_peak_in_model_units(ranks: int, chunks: int) -> None:
    # Megatron's warm-up, (V-1)P + 2(P-r-1) forwards, plus one, each of 1/V: P + (P-2r-1)/V with M large enough
    data = simulate_json("interleaved_1f1b", "-P", str(ranks), "-M", str(4 * ranks), "-V", str(chunks),
                         "--per-rank-share")
    expected = [ranks + (ranks - 2 * r - 1) / chunks for r in range(ranks)]
    assert [r["peak_memory"] for r in data["ranks"]] == pytest.approx(expected)


# --- the flag through every command, and nothing changed without it -----------------------------------------------


def test_without_the_flag_nothing_changes() -> None:
    plain = simulate_json("zbv", "-P", "4", "-M", "8", "--cost", "F=1,I=1,W=1")
    assert (plain["makespan"], plain["peak_memory_max"]) == (51, 8)  # stage units: twice the model's depth
    assert "units" not in plain
    shared = shared_run("zbv", 2)
    assert (shared["makespan"], shared["peak_memory_max"]) == (25.5, 4)
    # at V=1 a stage is a segment: the same simulation, only the units line added
    code, before, _ = run_main(["simulate", "1f1b", "-P", "4", "-M", "8"])
    code2, after, _ = run_main(["simulate", "1f1b", "-P", "4", "-M", "8", "--per-rank-share"])
    assert code == code2 == 0
    assert after.startswith(before) and after[len(before):].startswith("units: per rank share")


def test_check_limits_and_declared_bounds_in_model_units() -> None:
    base = ["check", "zbv", "-P", "4", "-M", "8", "--per-rank-share"]
    code, out, _ = run_main(base)
    assert code == 0
    assert re.search(r"^\s+0\s+80\s+4\s+4$", out, re.M)  # peak and declared bound (2P chunks) both 4
    assert run_main([*base, "--memory-limit", "4"])[0] == 0
    code, out, _ = run_main([*base, "--memory-limit", "3.5"])
    assert code == 1 and "over --memory-limit of 3.5" in out
    # without the flag the same limit counts chunks, so it fails
    assert run_main(["check", "zbv", "-P", "4", "-M", "8", "--memory-limit", "4"])[0] == 1
    # a heavier segment under the flag: stage sizes per segment
    code, out, _ = run_main([*base, "--stage-sizes", "2,1,1,1", "--memory-limit", "100"])
    # segment 0 (size 2) is stages 0 and 1 at 1 each: rank 0 holds stage 0's eight micro-batches at its peak,
    # rank 1 stage 1's mb 0..6 and one of stage 6 (segment 3, 0.5); ranks 2 and 3 are as with unit sizes
    assert code == 0
    assert re.findall(r"^\s+\d\s+\d+\s+([\d.]+)\s+100$", out, re.M) == ["8", "7.5", "4", "4"]


def test_show_and_viz_take_the_flag(tmp_path: Path) -> None:
    code, out, _ = run_main(["show", "zbv", "-P", "4", "-M", "8", "--per-rank-share"])
    assert code == 0 and "makespan 25.5" in out  # defaults F=1,B=2,W=1: 3 per micro-batch, halved per chunk
    svg = tmp_path / "z.svg"
    assert run_main(["viz", "zbv", "-P", "4", "-M", "8", "--per-rank-share", "-o", str(svg)])[0] == 0
    assert svg.read_text().startswith("<svg") or "<svg" in svg.read_text()[:500]
