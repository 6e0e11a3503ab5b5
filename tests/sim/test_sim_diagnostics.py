"""What `pipec simulate`, `show` and `viz` print when they refuse a schedule or a cost model, and the notes `show`
adds under its grid: golden transcripts, plus the structure refusal on hand-made programs.

Each tests/sim_diagnostics/NAME.txt is a transcript: its first line `$ pipec ARGS` is run in that directory, the
lines after it are standard output then standard error, and the last line `[exit N]` is the exit code. Set
PIPEC_UPDATE_GOLDEN=1 to rewrite them from the current output (then review the diff).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from golden_files import assert_matches_golden
from paths import TESTS

from pipec.cli import main
from pipec.errors import ScheduleError
from pipec.ir import Program, parse_instruction
from pipec.sim import simulate
from pipec.verify import check_structure

HERE = TESTS / "sim_diagnostics"
CASES = sorted(HERE.glob("*.txt"))


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_transcript(path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    command = path.read_text().splitlines()[0]
    assert command.startswith("$ pipec "), f"{path.name}: the first line is the command, `$ pipec ARGS`"
    monkeypatch.chdir(HERE)
    code = main(shlex.split(command)[2:])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert_matches_golden(f"{command}\n{out}{err}[exit {code}]\n", path)


def test_viz_refuses_a_structurally_invalid_schedule(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(HERE)
    picture = tmp_path / "s.svg"
    assert main(["viz", "wrong_chunk.pipe", "-P", "2", "-M", "4", "-o", str(picture)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: structure FAILED (as `pipec check` reports it), so the schedule is not simulated:")
    assert "stage 3 (its chunk 1) never runs 3F0..3F3" in err
    assert not picture.exists()


def _program(rows: list[str], P: int = 2, M: int = 1, forward_only: bool = False) -> Program:  # noqa: N803
    streams = tuple(tuple(parse_instruction(t) for t in row.split()) for row in rows)
    return Program("hand", P, M, 1, tuple(range(P)), streams, has_comms=True, forward_only=forward_only)


# Structurally invalid programs, most of which the simulator alone used to time without a word (the others it
# stopped at a symptom): each with a line `pipec check` prints for it.
SILENT = {
    "a backward never run (no one waits for stage 0's)": (
        ["0F0 0SEND_F0 0RECV_B0", "1RECV_F0 1F0 1B0 1SEND_B0"],
        "0B0 is missing",
    ),
    "compute on the wrong rank": (  # the run used to stop at 0B0: `runs before its input gradient is received`
        ["0F0 1F0 1B0 0B0", ""],
        "stage 1 lives on rank 1, not 0",
    ),
    "a weight gradient after a full backward": (
        ["0F0 0SEND_F0 0RECV_B0 0B0 0W0", "1RECV_F0 1F0 1B0 1SEND_B0"],
        "has both a full backward 0B0 and a split one",
    ),
    "a message sent and received twice": (
        ["0F0 0SEND_F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1RECV_F0 1F0 1B0 1SEND_B0"],
        "appears 2 times",
    ),
    "an overlapped pair of two forwards": (
        ["(0F0;0F1)OVERLAP_F_B 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
         "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1"],
        "an overlapped pair runs one forward (F) with one backward",
    ),
}


@pytest.mark.parametrize("p2p", ["nccl", "tagged", "torch", "ideal"])
@pytest.mark.parametrize("case", SILENT, ids=list(SILENT))
def test_simulate_refuses_what_the_structure_pass_refuses(case: str, p2p: str) -> None:
    rows, line = SILENT[case]
    program = _program(rows, M=2 if "pair" in case else 1)
    problems = check_structure(program)
    assert any(line in p for p in problems), problems
    if p2p == "ideal":  # the compute orders alone: the doubled message is no problem there
        problems = check_structure(program.with_streams(program.compute_streams(), has_comms=False))
        if not problems:
            simulate(program, p2p=p2p)
            return
    with pytest.raises(ScheduleError) as error:
        simulate(program, p2p=p2p)
    lines = str(error.value).splitlines()
    assert lines[0] == "error: structure FAILED (as `pipec check` reports it), so the schedule is not simulated:"
    assert lines[1:] == ["  " + p for p in problems]


def test_a_sound_program_simulates_as_before() -> None:
    # the same two ranks, whole: nothing refused. Rank 0's batch [0SEND_F0 0RECV_B0] completes when rank 1 posts
    # 1SEND_B0 at 4, so 0B0 runs from 4 to 6.
    result = simulate(_program(["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"]))
    assert result.makespan == 6.0 and result.busy == (3.0, 3.0)
