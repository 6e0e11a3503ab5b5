"""What a new user meets first: --version, help with examples and exit codes, --model as a file path."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from paths import ROOT

from pipec.cli import COMMANDS, main


def test_version_names_the_package(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("pipec ")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help_with_exit_codes(command: str, capsys) -> None:
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert f"usage: pipec {command}" in text
    assert "exit codes: 0" in text
    if command != "list":
        assert f"pipec {command} " in text.split("examples:")[1]  # at least one example of the command itself


def test_the_size_flags_say_when_they_are_needed_and_chunks_has_no_false_default(capsys) -> None:
    assert main(["compile", "--help"]) == 0
    text = capsys.readouterr().out
    assert "needed unless the schedule gives a default" in text
    assert "(default 1)" not in text.split("--chunks")[1].split("--set")[0]
    assert "--format {text,json,torch-csv,torch-csv-comms}" in text and "text (default)" in text


def test_a_model_without_factory_suggests_the_right_form(capsys) -> None:
    assert main(["run", "1f1b", "-P", "2", "-M", "4", "--model", "examples.workload"]) == 2
    err = capsys.readouterr().err
    assert "e.g. examples.workload:mlp" in err and "current directory" in err


def test_a_model_given_as_a_file_path_is_loaded_from_anywhere(tmp_path: Path, monkeypatch, capsys) -> None:
    model = tmp_path / "elsewhere" / "my_model.py"
    model.parent.mkdir()
    shutil.copy(ROOT / "examples" / "workload.py", model)
    monkeypatch.chdir(tmp_path)  # neither the repository root nor the file's folder is the current directory
    # a partition that cannot fit is refused only after the factory ran: proof that the file was imported
    code = main(["run", "1f1b", "-P", "2", "-M", "4", "--model", f"{model}:mlp", "--partition", "1,2,3"])
    err = capsys.readouterr().err
    assert code == 2 and "positive layer counts" in err, err
    assert main(["run", "1f1b", "-P", "2", "-M", "4", "--model", "missing/model.py:mlp"]) == 2
    assert "no file missing/model.py" in capsys.readouterr().err


def test_an_output_may_not_replace_the_model_file(tmp_path: Path, capsys) -> None:
    model = tmp_path / "my_model.py"
    shutil.copy(ROOT / "examples" / "workload.py", model)
    before = model.read_text()
    code = main(["run", "1f1b", "-P", "2", "-M", "4", "--model", f"{model}:mlp", "--save", str(model)])
    assert code == 2 and "refusing to overwrite" in capsys.readouterr().err
    assert model.read_text() == before
