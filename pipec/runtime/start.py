"""Starting a verified program's training: P x D local worker processes (`launch.spawn`), or, under torchrun, this
process as one of them (`launch.join_torchrun`). Everything that can be checked without a process group is
checked first (`preflight.validate`), so that bad input ends in exit 2 before any worker starts."""

from __future__ import annotations

import os
import sys

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
    options = validate(program, options)
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
    sys.stdout.flush()
    launch.spawn(run_worker, world, (program, options), timeout_s=options.timeout_s, backend=backend, pass_status=True)
