"""Parameters tied across ranks through `pipec run` (#21 item 1): a tiny language model whose LM head (last layer)
reuses the embedding's weight (first layer, tests/support/tied_workloads.py) trains under 1f1b, interleaved_1f1b
(V=2), zb_h1 and zbv on 2 and 4 gloo ranks, and with --dp 2, as the plain one-process loop trains it (the whole
batch, one backward, one SGD-with-momentum step; written without pipec): weights within 1e-6 after 3 steps, and
every copy of the tied weight, on every rank and replica, bitwise equal. The SYNC that sums the copies' gradients
is in the streams (placed by insert_syncs, verified, run by the interpreter); zbv keeps the first and the last
stage on rank 0, so there one parameter object needs none. A checkpoint stores the tied parameter once (its
optimizer state under its first name) and a resume, under another schedule, keeps the copies equal.

One spawn per world size runs every config in turn, to share the workers' start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import pytest
import tied_workloads
import torch
from paths import SUPPORT
from tied_workloads import STEPS

import pipec
from pipec.ir import Kind
from pipec.runtime import checkpoint, launch

MODEL = "tied_workloads:tied_lm"
TOLERANCE = 1e-6
HEAD = "7.weight"  # the head's key: the tied weight's second name (its first: the embedding's 0.weight)
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2))
# world size -> (key, schedule, P, V, D) of each run; the 2-rank spawn also checkpoints and resumes
CONFIGS = {
    2: [((name, 2, 1), name, 2, chunks, 1) for name, chunks in SCHEDULES],
    4: [((name, 4, 1), name, 4, chunks, 1) for name, chunks in SCHEDULES]
    + [((name, 2, 2), name, 2, chunks, 2) for name, chunks in SCHEDULES],
}


def _train_all(configs: list[tuple], folder: str) -> dict:
    """In every worker: each config for 3 steps; on 2 ranks also 2 steps of 1f1b with a checkpoint, then the
    third step resumed from it under interleaved_1f1b (V=2). Per key: this rank's weights, the run's streams."""
    from pipec.runtime.options import Options
    from pipec.runtime.worker import train

    out = {}
    for key, schedule, ranks, chunks, dp in configs:
        program = pipec.compile(schedule, ranks, 4, chunks)
        result = train(program, Options(model=MODEL, steps=STEPS, quiet=True, dp=dp))
        out[key] = {"weights": result["weights"], "report": result["report"]}
    if folder:
        where = os.path.join(folder, "ck")
        os.makedirs(where, exist_ok=True)  # (pipec run's preflight makes it before any worker starts)
        train(pipec.compile("1f1b", 2, 4), Options(model=MODEL, steps=2, quiet=True, checkpoint=where))
        resumed = os.path.join(where, checkpoint.step_name(2))
        result = train(
            pipec.compile("interleaved_1f1b", 2, 4, 2),
            Options(model=MODEL, steps=STEPS, quiet=True, resume=resumed, resume_step=2),
        )
        out["resumed"] = {"weights": result["weights"], "report": result["report"]}
    return out


@functools.cache
def runs(world: int, folder: str = "") -> list[dict]:
    return launch.spawn(_train_all, world, (CONFIGS[world], folder), timeout_s=120)


@functools.cache
def reference() -> dict[str, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run (their float32 sums are blocked by thread)
    try:
        return tied_workloads.reference()
    finally:
        torch.set_num_threads(threads)


def check_trained_like_one_process(per_rank: list[dict], key) -> float:
    """The ranks' weights against the one-process loop; every copy of the tied weight bitwise equal. Returns the
    worst difference."""
    expected = reference()
    merged: dict = {}
    copies = []
    for result in per_rank:
        weights = result[key]["weights"]
        merged.update(weights)
        copies += [weights[k] for k in ("0.weight", HEAD) if k in weights]
    assert sorted(merged) == sorted(expected)
    worst = max((merged[k] - expected[k]).abs().max().item() for k in expected)
    assert worst < TOLERANCE, f"{key}: max |weight - one process| {worst:g}"
    assert len(copies) >= 2 and all(torch.equal(c, copies[0]) for c in copies), key
    return worst


@pytest.mark.parametrize("world", [2, 4])
def test_tied_embeddings_train_like_one_process(world: int) -> None:
    per_rank = runs(world)
    for key, schedule, ranks, _, dp in CONFIGS[world]:
        worst = check_trained_like_one_process(per_rank, key)
        print(f"\n{schedule} P={ranks} --dp {dp}: worst |weight - one process| {worst:.1e}")
        report = per_rank[0][key]["report"]
        syncing = [r["rank"] for r in report["ranks"] if r["sync_s"] > 0]
        if schedule == "zbv":  # stages 0 and S-1 on rank 0: one parameter object, no SYNC
            assert syncing == []
        else:  # the first and the last pipeline rank of every replica
            assert syncing == [replica * ranks + r for replica in range(dp) for r in (0, ranks - 1)], key


def test_the_synced_program_verifies_and_syncs_once_per_member() -> None:
    """The program the runtime runs: one SYNC of group (0, S-1) on rank 0 and on rank P-1, after their last
    backward of the group's stages, and the verifier (nccl model) accepts it."""
    from pipec.runtime import ties, workload
    from pipec.verify import verify

    work = workload.build(MODEL, 0)
    for name, chunks in SCHEDULES[:3]:
        program = pipec.compile(name, 4, 4, chunks)
        sizes = (1,) * 8 if chunks == 2 else (2, 2, 2, 2)
        synced = ties.with_syncs(program, work.layers, sizes)
        assert synced.sync_groups == ((0, program.num_stages - 1),), name
        syncs = [[i for i in stream if i.kind is Kind.SYNC] for stream in synced.streams]
        assert [len(s) for s in syncs] == [1, 0, 0, 1], name
        assert verify(synced, p2p="nccl").ok, name


def test_a_checkpoint_stores_the_tied_parameter_once_and_a_resume_keeps_the_copies_equal(tmp_path) -> None:
    per_rank = runs(2, str(tmp_path))
    check_trained_like_one_process(per_rank, "resumed")
    saved = os.path.join(tmp_path, "ck", checkpoint.step_name(2))
    model = torch.load(os.path.join(saved, checkpoint.MODEL_FILE), weights_only=True)
    # both keys, for load_state_dict, holding one tensor: stored once
    assert model["0.weight"].untyped_storage().data_ptr() == model[HEAD].untyped_storage().data_ptr()
    optimizer = torch.load(os.path.join(saved, checkpoint.OPTIMIZER_FILE), weights_only=True)
    assert "0.weight" in optimizer["state"] and HEAD not in optimizer["state"]
    names = [n for group in optimizer["param_groups"] for n in group["params"]]
    assert len(names) == len(set(names)) and "0.weight" in names


def test_pipec_run_trains_a_tie_across_ranks_and_says_so(tmp_path) -> None:
    """The command line: checked before any worker starts (the synced program verified), then trained, exit 0;
    the start-up names the tie, the table has a sync_s column."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "pipec", "run", "1f1b", "-P", "2", "-M", "4", "--model", MODEL, "--steps", "1"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    code, out, err = done.returncode, done.stdout, done.stderr
    assert code == 0, err
    assert "tied: 0.weight = 7.weight (stages 0, 1 on ranks 0, 1): one parameter, its gradient summed by SYNC" in out
    assert "sync_s" in out


def test_a_synced_program_the_verifier_refuses_is_never_run(monkeypatch) -> None:
    """with_syncs verifies what insert_syncs made: a program with one member's SYNC missing (a deadlock: the
    other member waits for ever) is an invalid schedule, exit 1, with the verifier's counterexample."""
    import pipec.passes.sync as sync_pass
    from pipec.errors import ScheduleError
    from pipec.runtime import ties, workload

    place = sync_pass.insert_syncs

    def drop_rank_0s(program, groups):
        placed = place(program, groups)
        streams = (tuple(i for i in placed.streams[0] if i.kind is not Kind.SYNC), *placed.streams[1:])
        return dataclasses.replace(placed, streams=streams)

    monkeypatch.setattr(sync_pass, "insert_syncs", drop_rank_0s)
    with pytest.raises(ScheduleError) as caught:
        ties.with_syncs(pipec.compile("1f1b", 2, 4), workload.build(MODEL, 0).layers, (4, 4))
    assert caught.value.exit_code == 1
    assert "SYNC" in caught.value.message, caught.value.message
