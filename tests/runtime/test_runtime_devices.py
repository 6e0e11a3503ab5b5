"""Devices: which backend `pipec run` picks (a pure function, tested on any machine), what it says and refuses,
and NCCL runs where GPUs are visible: P=1 whenever CUDA is (the schedule's weights equal one process's, and the
report's timings are CUDA events), P=2 with two GPUs, fewer GPUs than ranks falling back to gloo. Tests that
need GPUs skip, saying how many they need and found."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import gpu_count, needs_gpus
from paths import SUPPORT, TESTS
from test_runtime import assert_same_weights, reference

from pipec.cli import main as cli_main
from pipec.errors import PipecInputError
from pipec.runtime.launch import choose_backend

ROOT = TESTS.parent


@pytest.mark.parametrize(
    ("requested", "cuda", "gpus", "processes", "backend"),
    [
        (None, False, 0, 4, "gloo"),  # no CUDA: gloo, nothing to say
        (None, True, 4, 4, "nccl"),  # a GPU per process
        (None, True, 8, 2, "nccl"),
        (None, True, 1, 1, "nccl"),
        ("gloo", True, 1, 4, "gloo"),  # asked for: no note
        ("gloo", True, 8, 4, "gloo"),
        ("nccl", True, 4, 4, "nccl"),
    ],
)
def test_backend_choice(requested: str | None, cuda: bool, gpus: int, processes: int, backend: str) -> None:
    assert choose_backend(requested, cuda, gpus, processes) == (backend, None)


def test_fewer_gpus_than_processes_falls_back_to_gloo_and_says_so_in_one_line() -> None:
    backend, note = choose_backend(None, True, 1, 4)
    assert backend == "gloo"
    assert note is not None and "\n" not in note
    assert "4 processes but 1 GPU:" in note and "gloo" in note
    assert "2 GPUs" in choose_backend(None, True, 2, 4)[1]  # type: ignore[operator]


@pytest.mark.parametrize(("cuda", "gpus", "found"), [(True, 1, "found 1"), (False, 0, "CUDA is not available")])
def test_explicit_nccl_without_enough_gpus_is_bad_input(cuda: bool, gpus: int, found: str) -> None:
    with pytest.raises(PipecInputError) as caught:
        choose_backend("nccl", cuda, gpus, 4)
    assert "--backend nccl needs 4 GPUs" in caught.value.message and found in caught.value.message


@pytest.mark.skipif(gpu_count() >= 2, reason="this machine could run it: the refusal needs fewer than 2 GPUs")
def test_cli_refuses_nccl_it_cannot_run(capsys: pytest.CaptureFixture) -> None:
    code = cli_main(["run", "1f1b", "-P", "2", "-M", "4", "--model", "workloads:mlp", "--backend", "nccl"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--backend nccl needs 2 GPUs" in err and "Traceback" not in err


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "pipec", "run", *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@needs_gpus(1)
@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 1), ("zbv", 2), ("interleaved_zb", 2)])
def test_one_rank_on_nccl_trains_like_one_process(tmp_path: Path, schedule: str, chunks: int) -> None:
    done = run(
        [schedule, "-P", "1", "-M", "4", "-V", str(chunks), "--model", "workloads:mlp", "--steps", "2",
         "--backend", "nccl", "--save", "w.pt", "--report", "r.json", "--trace", "t.json"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected, losses = reference("mlp")
    assert_same_weights(torch.load(tmp_path / "w.pt", map_location="cpu"), expected)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["losses"] == pytest.approx(losses, abs=1e-5)
    rank = report["ranks"][0]
    assert rank["timing"] == "cuda events"
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    traced = sum(e["dur"] for e in events if e["ph"] == "X" and e["cat"] in "FBIW") / 1e6
    assert traced == pytest.approx(rank["compute_s"], rel=1e-3)


@needs_gpus(2)
def test_two_ranks_on_nccl_train_like_one_process(tmp_path: Path) -> None:
    done = run(["1f1b", "-P", "2", "-M", "4", "--model", "workloads:mlp", "--steps", "2", "--save", "w.pt"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "note:" not in done.stdout  # a GPU per rank: NCCL, nothing to say
    assert_same_weights(torch.load(tmp_path / "w.pt", map_location="cpu"), reference("mlp")[0])


@needs_gpus(1)
def test_more_ranks_than_gpus_run_on_gloo_and_say_so(tmp_path: Path) -> None:
    ranks = gpu_count() + 1
    done = run(["1f1b", "-P", str(ranks), "-M", "4", "--model", "workloads:mlp", "--steps", "1"], tmp_path)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "running on gloo" in notes[0], done.stdout


def readme_run_line() -> list[str]:
    """The README's `pipec run` line as a user types it (its comment cut off), without the `pipec`."""
    line = next(text for text in (ROOT / "README.md").read_text().splitlines() if text.startswith("pipec run "))
    return shlex.split(line.split("#")[0])[1:]


# The parent process sees a machine with CUDA and one GPU; what it decides and starts is real.
ONE_GPU = (
    "import sys, torch\n"
    "torch.cuda.is_available = lambda: True\n"
    "torch.cuda.device_count = lambda: 1\n"
    "from pipec.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_the_readmes_run_line_on_a_one_gpu_machine_runs_on_gloo_and_says_so() -> None:
    """On any machine: `pipec run`'s device inventory reads one GPU (only its own: the workers start as fresh
    processes), so the README's 4-rank run must fall back to gloo on the CPU, say so in one line on stdout, keep
    stderr empty and train. On a real one-GPU machine `test_more_ranks_than_gpus_run_on_gloo_and_say_so` runs
    the same path without the stand-in."""
    argv = readme_run_line()
    assert argv[:1] == ["run"] and "-P" in argv
    done = subprocess.run(
        [sys.executable, "-c", ONE_GPU, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    notes = [line for line in done.stdout.splitlines() if line.startswith("note:")]
    ranks = argv[argv.index("-P") + 1]
    assert len(notes) == 1 and f"{ranks} processes but 1 GPU: running on gloo" in notes[0], done.stdout
    assert "step   0  loss" in done.stdout and "median step" in done.stdout


@pytest.mark.skipif(gpu_count() >= 2, reason="this machine could run it: the refusal needs fewer than 2 GPUs")
def test_torchrun_workers_honour_backend(tmp_path: Path) -> None:
    """Under torchrun, `--backend` is what each worker uses (it was once chosen from the GPUs regardless): an
    explicit nccl that the node cannot run is refused before any worker joins a process group. Each worker checks
    on its own, but torchrun stops the others once the first exits, so a slower one may never get to say it."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*torchrun, "-m", "pipec", "run", "1f1b", "-P", "2", "-M", "4", "--model", "examples.workload:mlp",
         "--backend", "nccl"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    refusals = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if "--backend nccl needs" in line]
    assert 1 <= len(refusals) <= 2 and all(line.startswith("error: --backend nccl needs 2 GPUs") for line in refusals)
    assert "Traceback" not in done.stdout


@needs_gpus(1)
def test_profiling_on_a_gpu_times_each_layer_there_and_leaves_the_model_as_it_was() -> None:
    """`--partition profile` on a GPU rank: each layer is measured on the GPU (synchronized) and goes back to
    the CPU with no gradient and unchanged weights, so the stages built next are the model's own."""
    from torch import nn

    from pipec.runtime.stages import layer_weights_by_profile

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64), nn.Linear(64, 64))
    before = {k: v.clone() for k, v in layers.state_dict().items()}
    weights = layer_weights_by_profile(layers, torch.randn(256, 64), device=torch.device("cuda", 0))
    assert len(weights) == 4 and all(w > 0 for w in weights)
    assert all(p.device.type == "cpu" and p.grad is None for p in layers.parameters())
    assert all(torch.equal(before[k], v) for k, v in layers.state_dict().items())


@needs_gpus(1)
def test_the_next_batch_is_copied_ahead_and_taken_on_the_compute_stream() -> None:
    """feed.Feed on a GPU: a batch prefetched on the side stream is handed over equal to the batch, even when the
    copy is still queued (the compute stream must wait for it), on the device where the rank reads it (inputs on
    stage 0's rank, targets on the last stage's) and on the CPU where it does not; a batch other than the
    announced one is copied as it is taken."""
    from pipec.runtime.feed import Feed

    device = torch.device("cuda", torch.cuda.current_device())
    a, b, c = [(torch.randn(8, 1 << 16), torch.randn(8, 1 << 16)) for _ in range(3)]

    def check(got: tuple, batch: tuple, inputs_here: bool, targets_here: bool) -> None:
        inputs, targets = got
        assert {t.device.type for t in inputs} == {"cuda" if inputs_here else "cpu"}
        assert {t.device.type for t in targets} == {"cuda" if targets_here else "cpu"}
        read = [torch.cat([t.to(device) + 0 for t in part]).cpu() for part in got]  # read on the compute stream
        assert torch.equal(read[0], batch[0]) and torch.equal(read[1], batch[1])

    for inputs_here, targets_here in [(True, True), (True, False), (False, True)]:
        feed = Feed(device, 4, inputs_here=inputs_here, targets_here=targets_here)
        check(feed.take(a), a, inputs_here, targets_here)  # nothing ahead: copied when taken
        with torch.cuda.stream(feed.stream):
            torch.cuda._sleep(100_000_000)  # the copy ahead queued behind tens of milliseconds of GPU work
        feed.prefetch(b)
        check(feed.take(b), b, inputs_here, targets_here)
        feed.prefetch(c)
        check(feed.take(a), a, inputs_here, targets_here)  # not the announced batch
