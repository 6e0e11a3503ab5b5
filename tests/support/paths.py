"""Where the suite's files are, for tests in any folder: the data folders stay at tests/ (bad_schedules, golden,
reference, diagnostics, sim_diagnostics), the shared helpers and workloads in tests/support (on sys.path, see
conftest.py)."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
