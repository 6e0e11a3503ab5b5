"""`pipec.cli.main` in-process with its output captured, for the tests that read what a command printed."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from pipec.cli import main


def run_main(argv: list[str], cwd: Path | None = None) -> tuple[int, str, str]:
    """`pipec ARGV` in-process (in directory `cwd` if given): exit code, stdout, stderr. main returns argparse's
    usage errors as exit codes too, so nothing here needs to catch SystemExit."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()
