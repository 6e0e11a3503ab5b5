"""Where this worker process is, for its guard thread and its error messages: the phase (set-up, steps, writing a
checkpoint, after the last step, writing the outputs), the runner whose stream it is running, the temporary
files of outputs being written (removed when the process is stopped), and the process that started it.

One `RankStatus` per worker: launch.py creates it with the worker and hands it to the guard and to the function
the worker runs (`launch.spawn(..., pass_status=True)`), which keeps it up to date (worker.train); nothing here
is module state. This module imports no other part of the runtime, and torch only to name the rank (`rank_or_unknown`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import BinaryIO, Protocol

from pipec.errors import PipecError


class Stream(Protocol):
    """What the status reads of the runner whose stream this process runs (runner.Runner)."""

    step_index: int

    def where(self) -> str: ...

    def progress(self) -> tuple | None: ...


class RankStatus:
    """This worker's phase, its runner during the steps, its outputs being written and its parent's pid."""

    def __init__(self, parent_pid: int | None = None) -> None:
        self.parent_pid = parent_pid  # the process that started this worker (None: not known, never gone)
        self.phase = "set-up"  # set-up, steps, writing a checkpoint, after the last step, writing the outputs
        self.runner: Stream | None = None  # the runner whose stream this process runs, during training
        self.partial_files: set[str] = set()  # temporary files of outputs being written
        self.partial_dirs: set[str] = set()  # the temporary directory of a checkpoint being written

    def where(self) -> str:
        if self.phase == "steps" and self.runner is not None:
            return self.runner.where()
        return self.phase

    def where_stopped(self) -> str:
        """Where this rank was, for the message of a rank stopped by a signal."""
        phase = self.phase
        if phase == "steps" and self.runner is not None:
            return "at " + self.runner.where()
        if phase == "writing the outputs":
            return "while writing the outputs (none kept)"
        if phase.startswith("writing the checkpoint"):
            return f"while {phase} (not committed; the previous one is intact)"
        return "during set-up" if phase == "set-up" else phase

    def progress(self) -> tuple | None:
        """What changes while this rank runs its stream (the guard thread compares it over time); None outside
        the stream (set-up, between steps), where only collectives block and the process group's timeout bounds
        them."""
        return None if self.runner is None else self.runner.progress()

    def parent_gone(self) -> bool:
        """Whether the process that started this worker has died or is dying. Its children are re-parented once
        it is gone; but its death signal (PR_SET_PDEATHSIG) comes when its main thread exits, and the children
        belong to its other threads, under the same pid, until they too have exited: /proc shows that main
        thread a zombie."""
        if self.parent_pid is None:
            return False
        if os.getppid() != self.parent_pid:
            return True
        try:
            with open(f"/proc/{self.parent_pid}/status") as status:
                state = next((line for line in status if line.startswith("State:")), "")
        except OSError:
            return False  # no /proc: getppid() alone decides
        return "Z" in state or "X" in state

    def tracked(self, writer: Callable[[BinaryIO], object]) -> Callable[[BinaryIO], object]:
        """`writer`, with the temporary file it writes known to `abandon_outputs` while it is being written."""

        def write(stream: BinaryIO) -> object:
            name = None
            with contextlib.suppress(OSError, ValueError):
                name = os.readlink(f"/proc/self/fd/{stream.fileno()}")  # Linux: the temporary file's path
            if name:
                self.partial_files.add(name)
            try:
                return writer(stream)
            finally:
                self.partial_files.discard(name or "")

        return write

    def track_directory(self, path: str | None) -> None:
        """The temporary directory of the checkpoint being written, for `abandon_outputs` (None: no longer any)."""
        self.partial_dirs.clear()
        if path is not None:
            self.partial_dirs.add(path)

    def abandon_outputs(self) -> None:
        """Remove the temporary files of outputs being written, and the temporary directory of a checkpoint: the
        process is about to end without finishing."""
        import shutil

        for path in list(self.partial_files):
            with contextlib.suppress(OSError):
                os.unlink(path)
        for path in list(self.partial_dirs):
            shutil.rmtree(path, ignore_errors=True)


def describe_failure(error: BaseException, rank: int, status: RankStatus) -> str:
    text = error.message if isinstance(error, PipecError) else f"{type(error).__name__}: {error}"
    text = text.strip() or type(error).__name__
    if len(text) > 800:
        text = text[:800] + " ..."
    if getattr(error, "located", False):  # the message already names the rank and where it was
        return text
    return f"rank {rank}: {status.where()}: {text}"


def rank_or_unknown() -> str:
    """This process's rank in the default process group, or "?" before it has joined one."""
    import torch.distributed as dist

    return str(dist.get_rank()) if dist.is_initialized() else "?"
