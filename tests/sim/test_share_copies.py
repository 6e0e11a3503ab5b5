"""`--per-rank-share` with replicated pipelines (C copies of the model, docs/simulator.md "Units"): a stage is C/V
of a rank's share, so DualPipe's and Chimera's V = C stage is a whole share and their figures in share units equal
their stage-unit ones; the compute a step does per rank is the model's, whatever the schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import run_main

from pipec.errors import PipecInputError
from pipec.sim.costs import parse_costs, per_rank_share
from pipec.verify.memory import share_stage_sizes, spread_segments


def simulate_json(*args: str) -> dict:
    code, out, err = run_main(["simulate", *args, "--format", "json"])
    assert code == 0, err
    return json.loads(out)


def test_a_copy_stage_covers_c_over_v_of_its_segment() -> None:
    # P=2 segments. V=C=2: each copy is the model's 2 stages, stage c*L + l in segment l, a whole one
    assert spread_segments((3.0, 6.0), 2, 2, "x", pipelines=2) == (3.0, 6.0, 3.0, 6.0)
    # V=4, C=2: a copy is 4 stages, two to a segment, each half of it
    assert spread_segments((3.0, 6.0), 2, 4, "x", pipelines=2) == (1.5, 1.5, 3.0, 3.0, 1.5, 1.5, 3.0, 3.0)
    assert spread_segments((3.0, 6.0), 2, 4, "x", divide=False, pipelines=2) == (3.0, 3.0, 6.0, 6.0) * 2
    assert share_stage_sizes(None, 4, 2, 2) == (1.0,) * 8
    shared = per_rank_share(parse_costs({"F": [1, 2, 3, 4], "B": 2, "FB": 2.5}), 4, 2, 2)
    assert (shared.F, shared.B, shared.FB, shared.activation) == ((1.0, 2.0, 3.0, 4.0) * 2, 2.0, 2.5, None)


def test_one_copy_is_bit_for_bit_what_it_was() -> None:
    costs = parse_costs({"F": [1, 2, 3], "I": 0.7, "W": 0.3, "scale": [1, 1, 2], "activation": 3})
    for chunks in (1, 2, 3, 7):
        assert per_rank_share(costs, 3, chunks, 1) == per_rank_share(costs, 3, chunks)
        stages = per_rank_share(costs, 3, chunks)
        assert stages.I == 0.7 / chunks and stages.activation == 3 / chunks  # the old float, exactly


def test_stages_across_segments_take_a_number_and_refuse_a_list() -> None:
    # V=1, C=2 over P=4: a copy is 2 stages, each two segments: 2 shares
    assert spread_segments(1.5, 4, 1, "x", pipelines=2) == (3.0,) * 4
    with pytest.raises(PipecInputError, match=r"cost 'F': .*each stage inside one segment.*V=1 is not a multiple"):
        per_rank_share(parse_costs({"F": [1, 2, 3, 4]}), 4, 1, 2)


DUALPIPE = ("dualpipe", "-P", "4", "-M", "8")
CHIMERA = ("chimera", "-P", "4", "-M", "8")
CHIMERA4 = ("chimera", "-P", "4", "-M", "8", "-V", "4")


@pytest.mark.parametrize("schedule", [DUALPIPE, CHIMERA, CHIMERA4])
@pytest.mark.parametrize("cost", ["F=1,B=2,W=1", "F=1.5,I=1,W=0.5,FB=2", "F=1,B=3,W=1,comm=0.25,sync=1"])
def test_at_v_equal_c_share_units_are_stage_units(schedule: tuple[str, ...], cost: str) -> None:
    plain = simulate_json(*schedule, "--cost", cost)
    shared = simulate_json(*schedule, "--cost", cost, "--per-rank-share")
    assert shared["makespan"] == plain["makespan"]  # before: 1/V of it, the copies looking V times cheaper
    assert [r["peak_memory"] for r in shared["ranks"]] == [r["peak_memory"] for r in plain["ranks"]]


def test_a_per_segment_list_is_each_copy_of_the_segment(tmp_path: Path) -> None:
    segments, stages = tmp_path / "segments.json", tmp_path / "stages.json"
    segments.write_text('{"F": [1, 2, 3, 4], "I": 1, "W": 1}')
    stages.write_text('{"F": [1, 2, 3, 4, 1, 2, 3, 4], "I": 1, "W": 1}')  # copy c's stage l is stage 4c + l
    shared = simulate_json(*DUALPIPE, "--cost", str(segments), "--per-rank-share")
    assert shared["makespan"] == simulate_json(*DUALPIPE, "--cost", str(stages))["makespan"]


@pytest.mark.parametrize("schedule", [DUALPIPE, CHIMERA, CHIMERA4])
@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (0.5, 1.25)])
def test_a_step_computes_the_same_per_rank_as_1f1b(schedule: tuple[str, ...], f: float, b: float) -> None:
    # an independent pin of the unit: whatever the schedule, a step runs M micro-batches through the whole model
    # once, so at the same per-rank-share costs the ranks' busy time sums to 1F1B's, P * M * (F + B)
    cost = f"F={f:g},B={b:g},W={b / 2:g}"
    copies = simulate_json(*schedule, "--cost", cost, "--per-rank-share")
    one = simulate_json("1f1b", "-P", "4", "-M", "8", "--cost", cost, "--per-rank-share")
    assert sum(r["busy"] for r in copies["ranks"]) == pytest.approx(sum(r["busy"] for r in one["ranks"]))
    assert sum(r["busy"] for r in one["ranks"]) == pytest.approx(4 * 8 * (f + b))


def test_check_converts_copies_at_c_over_v() -> None:
    code, out, _ = run_main(["check", *DUALPIPE])
    assert code == 0
    # before: "so 5 here is 2.5 there"; the middle ranks hold P + 1 = 5 micro-batches of a whole share
    assert "V/C = 2/2 stages, so 5 here is 5 there" in out
    code, out, _ = run_main(["check", *CHIMERA4])
    assert code == 0 and "V/C = 4/4 stages" in out
    base = ["check", *DUALPIPE, "--per-rank-share"]
    assert run_main([*base, "--memory-limit", "5"])[0] == 0  # the README's P + 1 activations, in share units
    code, out, _ = run_main([*base, "--memory-limit", "4.5"])
    assert code == 1 and "over --memory-limit of 4.5" in out
