"""Hostile stream files and cost models never reach the user as a traceback, a hang or an exhausted machine
(issue #12, "Nothing lost, nothing silent").

Bundled schedules are compiled to every stream format (text, JSON, torch CSV with and without comms), mutated with
seeded random edits (flipped and non-UTF-8 bytes, numbers made huge, lines deleted, duplicated or swapped, actions
replaced or swapped, truncation, JSON fields given other types, deep nesting, NaN), and run through `pipec check`,
`compile`, `simulate`, `show` and `viz` in-process; `--cost` flags and cost files are fuzzed the same way through
simulate, show and viz. Each run must return 0, 1 or 2 with nothing escaping `pipec.cli.main`, no "Traceback" and
no last-resort message on stderr, within a generous time limit (a SIGALRM guard: hang detection, not a speed test)
and a bounded growth of the address space. The guards and the generic mutations are tests/frontend/test_fuzz_pipe.py's.

More cases: PIPEC_FUZZ_STREAM_CASES=500 pytest tests/frontend/test_fuzz_streams.py (mutants per format; default 120).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from test_fuzz_pipe import delete_line, duplicate_line, flip_byte, huge_number, insert_bytes, problem, run

import pipec
from pipec.emit import FORMATS, emit

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="POSIX only")

CASES_PER_FORMAT = int(os.environ.get("PIPEC_FUZZ_STREAM_CASES", "120"))
SUFFIX = {"text": ".txt", "json": ".json", "torch-csv": ".csv", "torch-csv-comms": ".csv"}
# (schedule, P, M, V): 1F1B at three sizes, two chunks per rank in both placements, and overlapped pairs
SCHEDULES = [
    ("1f1b", 2, 4, 1),
    ("1f1b", 3, 5, 1),
    ("1f1b", 4, 6, 1),
    ("interleaved_1f1b", 2, 4, 2),
    ("zbv", 2, 4, 2),
    ("dualpipev", 2, 4, 2),
]
# each mutant runs `check` and one of these, in turn (viz also gets its output flags)
SECOND_COMMANDS = (
    ["simulate"],
    ["show"],
    ["compile", "--format", "json"],
    ["viz"],
    ["simulate", "--why"],
    ["simulate", "--p2p", "tagged", "--format", "json"],
    ["show", "--p2p", "ideal"],
)

_ACTION = re.compile(rb"\d+(?:SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)\d+")
_KINDS = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")


def _base(schedule: tuple[str, int, int, int], fmt: str) -> bytes:
    return emit(pipec.compile(*schedule), fmt).encode()


BASES = {(schedule, fmt): _base(schedule, fmt) for schedule in SCHEDULES for fmt in FORMATS}


# ---- stream mutations (on top of test_fuzz_pipe's byte and line edits) ------------------------------------------


def replace_action(rng: random.Random, data: bytes) -> bytes:
    """An action becomes another, mostly with a stage and a micro-batch the file already uses: it still loads and
    is often structurally wrong (a stage on the wrong rank, a duplicate, a missing op, a send without its receive,
    an overlapped pair), which takes the mutant past the loader into the verifier and the simulator."""
    actions = list(_ACTION.finditer(data))
    if not actions:
        return flip_byte(rng, data)
    numbers = [re.fullmatch(rb"(\d{1,18})\D+(\d{1,18})", m.group()) for m in actions]  # not the huge ones
    stages = [int(n[1]) for n in numbers if n]
    mbs = [int(n[2]) for n in numbers if n]
    if not stages:
        return flip_byte(rng, data)

    def action() -> str:
        stage = rng.choice(stages) if rng.random() < 0.9 else rng.randrange(8)
        return f"{stage}{rng.choice(_KINDS)}{rng.choice(mbs) if rng.random() < 0.9 else rng.randrange(10)}"

    m = rng.choice(actions)
    new = action()
    if rng.random() < 0.15:
        new = f"({new};{action()})OVERLAP_F_B"
    return data[: m.start()] + new.encode() + data[m.end() :]


def drop_or_repeat_action(rng: random.Random, data: bytes) -> bytes:
    """One action deleted, or written twice in a row: a missing or a repeated op, the file still well formed."""
    actions = list(_ACTION.finditer(data))
    if not actions:
        return flip_byte(rng, data)
    start, end = rng.choice(actions).span()
    if data[start - 1 : start] == b'"' and data[end : end + 1] == b'"':  # a JSON string: the quotes go with it
        start, end = start - 1, end + 1
    while end < len(data) and data[end : end + 1] in b", \n":  # and the separator after it
        end += 1
    if rng.random() < 0.5:
        return data[:start] + data[end:]
    return data[:start] + data[start:end] + data[start:]


def swap_actions(rng: random.Random, data: bytes) -> bytes:
    """Two actions trade places, possibly across ranks: the order changes, the text stays well formed."""
    actions = list(_ACTION.finditer(data))
    if len(actions) < 2:
        return flip_byte(rng, data)
    a, b = sorted(rng.sample(actions, 2), key=lambda m: m.start())
    return data[: a.start()] + b.group() + data[a.end() : b.start()] + a.group() + data[b.end() :]


def swap_lines(rng: random.Random, data: bytes) -> bytes:
    lines = data.split(b"\n")
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return b"\n".join(lines)


def truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data) + 1)]


_JUNK = [None, True, False, 0, -1, 1.5, "x", "", [], {}, [[]], 10**30, 2**63, [1, "2"], {"a": 1}]


def json_field(rng: random.Random, data: bytes) -> bytes:
    """A field of the document changed in type or value, deleted, or an unknown one added."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # already mutated past JSON
        return flip_byte(rng, data)
    if not isinstance(doc, dict) or not doc:
        return flip_byte(rng, data)
    key = rng.choice(sorted(doc))
    choice = rng.randrange(10)
    if choice == 0:
        del doc[key]
    elif choice == 1:
        doc["unknown_" + key] = 1
    elif choice == 2 and isinstance(doc.get("streams"), list) and doc["streams"]:
        stream = rng.choice(doc["streams"])
        if isinstance(stream, list) and stream:
            stream[rng.randrange(len(stream))] = rng.choice([*_JUNK, "0F99999", "999999F0", "0F0", "1SEND_F0"])
    elif choice == 3:
        ranks = doc.get("ranks") if isinstance(doc.get("ranks"), int) else 2
        doc["memory_bound"] = rng.choice(
            ["x", [float("nan")] * ranks, [None] * ranks, [-1] * ranks, [float("inf")] * ranks, [True] * ranks, [1]]
        )
    elif choice == 4:
        doc[rng.choice(["ranks", "microbatches", "chunks", "stages"])] = rng.choice([0, 1, 3, 10**6, 10**18, 10**100])
    elif choice == 5:
        doc["params"] = rng.choice(["x", {"P": "x"}, {"P": [1]}, None, {"Q": 10**100}, {"": 1}])
    elif choice == 6:
        doc["placement"] = rng.choice([[0], [10**9] * 4, [-1, 0], "0,1", [0.5, 1]])
    elif choice == 7:
        doc["has_comms"] = rng.choice([not doc.get("has_comms"), "yes", None, 1])
    elif choice == 8:
        doc["schedule"] = rng.choice(["", "\x1b[2J", "x" * 10_000, 7, None])
    else:
        doc[key] = rng.choice(_JUNK)
    # allow_nan: NaN and Infinity are not JSON, but Python's reader takes them and so may a user's file
    return json.dumps(doc, allow_nan=True).encode()


def json_nesting(rng: random.Random, data: bytes) -> bytes:
    """A value replaced by lists nested hundreds to hundreds of thousands deep (recursion in the JSON reader)."""
    depth = rng.choice([50, 900, 5000, 200_000])
    nested = b"[" * depth + b"]" * depth
    where = data.find(b"[")
    return data + nested if where < 0 else data[:where] + nested + b"," + data[where:]


Mutation = Callable[[random.Random, bytes], bytes]
COMMON: list[Mutation] = [
    flip_byte,
    insert_bytes,
    huge_number,
    huge_number,
    delete_line,
    duplicate_line,
    swap_lines,
    truncate,
    replace_action,
    replace_action,
    replace_action,
    drop_or_repeat_action,
    drop_or_repeat_action,
    swap_actions,
    swap_actions,
]
BY_FORMAT: dict[str, list[Mutation]] = {
    "text": COMMON,
    "torch-csv": COMMON,
    "torch-csv-comms": COMMON,
    "json": [*COMMON, json_field, json_field, json_field, json_nesting],
}


def mutant(fmt: str, seed: int) -> tuple[tuple[str, int, int, int], list[str], bytes]:
    """(the schedule it came from, the mutations applied, the bytes); the same on every run for (fmt, seed)."""
    rng = random.Random(f"{fmt}/{seed}")  # str seeds hash with SHA-512: stable across runs and platforms
    schedule = rng.choice(SCHEDULES)
    data = BASES[schedule, fmt]
    applied = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        if not data:  # truncated to nothing: an empty file is a case too, and the byte edits need a byte
            break
        mutation = rng.choice(BY_FORMAT[fmt])
        applied.append(mutation.__name__)
        data = mutation(rng, data)
    return schedule, applied, data


@pytest.mark.parametrize("fmt", FORMATS)
def test_mutated_stream_files_end_in_a_verdict_or_a_message(fmt: str, tmp_path: Path) -> None:
    failures = []
    codes = {0: 0, 1: 0, 2: 0}
    for seed in range(CASES_PER_FORMAT):
        schedule, applied, data = mutant(fmt, seed)
        path = tmp_path / f"m{seed}{SUFFIX[fmt]}"
        path.write_bytes(data)
        command, *flags = SECOND_COMMANDS[seed % len(SECOND_COMMANDS)]
        for argv in (["check", str(path)], [command, str(path), *flags, *_outputs(command, tmp_path)]):
            outcome = run(argv)
            found = problem(argv, outcome)
            if found:
                failures.append(f"{fmt} seed {seed} ({schedule}, {'+'.join(applied)}): {found}")
            elif outcome.code is not None:
                codes[outcome.code] += 1
    assert not failures, "\n".join(failures)
    # the mutants exercise both ends: files refused at load (2) and files that load and get a verdict (0 or 1)
    assert codes[2] and codes[0] + codes[1], codes


def _outputs(command: str, tmp_path: Path) -> list[str]:
    return ["-o", str(tmp_path / "picture.svg"), "--trace", str(tmp_path / "trace.json")] if command == "viz" else []


# ---- specific messages -----------------------------------------------------------------------------------------


def _check(path: Path, text: str | bytes) -> tuple[int | None, str]:
    if isinstance(text, str):
        text = text.encode()
    path.write_bytes(text)
    outcome = run(["check", str(path)])
    assert problem(["check", str(path)], outcome) is None, problem(["check", str(path)], outcome)
    return outcome.code, outcome.err


def test_a_huge_number_in_a_csv_names_the_line_and_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "huge.csv"
    code, err = _check(path, "0F0,0F1,0B0,0B1\n1F0,1B0,1F99999,1B1\n")
    assert code == 2
    assert err.startswith(f"{path}:2:3: error: row 2 (rank 1), cell 3: micro-batch 99999 is too large"), err
    assert "micro-batches must be below 4" in err, err
    code, err = _check(path, "0F0,0F1,0B0,0B1\n99999F0,1B0,1F1,1B1\n")
    assert code == 2 and err.startswith(f"{path}:2:1: error: row 2 (rank 1), cell 1: stage 99999 is outside 0..2"), err
    # past pipec's global limits the number is refused before it is converted, and a huge word is not repeated
    code, err = _check(path, "0F0,0F1,0B0,0B1\n1F0,1B0,1F" + "9" * 30 + ",1B1\n")
    assert code == 2 and f"{path}:2:3: error: row 2 (rank 1), cell 3:" in err, err
    assert "the micro-batch number is over pipec's limit of 999,999" in err, err
    code, err = _check(path, "0F0,0F1,0B0,0B1\n1F0,1B0,1F" + "9" * 5000 + ",1B1\n")
    assert code == 2 and f"{path}:2:3: error: row 2 (rank 1), cell 3:" in err, err[:300]
    assert "is not an action: longer than 100 characters" in err and len(err) < 300, err[:300]


def test_a_huge_rank_in_a_text_stream_names_the_line_and_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "huge.txt"
    code, err = _check(path, "rank 0: 0F0 0F1 0B0 0B1\nrank 99999999999: 1F0 1B0 1F1 1B1\n")
    assert code == 2
    assert err.startswith(f"{path}:2:1: error: rank 99999999999 is out of range: the file has 2 'rank' line(s), "
                          "so ranks are 0..1"), err
    code, err = _check(path, "rank 0: 0F0 0F1 0B0 0B1\nrank 0: 1F0 1B0 1F1 1B1\n")
    assert code == 2 and "rank 0 already has a line (line 1)" in err, err


def test_json_fields_are_validated(tmp_path: Path) -> None:
    document = json.loads(emit(pipec.compile("1f1b", 2, 2), "json"))
    path = tmp_path / "s.json"
    cases = [
        ("memory_bound", "x", "'memory_bound' must be null or a list of 2 numbers"),
        ("memory_bound", [float("nan"), 1], "memory_bound[0] must be a finite number"),
        ("memory_bound", [1, None], "memory_bound[1] must be a finite number"),
        ("memory_bound", [-1, 1], "memory_bound[0] must be a finite number in 0.."),
        ("microbatches", 10**18, "'microbatches' x 'stages' = 2000000000000000000 is more than the 8 compute"),
        ("schedule", "\x1b[2J", "'schedule' must be a name of 1 to 200 printable characters"),
        ("params", {"P": 3}, "params['P'] is 3 but 'ranks' is 2"),
        ("has_comms", False, "0SEND_F0 is a send/recv, but 'has_comms' is false"),
        ("has_comms", "yes", "'has_comms' must be true or false"),
        ("chunks", 2, "'stages' must be 'ranks' x 'chunks' = 4, got 2"),
        ("comment", "hi", "unknown field 'comment'"),
        ("placement", [0, 7], "placement[1] must be a rank in 0..1, got 7"),
    ]
    for key, value, message in cases:
        code, err = _check(path, json.dumps({**document, key: value}))
        assert code == 2 and message in err, (key, value, err)
    streams = [list(s) for s in document["streams"]]
    streams[1][2] = "1F7"
    code, err = _check(path, json.dumps({**document, "streams": streams}))
    assert code == 2 and "streams[1][2]: micro-batch 7 is outside 0..1 ('microbatches' is 2)" in err, err
    code, err = _check(path, "[" * 100_000 + "]" * 100_000)
    assert code == 2 and "nested too deeply" in err, err


def test_a_structurally_wrong_file_loads_and_gets_a_verdict(tmp_path: Path) -> None:
    """What is well formed but wrong (a repeated op, a missing one, a send without its receive) is the
    verifier's to report, and simulate, show and viz refuse it without a crash."""
    path = tmp_path / "wrong.txt"
    code, _ = _check(path, "rank 0: 0F0 0F1 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n")
    assert code == 1
    outcome = run(["check", str(path)])
    assert "structure  FAILED" in outcome.out and "0F1 appears 2 times" in outcome.out, outcome.out
    path.write_text("rank 0: 0F0 0SEND_F0 0F1 0B0 0B1\nrank 1: 1RECV_F0 1F0 1B0 1F1 1B1\n")
    for argv in (["check", str(path)], ["simulate", str(path)], ["show", str(path)],
                 ["viz", str(path), "-o", str(tmp_path / "w.svg")]):
        outcome = run(argv)
        assert problem(argv, outcome) is None and outcome.code in (1, 2), (argv, outcome.err)


def test_every_format_loads_back_what_compile_wrote(tmp_path: Path) -> None:
    """The unmutated files: the fuzzing starts from valid input (forward-only included, which the JSON records)."""
    for (schedule, fmt), data in BASES.items():
        path = tmp_path / f"ok{SUFFIX[fmt]}"
        path.write_bytes(data)
        assert run(["check", str(path)]).code == 0, (schedule, fmt)
    path = tmp_path / "forward.json"
    path.write_text(emit(pipec.compile("forward_only", 2, 3), "json"))
    assert run(["check", str(path)]).code == 0


def test_many_ranks_stay_linear(tmp_path: Path) -> None:
    """20,000 ranks of one stage each: tables per pair of ranks (P * P) would need tens of GB; within the
    address-space cap this runs in seconds."""
    ranks = 20_000
    path = tmp_path / "wide.txt"
    path.write_text("".join(f"rank {r}: {r}F0 {r}B0\n" for r in range(ranks)))
    for argv in (["check", str(path)], ["simulate", str(path)]):
        outcome = run(argv)
        assert problem(argv, outcome) is None and outcome.code == 0, (argv, outcome.err[:500])


# ---- cost models -------------------------------------------------------------------------------------------------

COST_KEYS = ("F", "B", "I", "W", "FB", "comm", "latency", "bandwidth", "size", "overlap", "input_fraction", "scale",
             "activation", "Q")
COST_VALUES = ("1", "2.5", "0", "1e9", "1e-9", "1e15", "1e-12", "inf", "-inf", "nan", "1e308", "1e999", "-1",
               "1e-300", "5e-324", "x", "", "1_0", "\u0663", "9" * 5000, "0x10", "1e", ".5", "+3")


def cost_flag(rng: random.Random) -> str:
    items = [f"{rng.choice(COST_KEYS)}={rng.choice(COST_VALUES)}" for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.1:
        items.append(rng.choice(["F", "=", ",,", "F==1"]))
    return ",".join(items)


def cost_file(rng: random.Random) -> bytes:
    numbers = [1, 2, 0.5, 0, 1e9, 1e-9, 1e15, -1, 1e308, 10**400, True, "1", None, [1], float("nan"), float("inf")]
    doc: dict = {}
    for _ in range(rng.randint(1, 4)):
        key = rng.choice(COST_KEYS)
        if rng.random() < 0.4:
            doc[key] = [rng.choice(numbers[:7]) if rng.random() < 0.8 else rng.choice(numbers)
                        for _ in range(rng.choice([0, 1, 2, 3, 4]))]
        else:
            doc[key] = rng.choice(numbers)
    data = json.dumps(doc, allow_nan=True).encode()
    twist = rng.randrange(8)
    if twist == 0:
        data = data[: len(data) // 2] + b"\xff\xfe" + data[len(data) // 2 :]
    elif twist == 1:
        data = b'{"F": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    elif twist == 2:
        data = data[: rng.randrange(len(data) + 1)]
    elif twist == 3:
        data = rng.choice([b"[1, 2]", b"null", b"", b"1e999", b'{"F": 1' + b"0" * 5000 + b"}"])
    return data


COST_CASES = 90


def test_fuzzed_costs_end_in_a_result_or_a_message(tmp_path: Path) -> None:
    failures = []
    codes = {0: 0, 1: 0, 2: 0}
    for seed in range(COST_CASES):
        rng = random.Random(f"costs/{seed}")
        if seed % 3 == 2:
            spec = tmp_path / f"costs{seed}.json"
            spec.write_bytes(cost_file(rng))
            cost = str(spec)
        else:
            cost = cost_flag(rng)
        command = ("simulate", "show", "viz")[seed % 3 if seed % 3 != 2 else rng.randrange(3)]
        argv = [command, "1f1b", "-P", "2", "-M", "3", "--cost", cost, *_outputs(command, tmp_path)]
        outcome = run(argv)
        found = problem(argv, outcome)
        if found:
            failures.append(f"seed {seed}: {found}")
        elif outcome.code is not None:
            codes[outcome.code] += 1
    assert not failures, "\n".join(failures)
    assert codes[0] and codes[2], codes


@pytest.mark.parametrize("value", ["inf", "nan", "1e308", "-1", "1e-300"])
def test_absurd_costs_are_refused_naming_the_key(value: str, tmp_path: Path) -> None:
    for command in ("simulate", "show", "viz"):
        argv = [command, "1f1b", "-P", "2", "-M", "2", "--cost", f"W=1,F={value}", *_outputs(command, tmp_path)]
        outcome = run(argv)
        assert outcome.code == 2 and outcome.err.startswith("error: --cost: F "), (argv, outcome.err)
    path = tmp_path / "costs.json"
    as_json = {"inf": "Infinity", "nan": "NaN"}.get(value, value)  # what Python's JSON reader takes for them
    path.write_text(f'{{"W": 1, "F": {as_json}}}')
    outcome = run(["simulate", "1f1b", "-P", "2", "-M", "2", "--cost", str(path)])
    assert outcome.code == 2 and f"error: {path}: F " in outcome.err, outcome.err


def test_cost_files_that_are_not_cost_models_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    cases = {
        b'{"F": 1, "B": "\xff"}': "not UTF-8",
        b'{"F": ' + b"[" * 50_000 + b"]" * 50_000 + b"}": "nested too deeply",
        b'{"F": true}': "F must be a number, got True",
        b'{"F": "1"}': "F must be a number, got '1'",
        b'{"F": [1, [2]]}': "F[1] must be a number",
        b'{"F": [1, 2, 3]}': "cost 'F' has 3 entries, the schedule has 2 stages",
        b'{"B": [2, 2, 2], "W": [1, 1]}': "B has 3 entries, W 2",
        b'{"activation": [1, 2, 3]}': "cost 'activation' has 3 entries, the schedule has 2 stages",
        b"[1]": "expected a JSON object of costs",
    }
    for data, message in cases.items():
        path.write_bytes(data)
        for command in ("simulate", "show", "viz"):
            argv = [command, "1f1b", "-P", "2", "-M", "2", "--cost", str(path), *_outputs(command, tmp_path)]
            outcome = run(argv)
            assert problem(argv, outcome) is None and outcome.code == 2 and message in outcome.err, (
                data[:40], command, outcome.err)


@pytest.mark.parametrize(
    "cost",
    ["F=1e9,W=1e-9", "F=1e15,B=1e15,W=1e-12", "F=1e-12,B=0,W=0", "F=0,B=0,W=0", "size=1e15,bandwidth=1e-12",
     "comm=1e15,overlap=1"],
)
def test_extreme_accepted_costs_draw(cost: str, tmp_path: Path) -> None:
    """Whatever simulate accepts, show and viz draw: finite scales, a bounded number of columns and ticks."""
    for command in ("simulate", "show", "viz"):
        argv = [command, "interleaved_1f1b", "-P", "2", "-M", "4", "-V", "2", "--cost", cost,
                *_outputs(command, tmp_path)]
        outcome = run(argv)
        assert problem(argv, outcome) is None and outcome.code == 0, (argv, outcome.err)
        if command == "show":
            assert max(len(line) for line in outcome.out.splitlines()) < 3000, outcome.out[:300]
    picture = (tmp_path / "picture.svg").read_text()
    assert "nan" not in picture and "inf" not in picture
    assert picture.count("<text") < 200  # the axis has about ten ticks whatever the makespan
