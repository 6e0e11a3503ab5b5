"""Bad inputs end in a clear message and exit 2 (file:line:col with a caret for .pipe text), never a traceback.

Each tests/diagnostics/NAME.pipe has its expected stderr in NAME.expected; a first-line comment
`# args: ...` gives the command-line arguments (default `-P 2 -M 4`).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from golden_files import assert_matches_golden

from pipec.cli import main

CASES = sorted(Path(__file__).parent.joinpath("diagnostics").glob("*.pipe"))


def _args(path: Path) -> list[str]:
    first = path.read_text().splitlines()[0]
    if first.startswith("# args:"):
        return shlex.split(first[len("# args:") :])
    return ["-P", "2", "-M", "4"]


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_bad_pipe_file_gives_its_message(path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.chdir(path.parent)
    code = main(["compile", path.name, *_args(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith(f"{path.name}:") or err.startswith("error:"), err
    assert_matches_golden(err, path.with_suffix(".expected"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compile", "no_such_schedule", "-P", "2"], "unknown schedule 'no_such_schedule'; bundled schedules: 1f1b,"),
        (["compile", "1f1b", "-P", "2"], "needs parameter M (--microbatches)"),
        (["compile", "1f1b", "-P", "4", "-M", "8", "-V", "2"], "1F1B runs one stage per rank (V = 1)"),
        (["compile", "1f1b", "-P", "4", "-M", "8", "--set", "X=1"], "has no parameter 'X'"),
        (["compile", "1f1b", "-P", "4", "-M", "8", "--set", "M=1"], "set M with --microbatches"),
        (["compile", "dualpipev", "-P", "4", "-M", "6"], "DualPipeV needs at least as many micro-batches as stages"),
        (["compile", "missing.pipe", "-P", "4", "-M", "8"], "cannot read missing.pipe"),
        (["compile", "1f1b"], "needs parameter P (--ranks)"),
    ],
)
def test_bad_usage_exits_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["compile", "1f1b", "-P", "0", "-M", "2"], ["compile", "1f1b", "-P", "x"], []])
def test_argparse_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_junk_in_a_torch_csv_cell_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "junk.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,oops,1F1,1B1\n")
    assert main(["compile", str(path)]) == 2
    err = capsys.readouterr().err
    assert "row 2 (rank 1), cell 3" in err and "'oops' is not an action" in err


def test_csv_flags_must_agree_with_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert main(["compile", str(path), "--ranks", "4"]) == 2
    assert "--ranks 4 disagrees with the file, which has P = 2" in capsys.readouterr().err


def test_stage_on_two_ranks_in_a_csv_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.csv"
    path.write_text("0F0,0B0\n0F1,0B1\n")
    assert main(["compile", str(path)]) == 2
    assert "stage 0 appears on rank 0 and on rank 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("{", "not JSON"),
        ('{"format": "other"}', "'format' must be 'pipec.streams'"),
        ('{"format": "pipec.streams", "version": 99}', "unsupported version 99"),
        (
            '{"format": "pipec.streams", "version": 1, "ranks": 2, "microbatches": 1, "chunks": 1, "stages": 2,'
            ' "placement": [0, 1], "streams": [["0F0", "0B0"]]}',
            "'streams' must be a list of 2 lists",
        ),
        (
            '{"format": "pipec.streams", "version": 1, "ranks": 2, "microbatches": 1, "chunks": 1, "stages": 2,'
            ' "placement": [0, 1], "streams": [["0F0", "0B0"], ["1F0", "1Q0"]]}',
            "streams[1][1]",
        ),
    ],
)
def test_json_streams_are_validated_on_load(
    document: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.json"
    path.write_text(document)
    assert main(["compile", str(path)]) == 2
    assert message in capsys.readouterr().err
