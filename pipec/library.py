"""Finding schedules: bundled names, .pipe paths, source text, torch CSV, text and JSON stream files.

A SCHEDULE argument is untrusted: a file is opened without blocking and read only if it is a regular file (a
FIFO or a device such as /dev/zero would block or never end), at most a size cap plus one byte is read, and text
that is not UTF-8 is refused with the line and column of the first bad byte.
"""

from __future__ import annotations

import os
import stat
from importlib import resources
from pathlib import Path
from typing import Any

from pipec.errors import PipecInputError, PipecSyntaxError, Span
from pipec.limits import MAX_SOURCE_BYTES, MAX_STREAM_BYTES, MiB

_KINDS = {".pipe": "pipe", ".csv": "csv", ".json": "json", ".txt": "text"}


def bundled_names() -> list[str]:
    folder = resources.files("pipec").joinpath("schedules")
    return sorted(entry.name[: -len(".pipe")] for entry in folder.iterdir() if entry.name.endswith(".pipe"))


def bundled_source(name: str) -> str:
    return resources.files("pipec").joinpath("schedules", f"{name}.pipe").read_text(encoding="utf-8")


def resolve(schedule: str) -> tuple[str, str, str]:
    """Classify a SCHEDULE argument. Returns (kind, text, filename) where kind is pipe, csv, text or json."""
    if "\n" in schedule:
        size = len(schedule.encode("utf-8", "surrogatepass"))
        if size > MAX_SOURCE_BYTES:
            raise PipecInputError(f"the schedule text is {size:,} bytes, over the limit of {_mib(MAX_SOURCE_BYTES)}")
        return "pipe", schedule, "<string>"
    path = Path(schedule)
    suffix = path.suffix.lower()
    if suffix in _KINDS:
        kind = _KINDS[suffix]
        return kind, read_text(schedule, MAX_SOURCE_BYTES if kind == "pipe" else MAX_STREAM_BYTES), schedule
    if schedule in bundled_names():
        return "pipe", bundled_source(schedule), f"{schedule}.pipe"
    if path.exists():
        raise PipecInputError(f"{schedule}: unknown file type; expected .pipe, .csv (torch), .txt or .json")
    guess = closest_name(schedule, bundled_names())
    raise PipecInputError(
        f"unknown schedule {schedule!r}{f' (did you mean {guess}?)' if guess else ''}; bundled schedules: "
        f"{', '.join(bundled_names())} "
        "(or give a path to a .pipe, torch .csv, .txt or .json file)"
    )


def closest_name(typed: str, names: list[str]) -> str | None:
    """The name `typed` most likely meant: the same but for case and - for _ (`1F1B`, `interleaved-1f1b`), else
    the closest by difflib's ratio (`zbh1`), else None."""
    import difflib

    def folded(name: str) -> str:
        return name.lower().replace("-", "_")

    by_fold = {folded(n): n for n in names}
    if folded(typed) in by_fold:
        return by_fold[folded(typed)]
    close = difflib.get_close_matches(folded(typed), list(by_fold), n=1, cutoff=0.6)
    return by_fold[close[0]] if close else None


def read_text(filename: str, limit: int) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes; anything else is a PipecError, never a hang."""
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; on a regular file it does nothing
        fd = os.open(filename, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise PipecInputError(f"cannot read {filename}: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PipecInputError(f"cannot read {filename}: it is {_file_type(mode)}, not a regular file")
        data = _read_at_most(fd, limit + 1)  # one byte more than allowed tells "too big" without reading it all
    except OSError as e:
        raise PipecInputError(f"cannot read {filename}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise PipecInputError(f"{filename} is larger than the limit of {_mib(limit)} for this kind of file")
    return decode(data, filename)


def parse_json(text: str, where: str, what: str) -> Any:
    """JSON text to Python values, or a PipecSyntaxError naming `where` (file:line:col) and `what` the file should
    be: Python's own errors for deep nesting and huge integers are not messages a user can act on."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PipecSyntaxError(f"{where}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    except RecursionError:
        raise PipecSyntaxError(f"{where}: not {what}: the JSON is nested too deeply") from None
    except ValueError:  # an integer of more digits than Python converts (4,300)
        raise PipecSyntaxError(f"{where}: not {what}: a number has thousands of digits") from None


def _read_at_most(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, MiB))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def decode(data: bytes, filename: str) -> str:
    """UTF-8 (a leading byte-order mark is dropped); a bad byte is a PipecSyntaxError at its line and column."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        line_start = data.rfind(b"\n", 0, e.start) + 1
        column = len(data[line_start : e.start].decode("utf-8", "replace")) + 1  # in characters, as Lark counts
        shown = data.decode("utf-8", "replace")  # so that the error can show the line, with U+FFFD for the byte
        span = Span(filename, line, column, line, column + 1, shown)
        raise PipecSyntaxError(
            f"the file is not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}, column {column} cannot be decoded",
            span,
        ) from None
    return text[1:] if text.startswith("\ufeff") else text


def _file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a special file"


def _mib(limit: int) -> str:
    return f"{limit // MiB} MiB" if limit % MiB == 0 else f"{limit:,} bytes"
