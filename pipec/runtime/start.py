"""Starting a verified program's training: P x D local worker processes (`launch.spawn`), or, under torchrun, this
process as one of them (`launch.join_torchrun`). Everything that can be checked without a process group is
checked first (`worker.validate`), so that bad input ends in exit 2 before any worker starts."""

from __future__ import annotations

import os
import sys

from pipec.errors import PipecInputError
from pipec.ir import Program
from pipec.runtime import launch
from pipec.runtime.worker import Options, run_worker, validate


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
    options = validate(program, options)
    if options.resume and options.steps is not None and options.resume_step >= options.steps:
        # nothing to train: say so now rather than start P x D workers to find it out (and print a table of zeros)
        if os.environ.get("RANK", "0") == "0":
            done = f"{options.resume} has trained {options.resume_step} of --steps {options.steps}"
            print(f"no step left to train: {done}")
        return
    if torchrun:
        launch.join_torchrun(run_worker, (program, options), timeout_s=options.timeout_s, backend=backend)
        return
    import torch

    cuda = torch.cuda.is_available()
    backend, note = launch.choose_backend(backend, cuda, torch.cuda.device_count() if cuda else 0, world)
    if note is not None:
        print(f"note: {note}")
    sys.stdout.flush()
    launch.spawn(run_worker, world, (program, options), timeout_s=options.timeout_s, backend=backend)
