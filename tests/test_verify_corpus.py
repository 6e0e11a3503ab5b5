"""The corpus of hand-written bad schedules: each is rejected with exit 1 and the explanation written beside it.

tests/bad_schedules/NAME.{csv,pipe} is checked with `pipec check`; NAME.expected holds `# comments`, an optional
`args: ...` line (extra command-line arguments) and lines that must each appear verbatim in the output.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from pipec.cli import main

CORPUS = Path(__file__).parent / "bad_schedules"
CASES = sorted(p for p in CORPUS.iterdir() if p.suffix in (".csv", ".pipe"))


def _expectation(case: Path) -> tuple[list[str], list[str]]:
    args: list[str] = []
    lines = []
    for line in case.with_suffix(".expected").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line.startswith("args:"):
            args = shlex.split(line[len("args:") :])
        else:
            lines.append(line)
    return args, lines


def test_corpus_is_not_empty() -> None:
    assert len(CASES) >= 8
    assert {p.suffix for p in CASES} == {".csv", ".pipe"}


@pytest.mark.parametrize("case", CASES, ids=[p.name for p in CASES])
def test_bad_schedule_is_rejected_with_its_explanation(case: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args, expected = _expectation(case)
    assert expected, f"{case.name}: the .expected file names nothing to look for"
    code = main(["check", str(case), *args])
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert code == 1, output
    assert "Traceback" not in output
    for line in expected:
        assert line in output, f"{case.name}: missing {line!r} in\n{output}"


def test_the_counterexample_in_the_docs_is_real(capsys: pytest.CaptureFixture[str]) -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "verification.md").read_text()
    command = "$ pipec check tests/bad_schedules/zbv_naive_recvs.csv\n"
    shown = doc[doc.index(command) + len(command) : doc.index("# exit 1", doc.index(command))]
    code = main(["check", str(CORPUS / "zbv_naive_recvs.csv")])
    out = capsys.readouterr().out
    assert code == 1
    assert [line.rstrip() for line in out.splitlines()] == [line.rstrip() for line in shown.splitlines()]
