"""The command line never loses a file and never ends in a traceback: outputs checked before work and written
atomically, numbers on the command line parsed strictly, standard output failures reported.

Subprocess tests run the real `pipec` entry point (resource limits and closed descriptors need a real process);
the flag fuzz runs `pipec.cli.main` in-process.
"""

from __future__ import annotations

import os
import random
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from cli_capture import run_main

PIPEC = [sys.executable, "-m", "pipec.cli"]


def run_cli(args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*PIPEC, *args], cwd=cwd, capture_output=True, text=True, timeout=60, **kwargs)


@pytest.fixture
def schedule(tmp_path: Path) -> Path:
    path = tmp_path / "mine.pipe"
    path.write_text(Path("pipec/schedules/1f1b.pipe").read_text())
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["compile", "{s}", "-P", "4", "-M", "8", "-o", "{s}"],
        ["compile", "{s}", "-P", "4", "-M", "8", "--format", "json", "-o", "{s}"],
        ["compile", "{s}", "--emit", "ast", "-o", "{s}"],
        ["simulate", "{s}", "-P", "4", "-M", "8", "-o", "{s}"],
        ["viz", "{s}", "-P", "4", "-M", "8", "-o", "{s}"],
        ["viz", "{s}", "-P", "4", "-M", "8", "--trace", "{d}/../{n}"],
        ["viz", "{s}", "-P", "4", "-M", "8", "-o", "{d}/x.svg", "--trace", "{d}/x.svg"],
    ],
)
def test_an_output_never_replaces_an_input_or_another_output(schedule: Path, argv: list[str]) -> None:
    before = schedule.read_text()
    d = schedule.parent / "sub"
    d.mkdir()
    argv = [a.format(s=schedule, d=d, n=schedule.name) for a in argv]
    code, _, err = run_main(argv)
    assert code == 2
    assert "refusing to overwrite" in err
    assert schedule.read_text() == before
    assert not (d / "x.svg").exists()


def test_an_output_through_a_symlink_to_the_input_is_refused(schedule: Path) -> None:
    link = schedule.parent / "link.txt"
    link.symlink_to(schedule)
    code, _, err = run_main(["compile", str(schedule), "-P", "2", "-M", "2", "-o", str(link)])
    assert code == 2 and "is the input" in err
    assert schedule.read_text().startswith("schedule 1f1b")


def test_a_cost_file_is_an_input_too(tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text('{"F": 1, "B": 2}')
    code, _, err = run_main(["simulate", "1f1b", "-P", "2", "-M", "4", "--cost", str(costs), "-o", str(costs)])
    assert code == 2 and "is the input" in err
    assert costs.read_text() == '{"F": 1, "B": 2}'


def test_an_unwritable_output_is_refused_before_any_work(tmp_path: Path) -> None:
    code, out, err = run_main(["compile", "1f1b", "-P", "4", "-M", "8", "-o", str(tmp_path / "missing" / "x.txt")])
    assert code == 2 and "does not exist" in err and out == ""
    code, _, err = run_main(["compile", "1f1b", "-P", "4", "-M", "8", "-o", str(tmp_path)])
    assert code == 2 and "is a directory" in err


def _limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_failed_write_keeps_the_old_file_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "streams.json"
    good = run_cli(["compile", "1f1b", "-P", "2", "-M", "2", "--format", "json", "-o", str(target)], tmp_path)
    assert good.returncode == 0
    before = target.read_bytes()
    # A bigger output under a file-size limit smaller than it: the write fails part-way.
    big = run_cli(
        ["compile", "1f1b", "-P", "16", "-M", "64", "--format", "json", "-o", str(target)],
        tmp_path,
        preexec_fn=_limit_file_size(len(before) + 100),
    )
    assert big.returncode == 2, big.stderr
    assert "cannot write" in big.stderr and "File too large" in big.stderr
    assert "previous file is unchanged" in big.stderr
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["streams.json"]


def test_a_new_file_gets_the_usual_permissions_and_an_old_one_keeps_its_own(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.txt"
    assert run_main(["compile", "1f1b", "-P", "2", "-M", "2", "-o", str(fresh)])[0] == 0
    umask = os.umask(0)
    os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~umask
    kept = tmp_path / "kept.txt"
    kept.write_text("old")
    kept.chmod(0o640)
    assert run_main(["compile", "1f1b", "-P", "2", "-M", "2", "-o", str(kept)])[0] == 0
    assert kept.stat().st_mode & 0o777 == 0o640
    assert kept.read_text().startswith("rank 0:")


def test_standard_output_failures_are_reported_not_raised(tmp_path: Path) -> None:
    with open("/dev/full", "w") as full:
        result = subprocess.run([*PIPEC, "list"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert result.returncode == 2
    assert "No space left on device" in result.stderr and "Traceback" not in result.stderr
    closed = subprocess.run(
        [*PIPEC, "compile", "1f1b", "-P", "2", "-M", "2"], stdout=None, stderr=subprocess.PIPE, text=True,
        timeout=60, preexec_fn=lambda: os.close(1),
    )
    assert closed.returncode == 2 and "standard output is closed" in closed.stderr
    piped = subprocess.run(
        f"{sys.executable} -m pipec.cli compile 1f1b -P 64 -M 512 | head -c 10", shell=True, capture_output=True,
        text=True, timeout=60,
    )
    assert piped.stderr == ""


@pytest.mark.parametrize("value", ["٤", "1_000", " 4", "4.0", "0x4", "1e3", "9" * 5000, "", "-", "+-1"])
def test_integer_flags_take_ascii_decimal_digits_only(value: str) -> None:
    code, _, err = run_main(["check", "1f1b", "-P", value, "-M", "4"])
    assert code == 2 and "expected an integer" in err


@pytest.mark.parametrize("value", ["inf", "nan", "1e999", "٤", "1_0", "0x10", "infinity"])
def test_amounts_must_be_finite_plain_numbers(value: str) -> None:
    code, _, err = run_main(["check", "1f1b", "-P", "2", "-M", "4", "--memory-limit", value])
    assert code == 2 and "expected a finite number" in err
    code, _, err = run_main(["check", "1f1b", "-P", "2", "-M", "4", "--stage-sizes", f"1,{value}"])
    assert code == 2


_FLAG_VALUES = [
    "0", "1", "2", "3", "-1", "64", "1000000000000", "٤", "1_0", "", " ", "x", "nan", "inf", "1e308", "9" * 40,
    "\x00", "é", "4,4", "=", "a=1", "P=3", "--", "-P",
]
_FLAGS = ["-P", "-M", "-V", "--set", "--memory-limit", "--input-fraction", "--stage-sizes", "--p2p", "--format",
          "--emit", "--cost", "--width", "--why"]


_VALID = [
    ["compile", "1f1b", "-P", "4", "-M", "8"],
    ["check", "zbv", "-P", "2", "-M", "4", "-V", "2"],
    ["simulate", "interleaved_1f1b", "-P", "2", "-M", "4", "-V", "2"],
    ["show", "gpipe", "-P", "3", "-M", "3"],
    ["list"],
]


def test_random_flag_abuse_never_ends_in_a_traceback_or_an_internal_error(tmp_path: Path) -> None:
    """Valid command lines with 0-3 flags added or replaced by odd values."""
    rng = random.Random(12)
    seen_codes = set()
    for _ in range(150):
        argv = list(rng.choice(_VALID))
        for _ in range(rng.randint(0, 3)):
            flag, value = rng.choice(_FLAGS), rng.choice(_FLAG_VALUES)
            if flag in argv and rng.random() < 0.7:
                argv[argv.index(flag) + 1] = value
            else:
                argv += [flag, value]
        if rng.random() < 0.2:
            argv += ["-o", str(tmp_path / "out.txt")]
        code, _, err = run_main(argv)
        seen_codes.add(code)
        assert code in (0, 1, 2), (argv, code, err)
        assert "Traceback" not in err and "internal error" not in err, (argv, err)
        if code == 2:
            assert "error" in err, (argv, err)
    assert {0, 2} <= seen_codes
