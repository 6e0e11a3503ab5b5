"""Replicated pipelines in the stream formats (docs/format.md): text's `pipelines C` line and JSON's `pipelines` and
`routes` round trip, are written only for C > 1, routes read from the ops refuse an op that leaves its copy, and
torch's CSV refuses C > 1 saying why (exit 2 through the CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import run_main
from deepseek_orders import dualpipe_cases, dualpipe_text

import pipec
from pipec.emit import load_json, load_text
from pipec.emit.json import dump_json
from pipec.emit.text import dump_text
from pipec.errors import PipecInputError, PipecSyntaxError


def _text(ranks: int = 4, microbatches: int = 8) -> str:
    return dualpipe_text(next(o for p, m, o in dualpipe_cases() if (p, m) == (ranks, microbatches)))


def test_text_and_json_round_trip_the_copies_and_routes(tmp_path: Path) -> None:
    path = tmp_path / "dualpipe.txt"
    path.write_text(_text())
    program = pipec.compile(str(path))
    text, document = dump_text(program), dump_json(program)
    assert text.startswith("pipelines 2\nrank 0: ")
    assert '"pipelines": 2' in document
    for loaded in (load_text(text), load_json(document)):
        assert (loaded.pipelines, loaded.routes) == (2, (0, 0, 0, 0, 1, 1, 1, 1))
        assert loaded.streams == program.streams and loaded.sync_groups == program.sync_groups
        assert loaded.check().ok


def test_one_pipeline_writes_what_it_wrote() -> None:
    program = pipec.compile("1f1b", 2, 4)
    assert "pipelines" not in dump_text(program)
    assert "pipelines" not in dump_json(program) and "routes" not in dump_json(program)


def test_an_op_leaving_its_micro_batchs_copy_is_refused_naming_it() -> None:
    text = _text().replace("rank 0: 0F0 0F1 0F2 7F4", "rank 0: 0F0 0F1 0F2 7F2", 1)
    with pytest.raises(PipecSyntaxError) as error:
        load_text(text)
    assert "7F2 leaves micro-batch 2's copy: its first op, 0F2 (rank 0 op 2), is at copy 0's stages 0..3" in str(
        error.value
    )
    assert "line 2" in str(error.value) or ":2:" in str(error.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("pipelines", 3, "'stages' \\(8\\) must split into 'pipelines' \\(3\\)"),
        ("pipelines", 0, "'pipelines' must be a positive integer"),
        ("routes", [0, 1], "'routes' must be a list of 8 copies"),
        ("routes", [0, 0, 0, 0, 1, 1, 1, 5], r"routes\[7\] must be a copy in 0..1, got 5"),
    ],
)
def test_json_copies_and_routes_are_checked(tmp_path: Path, field: str, value: object, message: str) -> None:
    path = tmp_path / "dualpipe.txt"
    path.write_text(_text())
    document = json.loads(dump_json(pipec.compile(str(path))))
    document[field] = value
    with pytest.raises(PipecSyntaxError, match=message):
        load_json(json.dumps(document))


def test_torch_csv_refuses_copies_saying_why(tmp_path: Path) -> None:
    path = tmp_path / "dualpipe.txt"
    path.write_text(_text())
    with pytest.raises(PipecInputError, match="one module per stage index"):
        from pipec.emit.torch_csv import dump_torch_csv

        dump_torch_csv(pipec.compile(str(path)), True)
    code, out, err = run_main(["compile", str(path), "--format", "torch-csv"])
    assert code == 2 and not out
    assert "2 pipelines (copies of the model)" in err and "no cross-stage all-reduce" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pipelines 2\npipelines 2\nrank 0: 0F0 1F0 1B0 0B0\n", "'pipelines' is given twice \\(first on line 1\\)"),
        ("rank 0: 0F0 1F0 1B0 0B0\npipelines 2\n", "'pipelines C' must come before the 'rank' lines"),
        ("pipelines 0\nrank 0: 0F0 0B0\n", "'pipelines' must be at least 1"),
        ("pipelines 3\nrank 0: 0F0 1F0 1B0 0B0\n", "2 stages do not split into 3 pipelines"),
    ],
)
def test_the_pipelines_line_is_checked(text: str, message: str) -> None:
    with pytest.raises(PipecSyntaxError, match=message):
        load_text(text)


def test_two_copies_on_one_rank_read_their_routes_from_the_ops() -> None:
    """One rank, two copies of one stage each: micro-batch 0 through copy 0 (stage 0), 1 through copy 1 (stage 1)."""
    program = load_text("pipelines 2\nrank 0: 0F0 1F1 1B1 0B0\n")
    assert (program.pipelines, program.routes, program.num_stages) == (2, (0, 1), 2)
    assert program.check().ok
