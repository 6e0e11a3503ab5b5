"""A worker's status (pipec/runtime/status.py), the data its guard thread and its messages read: where the rank
is in each phase, the temporary files of outputs being written (removed when the process is stopped) and
whether the process that started it is gone. In-process: no process group is needed."""

from __future__ import annotations

import os
from pathlib import Path

from pipec.errors import PipecError
from pipec.outputs import write_with
from pipec.runtime.status import RankStatus, describe_failure


class FakeRunner:
    """Stands in for runner.Runner: the two things the status reads of it."""

    step_index = 3

    def where(self) -> str:
        return "step 3, instruction 7 (0B1)"

    def progress(self) -> tuple | None:
        return (3, 7)


def test_where_follows_the_phase_and_the_runner() -> None:
    status = RankStatus()
    assert (status.where(), status.where_stopped(), status.progress()) == ("set-up", "during set-up", None)
    status.phase = "steps"
    assert status.where() == "steps"  # no runner yet
    status.runner = FakeRunner()
    assert status.where() == "step 3, instruction 7 (0B1)"
    assert status.where_stopped() == "at step 3, instruction 7 (0B1)"
    assert status.progress() == (3, 7)
    status.phase = "writing the checkpoint of step 4"
    assert status.where() == "writing the checkpoint of step 4"
    stopped = "while writing the checkpoint of step 4 (not committed; the previous one is intact)"
    assert status.where_stopped() == stopped
    status.phase = "writing the outputs"
    assert status.where_stopped() == "while writing the outputs (none kept)"


def test_a_failure_is_described_where_the_status_says_unless_it_names_its_place() -> None:
    status = RankStatus()
    status.phase = "after the last step"
    assert describe_failure(ValueError("bad"), 2, status) == "rank 2: after the last step: ValueError: bad"

    class LocatedError(PipecError):
        located = True

    assert describe_failure(LocatedError("rank 1: step 0: stopped"), 1, status) == "rank 1: step 0: stopped"


def test_outputs_being_written_are_known_until_done_and_removed_when_abandoned(tmp_path: Path) -> None:
    status = RankStatus()
    seen: list[set[str]] = []

    def writer(stream) -> None:
        seen.append(set(status.partial_files))
        stream.write(b"data")

    write_with(str(tmp_path / "out.bin"), status.tracked(writer))
    assert len(seen[0]) == 1 and not status.partial_files  # known while written, forgotten once renamed
    assert (tmp_path / "out.bin").read_bytes() == b"data"

    leftover = tmp_path / "partial.tmp"
    leftover.write_bytes(b"half")
    directory = tmp_path / "checkpoint.tmp"
    (directory / "inner").mkdir(parents=True)
    status.partial_files.add(str(leftover))
    status.track_directory(str(directory))
    status.abandon_outputs()
    assert not leftover.exists() and not directory.exists()
    status.track_directory(None)
    assert not status.partial_dirs


def test_the_parent_is_gone_once_this_process_is_not_its_child() -> None:
    assert not RankStatus().parent_gone()  # no parent known: never gone
    assert not RankStatus(os.getppid()).parent_gone()
    assert RankStatus(os.getpid()).parent_gone()  # this process is not its own child
