"""Golden-file comparison shared by the golden-stream and diagnostics tests.

Set PIPEC_UPDATE_GOLDEN=1 to rewrite the expected files from the current output (then review the diff).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path


def assert_matches_golden(actual: str, path: Path) -> None:
    if os.environ.get("PIPEC_UPDATE_GOLDEN") == "1" or not path.exists():
        if os.environ.get("PIPEC_UPDATE_GOLDEN") != "1":
            raise AssertionError(f"{path} does not exist; run with PIPEC_UPDATE_GOLDEN=1 to create it")
        path.write_text(actual)
        return
    expected = path.read_text()
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), str(path), "actual"))
        raise AssertionError(f"output differs from {path}:\n{diff}")
