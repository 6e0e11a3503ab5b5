"""Bad inputs end in a clear message and exit 2 (file:line:col with a caret for .pipe text), never a traceback.

Each tests/diagnostics/NAME.pipe has its expected stderr in NAME.expected; leading comments give the
command-line arguments (`# args: ...`, default `-P 2 -M 4`) and, for a schedule that compiles but is invalid,
`# exit: 1` (the report of `pipec compile`, which names the first cause of a deadlock or a structure problem).
"""

from __future__ import annotations

import pickle
import re
import shlex
from pathlib import Path

import pytest
from golden_files import assert_matches_golden
from paths import TESTS

import pipec
import pipec.verify as verify_package
from pipec.cli import main
from pipec.ir import Action, Kind
from pipec.verify import verify
from pipec.verify.deadlock import explain

DIAGNOSTICS = TESTS / "diagnostics"
CORPUS = TESTS / "bad_schedules"
CASES = sorted(DIAGNOSTICS.glob("*.pipe"))


def _directive(path: Path, name: str) -> str | None:
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            return None
        if line.startswith(f"# {name}:"):
            return line[len(f"# {name}:") :]
    return None


def _args(path: Path) -> list[str]:
    args = _directive(path, "args")
    return shlex.split(args) if args is not None else ["-P", "2", "-M", "4"]


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_bad_pipe_file_gives_its_message(path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.chdir(path.parent)
    expected_code = int(_directive(path, "exit") or 2)
    code = main(["compile", path.name, *_args(path)])
    err = capsys.readouterr().err
    assert code == expected_code, err
    assert "Traceback" not in err
    if expected_code == 2:
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
    assert main(argv) == 2  # argparse's usage error, returned rather than raised: main never exits the process
    err = capsys.readouterr().err
    assert "usage: pipec" in err and "Traceback" not in err


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
        ("{", "not valid JSON"),
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


# ---- what a deadlock's explanation says first (issue 13) -------------------------------------------------------

BUNDLED = [("1f1b", 4, 8, 1), ("interleaved_1f1b", 4, 8, 2), ("zbv", 4, 8, 2), ("dualpipev", 4, 8, 2)]


@pytest.mark.parametrize(("name", "p", "m", "v"), [*BUNDLED, ("zb_h1", 3, 5, 1), ("interleaved_zb", 2, 4, 2)])
def test_op_spans_point_at_the_text_that_emitted_each_op(name: str, p: int, m: int, v: int) -> None:
    """Re-expanding with recording on gives one span per instruction of each compute order, under the op (or the
    `drain`, or the pair) that emitted it, in the program as compiled: send/recv and all."""
    program = pipec.compile(name, p, m, v)
    spans = program.op_spans()
    assert spans is not None
    for stream, rank_spans in zip(program.compute_streams(), spans, strict=True):
        assert len(rank_spans) == len(stream)
        for instruction, span in zip(stream, rank_spans, strict=True):
            text = span.text.splitlines()[span.line - 1][span.column - 1 :]
            first = instruction.parts[0].kind.value
            assert text.startswith(first) or (first == "W" and text.startswith("drain")), (instruction, text)


def test_op_spans_answer_only_for_the_program_expanded() -> None:
    program = pipec.compile("1f1b", 2, 2)
    edited = program.with_streams((program.streams[1], program.streams[0]), True)
    assert edited.op_spans() is None  # the orders are not what the schedule expands to
    assert pipec.compile(str(CORPUS / "send_queued_behind_recv.csv")).op_spans() is None  # not from a .pipe


def test_op_spans_travel_with_the_program() -> None:
    """No cache of the schedules expanded lately: a program still knows its lines after twenty other schedules were
    compiled, and so does a pickled copy (what a worker process receives)."""
    program = pipec.compile("1f1b", 2, 2)
    spans = program.op_spans()
    for n in range(20):
        pipec.compile(f"schedule other_{n}\nper rank r:\n    repeat M: F\n    repeat M: B\n", 2, 2)
    assert spans is not None and program.op_spans() == spans
    assert pickle.loads(pickle.dumps(program)).op_spans() == spans


def _first_line(program: pipec.Program) -> str:
    deadlock = verify(program).verdict("deadlock")
    assert deadlock is not None and not deadlock.ok
    return deadlock.explanation.splitlines()[0]


@pytest.mark.parametrize(("name", "p", "m", "v"), BUNDLED)
def test_the_first_line_names_the_rank_whose_order_was_swapped(name: str, p: int, m: int, v: int) -> None:
    """Two ops of one rank swapped (a few positions apart), as a hand-edited order would be: when that deadlocks,
    the first line names that rank first, and one of the two ops, before the change it proposes."""
    base = pipec.load(name, p, m, v)
    found = 0
    for rank in range(p):
        stream = base.streams[rank]
        for i in range(0, len(stream) - 3, 3):
            for j in (i + 1, i + 3):
                swapped = list(stream)
                swapped[i], swapped[j] = swapped[j], swapped[i]
                streams = list(base.streams)
                streams[rank] = tuple(swapped)
                report = verify(base.with_streams(tuple(streams), False))
                if report.verdict("structure").ok and not report.verdict("deadlock").ok:
                    found += 1
                    line = _first_line(base.with_streams(tuple(streams), False))
                    culprit = re.search(r"cannot finish: rank (\d+)'s", line)
                    assert culprit and int(culprit[1]) == rank, (rank, str(stream[i]), str(stream[j]), line)
                    named = {str(a) for ins in (stream[i], stream[j]) for a in ins.parts}
                    assert any(op in line.split(";")[0] for op in named), line
    assert found >= 3


def test_p2p_mismatches_after_a_deadlock_are_its_consequence_only_when_pipec_placed_them() -> None:
    program = pipec.compile(str(DIAGNOSTICS / "deadlock_consequence.pipe"), 4, 8)
    report = verify(program)
    order, deadlock = report.verdict("p2p order"), report.verdict("deadlock")
    assert order is not None and not order.ok and order.note == "(only a consequence of the deadlock below)"
    assert deadlock is not None and "p2p order mismatches that follow from this deadlock" in deadlock.explanation
    assert "p2p order mismatch on channel" in deadlock.explanation.split("follow from this deadlock")[1]
    # the same streams with two sends of rank 0 traded: now the send/recv are the author's, and so is the mistake
    stream = list(program.streams[0])
    sends = [i for i, ins in enumerate(stream) if isinstance(ins, Action) and ins.kind is Kind.SEND_F]
    stream[sends[0]], stream[sends[1]] = stream[sends[1]], stream[sends[0]]
    edited = program.with_streams((tuple(stream), *program.streams[1:]), True)
    order = verify(edited).verdict("p2p order")
    assert order is not None and not order.ok and order.note == "" and "consequence" not in order.explanation


def test_a_valid_schedule_never_runs_the_diagnosis(monkeypatch: pytest.MonkeyPatch) -> None:
    """Explanations cost only on failure: verification of a valid program never calls them."""

    def refuse(*args: object) -> None:
        raise AssertionError("diagnosed a valid program")

    monkeypatch.setattr(explain, "diagnose", refuse)
    monkeypatch.setattr(verify_package, "placed_by_pipec", refuse)
    assert verify(pipec.compile("zbv", 4, 8, 2)).ok
    with pytest.raises(AssertionError, match="diagnosed"):
        verify(pipec.compile(str(CORPUS / "short_warmup.pipe"), 3, 4))


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        ("(0F0;0F1)OVERLAP_F_B,0B0,0B1", "an overlapped pair runs one forward (F) with one backward (B, I or W)"),
        ("0F0,(0F1;0B1)OVERLAP_F_B,0B0", "the halves of an overlapped pair take two different micro-batches"),
    ],
)
def test_a_stream_file_with_a_bad_pair_fails_the_structure_check(cells: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "pairs.csv"
    path.write_text(f"{cells}\n1F0,1B0,1F1,1B1\n")
    structure = verify(pipec.compile(str(path))).verdict("structure")
    assert structure is not None and not structure.ok and message in structure.explanation
