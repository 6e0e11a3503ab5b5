"""`pipec run` under faults (issue #12, "Nothing lost, nothing silent"): bad workloads and numbers are refused
before any worker starts (exit 2, a message, no traceback); outputs are checked first and written atomically;
SIGINT/SIGTERM stop every worker and say where each was (exit 130/143); a SIGKILLed parent takes its workers
along; a NaN or inf stops the run (exit 3) unless --allow-nonfinite.

Real processes and gloo groups, no mocks. Each full run costs a few seconds (torch is imported per process),
so each test runs one, on the small models of tests/support/faulty_workloads.py.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import on_gloo
from paths import SUPPORT

from pipec.cli import main as cli_main

PIPEC = [sys.executable, "-m", "pipec"]
RUN = [*PIPEC, "run", "1f1b", "-P", "2", "-M", "4"]


def environment(tmp_path: Path) -> dict[str, str]:
    """The tests' workloads importable; a private TMPDIR, to see what a run leaves there."""
    temporary = tmp_path / "tmp"
    temporary.mkdir(exist_ok=True)
    path = os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, TMPDIR=str(temporary))


def run(args: list[str], tmp_path: Path, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        on_gloo(args), cwd=tmp_path, env=environment(tmp_path), capture_output=True, text=True, timeout=timeout,
        **kwargs,
    )


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting to be reaped has stopped running)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status and "\nState:\tX" not in status


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                found.append(int(entry.name))
    return found


def wait_for(condition, limit: float) -> float | None:
    """Seconds until `condition()` held, or None if it did not within `limit`."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if condition():
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def start_training(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, list[int], Path, Path]:
    """A long run (faulty_workloads:slow), returned once it prints its first step: the parent, its children
    (the workers and multiprocessing's resource tracker), its stdout and stderr files."""
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    command = [*RUN, "--model", "faulty_workloads:slow", "--save", "w.pt", *extra]
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(command, cwd=tmp_path, env=environment(tmp_path), stdout=stdout, stderr=stderr)
    if wait_for(lambda: "step   0" in out.read_text() or proc.poll() is not None, 90) is None or proc.poll():
        proc.kill()
        pytest.fail(f"the run did not start: {err.read_text()}")
    return proc, children(proc.pid), out, err


def leftovers(tmp_path: Path) -> list[str]:
    """What a run must not leave: its rendezvous folders, multiprocessing's folders, half-written outputs."""
    names = [p.name for p in (tmp_path / "tmp").iterdir()] + [p.name for p in tmp_path.iterdir()]
    return [n for n in names if n.startswith(("pipec-run-", "pymp-", ".w.pt"))]


# --- refused before any worker starts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("raises", "the factory raised ValueError: the factory broke on purpose"),
        ("needs_args", "the factory needs arguments (hidden) but pipec calls it with none"),
        ("string_layers", "layers is the str 'not a model'; expected an nn.Sequential or a list of modules"),
        ("int_layers", "layers[0] is an int, not an nn.Module"),
        ("tensor_batches", "batches is a tensor of shape (2, 8, 8); expected a list of (input, target) pairs"),
        ("unpaired_batches", "batches[0] is a tensor of shape (8, 8); expected an (input, target) pair"),
        ("number_batches", "batches is an int; expected a list of (input, target) pairs"),
        ("wrong_width", "layer 0 (Linear) fails on a micro-batch of batches[0] (input (2, 5) torch.float32)"),
    ],
)
def test_a_bad_workload_is_refused_with_a_message_before_any_worker(factory: str, message: str, capsys) -> None:
    code = cli_main(["run", "1f1b", "-P", "2", "-M", "4", "--model", f"faulty_workloads:{factory}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: --model faulty_workloads:{factory}: {message}" in err
    assert "Traceback" not in err and "internal error" not in err
    assert not multiprocessing.active_children()  # no worker was started


def test_a_bad_workload_in_a_fresh_process_exits_2_without_a_traceback(tmp_path: Path) -> None:
    start = time.monotonic()
    done = run([*RUN, "--model", "faulty_workloads:raises", "--save", "w.pt"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: --model faulty_workloads:raises: the factory raised ValueError")
    assert "Traceback" not in done.stderr and not (tmp_path / "w.pt").exists()
    # no partition, no step: no worker ran (only the line saying what pipec run was checking)
    assert time.monotonic() - start < 30
    assert done.stdout.startswith("pipec run: compiling") and done.stdout.count("\n") == 1


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--seed", str(2**70), "expected an integer from 0 to 2**64-1"),
        ("--seed", "-1", "expected an integer from 0 to 2**64-1"),
        ("--timeout", "nan", "expected seconds from 0.1 to 86400"),
        ("--timeout", "inf", "expected seconds from 0.1 to 86400"),
        ("--timeout", "1e30", "expected seconds from 0.1 to 86400"),
        ("--timeout", "0", "expected seconds from 0.1 to 86400"),
    ],
)
def test_out_of_range_numbers_are_refused_up_front(flag: str, value: str, message: str, tmp_path: Path) -> None:
    done = run([*RUN, "--model", "faulty_workloads:good", flag, value], tmp_path, timeout=60)
    assert done.returncode == 2
    assert f"argument {flag}: {message}" in done.stderr and "Traceback" not in done.stderr


def test_the_largest_seed_is_accepted(capsys) -> None:
    import pipec
    from pipec.runtime.options import Options
    from pipec.runtime.preflight import validate

    program = pipec.compile("1f1b", 2, 4)
    validate(program, Options(model="faulty_workloads:good", seed=2**64 - 1))  # torch.manual_seed takes it
    assert cli_main(["run", "1f1b", "-P", "2", "-M", "4", "--model", "x:y", "--seed", "18446744073709551615"]) == 2
    assert "cannot import x" in capsys.readouterr().err  # the seed passed; the model did not


def test_an_output_in_a_missing_directory_is_refused_before_any_work(tmp_path: Path) -> None:
    start = time.monotonic()
    done = run([*RUN, "--model", "faulty_workloads:good", "--report", "r.json", "--save", "no/such/w.pt"], tmp_path)
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    assert "error: --save no/such/w.pt: the directory no/such does not exist" in done.stderr
    assert elapsed < 10 and not done.stdout  # refused before compiling, importing torch or starting workers
    assert not (tmp_path / "r.json").exists()


# --- outputs: nothing lost -----------------------------------------------------------------------------------


def test_a_failed_save_keeps_the_previous_file_and_the_other_outputs(tmp_path: Path) -> None:
    """A file-size limit stands in for a full disk: --save (a few KB) cannot be written, --report (1 KB) can.
    The old weights file must survive intact, the report must be written, and the run must fail (exit 3)
    naming what was not written."""
    old = {"kept": torch.arange(4.0)}
    torch.save(old, tmp_path / "w.pt")
    before = (tmp_path / "w.pt").read_bytes()

    def limit_file_size() -> None:  # in the child: Python ignores SIGXFSZ, so a write past it is EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    done = run(
        [*RUN, "--model", "faulty_workloads:wide", "--save", "w.pt", "--report", "r.json"],
        tmp_path,
        preexec_fn=limit_file_size,
    )
    assert done.returncode == 3, done.stderr
    assert "cannot write w.pt: File too large (the previous file is unchanged); written: r.json" in done.stderr
    assert "Traceback" not in done.stderr
    assert (tmp_path / "w.pt").read_bytes() == before
    assert torch.equal(torch.load(tmp_path / "w.pt")["kept"], old["kept"])
    assert '"losses"' in (tmp_path / "r.json").read_text()
    assert not leftovers(tmp_path)


# --- signals: nothing left behind ----------------------------------------------------------------------------


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_every_worker_and_says_where_each_was(signum: int, code: int, tmp_path: Path) -> None:
    proc, kids, _, err = start_training(tmp_path)
    assert len(kids) >= 2  # the two workers (and multiprocessing's resource tracker)
    start = time.monotonic()
    proc.send_signal(signum)
    proc.wait(timeout=30)
    elapsed = time.monotonic() - start
    stderr = err.read_text()
    assert proc.returncode == code, stderr
    assert elapsed < 8, elapsed  # STOP_GRACE_S is 5; the workers answer in well under a second
    name = signal.Signals(signum).name
    assert stderr.startswith(f"error: interrupted by {name}; stopped every rank, wrote no outputs:"), stderr
    for rank in (0, 1):  # each names its step and instruction (the workers were mid-training)
        assert f"\n  rank {rank}: stopped at step " in stderr and ", instruction " in stderr, stderr
    assert "Traceback" not in stderr
    assert wait_for(lambda: not any(alive(pid) for pid in kids), 5) is not None, [p for p in kids if alive(p)]
    assert not (tmp_path / "w.pt").exists() and not leftovers(tmp_path)


def test_a_killed_parent_takes_its_workers_along_and_nothing_is_written(tmp_path: Path) -> None:
    proc, kids, _, err = start_training(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    gone = wait_for(lambda: not any(alive(pid) for pid in kids), 5)
    assert gone is not None, [pid for pid in kids if alive(pid)]
    print(f"the workers were gone {gone:.2f} s after their parent was killed")
    time.sleep(0.5)  # long enough for an orphan to have started writing --save, had one survived
    assert not (tmp_path / "w.pt").exists() and not leftovers(tmp_path)
    assert "the launching process is gone" in err.read_text()


def test_a_boundary_tensor_whose_shape_changes_stops_the_run_naming_it(tmp_path: Path) -> None:
    """Shapes are learnt from micro-batch 0; a later one of another shape would be read into buffers of the
    learnt size (gloo accepts a shorter message: garbage, silently). The sender stops the run instead."""
    done = run([*RUN, "--model", "faulty_workloads:varying_shapes", "--allow-nonfinite", "--save", "w.pt"], tmp_path)
    assert done.returncode == 3, done.stderr
    assert (
        "rank 0: step 0, instruction 3 (0SEND_F1): stage 0 sends micro-batch 1 tensors of (1, 8) torch.float32, "
        "where start-up learnt (2, 8) torch.float32 from micro-batch 0"
    ) in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "w.pt").exists()


# --- NaN and inf ---------------------------------------------------------------------------------------------


def test_a_nan_stops_the_run_naming_step_rank_and_stage(tmp_path: Path) -> None:
    done = run([*RUN, "--model", "faulty_workloads:nan_layers", "--partition", "2,2", "--save", "w.pt"], tmp_path)
    assert done.returncode == 3, done.stderr
    # stage 1's poison turns micro-batch 3 of step 0 into NaN; the gradients of both stages follow
    assert "rank 1: step 0: the loss is nan at micro-batch 3 of stage 1" in done.stderr
    assert "rank 0: step 0: stage 0 has non-finite gradients" in done.stderr
    assert "--allow-nonfinite" in done.stderr and "Traceback" not in done.stderr
    assert "step   0" not in done.stdout and not (tmp_path / "w.pt").exists()


def test_allow_nonfinite_trains_on(tmp_path: Path) -> None:
    flags = ["--partition", "2,2", "--allow-nonfinite", "--report", "r.json"]
    done = run([*RUN, "--model", "faulty_workloads:nan_layers", *flags], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "step   3  loss nan" in done.stdout  # printed as it is: not turned into a number by the reduction
    report = (tmp_path / "r.json").read_text()
    assert '"losses": [\n    null,' in report  # strict JSON: NaN is written as null
