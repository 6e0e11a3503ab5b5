"""The unit line under `pipec run`'s per-rank table: the predicted peaks are in stage units, and a stage of a
schedule of C copies of the model is C/V of a rank's share (docs/simulator.md, "Units")."""

from __future__ import annotations

from pipec.runtime.report import _say_summary


def summary(chunks: int, pipelines: int | None) -> list[str]:
    rank = {"rank": 0, "compute_s": 1.0, "comm_wait_s": 0.0, "idle_s": 0.0, "sync_s": 0.0,
            "interpreter_us_per_instruction": 1.0, "peak_activations": 5, "peak_activations_predicted": 5}
    report = {"median_step_s": 0.1, "samples_per_s": 10.0, "first_step": 0, "dp": 1, "chunks": chunks,
              "ranks": [rank]}
    if pipelines is not None:
        report["pipelines"] = pipelines
    lines: list[str] = []
    _say_summary(report, lines.append)
    return lines


def test_the_unit_line_takes_the_copies() -> None:
    assert summary(2, 2)[-1].endswith("V/C = 2/2 stages, so 5 here is 5 there)")  # dualpipe: a stage is a share
    assert summary(2, 1)[-1].endswith("of a rank's V=2 stages, so 5 here is 2.5 there)")
    assert summary(2, None)[-1] == summary(2, 1)[-1]  # a report written before copies existed
    assert "here is" not in summary(1, None)[-1]  # V = 1, one copy: stage units are share units
