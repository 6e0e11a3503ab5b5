"""Writing a checkpoint during a run: replica 0's ranks send their state to rank 0, which writes and commits it
(pipec.runtime.checkpoint holds the format and the atomic write); every rank learns whether that worked."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pipec.runtime import checkpoint, workload
from pipec.runtime.objects import broadcast_object, gather_objects
from pipec.runtime.options import Options
from pipec.runtime.runner import Runner
from pipec.runtime.status import RankStatus
from pipec.runtime.ties import one_model

CHECKPOINT_WAIT_S = 1800.0  # how long the other ranks wait for rank 0 to write a checkpoint (or --timeout)


class CheckpointWriter:
    """Writes the checkpoint of a step: replica 0's ranks send their model entries and optimizer state to rank 0
    (the other replicas hold the same), rank 0 writes and commits it (pipec.runtime.checkpoint.write), and every
    rank learns whether that worked (a failure stops the run, exit 3: a run that cannot checkpoint is not
    protected, and should not look as if it were). `status` is the process's (status.RankStatus): the phase
    says a checkpoint is being written, and its temporary directory is known there until committed."""

    def __init__(self, runner: Runner, options: Options, say, status: RankStatus) -> None:
        self.runner, self.options, self.say, self.status = runner, options, say, status
        self.times: list[dict] = []
        # The other ranks wait for rank 0 to write in a gloo group of its own, with a long timeout: writing a
        # large model can take minutes, far beyond an NCCL group's timeout (--timeout, 30 s by default).
        wait = timedelta(seconds=max(options.timeout_s, CHECKPOINT_WAIT_S))
        self.wait_group = dist.new_group(backend="gloo", timeout=wait)  # collective: every rank creates it
        self.kind = None
        if runner.rank == 0:  # the optimizer's class, from the whole model (rank 0 may hold no parameters)
            params = [p for p in runner.work.layers.parameters() if p.requires_grad]
            self.kind = checkpoint.optimizer_kind(workload.make_optimizer(runner.work, params))

    def write(self, step: int) -> None:
        runner = self.runner
        self.status.phase = f"writing the checkpoint of step {step}"
        start = time.perf_counter()
        mine = (runner.model_part(), runner.optimizer_state()) if runner.replica == 0 else None
        parts = gather_objects(mine, dst=0)
        error, path = None, ""
        if parts is not None:
            try:
                if self.status.parent_gone():  # pipec run was killed: nothing it would report is written
                    raise checkpoint.CheckpointWriteError("the launching process is gone")
                path = self._commit(step, [part for part in parts if part is not None])
            except checkpoint.CheckpointWriteError as e:
                error = e.message
            except Exception as e:  # torch.save of a state it cannot pickle, say
                error = f"cannot write the checkpoint of step {step}: {type(e).__name__}: {e}"
        error = broadcast_object(error, src=0, group=self.wait_group)
        if error is not None:
            self.status.phase = "steps"
            text = f"{error}; the previous checkpoint is intact" if runner.rank == 0 else "stopped with rank 0"
            raise checkpoint.CheckpointWriteError(f"rank {runner.rank}: after step {step - 1}: {text}")
        seconds = time.perf_counter() - start
        self.times.append({"step": step, "seconds": seconds})
        if self.say is not None:
            self.say(f"checkpoint {path} ({seconds:.2f} s)")
        self.status.phase = "steps"

    def _commit(self, step: int, parts: list[tuple]) -> str:
        runner, options = self.runner, self.options
        # One model, as --save writes it: copy 0's, in layer order, a tied parameter stored once under each key
        model = one_model([state for state, _ in parts], runner.ties)
        optimizer = checkpoint.merge_optimizer_states(opt for _, opt in parts)
        program, count = runner.program, len(runner.work.batches)
        spec = checkpoint.state_spec(model)
        manifest = {
            "seed": options.seed,
            "model": options.model,
            "state": {k: {"shape": list(shape), "dtype": dtype} for k, (shape, dtype) in spec.items()},
            "optimizer": self.kind,
            "data": {"batches": count, "next_batch": step % count},
            "rng": checkpoint.RNG_NOTE,
            "written_by": {
                "schedule": program.name,
                "ranks": program.ranks,
                "microbatches": program.microbatches,
                "chunks": program.chunks,
                "dp": options.dp,
                "partition": list(runner.sizes),
                "job": options.job,
                "torch": torch.__version__,
            },
        }
        files = {
            checkpoint.MODEL_FILE: lambda stream: torch.save(model, stream),
            checkpoint.OPTIMIZER_FILE: lambda stream: torch.save(optimizer, stream),
        }
        return checkpoint.write(options.checkpoint, step, files, manifest, on_temporary=self.status.track_directory)
