"""Data parallel x pipeline parallel (`pipec run --dp D`, issue #11): D replicas of a P-rank pipeline train to
the weights of one process training on the full batch.

One spawn of 4 gloo processes runs every P x D = 4 configuration in turn (P=2 D=2 for 1f1b, interleaved_1f1b and
zbv; P=1 D=4; a sparse gradient; a NaN in one replica's data), one spawn of 2 processes runs the same schedules
with P=2 D=1: sharing the processes' start-up keeps this file to two spawns. The D=2 and D=1 runs cut each
batch into the same D x M = 4 micro-batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import dp_workloads
import pytest
import torch
from test_runtime import assert_same_weights

from pipec.cli import main as cli_main
from pipec.runtime import launch
from pipec.runtime.stages import run_layers
from pipec.runtime.workload import build, make_optimizer

SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv")
STEPS = 2


def _configs(trace: Path) -> list[tuple]:
    """(key, schedule, P, M, Options fields) of the 4-process spawn."""
    out = []
    for name in SCHEDULES:
        fields = {"model": "workloads:mlp", "steps": STEPS, "dp": 2}
        if name == "1f1b":
            fields["trace"] = str(trace)
        out.append((name, name, 2, 2, fields))
    out.append(("residual", "zbv", 2, 2, {"model": "workloads:residual", "steps": STEPS, "dp": 2}))
    out.append(("pure-dp", "1f1b", 1, 2, {"model": "workloads:mlp", "steps": STEPS, "dp": 4}))
    out.append(("sparse", "1f1b", 2, 2, {"model": "dp_workloads:sparse_embedding", "steps": STEPS, "dp": 2}))
    out.append(("nan", "1f1b", 2, 2, {"model": "dp_workloads:nan_in_replica_1", "steps": 3, "dp": 2}))
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> tuple[list[dict], Path]:
    trace = tmp_path_factory.mktemp("dp") / "trace.json"
    return launch.spawn(dp_workloads.train_configs, 4, (_configs(trace),), timeout_s=60), trace


@pytest.fixture(scope="module")
def two() -> list[dict]:
    configs = [(name, name, 2, 4, {"model": "workloads:mlp", "steps": STEPS}) for name in SCHEDULES]
    return launch.spawn(dp_workloads.train_configs, 2, (configs,), timeout_s=60)


def replica_weights(per_rank: list[dict], key: str, ranks: int, replica: int) -> dict:
    weights = {}
    for rank in range(replica * ranks, (replica + 1) * ranks):
        weights.update(per_rank[rank][key]["weights"])
    return weights


def reference(spec: str, steps: int = STEPS, microbatches: int = 1) -> tuple[dict, list[float]]:
    """One process training the whole model on each full batch (same seed, same optimizer; a layer's tuple output
    is the next layer's positional arguments, as `pipec run --model` documents). With `microbatches` M > 1, the
    batch's M micro-batches in turn, each loss / M, their gradients accumulated before the optimizer step (the
    same arithmetic as the pipeline's: an optimizer that amplifies rounding, AdamW on near-zero gradients, then
    compares within 1e-5 where the whole batch at once differs by more)."""
    work = build(spec, seed=0)
    optimizer = make_optimizer(work, [p for p in work.layers.parameters() if p.requires_grad])
    losses = []
    for k in range(steps):
        x, y = work.batches[k % len(work.batches)]
        optimizer.zero_grad()
        total = 0.0
        for part_x, part_y in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            loss = work.loss_fn(run_layers(work.layers, part_x), part_y) / microbatches
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return {k: v.detach().clone() for k, v in work.layers.state_dict().items()}, losses


def max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize(
    ("key", "ranks", "replicas", "model"),
    [
        ("1f1b", 2, 2, "workloads:mlp"),
        ("interleaved_1f1b", 2, 2, "workloads:mlp"),
        ("zbv", 2, 2, "workloads:mlp"),
        ("residual", 2, 2, "workloads:residual"),
        ("pure-dp", 1, 4, "workloads:mlp"),
        ("sparse", 2, 2, "dp_workloads:sparse_embedding"),
    ],
)
def test_replicas_train_like_one_process_on_the_full_batch(four, key, ranks, replicas, model) -> None:
    per_rank, _ = four
    expected, losses = reference(model)
    first = replica_weights(per_rank, key, ranks, 0)
    print(f"{key} P={ranks} D={replicas}: max |w - reference| = {max_difference(first, expected):.3g}")
    assert_same_weights(first, expected)
    for replica in range(1, replicas):  # the all-reduce leaves every replica the same mean: bitwise equal weights
        other = replica_weights(per_rank, key, ranks, replica)
        assert all(torch.equal(other[k], first[k]) for k in first), replica
    report = per_rank[0][key]["report"]
    assert report["dp"] == replicas and report["world_size"] == 4
    assert report["losses"] == pytest.approx(losses, abs=1e-5)  # the mean over replicas: the full batch's loss
    assert [(r["rank"], r["replica"], r["pipeline_rank"]) for r in report["ranks"]] == [
        (g, g // ranks, g % ranks) for g in range(4)
    ]  # pipeline-major layout
    for row in report["ranks"]:
        assert row["allreduce_s"] > 0, row  # every rank averaged its stages' gradients
        assert row["peak_activations"] == row["peak_activations_predicted"], row


@pytest.mark.parametrize("name", SCHEDULES)
def test_one_replica_and_two_agree(four, two, name: str) -> None:
    """P=2 with D=1 (M=4) and D=2 (M=2 each): the same 4 micro-batches, the same weights to float rounding."""
    one = replica_weights(two, name, 2, 0)
    both = replica_weights(four[0], name, 2, 0)
    expected, _ = reference("workloads:mlp")
    print(f"{name}: D=1 vs reference {max_difference(one, expected):.3g}, D=1 vs D=2 {max_difference(one, both):.3g}")
    assert_same_weights(one, expected)
    assert_same_weights(both, one)
    assert all(row["allreduce_s"] == 0 for row in two[0][name]["report"]["ranks"])  # D=1: no collective


def test_the_trace_shows_each_ranks_all_reduce_and_p2p_stays_in_its_replica(four) -> None:
    _, trace = four
    events = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in slices} == {0, 1, 2, 3}
    for rank in range(4):  # one all-reduce per stage and step on every rank (one bucket each: tiny stages)
        reduces = [e for e in slices if e["tid"] == rank and e["cat"] == "allreduce"]
        assert len(reduces) == STEPS, reduces
        assert all(e["dur"] >= 0 and e["name"].startswith("allreduce stage ") for e in reduces)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts and set(starts) == set(ends)
    for key, start in starts.items():  # sender and receiver are in the same replica (P = 2)
        assert start["tid"] // 2 == ends[key]["tid"] // 2, (start, ends[key])
    assert {start["tid"] // 2 for start in starts.values()} == {0, 1}


def test_a_nan_in_one_replica_stops_every_rank_before_the_optimizer_step(four) -> None:
    per_rank, _ = four
    errors = [per_rank[rank]["nan"].get("error", "") for rank in range(4)]
    # replica 1 (ranks 2, 3) saw the NaN of step 1's row 5 (its micro-batch 0); replica 0 stopped with it
    assert errors[3].startswith("rank 3 (replica 1): step 1: the loss is nan at micro-batch 0 of stage 1"), errors
    assert errors[2].startswith("rank 2 (replica 1): step 1: stage 0 has non-finite gradients"), errors
    for rank in (0, 1):
        assert errors[rank] == (
            f"rank {rank} (replica 0): step 1: stopped with the others (non-finite values on rank 2, 3)"
        ), errors


def test_a_batch_that_does_not_split_into_d_x_m_is_refused_before_any_worker(capsys) -> None:
    code = cli_main(["run", "1f1b", "-P", "2", "-M", "2", "--dp", "3", "--model", "workloads:mlp"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the batch size 8 is not divisible by --dp 3 x 2 micro-batches = 6" in err
    # an argparse type error: the usage line and exit 2
    assert cli_main(["run", "1f1b", "-P", "2", "-M", "2", "--dp", "0", "--model", "workloads:mlp"]) == 2
    assert "argument --dp: must be at least 1, got 0" in capsys.readouterr().err


def test_torchrun_with_the_wrong_number_of_processes_is_refused_before_joining(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = cli_main(["run", "1f1b", "-P", "2", "-M", "2", "--dp", "2", "--model", "workloads:mlp"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "torchrun started 2 processes; 1f1b with P=2 and --dp 2 needs P x D = 4" in err
