"""pipec.testing and `pipec test`: valid parameters by construction, library schedules pass, bugs shrink to the
smallest failing parameters (checked against a brute-force search)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from paths import ROOT

from pipec.cli import main
from pipec.compiler import parse_schedule
from pipec.library import bundled_names, bundled_source
from pipec.testing import ParamSpace, ScheduleCheckError, as_compile_args, assert_schedule_ok, schedule_params
from pipec.testing.strategies import _schedule_ast


@pytest.mark.parametrize("name", bundled_names())
def test_every_drawn_parameter_set_compiles(name: str) -> None:
    """No draw is ever refused by the schedule's own `require` lines: they are satisfied by construction."""
    import pipec

    space = ParamSpace(parse_schedule(name), {"P": 5, "M": 10, "V": 3})
    every = space.all_params()
    assert every, name
    for params in every:
        pipec.load(name, **as_compile_args(params))  # raises on a refused set


@settings(max_examples=40, deadline=None)
@given(schedule_params("dualpipev", max_ranks=6, max_microbatches=20))
def test_schedule_params_respects_requirements(params: dict[str, int]) -> None:
    assert params["V"] == 2 and params["M"] >= 2 * params["P"]
    assert 1 <= params["P"] <= 6 and params["M"] <= 20


def test_declared_ranges_bound_the_draws() -> None:
    source = (
        "schedule ranged\nparams P in 2 .. 4, M = 4 in P .. 2 * P + 1, V = 1 in 1 .. 3, k = 0 in 0 .. 3\n"
        "per rank r:\n    repeat M: F\n    repeat M: B\n"
    )
    every = ParamSpace(_schedule_ast(source)).all_params()
    assert {p["P"] for p in every} == {2, 3}
    assert all(p["P"] <= p["M"] <= 2 * p["P"] for p in every)
    assert {p["k"] for p in every} == {0, 1, 2}
    assert {p["V"] for p in every} == {1, 2}  # a declared range is the author's word, even for V
    assert len(every) == (3 + 4) * 2 * 3


@pytest.mark.parametrize("name", bundled_names())
def test_pipec_test_passes_every_library_schedule(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["test", name, "--examples", "40", "--max-ranks", "6", "--max-microbatches", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{name}: ok, ")


def _broken(tmp_path: Path, name: str, old: str, new: str) -> Path:
    source = bundled_source(name)
    assert old in source
    path = tmp_path / f"broken_{name}.pipe"
    path.write_text(source.replace(old, new))
    return path


def _smallest_failure(path: Path, maxima: dict[str, int]) -> dict[str, int]:
    """Brute force, independent of Hypothesis: the first failing set in (P, M, V) order."""
    for params in ParamSpace(_schedule_ast(str(path)), maxima).all_params():
        try:
            assert_schedule_ok(str(path), **as_compile_args(params))
        except ScheduleCheckError:
            return params
        except Exception:  # a compile error for valid parameters is a failure too
            return params
    raise AssertionError("the broken schedule never fails")


@pytest.mark.parametrize(
    ("name", "old", "new"),
    [
        # warm-up one too long on the last rank
        ("1f1b", "warm = min(P - r, M)", "warm = min(P - r, M) + (1 if r == P - 1 and P > 2 else 0)"),
        # the last rank forgets the weight gradients it deferred
        ("zb_h1", "    drain W\n", "    if r < P - 1: drain W\n"),
    ],
)
def test_pipec_test_shrinks_a_bug_to_the_smallest_parameters(
    name: str, old: str, new: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _broken(tmp_path, name, old, new)
    assert main(["test", str(path), "--examples", "200", "--max-ranks", "6", "--max-microbatches", "12"]) == 1
    out = capsys.readouterr().out
    smallest = _smallest_failure(path, {"P": 6, "M": 12})
    expected = " ".join(f"{k}={v}" for k, v in smallest.items())
    assert f"smallest failing parameters: {expected}\n" in out, out
    assert "FAILED" in out and ("rank" in out)


def test_expect_bubble_is_checked_against_the_simulator(tmp_path: Path) -> None:
    source = bundled_source("gpipe")
    right = tmp_path / "gpipe_right.pipe"
    right.write_text(source + "expect bubble (P - 1) / (M + P - 1)\n")
    assert_schedule_ok(str(right), 4, 8)
    wrong = tmp_path / "gpipe_wrong.pipe"
    wrong.write_text(source + "expect bubble (P - 1) / M\n")
    with pytest.raises(ScheduleCheckError, match=r"simulated bubble fraction is 0\.272727"):
        assert_schedule_ok(str(wrong), 4, 8)


def test_the_documented_example_property_test_passes() -> None:
    import subprocess
    import sys

    root = ROOT
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "examples" / "testing")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


# ---- which V, which sizes: issue 13 ----------------------------------------------------------------------------

TUTORIAL = ROOT / "examples" / "tutorial"
CHUNKLESS = "    repeat M: F\n    repeat M: B\n"
CHUNKED = "    for c in 0 .. V:\n        repeat M: F[c]\n    for c in 0 .. V:\n        repeat M: B[V - 1 - c]\n"


@pytest.mark.parametrize("step", ["step1_gpipe.pipe", "step2_1f1b.pipe"])
def test_pipec_test_passes_the_tutorials_own_schedules(step: str, capsys: pytest.CaptureFixture[str]) -> None:
    """They never name a chunk, so they run at V = 1 only; `pipec test` drew V = 2 and failed on them."""
    path = str(TUTORIAL / step)
    assert main(["test", path, "--examples", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert ": ok, " in lines[0] and " V=1" in lines[0]
    assert lines[1:] == [
        "note: V = 1 only: the schedule never reads V nor names a chunk (F[c]), so at V > 1 its ops would all run on "
        "chunk 0 and the other chunks never (to test V > 1, name the chunks: F[c], B[c])"
    ]
    assert {p["V"] for p in ParamSpace(parse_schedule(path)).all_params()} == {1}


@pytest.mark.parametrize(
    ("params", "body", "drawn"),
    [
        ("params P, M", CHUNKLESS, {1}),
        ("params P, M, V = 1", CHUNKLESS, {1}),
        ("params P, M, V = 1 in 1 .. 3", CHUNKLESS, {1, 2}),  # a declared range is the author's claim: drawn
        ("params P, M", CHUNKED, {1, 2, 3, 4}),  # reads V: no declaration needed
        ("params P, M, V = 2", CHUNKED, {1, 2, 3, 4}),
        ("params P, M\nrequire V <= 2, \"two chunks at most\"", CHUNKLESS, {1, 2}),  # reads V: its require rules
    ],
)
def test_v_is_drawn_only_where_the_schedule_can_take_it(params: str, body: str, drawn: set[int]) -> None:
    source = f"schedule s\n{params}\nper rank r:\n{body}"
    every = ParamSpace(_schedule_ast(source), {"P": 3, "M": 3}).all_params()
    assert {p["V"] for p in every} == drawn


def test_a_placement_refuses_the_v_it_cannot_place(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pipec

    path = tmp_path / "listed.pipe"
    path.write_text("schedule listed\nparams P, M, V = 2\nplacement [0, 0, 1, 1]\nper rank r:\n" + CHUNKED)
    every = ParamSpace(_schedule_ast(str(path)), {"M": 6}).all_params()
    assert {(p["P"], p["V"]) for p in every} == {(2, 2)}  # four stages: P = 1 and P = 4 cannot hold this list
    for params in every:
        pipec.load(str(path), **as_compile_args(params))  # none refused
    assert main(["test", str(path), "--max-microbatches", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "listed: ok, all 6 valid parameter sets, largest P=2 M=6 V=2"
    assert out[1].startswith("note: V = 1, 3, 4 not drawn: at P = 1, the placement lists 4 stage(s), not P * V = 1 ")
    assert len(out) == 2


def test_pipec_test_checks_a_stream_file_at_its_own_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.csv"
    assert main(["compile", "1f1b", "-P", "4", "-M", "8", "--format", "torch-csv", "-o", str(good)]) == 0
    assert capsys.readouterr().out == f"wrote {good}\n"
    assert main(["test", str(good)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{good}: ok at its own size P=4 M=8 V=1 ") and out.count("\n") == 1
    bad = tmp_path / "bad.csv"
    lines = good.read_text().splitlines()
    lines[0] = lines[0].replace("0F0,0F1,0F2,0F3,0B0", "0F0,0B0,0F1,0F2,0F3")  # rank 0 waits for a gradient too early
    bad.write_text("\n".join(lines) + "\n")
    assert main(["test", str(bad)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{bad}: FAILED at its own size P=4 M=8 V=1")
    assert main(["check", str(bad)]) == 1
    explanation = capsys.readouterr().out.split("\n", 1)[1]  # what check prints after its header line
    assert "deadlock   FAILED" in explanation and explanation in out
    assert main(["test", str(good), "--ranks", "3"]) == 2
    assert "--ranks 3 disagrees with the file, which has P = 4" in capsys.readouterr().err


def test_fixed_flags_fix_their_parameter_and_the_others_are_drawn(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["test", "1f1b", "--ranks", "3", "--max-microbatches", "10"]) == 0
    assert capsys.readouterr().out == "1f1b: ok, all 10 valid parameter sets, largest P=3 M=10 V=1\n"
    step3 = str(TUTORIAL / "step3_warmup.pipe")
    assert main(["test", step3, "-M", "6", "--set", "extra=2", "--max-ranks", "4"]) == 0
    assert capsys.readouterr().out == "my_1f1b_warm: ok, all 4 valid parameter sets, largest P=4 M=6 V=1 extra=2\n"
    assert main(["test", "interleaved_1f1b", "-V", "3", "-P", "2", "-M", "4"]) == 0
    assert capsys.readouterr().out == "interleaved_1f1b: ok at P=2 M=4 V=3, its only valid parameter set\n"
    assert main(["test", "1f1b", "--chunks", "2"]) == 2  # refused, with the schedule's own reason
    assert "1F1B runs one stage per rank" in capsys.readouterr().err
    assert main(["test", "1f1b", "--set", "P=2"]) == 2
    assert "set P with --ranks" in capsys.readouterr().err
    assert main(["test", step3, "--set", "warmup=1"]) == 2
    assert "has no parameter 'warmup'; its parameters: extra" in capsys.readouterr().err


@settings(max_examples=20, deadline=None)
@given(schedule_params("interleaved_1f1b", max_ranks=4, max_microbatches=8, fixed={"V": 3}))
def test_schedule_params_keeps_fixed_values(params: dict[str, int]) -> None:
    assert params["V"] == 3 and 1 <= params["P"] <= 4


def _literal(tmp_path: Path, drop: str = "") -> Path:
    import pipec

    program = pipec.load("1f1b", 4, 8)
    kept = [" ".join(str(i) for i in stream if str(i) != drop) for stream in program.streams]
    lines = "".join(f"rank {rank}: {text}\n" for rank, text in enumerate(kept))
    path = tmp_path / "lit4.pipe"
    path.write_text(f'schedule lit4 "1F1B written out at P = 4, M = 8"\nparams P, M\n{lines}')
    return path


def test_literal_lists_are_tested_at_the_size_they_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _literal(tmp_path)
    assert main(["test", str(path)]) == 0
    assert capsys.readouterr().out == (
        "lit4: ok at P=4 M=8 V=1, its only valid parameter set\n"
        "note: the literal rank lists fix P = 4, V = 1 and M = 8: tested at that size only\n"
    )
    broken = _literal(tmp_path, drop="0F7")
    assert main(["test", str(broken)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("lit4: FAILED after 1 parameter set\n")
    assert "smallest failing parameters: P=4 M=8 V=1\n" in out
    assert "0F7 is missing" in out and "4F0" not in out  # drawn at V = 2 it printed 79 lines about stages 4..7
    assert main(["test", str(path), "-P", "3"]) == 2
    assert "--ranks 3 disagrees with the literal rank lists, which fix P = 4" in capsys.readouterr().err


def test_the_test_kit_uses_only_public_names_of_other_modules() -> None:
    """pipec.testing reads the front end through its public `evaluate`, not the private `_evaluate`."""
    import ast

    from pipec.errors import ScheduleProgramError
    from pipec.frontend.params import evaluate

    for path in (ROOT / "pipec" / "testing").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipec."):
                if node.module.startswith("pipec.testing"):
                    continue
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
    schedule = _schedule_ast("schedule e\nparams P, M\nlet rounds = max(1, M // P)\nper rank r:\n    F\n    B\n")
    expression = schedule.header[0].value
    assert evaluate(expression, {"P": 4, "M": 8}) == 2
    with pytest.raises(ScheduleProgramError):
        evaluate(expression, {"P": 0, "M": 8})
