"""`pipec run` end to end: the CLI's report, trace and saved weights, a torchrun launch, a worker killed
mid-step, bad inputs refused before any process starts, and the partitioner against brute force."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import on_gloo
from paths import ROOT, SUPPORT
from test_runtime import assert_same_weights, reference

from pipec.cli import main as cli_main
from pipec.ir import Action, Kind, parse_instruction
from pipec.runtime.stages import optimal_partition

PIPEC = [sys.executable, "-m", "pipec"]


def run(command: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(on_gloo(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_writes_report_trace_and_the_trained_weights(tmp_path: Path) -> None:
    done = run(
        [*PIPEC, "run", "zbv", "-P", "2", "-M", "4", "--model", "workloads:residual", "--steps", "2",
         "--report", "run.json", "--trace", "trace.json", "--save", "w.pt"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # a good run says nothing on stderr (workers once aborted in teardown: std::terminate)
    assert "step   0  loss" in done.stdout and "step   1  loss" in done.stdout
    assert "stage 3 (rank 0)" in done.stdout  # the printed partition, V placement
    report = json.loads((tmp_path / "run.json").read_text())
    assert len(report["step_times"]) == 2 and report["median_step_s"] > 0
    expected, losses = reference("residual")
    assert report["losses"] == pytest.approx(losses, abs=1e-5)
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for row in report["ranks"]:
        assert {"compute_s", "comm_wait_s", "idle_s"} <= set(row)
        assert row["peak_activations"] == row["peak_activations_predicted"]
    assert_same_weights(torch.load(tmp_path / "w.pt"), expected)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    # every compute action of both steps appears once on its rank: zbv P=2 M=4 has 4 stages x 4 mbs x F, I, W
    computed = [e["name"] for e in slices if e["cat"] in ("F", "B", "I", "W")]
    assert len(computed) == 2 * 4 * 4 * 3 and {e["tid"] for e in slices} == {0, 1}
    assert any(e["ph"] == "s" for e in events)  # send -> receive arrows
    # every batch is posted once ("comm") and waited for once ("wait"), after it was posted
    posted, waited = p2p_slices(slices)
    assert sorted(posted) == sorted(waited) and posted
    assert all(waited[key][0] >= posted[key][0] for key in posted)
    # one time origin for all ranks: no receive is delivered before its send was posted on the other rank
    pairs = 0
    for (step, name), (start, _) in posted.items():
        stage, kind, mb = parse_instruction(name)
        if kind is Kind.SEND_F or kind is Kind.SEND_B:
            peer = Action(stage + 1 if kind is Kind.SEND_F else stage - 1, Kind[f"RECV_{kind.value[-1]}"], mb)
            assert waited[step, str(peer)][1] >= start, (step, name)
            pairs += 1
    assert pairs > 0


def p2p_slices(slices: list[dict]) -> tuple[dict, dict]:
    """(step, p2p action) -> (start, end) of the slice posting its batch, and of the slice waiting for it."""
    posted, waited = {}, {}
    for e in slices:
        box = {"comm": posted, "wait": waited}.get(e["cat"])
        for part in e["name"].split() if box is not None else ():
            assert (e["args"]["step"], part) not in box, part
            box[e["args"]["step"], part] = (e["ts"], e["ts"] + e["dur"])
    return posted, waited


def test_a_rank_computes_on_while_its_sends_wait_for_the_receiver(tmp_path: Path) -> None:
    """Rule version 2: rank 0 never waits for a send before computing. Its receiver (stage 1) sleeps 0.25 s per
    forward and posts RECV_F(1, m) only after F(1, m-1), so under version 1 (each batch waited for at once)
    rank 0 could not start F(0, 3) before F(1, 1) ended; under version 2 it runs all its forwards at once and
    waits for its sends only at the end of the step."""
    done = run(
        [*PIPEC, "run", "gpipe", "-P", "2", "-M", "4", "--model", "workloads:slow_receiver", "--partition", "2,2",
         "--steps", "1", "--trace", "trace.json"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    slices = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    at = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in slices if e["cat"] == "F"}
    assert at["0F3"][0] < at["1F1"][1] - 0.2e6  # a wide margin: the sleep alone puts 1F1's end 0.5 s in
    posted, waited = p2p_slices(slices)
    # rank 0's sends completed only once rank 1 posted the receives, long after rank 0's forwards
    for m in range(4):
        assert waited[0, f"0SEND_F{m}"][1] >= posted[0, f"1RECV_F{m}"][0]
    assert posted[0, "1RECV_F3"][0] > at["0F3"][1] + 0.2e6


def test_torchrun_launch(tmp_path: Path) -> None:
    done = run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "pipec.run",
         "1f1b", "-P", "2", "-M", "4", "--model", "workloads:mlp", "--save", "w.pt"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected, _ = reference("mlp")
    assert_same_weights(torch.load(tmp_path / "w.pt"), expected)


def test_a_killed_worker_stops_every_rank_with_a_clear_error(tmp_path: Path) -> None:
    start = time.monotonic()
    done = run(
        [*PIPEC, "run", "1f1b", "-P", "4", "-M", "4", "--model", "workloads:dies", "--partition", "2,2,3,2",
         "--timeout", "10"],
        tmp_path,
        timeout=120,  # a hang guard only: the process group timeout is 10 s
    )  # fmt: skip
    elapsed = time.monotonic() - start
    print(f"pipec run with a killed rank exited after {elapsed:.1f} s (rc {done.returncode})\n{done.stderr}")
    assert done.returncode == 3
    lines = done.stderr.splitlines()
    assert "rank 2: the process was killed by SIGKILL" in done.stderr
    for rank in (0, 1, 3):  # each survivor names itself, the step and where it was blocked
        assert any(line.strip().startswith(f"rank {rank}: step 1, ") and "waiting for" in line for line in lines), rank
    assert "step   0  loss" in done.stdout


def test_a_rank_dying_while_its_peer_waits_on_sends_at_the_end_of_the_step(tmp_path: Path) -> None:
    # rank 1 dies in F(1, 5) of step 0, having posted its receives up to micro-batch 7 (two batches ahead on
    # gloo); rank 0 has posted every forward send and waits for them at the end of the step: the sends of
    # micro-batches 8 to 11 can never complete
    start = time.monotonic()
    done = run(
        [*PIPEC, "run", "forward_only", "-P", "2", "-M", "12", "--model", "workloads:dies_receiving",
         "--partition", "2,2", "--timeout", "10"],
        tmp_path,
        timeout=120,  # a hang guard only
    )  # fmt: skip
    print(f"exited after {time.monotonic() - start:.1f} s (rc {done.returncode})\n{done.stderr}")
    assert done.returncode == 3
    assert "rank 1: the process was killed by SIGKILL" in done.stderr
    line = next(line.strip() for line in done.stderr.splitlines() if line.strip().startswith("rank 0: "))
    assert line.startswith("rank 0: step 0, end of step, waiting for the batch at instruction "), line
    assert "0SEND_F" in line


def test_a_hung_worker_is_ended_by_the_watchdog_and_the_others_time_out(tmp_path: Path) -> None:
    done = run(
        [*PIPEC, "run", "1f1b", "-P", "4", "-M", "4", "--model", "workloads:hangs", "--partition", "2,2,3,2",
         "--timeout", "3"],
        tmp_path,
        timeout=120,  # a hang guard only
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    # the hung rank: its watchdog saw no progress for timeout + 5 s, inside stage 2's first forward of step 1
    assert "rank 2: no progress for 8 s at step 1, instruction 1 (2F0)" in done.stderr
    for rank in (0, 1, 3):  # its neighbours' p2p ops timed out after --timeout
        assert f"rank {rank}: step 1, instruction" in done.stderr and "Timed out" in done.stderr


def write_csv(tmp_path: Path, rows: list[str]) -> str:
    path = tmp_path / "schedule.csv"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--model", "no_such_module:make"], 2, "cannot import no_such_module"),
        (["--model", "workloads:no_such_factory"], 2, "has no function no_such_factory"),
        (["--model", "workloads:mlp", "--partition", "1,2"], 2, "expected 2 positive layer counts"),
        (["--model", "workloads:mlp", "-M", "3"], 2, "not divisible by the 3 micro-batches"),
        (["--model", "workloads:mlp", "--steps", "0"], 2, "--steps"),
    ],
)
def test_bad_input_is_refused_before_any_process_starts(extra, code, message, capsys) -> None:
    args = ["run", "1f1b", "-P", "2", *extra]
    if "-M" not in extra:
        args += ["-M", "4"]
    assert cli_main(args) == code
    assert message in capsys.readouterr().err


def test_more_stages_than_layers_is_bad_input(capsys) -> None:
    assert cli_main(["run", "interleaved_1f1b", "-P", "2", "-M", "4", "--model", "workloads:tiny"]) == 2
    assert "the model has 2 layers but the schedule has 4 stages" in capsys.readouterr().err


def test_an_invalid_schedule_is_refused_with_exit_1(tmp_path: Path, capsys) -> None:
    # rank 1 runs its backward before its forward: the verifier finds the deadlock, nothing is launched
    schedule = write_csv(tmp_path, ["0F0,0B0", "1B0,1F0"])
    assert cli_main(["run", schedule, "--model", "workloads:mlp"]) == 1
    assert "deadlock" in capsys.readouterr().err


def brute_force(weights: list[float], parts: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(weights)), parts - 1):
        bounds = (0, *cuts, len(weights))
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_partition_is_optimal_and_contiguous() -> None:
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        weights = [float(rng.randint(0, 20)) for _ in range(n)]
        sizes = optimal_partition(weights, parts)
        assert len(sizes) == parts and sum(sizes) == n and min(sizes) >= 1
        bounds = [0, *itertools.accumulate(sizes)]
        largest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        assert largest == brute_force(weights, parts)


def test_the_runtime_needs_no_numpy(tmp_path: Path) -> None:
    """torch's object collectives and shape inference need NumPy; pipec's runtime must not (a torch CPU
    install does not bring it). A stand-in package makes `import numpy` fail in every worker."""
    blocker = tmp_path / "blocked" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError('numpy is blocked for this test', name='numpy')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker.parent), str(ROOT), str(SUPPORT)]))
    command = [sys.executable, "-m", "pipec", "run", "1f1b", "-P", "2", "-M", "2", "--model", "workloads:mlp"]
    command += ["--save", str(tmp_path / "w.pt"), "--report", str(tmp_path / "r.json")]
    result = subprocess.run(on_gloo(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ranks"][1]["peak_activations"] == 1
