"""Starting the workers: P local processes under a supervisor (`spawn`), or one worker of a torchrun launch.

Faults never hang, and nothing outlives the run. Three layers bound the time every rank takes to stop once one
rank fails:
- every p2p wait gives up after `--timeout` (default 30 s); a peer that died usually makes the sockets fail at
  once. With gloo the process group itself gets max(timeout, 120 s), so that a slow start-up (processes
  importing torch on a busy machine) is not mistaken for a fault; with NCCL it gets the timeout;
- a guard thread in each worker: no progress inside the stream (same step, same instruction) for timeout + 5 s
  ends the process with a message naming the rank and the instruction (set-up and the per-step collectives
  block only in collectives, which the process group's timeout bounds);
- the parent (local launches): once a rank has failed, the others get timeout + 10 s to exit, then are killed.
A worker that fails reports `rank R: step K, instruction I (label): cause` and exits non-zero.

Signals. The guard thread also stops its worker on SIGINT or SIGTERM, even while the main thread is blocked
inside torch (a p2p wait): Python runs signal handlers only in the main thread, between bytecodes, so the
handlers here do nothing and `signal.set_wakeup_fd` wakes the guard instead, which reports where the rank was and
ends the process without writing outputs (a partly written output's temporary file is removed first). The
parent (`spawn`), on SIGINT or SIGTERM, sends SIGTERM to every worker, collects where each one was, kills those
that have not stopped after STOP_GRACE_S, and raises `RunInterruptedError` (exit 128 + signal: 130, 143). A parent that
dies without cleaning up (SIGKILL) takes its workers along: they ask Linux for SIGTERM when their parent dies
(prctl PR_SET_PDEATHSIG) and the guard also polls getppid() (the portable fallback, and the torchrun case).
The rendezvous is a TCPStore served by the parent: no temporary folder to leak. Results come back on one pipe
per worker (no multiprocessing.Queue, whose semaphores and feeder thread could outlive a killed parent).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from pipec.errors import PipecError, PipecInputError
from pipec.runtime.status import RankStatus, describe_failure, rank_or_unknown

DEFAULT_TIMEOUT_S = 30.0
SETUP_TIMEOUT_S = 120.0  # gloo: rendezvous, set-up and per-step collectives; p2p waits use the short timeout
STOP_GRACE_S = 5.0  # after SIGTERM, how long a worker may take to report where it was before it is killed
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LOCALHOST = "127.0.0.1"


def choose_backend(requested: str | None, cuda: bool, gpus: int, processes: int) -> tuple[str, str | None]:
    """The process group's backend for `processes` workers on this machine, and a one-line note when the default
    could not be NCCL although CUDA is there. NCCL needs a GPU of its own per process (two ranks of one
    communicator on one GPU are refused), so without --backend a machine with fewer GPUs than processes runs on
    gloo, on the CPU, and says so: the README's command works on a one-GPU machine. `--backend nccl` asked for
    explicitly with too few GPUs is bad input (PipecInputError), not silently something else."""
    if requested == "nccl":
        if not cuda or gpus < processes:
            found = f"found {gpus}" if cuda else "CUDA is not available"
            raise PipecInputError(f"--backend nccl needs {processes} GPUs (one per process), {found}")
        return "nccl", None
    if requested is not None or not cuda:
        return requested or "gloo", None
    if gpus >= processes:
        return "nccl", None
    plural = "s" if gpus != 1 else ""
    return "gloo", (
        f"{processes} processes but {gpus} GPU{plural}: running on gloo, on the CPU (NCCL needs a GPU per process; "
        "--backend nccl refuses, --backend gloo says nothing)"
    )


def group_timeout(backend: str, timeout_s: float) -> timedelta:
    return timedelta(seconds=timeout_s if backend == "nccl" else max(timeout_s, SETUP_TIMEOUT_S))


class RunError(PipecError):
    """One or more ranks failed; the message names each rank, and where it was."""

    exit_code = 3


class RunInterruptedError(PipecError):
    """`pipec run` got SIGINT or SIGTERM; exit 128 + the signal's number, as a shell reports it."""

    def __init__(self, signum: int, message: str = "") -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(message or f"interrupted by {signal_name(signum)}")


def signal_name(signum: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(signum).name
    return f"signal {signum}"


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise RunInterruptedError in the main thread while inside (instead of a KeyboardInterrupt
    traceback, or, for SIGTERM, dying without stopping the workers); the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        if _deferred is not None:  # starting processes: act once every started one is known
            _deferred.append(signum)
            return
        raise RunInterruptedError(signum)

    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


_deferred: list[int] | None = None  # signals that arrived while processes were starting


@contextlib.contextmanager
def _starting() -> Iterator[None]:
    """While processes start. A SIGTERM (or SIGINT) that reaches the handler of `interruptible` is only noted,
    and raised once every started process is known, so none is missed when stopping. SIGINT is ignored: the
    children inherit that, so a Ctrl-C on the terminal, which reaches them too, cannot end their start-up (the
    import of torch) in a KeyboardInterrupt traceback; their guard takes SIGINT again once installed. (A Ctrl-C
    in these few milliseconds is lost; a SIGTERM kills a child still starting, which the parent reports.)"""
    global _deferred
    _deferred = []
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
        pending, _deferred = _deferred, None
    if pending:
        raise RunInterruptedError(pending[0])


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """A second Ctrl-C while the workers are being stopped and reaped must not cut the clean-up short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


# --- the parent ------------------------------------------------------------------------------------------


def spawn(
    fn: Callable[..., Any],
    world: int,
    args: tuple = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    on_start: Callable[[list], None] | None = None,
    pass_status: bool = False,
) -> list[Any]:
    """Run `fn(*args)` on `world` fresh processes inside one process group; the results in rank order. With
    `pass_status`, `fn(*args, status=...)`: the worker's status.RankStatus, which its guard thread reads (where
    the rank is, for the messages and the no-progress check) and `fn` keeps up to date.

    `fn` must be importable by name (spawned processes re-import it). Raises RunError when any rank fails and
    RunInterruptedError (after stopping every worker) on SIGINT or SIGTERM (KeyboardInterrupt outside `interruptible`).
    """
    import multiprocessing

    import torch.distributed as dist

    mp = multiprocessing.get_context("spawn")
    limit = group_timeout(backend, timeout_s)
    store = dist.TCPStore(LOCALHOST, 0, None, is_master=True, timeout=limit, wait_for_workers=False)
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    supervisor = _Supervisor(timeout_s)
    try:
        try:
            os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})  # inherited by the workers only
            with _starting():
                for rank in range(world):
                    reader, writer = mp.Pipe(duplex=False)
                    proc = mp.Process(
                        target=_worker_entry,
                        args=(rank, world, store.port, backend, timeout_s, fn, args, writer, os.getpid(), pass_status),
                        name=f"pipec-rank-{rank}",
                    )
                    proc.start()
                    supervisor.add(proc, reader)
                    writer.close()  # the worker holds the other copy: its exit is our end of file
        finally:
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        if on_start is not None:
            on_start(supervisor.procs)
        return supervisor.run()
    except (KeyboardInterrupt, RunInterruptedError) as e:
        signum = e.signum if isinstance(e, RunInterruptedError) else int(signal.SIGINT)
        with _signals_ignored():
            message = supervisor.stop(signum)
        raise RunInterruptedError(signum, message) from None
    finally:
        with _signals_ignored():
            supervisor.close()
            del store


class _Supervisor:
    """Reads each worker's pipe until every rank has reported (or died), and stops them on request."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.procs: list = []
        self.readers: list = []
        self.open: dict = {}  # reader -> rank, until its end of file
        self.done: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self.stopped: dict[int, str] = {}
        self.exits: dict[int, int | None] = {}  # exit codes of the ranks that ended without a word

    def add(self, proc, reader) -> None:
        self.open[reader] = len(self.procs)
        self.procs.append(proc)
        self.readers.append(reader)

    def close(self) -> None:
        """Kill whatever still runs and reap every process (no zombie, nothing left behind)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for reader in self.readers:
            reader.close()

    def _receive(self, timeout: float) -> None:
        """Take what has arrived within `timeout`: results, failures, where a stopped rank was, ends of file."""
        from multiprocessing.connection import wait

        for reader in wait(list(self.open), timeout=timeout):
            rank = self.open[reader]
            try:
                kind, payload = pickle.loads(reader.recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError):  # the worker exited (or died mid-message)
                del self.open[reader]
                self._ended(rank)
                continue
            if kind == "ok":
                self.done[rank] = pickle.loads(payload)
            elif kind == "stopped":
                self.stopped[rank] = payload
            else:
                self.errors[rank] = payload

    def _ended(self, rank: int) -> None:
        if rank in self.done or rank in self.errors or rank in self.stopped:
            return
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        code = self.exits[rank] = proc.exitcode
        self.errors[rank] = f"rank {rank}: the process {_exit_text(code)} without reporting a result"

    def _settled(self, rank: int) -> bool:
        return rank in self.done or rank in self.errors or rank in self.stopped

    def run(self) -> list[Any]:
        world = len(self.procs)
        failed_at: float | None = None
        frozen: dict[int, float] = {}  # rank -> when it was first seen stopped (SIGSTOP, a debugger)
        while not all(self._settled(r) for r in range(world)):
            self._receive(0.2)
            self._kill_frozen(frozen)
            if self.errors and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.timeout_s + 10:
                for rank, proc in enumerate(self.procs):
                    if not self._settled(rank):
                        proc.kill()
                        wait_s = self.timeout_s + 10
                        self.errors[rank] = f"rank {rank}: still running {wait_s:.0f} s after the first failure; killed"
        if self.errors or self.stopped:
            lines = [self.errors.get(r) or self.stopped[r] for r in sorted({*self.errors, *self.stopped})]
            failed = len(lines)
            raise RunError(f"the run failed on {failed} of {world} ranks:\n  " + "\n  ".join(lines))
        return [self.done[r] for r in range(world)]

    def _kill_frozen(self, frozen: dict[int, float]) -> None:
        """A stopped process (SIGSTOP, a debugger) runs no guard and never times out: its peers would wait
        --timeout, then the parent timeout + 10 s more. Stopped for --timeout: killed, and the run fails now."""
        now = time.monotonic()
        for rank, proc in enumerate(self.procs):
            if self._settled(rank) or not _is_stopped(proc.pid):
                frozen.pop(rank, None)
                continue
            if now - frozen.setdefault(rank, now) >= self.timeout_s:
                proc.kill()
                self.errors[rank] = (
                    f"rank {rank}: the process was stopped (SIGSTOP or a debugger) for {self.timeout_s:g} s "
                    "(--timeout); killed"
                )

    def stop(self, signum: int) -> str:
        """SIGTERM to every worker still running; their reports of where they were, or what became of them."""
        for rank, proc in enumerate(self.procs):
            if not self._settled(rank) and proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.open and time.monotonic() < deadline:
            self._receive(0.1)
        lines = []
        for rank, proc in enumerate(self.procs):
            if rank in self.stopped:
                lines.append(self.stopped[rank])
            elif self.exits.get(rank) == -signal.SIGTERM:  # our SIGTERM reached it before its guard was set up
                lines.append(f"rank {rank}: stopped while starting")
            elif rank in self.errors:
                lines.append(self.errors[rank])
            elif rank in self.done:
                lines.append(f"rank {rank}: had finished")
            elif proc.is_alive():
                proc.kill()
                lines.append(f"rank {rank}: did not stop within {STOP_GRACE_S:.0f} s of SIGTERM; killed")
            else:
                lines.append(f"rank {rank}: stopped while starting")
        # Rank 0 writes the outputs before it reports its result: had it reported, they were written.
        outputs = "rank 0 had written the outputs" if 0 in self.done else "wrote no outputs"
        return f"interrupted by {signal_name(signum)}; stopped every rank, {outputs}:\n  " + "\n  ".join(lines)


def _is_stopped(pid: int | None) -> bool:
    """Whether the process is in the stopped or traced state (Linux /proc; elsewhere never known to be)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _exit_text(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return f"exited with status {code}"


# --- a worker ----------------------------------------------------------------------------------------------


def _worker_entry(rank, world, port, backend, timeout_s, fn, args, writer, parent_pid, pass_status) -> None:
    _die_with_parent(parent_pid)
    lock = threading.Lock()

    def send(kind: str, payload: Any) -> None:
        # Plain pickle bytes: a Connection's own pickler would share tensors by file descriptor, which dies
        # with us. The lock keeps the guard's message from interleaving with the main thread's result.
        data = pickle.dumps((kind, payload))
        if lock.acquire(timeout=2.0):
            try:
                writer.send_bytes(data)
            finally:
                lock.release()

    def finish(kind: str, message: str, code: int) -> None:
        with contextlib.suppress(Exception):
            send(kind, message)
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)

    status = RankStatus(parent_pid)
    guard(rank, timeout_s, finish, status)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        limit = group_timeout(backend, timeout_s)
        store = dist.TCPStore(LOCALHOST, port, None, is_master=False, timeout=limit)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=limit)
        result = fn(*args, status=status) if pass_status else fn(*args)
    except BaseException as error:  # every failure becomes a message naming the rank
        finish("error", describe_failure(error, rank, status), 1)
        return
    send("ok", pickle.dumps(result))
    writer.close()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    # End here, not through the interpreter's teardown: there, the store client's C++ threads could be destroyed
    # while still joinable, and std::terminate printed "terminate called without an active exception" after a
    # good run (1 run in 5 on 2 cores). The result is sent and the group closed; nothing is left to clean up.
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux for SIGTERM when the parent dies (the guard turns it into an exit without outputs); where
    prctl is missing, the guard's getppid() poll does the same within half a second."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def guard(rank: int | None, timeout_s: float, finish: Callable[[str, str, int], None], status: RankStatus) -> None:
    """Install this worker's signal handling and start its guard thread (call from the main thread).

    The guard ends the process through `finish(kind, message, exit code)`: "stopped" with where the rank was
    on SIGINT/SIGTERM, "error" when the stream made no progress for timeout + 5 s. When the parent has gone it
    exits at once, writing nothing (the run's outputs are the parent's to report). `status` says where the rank
    is (the worker keeps it up to date) and which process started it.
    """
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    for signum in STOP_SIGNALS:
        signal.signal(signum, _note_signal)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    limit = timeout_s + 5.0

    def who() -> str:
        return str(rank) if rank is not None else rank_or_unknown()

    def watch() -> None:
        last, since = None, time.monotonic()
        while True:
            ready, _, _ = select.select([wake_read], [], [], 0.5)
            if status.parent_gone():
                status.abandon_outputs()
                _say(f"rank {who()}: the launching process is gone; stopping, no outputs written")
                os._exit(1)
            if ready:
                data = os.read(wake_read, 64)
                signum = data[-1] if data else int(signal.SIGTERM)
                status.abandon_outputs()
                finish("stopped", f"rank {who()}: stopped {status.where_stopped()}", 128 + signum)
                return
            now_at = status.progress()
            if now_at is None or now_at != last:
                last, since = now_at, time.monotonic()
            elif time.monotonic() - since > limit:
                finish("error", f"rank {who()}: no progress for {limit:.0f} s at {status.where()}", 4)
                return

    threading.Thread(target=watch, name="pipec-guard", daemon=True).start()


def _say(line: str) -> None:
    """One line on stderr in one write (ranks share the terminal; print's two writes interleave)."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
        os.write(2, (line + "\n").encode(errors="replace"))


def _note_signal(signum: int, frame: object) -> None:
    """The Python-level handler: nothing to do here (the guard thread acts on the wakeup fd), and not raising
    KeyboardInterrupt keeps the main thread from unwinding into a traceback before the guard ends the process."""


def join_torchrun(
    fn: Callable[..., Any],
    args: tuple = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    pass_status: bool = False,
) -> Any:
    """Run as one worker of a torchrun launch (RANK, WORLD_SIZE, MASTER_ADDR, ... set by torchrun). `backend`
    as `--backend` asked (None: chosen from this node's GPUs and processes, `choose_backend`); `pass_status`
    as in `spawn`."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend, note = choose_backend(backend, cuda, torch.cuda.device_count() if cuda else 0, local)
    if note is not None and os.environ.get("RANK") == "0":
        print(f"note: {note}", flush=True)  # stdout, as pipec run says it: a good run keeps stderr empty
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    def finish(kind: str, message: str, code: int) -> None:
        _say(f"error: {message}")
        os._exit(code)

    status = RankStatus(os.getppid())
    guard(int(os.environ["RANK"]), timeout_s, finish, status)
    limit = group_timeout(backend, timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT and keeps it across restarts (torch 2.5+,
        # unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): the keys the previous attempt's workers wrote are still
        # there, so a restarted rank can read a dead rank's address and fail to connect (torch issue #135712).
        # Each attempt gets its own namespace. The restart count is the same on every worker of one node; across
        # nodes it can differ after a restart another node caused: multi-node jobs with restarts should set
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt; this branch is then not taken).
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, is_master=False, timeout=limit
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefixed = dist.PrefixStore(f"pipec/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/attempt-{attempt}/", store)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=limit)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=limit)
    try:
        return fn(*args, status=status) if pass_status else fn(*args)
    except Exception as error:
        raise RunError(describe_failure(error, dist.get_rank(), status)) from None
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
