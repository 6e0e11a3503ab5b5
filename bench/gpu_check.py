"""The runtime on a GPU, in one command: equivalence, precision, several tensors, timings (issue #14).

    python bench/gpu_check.py                 # on a machine with CUDA: every check, about 2-4 minutes on one GPU
    python bench/gpu_check.py --device cpu    # a dry run of the same logic on the CPU (gloo, small sizes)

Checks, one verdict line each (`ok`, `FAIL`, `skipped: why`, or `info` for a CPU dry run's timings):
1. equivalence at P=1 for 1f1b, zbv (V=2) and interleaved_zb (V=2): `pipec run ... --save` against a
   single-process gradient-accumulation loop on the same device (examples.workload:mlp; max abs diff of the
   weights, ok under 1e-5); with 2+ GPUs also 1f1b at P=2 and, with 4+, at P=4 (NCCL, one GPU per rank);
2. several tensors between stages (examples.workload:causal_transformer, fp32): the same equivalence, at P=1;
3. bf16 (`--dtype bf16`) on that model: the run succeeds and its losses stay within 5% of the fp32 run's;
   2 and 3 run only when the model and the flag exist (else `skipped: not available`);
4. timing: a compute-bound model (8 pre-norm MLP blocks, hidden 2048, micro-batches of 512 rows, M=8; hidden 256
   and 64 rows on the CPU) trained by `pipec run 1f1b -P 1`, its reported median step against a plain loop of
   the same training, its data already on the GPU, timed with `torch.cuda.synchronize()` (ok within 5%: pipec
   cannot be faster than the GPU, and should add little); the trace's compute slices against the reported
   compute time (ok within 0.1%); the interpreter's host cost per instruction (ok under 10 us on a GPU).
Without CUDA and without `--device cpu`, it says that the GPU checks need a GPU and runs the CPU dry run instead.
Exit status: 0 when no check failed (skipped ones included), 1 when one did.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HERE = Path(__file__).resolve()
EQUIVALENCE = [("1f1b", 1), ("zbv", 2), ("interleaved_zb", 2)]  # (schedule, V) at P=1
SIZES = {"cuda": (2048, 512), "cpu": (256, 64)}  # the timing model: hidden, rows per micro-batch
TIMING_M, TIMING_STEPS, WARMUP = 8, 12, 2


def blocks_gpu():
    return _blocks(*SIZES["cuda"])


def blocks_cpu():
    return _blocks(*SIZES["cpu"])


def _blocks(hidden: int, rows: int):
    """8 pre-norm MLP blocks and an MSE loss: matrix products large enough that the GPU, not the host, sets the
    pace (the issue's model)."""
    import torch
    from torch import nn

    from examples.workload import Block
    from pipec.runtime.workload import Workload

    layers = nn.Sequential(*[Block(hidden) for _ in range(8)])
    batches = [(torch.randn(rows * TIMING_M, hidden), torch.randn(rows * TIMING_M, hidden))]
    return Workload(layers, nn.functional.mse_loss, batches)


# --- helpers --------------------------------------------------------------------------------------------------


def pipec_run(args: list[str], where: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "pipec", "run", *args]
    return subprocess.run(command, cwd=where, env=env, capture_output=True, text=True, timeout=timeout)


def reference(spec: str, steps: int, microbatches: int, device: str, seed: int = 0) -> dict:
    """Ordinary training in this process on `device`: per step, every micro-batch's loss / M backward (gradients
    accumulate), then one optimizer step. What pipec's schedules must equal."""
    import torch

    from pipec.runtime import workload

    work = workload.build(spec, seed)
    layers = work.layers.to(device)
    params = [p for p in layers.parameters() if p.requires_grad]
    optimizer = workload.make_optimizer(work, params)
    for k in range(steps):
        inputs, targets = workload.split(work.batches[k % len(work.batches)], microbatches)
        for p in params:
            p.grad = None
        for x, y in zip(inputs, targets, strict=True):
            out = x.to(device)
            for layer in layers:
                out = layer(*out) if isinstance(out, tuple) else layer(out)
            (work.loss_fn(out, y.to(device)) / microbatches).backward()
        if optimizer is not None:
            optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return {k: v.detach().cpu() for k, v in layers.state_dict().items()}


def max_diff(saved: Path, expected: dict) -> float:
    import torch

    got = torch.load(saved, map_location="cpu", weights_only=True)
    if set(got) != set(expected):
        return float("inf")
    return max(float((got[k].float() - expected[k].float()).abs().max()) for k in expected)


def say(name: str, verdict: str, detail: str) -> None:
    print(f"{name:<44} {verdict:<8} {detail}", flush=True)


def available(where: Path) -> tuple[bool, bool]:
    """Whether R1's multi-tensor model and `--dtype` exist in this tree (they are checked only then)."""
    import importlib

    module = importlib.import_module("examples.workload")
    model = hasattr(module, "causal_transformer")
    help_text = pipec_run(["--help"], where, timeout=60).stdout
    return model, "--dtype" in help_text


# --- checks ---------------------------------------------------------------------------------------------------


def check_equivalence(device: str, backend: str, where: Path, gpus: int) -> list[bool]:
    results = []
    cases = [(name, v, 1) for name, v in EQUIVALENCE]
    for ranks in (2, 4):
        if device == "cpu" or gpus >= ranks:
            cases.append(("1f1b", 1, ranks))
        else:
            say(f"equivalence 1f1b P={ranks}", "skipped:", f"needs {ranks} GPUs, {gpus} visible")
    spec, steps, m = "examples.workload:mlp", 3, 4
    expected = reference(spec, steps, m, device)
    for name, chunks, ranks in cases:
        label = f"equivalence {name} P={ranks} V={chunks} ({backend})"
        saved = where / f"{name}-{ranks}.pt"
        done = pipec_run(
            [name, "-P", str(ranks), "-M", str(m), "-V", str(chunks), "--model", spec, "--steps", str(steps),
             "--backend", backend, "--save", str(saved)],
            ROOT,
        )  # fmt: skip
        if done.returncode != 0:
            say(label, "FAIL", f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
            results.append(False)
            continue
        diff = max_diff(saved, expected)
        ok = diff <= 1e-5
        say(label, "ok" if ok else "FAIL", f"max abs diff {diff:.3g} against one process on {device}")
        results.append(ok)
    return results


def check_transformer(device: str, backend: str, where: Path, model: bool, dtype: bool) -> list[bool]:
    if not model:
        say("several tensors between stages", "skipped:", "not available (examples.workload:causal_transformer)")
        say("bf16", "skipped:", "not available (causal_transformer)")
        return []
    spec, steps, m = "examples.workload:causal_transformer", 3, 4
    results = []
    saved, report = where / "ct.pt", where / "ct.json"
    done = pipec_run(
        ["1f1b", "-P", "1", "-M", str(m), "--model", spec, "--steps", str(steps), "--backend", backend,
         "--save", str(saved), "--report", str(report)],
        ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        say("several tensors between stages", "FAIL", f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
        return [False]
    diff = max_diff(saved, reference(spec, steps, m, device))
    ok = diff <= 1e-5
    say("several tensors between stages", "ok" if ok else "FAIL", f"max abs diff {diff:.3g} (fp32, P=1)")
    results.append(ok)
    if not dtype:
        say("bf16", "skipped:", "not available (pipec run --dtype)")
        return results
    fp32 = json.loads(report.read_text())["losses"]
    low = where / "ct-bf16.json"
    done = pipec_run(
        ["1f1b", "-P", "1", "-M", str(m), "--model", spec, "--steps", str(steps), "--backend", backend,
         "--dtype", "bf16", "--report", str(low)],
        ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        say("bf16", "FAIL", f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
        return [*results, False]
    losses = json.loads(low.read_text())["losses"]
    worst = max(
        (abs(a - b) / max(abs(b), 1e-12) if a is not None else float("inf") for a, b in zip(losses, fp32, strict=True)),
        default=float("inf"),
    )
    same = losses == fp32  # bit for bit: the flag changed nothing
    ok = worst <= 0.05 and not same
    detail = f"losses within {worst:.3g} (relative) of fp32's"
    if same:
        detail = "losses identical to fp32's: --dtype bf16 had no effect"
    say("bf16", "ok" if ok else "FAIL", f"{detail} (at most 0.05)")
    return [*results, ok]


def plain_loop(device: str, steps: int) -> list[float]:
    """The same training as the timed pipec run, in this process, each step timed up to a synchronize."""
    import torch

    from pipec.runtime import workload

    spec = f"{HERE}:blocks_{'gpu' if device == 'cuda' else 'cpu'}"
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # as pipec's workers run (one thread each)
    work = workload.build(spec, 0)
    layers = work.layers.to(device)
    params = list(layers.parameters())
    optimizer = workload.make_optimizer(work, params)
    # The data on the device before the clock starts: the GPU's pace for the training alone (pipec copies the next
    # step's batch while the GPU runs this one, see docs/runtime.md, Batches on the device).
    inputs, targets = (
        [t.to(device) for t in part] for part in workload.split(work.batches[0], TIMING_M)
    )
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for p in params:
            p.grad = None
        for x, y in zip(inputs, targets, strict=True):
            (work.loss_fn(layers(x), y) / TIMING_M).backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return times


def check_timing(device: str, backend: str, where: Path) -> list[bool]:
    spec = f"{HERE}:blocks_{'gpu' if device == 'cuda' else 'cpu'}"
    hidden, rows = SIZES[device]
    report, trace = where / "timing.json", where / "timing.trace.json"
    done = pipec_run(
        ["1f1b", "-P", "1", "-M", str(TIMING_M), "--model", spec, "--steps", str(TIMING_STEPS), "--backend", backend,
         "--report", str(report), "--trace", str(trace)],
        ROOT,
    )  # fmt: skip
    name = f"timing: median step vs plain loop (H={hidden}, {rows} rows)"
    if done.returncode != 0:
        say(name, "FAIL", f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
        return [False]
    data = json.loads(report.read_text())
    pipec_s = statistics.median(data["step_times"][WARMUP:])
    plain_s = statistics.median(plain_loop(device, TIMING_STEPS)[WARMUP:])
    ratio = pipec_s / plain_s
    soft = device == "cpu"  # a dry run's timings are information: the CPU shares the machine's load
    ok = 0.95 <= ratio <= 1.05
    verdict = "info" if soft else ("ok" if ok else "FAIL")
    say(name, verdict, f"pipec {pipec_s * 1e3:.2f} ms, plain loop {plain_s * 1e3:.2f} ms, ratio {ratio:.3f}")
    rank = data["ranks"][0]
    events = json.loads(trace.read_text())["traceEvents"]
    traced = sum(e["dur"] for e in events if e.get("ph") == "X" and e.get("cat") in ("F", "B", "I", "W")) / 1e6
    reported = rank["compute_s"]
    close = abs(traced - reported) <= 1e-3 * reported
    say(
        "timing: trace compute slices = compute_s",
        "ok" if close else "FAIL",
        f"{traced * 1e3:.2f} ms traced, {reported * 1e3:.2f} ms reported ({rank['timing']})",
    )
    interp = rank["interpreter_us_per_instruction"]
    fast = interp < 10.0
    verdict = "info" if soft else ("ok" if fast else "FAIL")
    say("timing: interpreter host cost per instruction", verdict, f"{interp:.1f} us (under 10 us on a GPU)")
    results = [close]
    if not soft:
        results += [ok, fast]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda else "cpu")
    if device == "cuda" and not cuda:
        print("gpu_check: --device cuda needs a GPU; none is visible", file=sys.stderr)
        return 2
    if device == "cpu" and args.device is None:
        print("gpu_check: no CUDA device: the GPU checks need a GPU; running the CPU dry run (--device cpu)")
    gpus = torch.cuda.device_count() if cuda else 0
    backend = "nccl" if device == "cuda" else "gloo"
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"gpu_check: {name}, {gpus} GPU(s) visible, torch {torch.__version__}, backend {backend}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipec-gpu-check-") as tmp:
        where = Path(tmp)
        model, dtype = available(where)
        results = check_equivalence(device, backend, where, gpus)
        results += check_transformer(device, backend, where, model, dtype)
        results += check_timing(device, backend, where)
    failed = results.count(False)
    print(f"gpu_check: {len(results) - failed} ok, {failed} failed ({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
