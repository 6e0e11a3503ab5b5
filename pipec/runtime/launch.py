"""Starting the workers: P local processes with a watchdog (`spawn`), or one worker of a torchrun launch.

Faults never hang. Three layers bound the time every rank takes to stop once one rank fails:
- every p2p wait gives up after `--timeout` (default 30 s); a peer that died usually makes the sockets fail at
  once. With gloo the process group itself gets max(timeout, 120 s), so that a slow start-up (processes
  importing torch on a busy machine) is not mistaken for a fault; with NCCL it gets the timeout;
- a watchdog thread in each worker: no progress inside the stream (same step, same instruction) for
  timeout + 5 s ends the process with a message naming the rank and the instruction (set-up and the per-step
  collectives block only in collectives, which the process group's timeout bounds);
- the parent (local launches): once a rank has failed, the others get timeout + 10 s to exit, then are killed.
A worker that fails reports `rank R: step K, instruction I (label): cause` and exits non-zero.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_module
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from pipec.errors import PipecError

DEFAULT_TIMEOUT_S = 30.0
SETUP_TIMEOUT_S = 120.0  # gloo: rendezvous, set-up and per-step collectives; p2p waits use the short timeout


def group_timeout(backend: str, timeout_s: float) -> timedelta:
    return timedelta(seconds=timeout_s if backend == "nccl" else max(timeout_s, SETUP_TIMEOUT_S))


class RunError(PipecError):
    """One or more ranks failed; the message names each rank, and where it was."""

    exit_code = 3


def spawn(
    fn: Callable[..., Any],
    world: int,
    args: tuple = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    on_start: Callable[[list], None] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world` fresh processes inside one process group; the results in rank order.

    `fn` must be importable by name (spawned processes re-import it). Raises RunError when any rank fails.
    """
    import multiprocessing

    mp = multiprocessing.get_context("spawn")
    results: queue_module.Queue = mp.Queue()
    store = Path(tempfile.mkdtemp(prefix="pipec-run-")) / "store"
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})  # inherited by the workers only
    try:
        procs = [
            mp.Process(
                target=_worker_entry,
                args=(rank, world, str(store), backend, timeout_s, fn, args, results),
                name=f"pipec-rank-{rank}",
            )
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if on_start is not None:
        on_start(procs)
    try:
        outcome = _supervise(procs, results, timeout_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        with contextlib.suppress(OSError):
            store.unlink()
            store.parent.rmdir()
    return outcome


def _supervise(procs: list, results, timeout_s: float) -> list[Any]:
    world = len(procs)
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failed_at: float | None = None
    exited_at: dict[int, float] = {}
    while len(done) + len(errors) < world:
        try:
            status, rank, payload = results.get(timeout=0.05)
            if status == "ok":
                done[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if status != "ok" and failed_at is None:
                failed_at = time.monotonic()
            continue
        except queue_module.Empty:
            pass
        now = time.monotonic()
        for rank, proc in enumerate(procs):
            if rank in done or rank in errors or proc.exitcode is None:
                continue
            exited_at.setdefault(rank, now)
            if now - exited_at[rank] > 1.0:  # its last message, if any, has had time to arrive
                errors[rank] = f"rank {rank}: the process {_exit_text(proc.exitcode)} without reporting a result"
                failed_at = failed_at or now
        if failed_at is not None and now - failed_at > timeout_s + 10:
            for rank, proc in enumerate(procs):
                if rank not in done and rank not in errors:
                    proc.kill()
                    errors[rank] = f"rank {rank}: still running {timeout_s + 10:.0f} s after the first failure; killed"
    if errors:
        lines = [errors[r] for r in sorted(errors)]
        raise RunError(f"the run failed on {len(errors)} of {world} ranks:\n  " + "\n  ".join(lines))
    return [done[r] for r in range(world)]


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _worker_entry(rank, world, store, backend, timeout_s, fn, args, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())

    def fail(message: str, code: int = 1) -> None:
        results.put(("error", rank, message))
        results.close()
        results.join_thread()
        sys.stderr.flush()
        os._exit(code)

    try:
        store_url, limit = f"file://{store}", group_timeout(backend, timeout_s)
        dist.init_process_group(backend, init_method=store_url, rank=rank, world_size=world, timeout=limit)
        start_watchdog(timeout_s, lambda message: fail(message, 4))
        result = fn(*args)
    except BaseException as error:  # every failure becomes a message naming the rank
        from pipec.runtime.worker import describe_failure

        fail(describe_failure(error, rank))
        return
    # Plain pickle bytes: the queue's own pickler would share tensors by file descriptor, which dies with us.
    results.put(("ok", rank, pickle.dumps(result)))
    results.close()
    results.join_thread()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def start_watchdog(timeout_s: float, on_stall: Callable[[str], None]) -> None:
    """A daemon thread: if this rank's stream makes no progress for timeout + 5 s, report where it is and end it."""
    from pipec.runtime import worker

    limit = timeout_s + 5.0

    def watch() -> None:
        last, since = None, time.monotonic()
        while True:
            time.sleep(0.5)
            now_at = worker.progress()
            if now_at is None or now_at != last:
                last, since = now_at, time.monotonic()
            elif time.monotonic() - since > limit:
                on_stall(f"rank {worker.rank_or_unknown()}: no progress for {limit:.0f} s at {worker.where()}")
                return

    threading.Thread(target=watch, name="pipec-watchdog", daemon=True).start()


def join_torchrun(fn: Callable[..., Any], args: tuple = (), timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Run as one worker of a torchrun launch (RANK, WORLD_SIZE, MASTER_ADDR, ... set by torchrun)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    def stall(message: str) -> None:
        print(f"error: {message}", file=sys.stderr, flush=True)
        os._exit(4)

    dist.init_process_group(backend, init_method="env://", timeout=group_timeout(backend, timeout_s))
    start_watchdog(timeout_s, stall)
    try:
        return fn(*args)
    except Exception as error:
        from pipec.runtime.worker import describe_failure

        raise RunError(describe_failure(error, dist.get_rank())) from None
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
