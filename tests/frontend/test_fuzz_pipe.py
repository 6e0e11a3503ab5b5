"""Hostile and mutated input never reaches the user as a traceback or a hang (issue #12, "Nothing lost, nothing
silent"): every bundled schedule is mutated with seeded random edits (flipped and inserted bytes, non-UTF-8
among them, numbers made huge, lines deleted or duplicated, indentation changed) and run through `pipec compile`
and `pipec check` in-process, next to hand-made hostile inputs (empty and huge files, deep nesting, endless
loops, FIFOs and devices, absurd -P/-M/-V). Each run must return 0, 1 or 2 with no exception escaping
`pipec.cli.main`, no "Traceback" on stderr and a message when it fails, within a generous time limit (a SIGALRM
guard: it detects hangs, it does not measure speed) and a bounded growth of the address space.

More cases: PIPEC_FUZZ_CASES=200 pytest tests/frontend/test_fuzz_pipe.py (the mutations per schedule; default 16).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # as conftest.py does: run as a script too

import pytest
from paths import TESTS

from pipec.cli import main
from pipec.library import bundled_names, bundled_source
from pipec.limits import MAX_MICROBATCHES, MAX_NESTING, MAX_RANKS, MAX_SOURCE_BYTES, TEST_MAX_RANKS

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGALRM") or not hasattr(os, "mkfifo"), reason="POSIX only")

CASES_PER_SCHEDULE = int(os.environ.get("PIPEC_FUZZ_CASES", "16"))
CASE_SECONDS = 20  # a hang, not a slow case: the budgets stop a runaway expansion after at most ~1 s at P=4, M=8
GROWTH_BYTES = 3 << 30  # address space a case may add (the budgets keep these cases far below it)
ARGS = ["-P", "4", "-M", "8"]  # valid for every bundled schedule (V comes from each schedule's default)


class Hang(BaseException):
    """Raised by the alarm. A BaseException, so that no `except Exception` in pipec can swallow it."""


@dataclass
class Outcome:
    code: int | None
    out: str
    err: str
    seconds: float
    escaped: BaseException | None


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def ring(signum: int, frame: object) -> None:
        raise Hang(f"no answer after {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _address_space_cap(growth: int) -> Iterator[None]:
    """RLIMIT_AS at the current size plus `growth`: an input that makes pipec allocate without bound fails the
    case with a MemoryError instead of exhausting the machine."""
    try:
        import resource

        size = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        yield
        return
    cap = size + growth
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# What the CLI prints when an exception reaches its last-resort handlers; with PIPEC_TRACEBACK set, an unexpected
# exception is raised again instead (and escapes main, which this suite reports).
LAST_RESORT_MESSAGES = ("internal error", "error: out of memory", "the input is nested too deeply to process")


def run(argv: list[str], seconds: float = CASE_SECONDS) -> Outcome:
    """pipec.cli.main(argv) in-process, with stdout and stderr captured, under the hang and memory guards."""
    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    escaped: BaseException | None = None
    start = time.monotonic()
    saved = os.environ.get("PIPEC_TRACEBACK")
    os.environ["PIPEC_TRACEBACK"] = "1"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            with _address_space_cap(GROWTH_BYTES), _alarm(seconds):
                code = main(argv)
    except BaseException as e:  # anything escaping main is the failure this suite looks for
        escaped = e
    finally:
        if saved is None:
            del os.environ["PIPEC_TRACEBACK"]
        else:
            os.environ["PIPEC_TRACEBACK"] = saved
    return Outcome(code, out.getvalue(), err.getvalue(), time.monotonic() - start, escaped)


def problem(argv: list[str], outcome: Outcome) -> str | None:
    """What is wrong with one run, or None."""
    where = " ".join(a if len(a) < 60 else a[:57] + "..." for a in argv)
    if isinstance(outcome.escaped, Hang):
        return f"{where}: hang (no answer within {CASE_SECONDS} s)"
    if outcome.escaped is not None:
        return f"{where}: {type(outcome.escaped).__name__} escaped main: {str(outcome.escaped)[:300]}"
    if outcome.code not in (0, 1, 2):
        return f"{where}: exit code {outcome.code}"
    if "Traceback" in outcome.err or "Traceback" in outcome.out:
        return f"{where}: a traceback was printed:\n{outcome.err[-2000:]}"
    for last_resort in LAST_RESORT_MESSAGES:  # the CLI's safety net caught what pipec should have refused itself
        if last_resort in outcome.err:
            return f"{where}: {outcome.err[:300]}"
    if outcome.code == 2 and "error" not in outcome.err:
        return f"{where}: exit 2 without an error message: {outcome.err[:300]!r}"
    if outcome.code == 1 and not (outcome.err or outcome.out).strip():
        return f"{where}: exit 1 without a report"
    return None


# ---- mutations ---------------------------------------------------------------------------------------------------

Mutation = Callable[[random.Random, bytes], bytes]
_NUMBER = re.compile(rb"\d+")


def flip_byte(rng: random.Random, data: bytes) -> bytes:
    at = rng.randrange(len(data))
    return data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]


def insert_bytes(rng: random.Random, data: bytes) -> bytes:
    at = rng.randrange(len(data) + 1)
    pool = [b"\xff", b"\xc3", b"\x80", b"\xe2\x82", b"\x00", b"\t", b"\r", b"\\", b"(", b"[", b":", b"\n", b" ",
            "\u2028".encode(), "\u00e9".encode(), b"\xef\xbb\xbf"]
    junk = b"".join(rng.choice(pool) if rng.random() < 0.6 else bytes([rng.randrange(256)])
                    for _ in range(rng.randint(1, 6)))
    return data[:at] + junk + data[at:]


def huge_number(rng: random.Random, data: bytes) -> bytes:
    """Replace a number (the mutations that hung pipec: a default or a bound grown to millions or more)."""
    numbers = list(_NUMBER.finditer(data))
    if not numbers:
        return insert_bytes(rng, data)
    m = rng.choice(numbers)
    digits = rng.choice([2, 3, 4, 6, 7, 9, 12, 18, 19, 25, 300, 5000])
    value = str(rng.randrange(10 ** (digits - 1), 10**digits)).encode() if digits < 300 else b"9" * digits
    return data[: m.start()] + value + data[m.end() :]


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def delete_line(rng: random.Random, data: bytes) -> bytes:
    lines = _lines(data)
    del lines[rng.randrange(len(lines))]
    return b"\n".join(lines)


def duplicate_line(rng: random.Random, data: bytes) -> bytes:
    lines = _lines(data)
    at = rng.randrange(len(lines))
    lines[at:at] = [lines[at]] * rng.choice([1, 2, 50])
    return b"\n".join(lines)


def reindent(rng: random.Random, data: bytes) -> bytes:
    lines = _lines(data)
    at = rng.randrange(len(lines))
    line = lines[at]
    stripped = line.lstrip(b" \t")
    indent = rng.choice([b"", b" ", b"  ", b"\t", b"    " * rng.randint(1, 4), line[: len(line) - len(stripped)] * 2])
    lines[at] = indent + stripped
    return b"\n".join(lines)


def swap_words(rng: random.Random, data: bytes) -> bytes:
    """Put one token where another was: keeps the text lexically plausible, so the parser gets further."""
    words = list(re.finditer(rb"[A-Za-z_]+|\d+|[^\sA-Za-z_\d]", data))
    if len(words) < 2:
        return flip_byte(rng, data)
    target, source = rng.choice(words), rng.choice(words)
    return data[: target.start()] + source.group() + data[target.end() :]


MUTATIONS: list[Mutation] = [flip_byte, insert_bytes, huge_number, delete_line, duplicate_line, reindent, swap_words]


def mutants(name: str, count: int) -> Iterator[tuple[int, bytes]]:
    """(seed, text) pairs; the seed reproduces the mutant: mutate(name, seed)."""
    for seed in range(count):
        yield seed, mutate(name, seed)


def mutate(name: str, seed: int) -> bytes:
    rng = random.Random(f"{name}/{seed}")  # str seeds hash with SHA-512: the same mutants on every run
    data = bundled_source(name).encode()
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        data = rng.choice(MUTATIONS)(rng, data) or b"\n"
    return data


@pytest.mark.parametrize("name", bundled_names())
def test_mutated_schedules_end_in_a_verdict_or_a_message(name: str, tmp_path: Path) -> None:
    failures = []
    counts = {0: 0, 1: 0, 2: 0}
    for seed, data in mutants(name, CASES_PER_SCHEDULE):
        path = tmp_path / f"{name}_{seed}.pipe"
        path.write_bytes(data)
        for argv in _commands(path):
            outcome = run(argv)
            found = problem(argv, outcome)
            if found:
                failures.append(f"seed {seed}: {found}")
            elif outcome.code is not None:
                counts[outcome.code] += 1
    assert not failures, "\n".join(failures)
    assert sum(counts.values()) == len(_commands(tmp_path)) * CASES_PER_SCHEDULE


def _commands(path: Path) -> list[list[str]]:
    """compile and check, and the AST dump (it walks the tree the parser built, recursively)."""
    return [["compile", str(path), *ARGS], ["check", str(path), *ARGS], ["compile", str(path), "--emit", "ast"]]


# ---- hand-made hostile inputs ------------------------------------------------------------------------------------


def _nested_blocks(depth: int) -> str:
    lines = ["schedule deep", "per rank r:"]
    lines += ["    " * (level + 1) + "if 1:" for level in range(depth)]
    lines.append("    " * (depth + 1) + "F")
    return "\n".join(lines) + "\n"


def _program(body: str, header: str = "") -> str:
    return f"schedule hostile\n{header}per rank r:\n" + "".join(f"    {line}\n" for line in body.splitlines())


HOSTILE_TEXTS = {
    "empty": "",
    "blank": "\n\n   \n\t\n",
    "comment_only": "# nothing here\n",
    "bom_only": "\ufeff",
    "nul_bytes": "schedule x\x00\nper rank r:\n    F\n",
    "blocks_300": _nested_blocks(300),
    "blocks_1000": _nested_blocks(1000),  # 2 MB of indentation: over the size limit before the nesting one
    "blocks_at_limit": _nested_blocks(MAX_NESTING - 1),
    "parens_20000": _program("x = " + "(" * 20000 + "1" + ")" * 20000),
    "unclosed_parens": _program("x = " + "(" * 20000),
    "unary_100000": _program("x = " + "-" * 100000 + "1"),
    "nots_50000": _program("x = " + "not " * 50000 + "1"),
    "sum_100000": _program("x = 1" + " + 1" * 100000),
    "chunk_nesting": _program("F" + "[" * 5000 + "0" + "]" * 5000),
    "literal_5000_digits": _program("repeat " + "9" * 5000 + ": F"),
    "rank_5000_digits": "schedule x\nrank " + "9" * 5000 + ": 0F0\n",
    "action_5000_digits": "schedule x\nrank 0: 0F" + "9" * 5000 + "\n",
    "while_forever": _program("while 1: pass"),
    "while_emitting": _program("while 1: F"),
    "many_ops_per_iteration": _program("repeat 100000000:\n    " + " ".join(["F"] * 5000)),
    "nested_repeats": _program("repeat 999999999999999999:\n    repeat 999999999999999999:\n        F"),
    "squaring": _program("x = 2\nwhile 1:\n    x = x * x"),
    "doubling": _program("x = 1\nwhile 1:\n    x = x + x"),
    "huge_for": _program("for k in 0 .. 999999999999999999: F @ k"),
    "pending_scan": _program("repeat 50000: I\nwhile pending(W) > 0:\n    W\n    F"),
    "drain_everything": _program("repeat 999999999999999999: I\ndrain W"),
    "huge_let": "schedule x\nlet big = 999999999999999999 * 999999999999999999 * 999999999999999999\n"
    "per rank r:\n    F\n",
    "huge_default_V": "schedule x\nparams P, M, V = 999999999999\nper rank r:\n    F\n",
    "huge_memory_fraction": "schedule x\nmemory 1" + " / 3" * 60 + "\nper rank r:\n    F\n",
    "huge_placement": "schedule x\nplacement s -> s * 999999999999999999 * 999999999\nper rank r:\n    F\n",
    "long_line": _program("x = 1 " + " " * 500_000 + "\nF"),
    "many_lines": _program("\n".join(["x = 1"] * 60_000)),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TEXTS))
def test_hostile_pipe_text_ends_in_a_message(case: str, tmp_path: Path) -> None:
    path = tmp_path / f"{case}.pipe"
    path.write_text(HOSTILE_TEXTS[case], encoding="utf-8")
    for command in ("compile", "check"):
        argv = [command, str(path), *ARGS]
        outcome = run(argv)
        assert problem(argv, outcome) is None, problem(argv, outcome)


def test_runaway_programs_name_what_stopped_them(tmp_path: Path) -> None:
    cases = {
        "squaring": "beyond pipec's limit of 10**18",
        "doubling": "beyond pipec's limit of 10**18",
        "huge_let": "beyond pipec's limit of 10**18",
        "while_forever": "the program ran too long",
        "many_ops_per_iteration": "the program ran too long",
        "literal_5000_digits": "integer literal with 5,000 digits; pipec allows at most 18",
        "rank_5000_digits": "integer literal with 5,000 digits",
        "action_5000_digits": "the micro-batch number is over pipec's limit",
        "blocks_300": f"nested more than {MAX_NESTING} levels deep",
        "blocks_1000": f"larger than the limit of {MAX_SOURCE_BYTES >> 20} MiB",
        "sum_100000": f"nested more than {MAX_NESTING} levels deep",
        "huge_default_V": "V = 999,999,999,999 (the schedule's default) is over pipec's limit of 1,024",
    }
    for case, message in cases.items():
        path = tmp_path / f"{case}.pipe"
        path.write_text(HOSTILE_TEXTS[case])
        outcome = run(["compile", str(path), *ARGS])
        assert outcome.code == 2, (case, outcome.err)
        assert message in outcome.err, (case, outcome.err)
    # the location comes with it: file:line:col of the literal
    outcome = run(["compile", str(tmp_path / "literal_5000_digits.pipe"), *ARGS])
    assert outcome.err.startswith(f"{tmp_path / 'literal_5000_digits.pipe'}:3:12: error: integer literal"), outcome.err


def test_nesting_at_the_limit_still_compiles(tmp_path: Path) -> None:
    path = tmp_path / "deep.pipe"
    path.write_text(_nested_blocks(MAX_NESTING - 1))
    for argv in (["compile", str(path), "-P", "1", "-M", "1", "--no-verify"], ["compile", str(path), "--emit", "ast"]):
        outcome = run(argv)
        assert outcome.code == 0, outcome.err


def test_a_bad_byte_is_named_by_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.pipe"
    path.write_bytes(b"schedule bad\nper rank r:\n    repeat M: F \xff\n    repeat M: B\n")
    for command in ("compile", "check"):
        outcome = run([command, str(path), *ARGS])
        assert outcome.code == 2
        assert outcome.err.startswith(f"{path}:3:17: error: the file is not UTF-8 text: byte 0xff at line 3, column 17")
    # columns count characters, as the parser's do: an é before the bad byte is one column
    path.write_bytes("schedule bad\n# é\xe9\n".encode()[:-2] + b"\xe9\n")
    outcome = run(["check", str(path), *ARGS])
    assert "line 2, column 4" in outcome.err, outcome.err


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.pipe"
    path.write_bytes(b"\xef\xbb\xbf" + bundled_source("1f1b").encode())
    assert run(["check", str(path), *ARGS]).code == 0


def test_files_that_are_not_regular_are_refused_without_reading(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.pipe"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    outcome = run(["compile", str(fifo), *ARGS], seconds=10)
    assert outcome.code == 2 and "it is a FIFO, not a regular file" in outcome.err, outcome.err
    assert outcome.seconds < 5
    if Path("/dev/zero").exists():
        zero = tmp_path / "zero.pipe"
        zero.symlink_to("/dev/zero")  # reading it all would never end
        outcome = run(["check", str(zero), *ARGS], seconds=10)
        assert outcome.code == 2 and "it is a character device, not a regular file" in outcome.err, outcome.err
    folder = tmp_path / "folder.csv"
    folder.mkdir()
    outcome = run(["check", str(folder)])
    assert outcome.code == 2 and "it is a directory" in outcome.err, outcome.err


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.pipe"
    with path.open("wb") as f:  # 50 MB, sparse: the test writes nothing, pipec must read at most 1 MiB of it
        f.write(b"schedule huge\nper rank r:\n")
        f.truncate(50_000_000)
    outcome = run(["compile", str(path), *ARGS])
    assert outcome.code == 2
    assert f"larger than the limit of {MAX_SOURCE_BYTES >> 20} MiB" in outcome.err, outcome.err
    text = "schedule huge\nper rank r:\n" + "    pass\n" * (MAX_SOURCE_BYTES // 9)
    outcome = run(["compile", text, *ARGS])  # source text given directly is capped too
    assert outcome.code == 2 and "over the limit of 1 MiB" in outcome.err, outcome.err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-P", "4", "-M", "1000000000000"], f"M = 1,000,000,000,000 (--microbatches) is over pipec's limit of "
         f"{MAX_MICROBATCHES:,}"),
        (["-P", "1000000000000", "-M", "4"], f"(--ranks) is over pipec's limit of {MAX_RANKS:,}"),
        (["-P", "4", "-M", "8", "-V", "1000000000000"], "(--chunks) is over pipec's limit of 1,024"),
        (["-P", "60000", "-M", "60000"], "ops, over pipec's limit of 10,000,000"),
        (["-P", "4", "-M", "10000000"], "(--microbatches) is over pipec's limit"),
        (["-P", "4", "-M", "8", "-V", "999999999999999999"], "(--chunks) is over pipec's limit"),
    ],
)
def test_huge_sizes_fail_fast_naming_the_limit(flags: list[str], message: str) -> None:
    for command in ("compile", "check"):
        outcome = run([command, "interleaved_1f1b", *flags], seconds=10)
        assert outcome.code == 2, outcome.err
        assert message in outcome.err, outcome.err
        assert outcome.seconds < 5  # refused before anything is allocated (it took minutes and gigabytes)


def test_stream_files_with_huge_numbers_are_refused(tmp_path: Path) -> None:
    """The stream loaders have their own checks; whichever refuses first, the answer is a message, fast."""
    csv = tmp_path / "huge.csv"
    csv.write_text("0F0,0F" + "9" * 40 + ",0B0\n1F0,1B0\n")
    json = tmp_path / "huge.json"
    json.write_text(
        '{"format": "pipec.streams", "version": 1, "ranks": 1, "microbatches": 1000000000000, "chunks": 1, '
        '"stages": 1, "placement": [0], "streams": [["0F0", "0B0"]]}'
    )
    for path in (csv, json):
        argv = ["check", str(path)]
        outcome = run(argv, seconds=10)
        assert problem(argv, outcome) is None, problem(argv, outcome)
        assert outcome.code == 2 and outcome.seconds < 5, outcome.err


def test_pipec_test_refuses_unbounded_sizes_up_front() -> None:
    outcome = run(["test", "1f1b", "--max-ranks", "100000"], seconds=10)
    assert outcome.code == 2
    assert f"--max-ranks 100,000 is over the limit of {TEST_MAX_RANKS:,}" in outcome.err, outcome.err
    assert outcome.seconds < 5


def test_pipec_test_bounds_the_parameter_space_it_enumerates(tmp_path: Path) -> None:
    path = tmp_path / "wide.pipe"
    path.write_text("schedule wide\nparams P, M, x in 0 .. 1000000000000000\nper rank r:\n    repeat M: F\n"
                    "    repeat M: B\n")
    outcome = run(["test", str(path), "--examples", "2"], seconds=60)
    assert outcome.code == 2 and "constraint checks, pipec's limit" in outcome.err, outcome.err


def test_a_negative_micro_batch_cannot_stand_in_for_another_op() -> None:
    """1F-1 has the int key of 0F0 in the verifier's flat form: rank 0 running nothing looked complete."""
    import pipec
    from pipec.verify import verify

    program = pipec.load(str(TESTS / "bad_schedules" / "negative_microbatch.pipe"), 2, 1)
    for model in ("nccl", "tagged"):
        report = verify(program, p2p=model)
        assert not report.ok
        assert "rank 1 op 0 1F-1: micro-batch -1 is outside 0..0" in report.render()


if __name__ == "__main__":  # a longer fuzzing run: python tests/frontend/test_fuzz_pipe.py [cases per schedule]
    import tempfile

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    totals = {0: 0, 1: 0, 2: 0}
    bad = 0
    with tempfile.TemporaryDirectory() as folder:
        for name in bundled_names():
            for seed, data in mutants(name, count):
                path = Path(folder) / f"{name}_{seed}.pipe"
                path.write_bytes(data)
                for argv in _commands(path):
                    outcome = run(argv)
                    found = problem(argv, outcome)
                    if found:
                        bad += 1
                        print(f"{name} seed {seed}: {found}", flush=True)
                    else:
                        totals[outcome.code or 0] += 1
    print(f"exit codes {totals}, problems {bad}")
