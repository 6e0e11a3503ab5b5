"""Checkpoints, resume and restarts (`pipec run --checkpoint DIR --checkpoint-every K --resume DIR`, issue #11).

The runs (real processes, gloo, no mocks) are made once per module, in order: an uninterrupted 8-step run of
1f1b with P=2, D=2 (a checkpoint every 2 steps); the same run with a rank SIGKILLed at the start of step 5
(tests/dp_workloads.KillOnce); its resume under pipec's launcher; a resume of a copy of the killed run's
checkpoints under zbv with P=2, D=1, M=4 (another schedule, V, D and partition; the same D x M micro-batches);
and a torchrun launch with --max-restarts 1 whose rank kills itself once. The model has dropout, so the resumed
runs must draw the same random numbers as the uninterrupted one. The refusals of corrupt and foreign
checkpoints run in-process, before any worker would start.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import on_gloo
from dp_workloads import KILL_ENV
from paths import SUPPORT

from pipec.cli import main as cli_main
from pipec.runtime import checkpoint

PIPEC = [sys.executable, "-m", "pipec"]
TRAIN = ["--model", "dp_workloads:dropout_mlp", "--steps", "8"]
D2 = ["1f1b", "-P", "2", "--dp", "2", "-M", "2"]  # 2 micro-batches per replica: KillOnce's 11th forward is step 5


def run(command: list[str], cwd: Path, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    full["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])
    full.update(env or {})
    return subprocess.run(on_gloo(command), cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


def tree(path: Path) -> dict[str, str]:
    """Every file under `path` (relative name -> SHA-256 of its bytes): to show that nothing was changed."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def bitwise_equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The runs, in order; each entry the finished process (and the directory they share)."""
    work = tmp_path_factory.mktemp("checkpoints")
    out: dict = {"dir": work}
    out["full"] = run([*PIPEC, "run", *D2, *TRAIN, "--checkpoint", "full", "--checkpoint-every", "2",
                       "--save", "full.pt", "--report", "full.json"], work)  # fmt: skip
    kill = {KILL_ENV: f"{work / 'killed.marker'}:11"}
    out["killed"] = run([*PIPEC, "run", *D2, *TRAIN, "--checkpoint", "ck", "--checkpoint-every", "2",
                         "--save", "never.pt"], work, kill)  # fmt: skip
    out["killed_tree"] = tree(work / "ck") if (work / "ck").exists() else {}
    shutil.copytree(work / "ck", work / "ck-copy")
    out["resumed"] = run([*PIPEC, "run", *D2, *TRAIN, "--checkpoint", "ck", "--checkpoint-every", "2", "--resume",
                          "ck", "--save", "resumed.pt", "--report", "resumed.json"], work, kill)  # fmt: skip
    out["zbv"] = run([*PIPEC, "run", "zbv", "-P", "2", "-M", "4", *TRAIN, "--resume", "ck-copy",
                      "--save", "zbv.pt"], work)  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                "--max-restarts", "1", "-m", "pipec.run"]  # fmt: skip
    kill_once = {KILL_ENV: f"{work / 'torchrun.marker'}:11"}
    out["torchrun"] = run([*torchrun, *D2, *TRAIN, "--checkpoint", "tr", "--checkpoint-every", "2",
                           "--save", "torchrun.pt"], work, kill_once)  # fmt: skip
    return out


def weights(runs: dict, name: str) -> dict:
    return torch.load(runs["dir"] / name)


def test_the_uninterrupted_run_checkpoints_every_two_steps(runs) -> None:
    done = runs["full"]
    assert done.returncode == 0, done.stderr
    folder = runs["dir"] / "full"
    assert (folder / "latest").read_text() == "step-00000008\n"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", *(f"step-0000000{k}" for k in (2, 4, 6, 8))]
    manifest = json.loads((folder / "step-00000008" / "manifest.json").read_text())
    assert manifest["format"] == "pipec-checkpoint" and manifest["version"] == 1 and manifest["step"] == 8
    assert manifest["optimizer"] == "torch.optim.adam.Adam" and manifest["data"] == {"batches": 8, "next_batch": 0}
    assert manifest["state"]["0.weight"] == {"shape": [8, 8], "dtype": "float32"}
    assert manifest["written_by"]["dp"] == 2 and manifest["written_by"]["job"] is None
    # the checkpoint's model is what --save wrote, keyed like the unsplit model
    saved = torch.load(folder / "step-00000008" / "model.pt")
    assert bitwise_equal(saved, weights(runs, "full.pt"))
    optimizer = torch.load(folder / "step-00000008" / "optimizer.pt")
    assert sorted(optimizer["state"]) == sorted(k for k in saved)  # Adam state for every parameter, by name
    assert optimizer["param_groups"][0]["lr"] == 0.01
    assert json.loads((runs["dir"] / "full.json").read_text())["checkpoints"][-1]["step"] == 8


def test_a_killed_rank_leaves_the_last_complete_checkpoint(runs) -> None:
    done = runs["killed"]
    assert done.returncode == 3, done.stderr
    assert "the process was killed by SIGKILL" in done.stderr
    assert "step   4  loss" in done.stdout and "step   5  loss" not in done.stdout
    # checkpoints after steps 2 and 4; step 5 never finished: nothing newer, no temporary left, no output
    assert (
        sorted(Path(name).parts[0] for name in runs["killed_tree"])
        == ["latest"] + ["step-00000002"] * 3 + ["step-00000004"] * 3
    )
    assert (runs["dir"] / "ck-copy" / "latest").read_text() == "step-00000004\n"
    assert not (runs["dir"] / "never.pt").exists()


def test_resume_after_a_kill_ends_bitwise_where_the_uninterrupted_run_ends(runs) -> None:
    done = runs["resumed"]
    assert done.returncode == 0, done.stderr
    assert "resuming from ck/step-00000004: step 4 of 8" in done.stdout
    assert "step   3  loss" not in done.stdout and "step   7  loss" in done.stdout  # --steps counts from step 0
    expected = weights(runs, "full.pt")
    assert bitwise_equal(weights(runs, "resumed.pt"), expected)
    full = json.loads((runs["dir"] / "full.json").read_text())
    resumed = json.loads((runs["dir"] / "resumed.json").read_text())
    assert resumed["first_step"] == 4 and resumed["losses"] == full["losses"][4:]  # the same losses, bitwise
    # the resumed run went on checkpointing into the same directory
    assert (runs["dir"] / "ck" / "latest").read_text() == "step-00000008\n"
    assert bitwise_equal(torch.load(runs["dir"] / "ck" / "step-00000008" / "model.pt"), expected)


def test_resume_under_another_schedule_v_d_and_partition(runs) -> None:
    """1f1b P=2 D=2 (2 stages) -> zbv P=2 D=1 M=4 (4 stages, V=2): the model and the Adam state are resharded
    by name; the 4 micro-batches and their dropout masks are the same, so only float rounding differs."""
    done = runs["zbv"]
    assert done.returncode == 0, done.stderr
    assert "resuming from ck-copy/step-00000004: step 4 of 8" in done.stdout
    difference = max_difference(weights(runs, "zbv.pt"), weights(runs, "full.pt"))
    print(f"1f1b D=2 -> zbv D=1 resume: max |w - uninterrupted| = {difference:.3g}")
    assert difference < 1e-5


def test_torchrun_restarts_a_killed_worker_and_the_job_resumes(runs) -> None:
    done = runs["torchrun"]
    assert done.returncode == 0, done.stdout + done.stderr
    assert (runs["dir"] / "torchrun.marker").exists()  # a rank did kill itself
    assert "torchrun restart 1 of job " in done.stdout
    assert "resuming from tr/step-00000004: step 4 of 8" in done.stdout
    assert bitwise_equal(weights(runs, "torchrun.pt"), weights(runs, "full.pt"))
    assert (runs["dir"] / "tr" / "latest").read_text() == "step-00000008\n"


# --- refused before any worker starts, nothing overwritten ------------------------------------------------------


def corrupt_model(folder: Path) -> None:
    path = folder / "step-00000008" / "model.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate_optimizer(folder: Path) -> None:
    path = folder / "step-00000008" / "optimizer.pt"
    path.write_bytes(path.read_bytes()[:100])


def remove_optimizer(folder: Path) -> None:
    (folder / "step-00000008" / "optimizer.pt").unlink()


def future_version(folder: Path) -> None:
    path = folder / "step-00000008" / "manifest.json"
    path.write_text(path.read_text().replace('"version": 1', '"version": 99'))


def broken_manifest(folder: Path) -> None:
    (folder / "step-00000008" / "manifest.json").write_text("{ not json")


def dangling_latest(folder: Path) -> None:
    (folder / "latest").write_text("step-00000009\n")


def not_a_checkpoint(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.mkdir()
    (folder / "notes.txt").write_text("hello\n")


@pytest.mark.parametrize(
    ("damage", "extra", "message"),
    [
        (corrupt_model, [], "step-00000008/model.pt does not match its checksum in the manifest (corrupt)"),
        (truncate_optimizer, [], "step-00000008/optimizer.pt has 100 bytes but the manifest says"),
        (remove_optimizer, [], "step-00000008/optimizer.pt is missing"),
        (future_version, [], "step-00000008 is checkpoint format version 99; this pipec reads version 1"),
        (broken_manifest, [], "step-00000008/manifest.json is not a readable JSON manifest"),
        (dangling_latest, [], "latest names step-00000009, which is missing"),
        (not_a_checkpoint, [], "no checkpoint there yet (no latest file)"),
        (None, ["--model", "dp_workloads:wider_mlp"], "holds another model: 8 key(s) only in the checkpoint "
         "(3.bias, 3.weight, 7.bias); 4 key(s) only in the model (2.bias, 2.weight, 4.bias); 0.bias is [8] float32 "
         "there but [16] float32 in the model"),
        (None, ["--model", "dp_workloads:sgd_dropout_mlp"], "trained with the optimizer torch.optim.adam.Adam; the "
         "workload makes torch.optim.sgd.SGD"),
        (None, ["--seed", "7"], "trained with --seed 0 (the data and the random numbers derive from it)"),
        (None, ["--steps", "6"], "has trained 8 steps, past --steps 6"),
    ],
)  # fmt: skip
def test_a_corrupt_or_foreign_checkpoint_is_refused_and_left_as_it_was(
    runs, tmp_path: Path, monkeypatch, capsys, damage, extra, message
) -> None:
    folder = tmp_path / "ck"
    shutil.copytree(runs["dir"] / "full", folder)
    if damage is not None:
        damage(folder)
    before = tree(folder)
    monkeypatch.chdir(tmp_path)
    args = ["run", *D2, *TRAIN, "--checkpoint", "ck", "--checkpoint-every", "2", "--resume", "ck", "--save", "w.pt"]
    code = cli_main([*args, *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err, err
    assert err.startswith("error: --resume ck") and "Traceback" not in err
    assert tree(folder) == before and not (tmp_path / "w.pt").exists()


def test_a_fresh_run_refuses_a_directory_holding_checkpoints(runs, tmp_path: Path, monkeypatch, capsys) -> None:
    folder = tmp_path / "ck"
    shutil.copytree(runs["dir"] / "full", folder)
    before = tree(folder)
    monkeypatch.chdir(tmp_path)
    assert cli_main(["run", *D2, *TRAIN, "--checkpoint", "ck", "--checkpoint-every", "2"]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint ck already holds checkpoints (latest: step-00000008, step 8); to continue that run add " in err
    # under torchrun, a checkpoint of another job is not resumed either (a restart resumes only its own job's)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert cli_main(["run", *D2, *TRAIN, "--checkpoint", "ck", "--checkpoint-every", "2"]) == 2
    err = capsys.readouterr().err
    assert "not resumed automatically: written by torchrun job (none: pipec run), this is job job-b" in err
    assert tree(folder) == before


def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_leaves_no_half_file(tmp_path: Path) -> None:
    """A file-size limit stands in for a full disk: model.pt (about 9 KB) cannot be written. The run stops (exit 3)
    naming the checkpoint, and DIR holds nothing: no step directory, no temporary one, no `latest`."""

    def limit_file_size() -> None:  # in the child: Python ignores SIGXFSZ, so a write past it is EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    command = [*PIPEC, "run", "1f1b", "-P", "2", "-M", "4", "--model", "faulty_workloads:wide"]
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        on_gloo([*command, "--checkpoint", "ck", "--checkpoint-every", "1"]),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, preexec_fn=limit_file_size,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert (
        "rank 0: after step 0: cannot write the checkpoint ck/step-00000001: File too large; "
        "the previous checkpoint is intact"
    ) in done.stderr
    assert "rank 1: after step 0: stopped with rank 0" in done.stderr and "Traceback" not in done.stderr
    assert "step   1" not in done.stdout  # stopped at the first checkpoint
    assert list((tmp_path / "ck").iterdir()) == []


def test_checkpoint_every_needs_a_directory(capsys) -> None:
    assert cli_main(["run", *D2, *TRAIN, "--checkpoint-every", "2"]) == 2
    assert "--checkpoint-every needs --checkpoint DIR" in capsys.readouterr().err


# --- the atomic write, in-process ---------------------------------------------------------------------------------


MANIFEST = {"seed": 0, "state": {"w": {"shape": [4], "dtype": "float32"}}, "optimizer": "none"}


def save(value: float):
    return lambda stream: torch.save({"w": torch.full((4,), value)}, stream)


def test_a_write_that_fails_midway_leaves_the_previous_checkpoint_and_no_half_file(tmp_path: Path) -> None:
    checkpoint.write(str(tmp_path), 2, {"model.pt": save(1.0), "optimizer.pt": save(2.0)}, MANIFEST)
    before = tree(tmp_path)

    def breaks(stream) -> None:
        stream.write(b"half a file")
        raise OSError(28, "No space left on device")

    with pytest.raises(checkpoint.CheckpointWriteError, match="No space left on device"):
        checkpoint.write(str(tmp_path), 4, {"model.pt": save(3.0), "optimizer.pt": breaks}, MANIFEST)
    assert tree(tmp_path) == before  # no step-00000004, no temporary directory, latest unchanged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]


def test_leftovers_of_a_crash_are_ignored_by_readers_and_replaced_by_writers(tmp_path: Path) -> None:
    checkpoint.write(str(tmp_path), 2, {"model.pt": save(1.0), "optimizer.pt": save(2.0)}, MANIFEST)
    # what a crash can leave: a half-written temporary directory, and a step renamed into place just before the
    # crash, before `latest` was moved to it (it holds garbage: it must not be read)
    (tmp_path / ".tmp-step-00000004-x").mkdir()
    (tmp_path / ".tmp-step-00000004-x" / "model.pt").write_bytes(b"half")
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "model.pt").write_bytes(b"garbage")
    found = checkpoint.find(str(tmp_path))
    assert found is not None and found.step == 2
    checkpoint.write(str(tmp_path), 4, {"model.pt": save(5.0), "optimizer.pt": save(6.0)}, MANIFEST)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002", "step-00000004"]
    assert torch.equal(torch.load(tmp_path / "step-00000004" / "model.pt")["w"], torch.full((4,), 5.0))
    assert checkpoint.find(str(tmp_path)).step == 4
    with pytest.raises(checkpoint.CheckpointWriteError, match="is the committed checkpoint"):
        checkpoint.write(str(tmp_path), 4, {"model.pt": save(7.0), "optimizer.pt": save(8.0)}, MANIFEST)


def test_optimizer_groups_merge_by_hyperparameters_not_position() -> None:
    """The usual decay / no-decay AdamW groups, with a rank that holds only 1-D parameters (its one group is
    the no-decay one): the merged state keeps that rank's parameters without decay, and a one-rank layout
    resuming it takes each parameter's own group."""
    from pipec.runtime.checkpoint import load_optimizer_state, merge_optimizer_states, optimizer_state

    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.zeros(3))
    norm = torch.nn.Parameter(torch.ones(3))
    names = {id(weight): "0.weight", id(bias): "0.bias", id(norm): "1.weight"}

    def adamw(params: list) -> torch.optim.Optimizer:
        decay = [p for p in params if p.dim() > 1]
        rest = [p for p in params if p.dim() <= 1]
        groups = [{"params": g, "weight_decay": wd} for g, wd in ((decay, 0.5), (rest, 0.0)) if g]
        return torch.optim.AdamW(groups, lr=0.1)

    rank0, rank1 = adamw([weight, bias]), adamw([norm])
    merged = merge_optimizer_states([optimizer_state(rank0, names), optimizer_state(rank1, names)])
    decay_of = {name: g["weight_decay"] for g in merged["param_groups"] for name in g["params"]}
    assert decay_of == {"0.weight": 0.5, "0.bias": 0.0, "1.weight": 0.0}
    whole = adamw([weight, bias, norm])
    load_optimizer_state(whole, names, merged)
    assert [(len(g["params"]), g["weight_decay"]) for g in whole.param_groups] == [(1, 0.5), (2, 0.0)]
