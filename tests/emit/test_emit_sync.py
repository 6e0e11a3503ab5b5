"""SYNC and sync groups in the stream formats: text and JSON carry them (and only programs that have them change),
torch's CSV refuses them, `pipec check` of a broken file exits 1 with the counterexample."""

from pathlib import Path

import pytest
from cli_capture import run_main

import pipec
from pipec.emit import load_json, load_text
from pipec.emit.json import dump_json
from pipec.emit.text import dump_text
from pipec.emit.torch_csv import dump_torch_csv
from pipec.errors import PipecInputError, PipecSyntaxError
from pipec.passes.sync import insert_syncs


def _tied() -> pipec.Program:
    return insert_syncs(pipec.compile("interleaved_1f1b", 4, 8, 2), [(0, 7), (1, 5)])


def test_text_and_json_round_trip_syncs_and_groups() -> None:
    program = _tied()
    text = dump_text(program)
    assert text.endswith("7SYNC0\nsync 0: 0 7\nsync 1: 1 5\n")
    for loaded in (load_text(text), load_json(dump_json(program))):
        assert loaded.sync_groups == ((0, 7), (1, 5))
        assert loaded.streams == program.streams
        assert loaded.check().ok


def test_programs_without_groups_write_what_they_wrote() -> None:
    program = pipec.compile("1f1b", 2, 2)
    assert "sync" not in dump_text(program) and "sync" not in dump_json(program)


@pytest.mark.parametrize("with_comms", [False, True])
def test_torch_csv_refuses_sync_groups_saying_why(with_comms: bool) -> None:
    with pytest.raises(PipecInputError, match="torch's runtime keeps one copy of each stage"):
        dump_torch_csv(_tied(), with_comms)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0SYNC0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1SYNC0\n", "declares none"),
        ("rank 0: 0F0 0B0\nsync 0: 0 x\n", "stage numbers"),
        ("rank 0: 0F0 0B0\nrank 1: 1F0 1B0\nsync 1: 0 1\n", "groups are 0..0"),
        ("rank 0: 0F0 0B0\nrank 1: 1F0 1B0\nsync 0: 0 5\n", "not a stage of 0..1"),
    ],
)
def test_bad_sync_lines_are_refused_with_a_message(text: str, message: str) -> None:
    with pytest.raises(PipecSyntaxError, match=message):
        load_text(text)


def test_check_of_a_broken_file_exits_1_with_the_counterexample(tmp_path: Path) -> None:
    program = insert_syncs(pipec.compile("1f1b", 2, 2), [(0, 1)])
    good = tmp_path / "tied.txt"
    good.write_text(dump_text(program))
    assert run_main(["check", str(good)])[0] == 0
    # rank 1 syncs before sending the last gradient rank 0 waits for: rank 0 never reaches its SYNC
    broken = dump_text(program).replace("1B1 1SEND_B1 1SYNC0", "1B1 1SYNC0 1SEND_B1")
    assert broken != dump_text(program)
    path = tmp_path / "broken.txt"
    path.write_text(broken)
    code, out, _ = run_main(["check", str(path)])
    assert code == 1
    assert "rank 1's 1SYNC0 (op 7) comes before its 1SEND_B1 (op 8), which rank 0's 0RECV_B1 (op 6) needs" in out, out
    missing = tmp_path / "missing.txt"
    missing.write_text(dump_text(program).replace(" 1SYNC0", ""))
    code, out, _ = run_main(["check", str(missing)])
    assert code == 1 and "rank 1 issues 0 SYNCs of it, rank 0 1" in out, out
    code, _, err = run_main(["compile", str(good), "--format", "torch-csv"])
    assert code == 2 and "no cross-stage all-reduce" in err
