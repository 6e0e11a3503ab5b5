"""The corpus of hand-written bad schedules: each is rejected with exit 1 and the explanation written beside it.

tests/bad_schedules/NAME.{csv,pipe,txt} is checked with `pipec check NAME.{csv,pipe,txt}` from that folder (so that the
explanations name `NAME.pipe`, not a path); NAME.expected holds `# comments`, an optional `args: ...` line (extra
command-line arguments), an optional `first: ...` line and lines that must each appear verbatim in the output.

`first:` is what a deadlock's explanation must say first: the first line under `deadlock   FAILED` ends with it,
and the first `rank N's OP` of that line is the first of the `first:` text, the rank and the op the author wrote
that needs to change.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from paths import ROOT, TESTS

from pipec.cli import main

CORPUS = TESTS / "bad_schedules"
CASES = sorted(p for p in CORPUS.iterdir() if p.suffix in (".csv", ".pipe", ".txt"))
_CULPRIT = re.compile(r"rank \d+'s \S+")


def _expectation(case: Path) -> tuple[list[str], list[str], str | None]:
    args: list[str] = []
    lines = []
    first = None
    for line in case.with_suffix(".expected").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line.startswith("args:"):
            args = shlex.split(line[len("args:") :])
        elif line.startswith("first:"):
            first = line[len("first:") :].strip()
        else:
            lines.append(line)
    return args, lines, first


def test_corpus_is_not_empty() -> None:
    assert len(CASES) >= 8
    assert {p.suffix for p in CASES} == {".csv", ".pipe", ".txt"}
    deadlocks = [case for case in CASES if _expectation(case)[2] is not None]
    assert len(deadlocks) >= 16  # swapped ops, warm-ups too short and too long, V shapes, literal lists, streams
    assert {p.suffix for p in deadlocks} == {".csv", ".pipe", ".txt"}


@pytest.mark.parametrize("case", CASES, ids=[p.name for p in CASES])
def test_bad_schedule_is_rejected_with_its_explanation(
    case: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args, expected, first = _expectation(case)
    assert expected or first, f"{case.name}: the .expected file names nothing to look for"
    monkeypatch.chdir(CORPUS)
    code = main(["check", case.name, *args])
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert code == 1, output
    assert "Traceback" not in output
    for line in expected:
        assert line in output, f"{case.name}: missing {line!r} in\n{output}"
    if first is not None:
        lines = output.splitlines()
        said = lines[lines.index("deadlock   FAILED  " + _model(args)) + 1]
        assert said.endswith(first), f"{case.name}: the deadlock's first line is\n{said}\nnot\n{first}"
        assert _CULPRIT.findall(said)[0] == _CULPRIT.findall(first)[0], said


def _model(args: list[str]) -> str:
    return f"({args[args.index('--p2p') + 1] if '--p2p' in args else 'nccl'} model)"


@pytest.mark.parametrize(
    ("doc", "case", "args"),
    [("verification.md", "zbv_naive_recvs.csv", []), ("torch.md", "torch_send_behind_recv.csv", ["--p2p", "torch"])],
)
def test_the_counterexample_in_the_docs_is_real(
    doc: str, case: str, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    text = (ROOT / "docs" / doc).read_text()
    command = f"$ pipec check tests/bad_schedules/{case}{''.join(' ' + a for a in args)}"
    start = text.index("\n", text.index(command)) + 1
    shown = text[start : text.index("\n```", start)].removesuffix("# exit 1")
    code = main(["check", str(CORPUS / case), *args])
    out = capsys.readouterr().out
    assert code == 1
    assert [line.rstrip() for line in out.splitlines()] == [line.rstrip() for line in shown.splitlines()]
