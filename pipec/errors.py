"""pipec's error family.

Every error a user can cause is a ``PipecError``; the CLI prints ``str(error)`` and exits with
``error.exit_code`` (2: bad input or usage, 1: the schedule is invalid). Errors about ``.pipe`` text carry a
``Span`` and render as ``file:line:col: error: ...`` with the source line and a caret.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """A region of a source file, 1-based, end exclusive."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int
    text: str = ""  # the whole source, so that errors can show the offending line

    def render(self, message: str) -> str:
        head = f"{self.file}:{self.line}:{self.column}: error: {message}"
        lines = self.text.splitlines()
        if not 1 <= self.line <= len(lines):
            return head
        source_line = lines[self.line - 1]
        width = self.end_column - self.column if self.end_line == self.line else len(source_line) - self.column + 1
        caret = " " * (self.column - 1) + "^" * max(1, width)
        return f"{head}\n    {source_line}\n    {caret}"


class PipecError(Exception):
    """Base of every error pipec raises on purpose."""

    exit_code = 2

    def __init__(self, message: str, span: Span | None = None, rank: int | None = None) -> None:
        self.message = message
        self.span = span
        self.rank = rank
        super().__init__(self.render())

    def render(self) -> str:
        message = f"rank {self.rank}: {self.message}" if self.rank is not None else self.message
        return self.span.render(message) if self.span is not None else f"error: {message}"


class PipecSyntaxError(PipecError):
    """The text of a .pipe file, CSV, text or JSON stream file does not parse."""


class PipecInputError(PipecError):
    """Bad usage: unknown schedule, unknown or missing parameter, bad value, failed `require`."""


class ScheduleProgramError(PipecError):
    """A per-rank program failed while it ran for the given parameters (division by zero, bad chunk, ...)."""


class ScheduleError(PipecError):
    """The compiled schedule is invalid: incomplete, duplicated, deadlocking or over its memory bound."""

    exit_code = 1
