"""Replicated pipelines through `pipec run` (#22 item 5): DualPipe (DeepSeek-V3) and Chimera (Li & Hoefler) hold
copies of the model over the same ranks (dualpipe: copy 0 runs micro-batches 0 .. M/2-1 down from rank 0, copy 1
the rest up from rank P-1; chimera: alternating pairs), and the copies' SYNCs sum their gradients. Checked, after
3 steps, against one process training the whole model (written without pipec's runtime; each batch's
micro-batches accumulated, test_runtime_dp.reference):

- dualpipe and chimera at P=4, M=8 on 4 gloo ranks (chimera also with V = 4 pipelines: four copies), on the
  bundled transformer example (examples/workload.py:causal_transformer, AdamW) and on a model not written for
  them (a tiny GPT-2 from Hugging Face's code through pipec.hf, against the HF model's own forward; its tied
  embeddings make per-parameter sync groups over all four of their stages): every weight within 1e-5, each
  step's loss that of one process, and after EVERY step each stage of every copy bitwise equal to copy 0's;
- `--dp 2` (dualpipe P=2 x 2 replicas), both copies of each stage on one rank (one set of layers, no SYNC), and a
  checkpoint written by dualpipe (one model, the unsplit model's keys) resumed by chimera;
- `pipec run` of DeepSeek's own DualPipe order (tests/reference/deepseek_dualpipe_orders.json.gz as a stream
  file) on the transformer and `pipec run chimera -P 4 -M 8` on the GPT-2: exit 0, `--save` writes one model (the
  tied weight once), the report's sync time per rank; `pipec.torch` refuses a replicated program.
One spawn of 4 workers runs every in-process config in turn, to share the start-up.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import deepseek_orders
import pytest
import torch
from conftest import on_gloo
from paths import SUPPORT, TESTS
from test_runtime_dp import reference

import pipec
from pipec.runtime import checkpoint, launch, stages, ties, workload

transformers = pytest.importorskip("transformers")
import hf_workloads  # noqa: E402  (after the skip: it imports pipec.hf's model code)

TRANSFORMER = "examples.workload:causal_transformer"
MLP = "workloads:mlp"
GPT2 = hf_workloads.spec("gpt2")
STEPS, TOLERANCE = 3, 1e-5
# key -> (schedule, P, M, V, Options fields); the COPIED runs are also stepped here, every copy compared after each
# step. Chimera's V is its number of pipelines: V = 4, four copies over the 4 ranks.
CONFIGS = {
    "dualpipe-transformer": ("dualpipe", 4, 8, 2, {"model": TRANSFORMER}),
    "chimera-transformer": ("chimera", 4, 8, 2, {"model": TRANSFORMER}),
    "chimera4-transformer": ("chimera", 4, 8, 4, {"model": TRANSFORMER}),
    "dualpipe-gpt2": ("dualpipe", 4, 8, 2, {"model": GPT2}),
    "chimera-gpt2": ("chimera", 4, 8, 2, {"model": GPT2}),
    "dualpipe-dp": ("dualpipe", 2, 4, 2, {"model": MLP, "dp": 2}),
}
COPIED = ("dualpipe-transformer", "chimera-transformer", "chimera4-transformer", "dualpipe-gpt2", "chimera-gpt2")
# Both copies of each stage on one rank (copy 1 down the same ranks, as a second GPipe): one set of layers there,
# the copies' gradients accumulated into it, no SYNC at all; run with --dp 2 on the spawn's 4 processes
SAME_RANK = "pipelines 2\nrank 0: 0F0 0F1 2F2 2F3 2B2 2B3 0B0 0B1\nrank 1: 1F0 1F1 3F2 3F3 3B2 3B3 1B0 1B1\n"


def _step_and_compare_copies(schedule: str, ranks: int, microbatches: int, chunks: int, spec: str) -> dict:
    """In every worker: the runtime's Runner stepped STEPS times; after each step every rank's stages' parameters
    gathered, and each stage of copies 1 .. C-1 compared with its copy 0 bitwise. Returns copy 0's weights
    (this rank's), the parameters compared and the stages that differed, per step."""
    from pipec.runtime.objects import all_gather_objects
    from pipec.runtime.runner import Runner

    program = pipec.compile(schedule, ranks, microbatches, chunks)
    work = workload.build(spec, 0)
    runner = Runner.setup(program, work)
    length = program.stages_per_pipeline
    compared, differing = [], []
    for k in range(STEPS):
        runner.step(work.batches[k % len(work.batches)])
        mine = {s: dict(stage.named_parameters()) for s, stage in runner.ctx.stages.items()}
        gathered = {s: params for part in all_gather_objects(mine) for s, params in part.items()}
        copies = [s for s in gathered if s >= length]
        compared.append(sum(len(gathered[s]) for s in copies))
        original = {s: gathered[s % length] for s in copies}  # copy 0's stage of the same layers
        differing.append([s for s in copies if any(not torch.equal(p, original[s][n]) for n, p in gathered[s].items())])
    return {"weights": runner.state_dict(), "compared": compared, "differing": differing}


def _train_all(folder: str) -> dict:
    """In every worker: each config through worker.train, each COPIED one also stepped here; then 2 steps of
    dualpipe with a checkpoint, and the third step resumed from it under chimera."""
    from pipec.runtime.options import Options
    from pipec.runtime.worker import train

    out = {}
    for key, (schedule, ranks, microbatches, chunks, fields) in CONFIGS.items():
        program = pipec.compile(schedule, ranks, microbatches, chunks)
        out[key] = train(program, Options(steps=STEPS, quiet=True, **fields))
        if key in COPIED:
            out[key]["copies"] = _step_and_compare_copies(schedule, ranks, microbatches, chunks, fields["model"])
    same_rank = pipec.compile(os.path.join(folder, "same_rank.txt"))
    out["same-rank"] = train(same_rank, Options(model=MLP, steps=STEPS, quiet=True, dp=2))
    where = os.path.join(folder, "ck")
    os.makedirs(where, exist_ok=True)  # (pipec run's preflight makes it before any worker starts)
    train(pipec.compile("dualpipe", 4, 8), Options(model=TRANSFORMER, steps=2, quiet=True, checkpoint=where))
    resumed = os.path.join(where, checkpoint.step_name(2))
    options = Options(model=TRANSFORMER, steps=STEPS, quiet=True, resume=resumed, resume_step=2)
    out["resumed"] = train(pipec.compile("chimera", 4, 8), options)
    return out


@functools.cache
def runs(folder: str) -> list[dict]:
    return launch.spawn(_train_all, 4, (folder,), timeout_s=180)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    made = tmp_path_factory.mktemp("replicated")
    (made / "same_rank.txt").write_text(SAME_RANK)
    return str(made)


@pytest.fixture(scope="module")
def per_rank(folder: str) -> list[dict]:
    return runs(folder)


@functools.cache
def expected(spec: str, microbatches: int) -> tuple[dict, list[float]]:
    """One process's weights after STEPS steps and its losses, each batch's micro-batches accumulated
    (test_runtime_dp.reference: AdamW, the transformer's optimizer, amplifies the rounding of a whole-batch
    backward past 1e-5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run (their float32 sums are blocked by thread)
    try:
        return reference(spec, STEPS, microbatches)
    finally:
        torch.set_num_threads(threads)


def worst(spec: str, weights: dict, microbatches: int = 8) -> float:
    """The largest |weight - one process| of a run's merged weights (copy 0's, every rank's); GPT-2 against the HF
    model's own forward and loss on the whole batch (SGD)."""
    if spec == GPT2:
        return hf_workloads.worst_difference("gpt2", weights)
    model = expected(spec, microbatches)[0]
    assert sorted(weights) == sorted(model)
    return max((weights[k] - model[k]).abs().max().item() for k in model)


def merged(per_rank: list[dict], key: str, part=lambda result: result["weights"], ranks=range(4)) -> dict:
    out: dict = {}
    for rank in ranks:
        out.update(part(per_rank[rank][key]))
    return out


@pytest.mark.parametrize("key", list(CONFIGS))
def test_replicated_schedules_train_like_one_process(per_rank: list[dict], key: str) -> None:
    _, ranks, microbatches, _, fields = CONFIGS[key]
    replicas = fields.get("dp", 1)
    for replica in range(replicas):  # each replica holds the whole model: copy 0 of it
        weights = merged(per_rank, key, ranks=range(replica * ranks, (replica + 1) * ranks))
        difference = worst(fields["model"], weights, microbatches * replicas)
        print(f"\n{key} replica {replica}: worst |weight - one process| {difference:.1e}")
        assert difference < TOLERANCE, (key, replica, difference)
    report = per_rank[0][key]["report"]
    assert all(row["sync_s"] > 0 for row in report["ranks"]), key  # every rank holds copies of stages of both
    if fields["model"] != GPT2:  # each step's loss: the ranks' shares (their copies' micro-batches) summed
        assert report["losses"] == pytest.approx(expected(fields["model"], microbatches * replicas)[1], abs=1e-6)
    if key in COPIED:
        copies = per_rank[0][key]["copies"]
        assert copies["compared"] == [copies["compared"][0]] * STEPS and copies["compared"][0] > 0
        assert copies["differing"] == [[]] * STEPS, key
        assert worst(fields["model"], merged(per_rank, key, lambda result: result["copies"]["weights"])) < TOLERANCE


def test_two_copies_of_a_stage_on_one_rank_are_one_set_of_layers(per_rank: list[dict]) -> None:
    report = per_rank[0]["same-rank"]["report"]
    assert all(row["sync_s"] == 0 for row in report["ranks"])  # nothing to sum across ranks
    for replica in range(2):
        weights = merged(per_rank, "same-rank", ranks=range(2 * replica, 2 * replica + 2))
        assert worst(MLP, weights, 8) < TOLERANCE


def test_a_checkpoint_is_one_model_and_a_resume_restores_every_copy(per_rank: list[dict], folder: str) -> None:
    """Written by dualpipe (two copies) after 2 steps: the unsplit model's entries, each once, as a one-copy run
    writes them; resumed by chimera for the third step: every copy restored, the weights of one process's 3
    steps."""
    saved = os.path.join(folder, "ck", checkpoint.step_name(2))
    model = torch.load(os.path.join(saved, checkpoint.MODEL_FILE), weights_only=True)
    assert list(model) == list(workload.build(TRANSFORMER, 0).layers.state_dict())
    optimizer = torch.load(os.path.join(saved, checkpoint.OPTIMIZER_FILE), weights_only=True)
    names = [n for group in optimizer["param_groups"] for n in group["params"]]
    assert sorted(names) == sorted(optimizer["state"]) and len(names) == len(set(names))
    assert worst(TRANSFORMER, merged(per_rank, "resumed")) < TOLERANCE


def test_the_sync_groups_are_per_parameter_over_ties_and_copies() -> None:
    """A tied model with copies: the tied weight's four stages are one group, the rest of each stage's parameters
    the group of its two copies; an untied model gets the copies' groups. Both verify (nccl model)."""
    from pipec.verify import verify

    program = pipec.compile("dualpipe", 4, 8)
    for spec, tied in ((GPT2, True), (TRANSFORMER, False)):
        work = workload.build(spec, 0)
        sizes = stages.partition(work.layers, program.stages_per_pipeline)
        synced = ties.with_syncs(program, work.layers, sizes)
        copies = tuple((s, s + 4) for s in range(4))
        assert synced.sync_groups == (((0, 3, 4, 7), *copies) if tied else copies), spec
        assert verify(synced, p2p="nccl").ok


def pipec_run(folder, *arguments: str) -> tuple[str, dict, dict]:
    """`pipec run ... --steps 3 --save w.pt --report r.json` in `folder` (exit 0): its output, the saved weights and
    the report."""
    # the examples folder's module from the checkout's root (as `python -m` would find it there)
    path = os.pathsep.join([str(SUPPORT), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "pipec", "run", *arguments, "--steps", str(STEPS), "--save", "w.pt",
               "--report", "r.json"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run(on_gloo(command), cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads((folder / "r.json").read_text())
    assert [row["sync_s"] > 0 for row in report["ranks"]] == [True] * 4  # every rank syncs its copies
    assert "sync_s" in done.stdout  # the printed table's column
    return done.stdout, torch.load(folder / "w.pt", weights_only=True), report


def test_pipec_run_trains_deepseeks_own_dualpipe_order_and_saves_one_model(tmp_path) -> None:
    """DeepSeek's own DualPipe order at P=4, M=8 (tests/reference, recorded from dualpipe.py) as a stream file."""
    streams = tmp_path / "deepseek_dualpipe.txt"
    streams.write_text(deepseek_orders.dualpipe_text(deepseek_orders.reference("dualpipe")["4,8"]))
    out, saved, report = pipec_run(tmp_path, str(streams), "--model", TRANSFORMER)
    assert "copies: stages 0, 4 on ranks 0, 3: one stage's 25 parameter tensors" in out, out
    # the measured costs describe one copy of the model as P segments (the median over its copies), and a SYNC
    assert [len(report["costs"][kind]) for kind in "FIW"] == [4, 4, 4] and report["costs"]["sync"] > 0
    assert list(saved) == list(workload.build(TRANSFORMER, 0).layers.state_dict())  # one model, in layer order
    assert worst(TRANSFORMER, saved) < TOLERANCE


def test_pipec_run_chimera_trains_a_tied_gpt2_and_saves_its_tied_weight_once(tmp_path) -> None:
    out, saved, _ = pipec_run(tmp_path, "chimera", "-P", "4", "-M", "8", "--model", GPT2)
    assert "(stages 0, 3, 4, 7 on ranks 0, 3): one parameter, its gradient summed by SYNC" in out, out
    embedding, head = saved[hf_workloads.EMBEDDING], saved[hf_workloads.HEAD]
    assert embedding.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()  # stored once
    assert hf_workloads.worst_difference("gpt2", saved) < TOLERANCE


def test_torchs_own_runtime_is_refused_a_replicated_program() -> None:
    """pipec.torch runs streams on torch's _PipelineScheduleRuntime, one module per stage index each handing to
    the next: a program of two copies would run copy 0's last stage into copy 1's first. Refused, saying why."""
    from pipec.errors import PipecInputError
    from pipec.torch import compile_for_torch

    with pytest.raises(PipecInputError, match="runs 2 copies of the model"):
        compile_for_torch("dualpipe", 4, 8, 2)


def test_an_explicit_partition_counts_the_stages_of_one_copy(capsys) -> None:
    """dualpipe at P=4 has 8 stages, two copies of 4: --partition gives one copy's 4 (before any worker starts)."""
    from pipec.cli import main as cli_main

    command = ["run", "dualpipe", "-P", "4", "-M", "8", "--model", MLP, "--partition", "2,2,2,2,2,2,2,2"]
    assert cli_main(command) == 2
    expected = "expected 4 positive layer counts (one per stage of one of the schedule's 2 copies of the model)"
    assert expected in capsys.readouterr().err
