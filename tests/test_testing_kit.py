"""pipec.testing and `pipec test`: valid parameters by construction, library schedules pass, bugs shrink to the
smallest failing parameters (checked against a brute-force search)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings

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
        "schedule ranged\nparams P in 2 .. 4, M = 4 in P .. 2 * P + 1, V = 1, k = 0 in 0 .. 3\n"
        "per rank r:\n    repeat M: F\n    repeat M: B\n"
    )
    every = ParamSpace(_schedule_ast(source)).all_params()
    assert {p["P"] for p in every} == {2, 3}
    assert all(p["P"] <= p["M"] <= 2 * p["P"] for p in every)
    assert {p["k"] for p in every} == {0, 1, 2}
    assert len(every) == (3 + 4) * 4 * 3  # V is free (1 .. 4): this schedule declares no stage count


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


def test_pipec_test_refuses_fixed_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["test", "1f1b", "--ranks", "4"]) == 2
    assert "draws P, M, V itself" in capsys.readouterr().err


def test_the_documented_example_property_test_passes() -> None:
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "examples" / "testing")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
