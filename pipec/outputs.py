"""Writing what the user asked for without losing what was there: checks before work, atomic writes.

Every output a command writes (`-o`, `--trace`, `--save`, `--report`) goes through here:
- `check_outputs` runs before any work starts: an output that names an input, another output or a directory,
  or whose directory is missing or not writable, is refused at once (exit 2), so that no long run is lost to
  a typo in the last flag;
- `write_text` / `write_with` write to a temporary file in the same directory, flush and fsync it, then rename
  it over the target, so an interrupted or failed write (full disk, file-size limit, a signal) leaves the old
  file intact and no half file. Character devices and FIFOs (`-o /dev/stdout`, `/dev/null`) are written in
  place: they cannot be renamed over.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import BinaryIO

from pipec.errors import PipecInputError


def _identity(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _special(path: str) -> bool:
    """A path that exists and is not a regular file or directory (a device, a FIFO, a socket)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def check_outputs(outputs: Mapping[str, str | None], inputs: Iterable[str | None] = ()) -> None:
    """Refuse, before any work, outputs that would destroy an input or another output, or cannot be written.

    `outputs` maps the flag that named it (for the message) to a path or None; `inputs` are paths the command
    reads (names that are not files, such as a bundled schedule, are ignored).
    """
    seen: dict[object, str] = {}
    for path in inputs:
        if path and not _special(path):
            key = _identity(path)
            if key is not None:
                seen[key] = f"the input {path}"
                seen[os.path.realpath(path)] = f"the input {path}"
    for flag, path in outputs.items():
        if not path:
            continue
        if _special(path):
            continue  # /dev/stdout, /dev/null, a FIFO: written in place, nothing to lose
        real = os.path.realpath(path)
        key = _identity(path)
        for mark in (key, real):
            if mark is not None and mark in seen:
                raise PipecInputError(f"{flag} {path} is {seen[mark]}; refusing to overwrite it (name another file)")
        if os.path.isdir(path):
            raise PipecInputError(f"{flag} {path} is a directory; give a file name")
        folder = os.path.dirname(real) or "."
        if not os.path.isdir(folder):
            raise PipecInputError(f"{flag} {path}: the directory {os.path.dirname(path) or '.'} does not exist")
        _probe(flag, path, folder)
        label = f"the output of {flag} {path}"
        if key is not None:
            seen[key] = label
        seen[real] = label


def _probe(flag: str, path: str, folder: str) -> None:
    """Create and remove a file beside the output: the only test that also holds for root, for whom os.access
    says yes on a read-only mount, /proc or /sys, where the write would otherwise fail only after the work."""
    try:
        handle, probe = tempfile.mkstemp(prefix=".pipec-probe-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as e:
        raise PipecInputError(f"{flag} {path}: cannot create a file in {folder}: {e.strerror or e}") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise PipecInputError(f"{flag} {path}: the file exists and is not writable")


def write_text(path: str, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically; on failure the old file is intact and PipecInputError says why."""
    data = text.encode("utf-8")
    write_with(path, lambda stream: stream.write(data))


def write_with(path: str, writer: Callable[[BinaryIO], object]) -> None:
    """Call `writer` on a binary stream that becomes `path` only once it has been written in full."""
    if _special(path):
        try:
            with open(path, "wb") as stream:
                writer(stream)
        except OSError as e:
            raise PipecInputError(f"cannot write {path}: {e.strerror or e}") from None
        return
    real = os.path.realpath(path)  # through a symlink: replace its target, keep the link
    folder = os.path.dirname(real) or "."
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(real)}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise PipecInputError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(handle, "wb") as stream:
            writer(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, _mode_for(real))
        os.replace(temporary, real)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(e, OSError):
            kept = " (the previous file is unchanged)" if os.path.exists(real) else ""
            raise PipecInputError(f"cannot write {path}: {e.strerror or e}{kept}") from None
        raise


def _mode_for(path: str) -> int:
    """The existing file's permissions, or what a plain open() would have given (0o666 less the umask)."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(os.stat(path).st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def input_paths(*candidates: str | None) -> list[str]:
    """The candidates that name existing files (a SCHEDULE may be a bundled name or source text)."""
    return [c for c in candidates if c and "\n" not in c and Path(c).exists()]
