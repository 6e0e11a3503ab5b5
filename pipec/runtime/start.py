"""Starting a verified program's training: P x D local worker processes (`launch.spawn`), or, under torchrun, this
process as one of them (`launch.join_torchrun`). Everything that can be checked without a process group is
checked first (`preflight.validate`), so that bad input ends in exit 2 before any worker starts."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

from pipec.errors import PipecInputError
from pipec.ir import Program
from pipec.runtime import launch
from pipec.runtime.options import Options
from pipec.runtime.preflight import validate
from pipec.runtime.worker import run_worker


def start(program: Program, options: Options, backend: str | None = None) -> None:
    """Train `program` as `options` say; raises PipecInputError before any worker starts, RunError after."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = program.ranks * options.dp
    if torchrun and os.environ["WORLD_SIZE"] != str(world):
        raise PipecInputError(
            f"torchrun started {os.environ['WORLD_SIZE']} processes; {program.name} with P={program.ranks} and "
            f"--dp {options.dp} needs P x D = {world} (--nnodes x --nproc-per-node)"
        )
    # bad --model, batches, partition or checkpoint: exit 2 here, before any process starts (under torchrun,
    # before this worker joins the process group: every worker checks the same thing and stops the same way)
    with _optimizer_without_dynamo(), _said_while_slow(f"--model {options.model}"):
        options = validate(program, options)
    if options.resume and options.steps is not None and options.resume_step >= options.steps:
        # nothing to train: say so now rather than start P x D workers to find it out (and print a table of zeros)
        if os.environ.get("RANK", "0") == "0":
            done = f"{options.resume} has trained {options.resume_step} of --steps {options.steps}"
            print(f"no step left to train: {done}")
        return
    if torchrun:
        launch.join_torchrun(
            run_worker, (program, options), timeout_s=options.timeout_s, backend=backend, pass_status=True
        )
        return
    import torch

    cuda = torch.cuda.is_available()
    backend, note = launch.choose_backend(backend, cuda, torch.cuda.device_count() if cuda else 0, world)
    if note is not None:
        print(f"note: {note}")
    print(f"starting {world} worker processes ({backend}): each imports torch and joins the process group")
    sys.stdout.flush()
    launch.spawn(run_worker, world, (program, options), timeout_s=options.timeout_s, backend=backend, pass_status=True)


@contextlib.contextmanager
def _optimizer_without_dynamo() -> Iterator[None]:
    """The check builds the --model's optimizer once. torch's Optimizer methods are wrapped to disable dynamo,
    and the wrapper imports torch._dynamo on its first call: about as long as importing torch itself, for a
    check that compiles nothing. For the check's duration they call the method itself (what the wrapper does
    when nothing is being compiled); afterwards the wrappers are as torch made them (a torchrun worker trains next,
    and its optimizer's step imports dynamo anyway)."""
    import torch

    primed = []
    for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
        method = getattr(getattr(torch.optim.Optimizer, name, None), "__wrapped__", None)
        if method is not None and not hasattr(method, "__dynamo_disable") and "torch._dynamo" not in sys.modules:
            method.__dynamo_disable = method
            primed.append(method)
    try:
        yield
    finally:
        for method in primed:
            with contextlib.suppress(AttributeError):
                del method.__dynamo_disable


SLOW_CHECK_S = 10.0  # the check of --model says it is still running after this, then every minute


@contextlib.contextmanager
def _said_while_slow(what: str, first_s: float = SLOW_CHECK_S, every_s: float = 60.0) -> Iterator[None]:
    """Say on standard output (with the run's other progress lines), after `first_s` and then every `every_s`,
    that the check of `what` still runs: a module whose import hangs (or a factory that downloads) would otherwise
    hold `pipec run` without a word. It is not stopped: a factory may take minutes on purpose; Ctrl-C ends it
    (exit 130)."""
    import threading

    done = threading.Event()
    began = time.monotonic()

    def remind() -> None:
        wait = first_s
        while not done.wait(wait):
            say = f"pipec run: still importing and checking {what} after {time.monotonic() - began:.0f} s"
            print(f"{say} (its import, its factory or one micro-batch without gradients; Ctrl-C stops)", flush=True)
            wait = every_s

    if os.environ.get("LOCAL_RANK", "0") != "0":  # under torchrun: one reminder a node
        yield
        return
    thread = threading.Thread(target=remind, name="pipec-slow-check", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
