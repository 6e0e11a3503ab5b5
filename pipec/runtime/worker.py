"""One rank's run of `pipec run`: set-up, the steps, their statistics, checkpoints, then the report, the trace
and the saved weights (`train`; `run_worker` is what every worker process runs).

Runs inside an initialised default process group of P x D ranks (launch.py starts it, or torchrun does; the
layout is replicas.Layout's). The workload is built with the shared seed (every rank holds the same model and
data); runner.py sets the rank up and runs each step; after each step one all-reduce shares the step's time,
loss and whether any rank found a NaN or inf; checkpoint_writer.py writes the checkpoints, report.py the report
and the outputs. The process status that the guard thread reads (status.RankStatus) is handed in and kept up to
date here.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from pipec.errors import PipecError
from pipec.ir import Program
from pipec.runtime import stages, ties, workload
from pipec.runtime.checkpoint_writer import CheckpointWriter
from pipec.runtime.objects import all_gather_objects
from pipec.runtime.options import Options
from pipec.runtime.replicas import Layout
from pipec.runtime.report import summarise
from pipec.runtime.runner import Runner
from pipec.runtime.status import RankStatus


def train(program: Program, options: Options, say=print, status: RankStatus | None = None) -> dict:
    """Run every step on this rank; rank 0 prints and writes the files. Returns this rank's result. `status`,
    kept up to date here, is what this process's guard thread reads (a fresh one when none is given)."""
    status = RankStatus() if status is None else status
    rank, world = dist.get_rank(), dist.get_world_size()
    status.phase = "set-up"
    work = workload.build(options.model, options.seed)
    runner = Runner.setup(
        program, work, options.partition, options.trace is not None, options.timeout_s, options.dp, options.seed,
        options.resume_step if options.resume else 0, options.dtype,
    )  # fmt: skip
    runner.check_finite = not options.allow_nonfinite
    program = runner.program  # with the SYNCs of parameters tied across ranks, if the model has any
    talk = rank == 0 and not options.quiet
    steps = options.steps or len(work.batches)
    start = options.resume_step if options.resume else 0
    if options.resume:
        status.phase = f"loading the checkpoint {options.resume}"
        runner.restore(options.resume)  # after set-up's shape pass: see runner.py's docstring
    status.runner = runner
    status.phase = "steps"
    if talk:
        replicas = f" x {options.dp} replicas" if options.dp > 1 else ""
        if program.pipelines > 1:
            replicas = f", {program.pipelines} copies of the model{replicas}"
        shape = f"P={program.ranks} M={program.microbatches} V={program.chunks}{replicas}"
        precision = f", --dtype {options.dtype} (autocast, float32 weights)" if options.dtype != "fp32" else ""
        say(f"{program.name}: {shape}, {world} processes{precision}")
        say("partition:\n" + stages.describe(work.layers, runner.sizes, program.stage_to_rank))
        for line in ties.describe_ties(runner.ties, program):
            say(line)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if options.job is not None else "0"
        if restart != "0":
            say(f"torchrun restart {restart} of job {options.job}")
        if options.resume:
            say(f"resuming from {options.resume}: step {start} of {steps}")
    writer = CheckpointWriter(runner, options, say if talk else None, status) if options.checkpoint else None
    runner.step_index = start - 1
    records = []
    began = time.perf_counter()
    for k in range(start, steps):
        upcoming = work.batches[(k + 1) % len(work.batches)] if k + 1 < steps else None
        stats = runner.step(work.batches[k % len(work.batches)], upcoming)
        # Outside the timed step, one collective: every rank's step time (the slowest is the step's), the loss
        # (held by the last stage's rank of each replica: the mean over replicas is the full batch's; a sum with
        # zeros is exact and keeps a NaN, where a max would drop it) and whether any rank found a NaN or inf.
        summary = torch.zeros(world + 2, dtype=torch.float64, device=runner.ctx.device)  # NCCL: CUDA tensors only
        summary[rank] = stats.wall_s
        summary[world] = 0.0 if stats.loss is None else stats.loss
        summary[world + 1] = 1.0 if stats.nonfinite else 0.0
        runner.activity = "sharing the step's time and loss (an all-reduce over every rank)"
        dist.all_reduce(summary, op=dist.ReduceOp.SUM)
        runner.activity = None
        if float(summary[world + 1]) > 0:
            _stop_nonfinite(k, rank, stats.nonfinite, runner.layout)
        step_s, loss = float(summary[:world].max()), float(summary[world]) / options.dp
        records.append((step_s, loss, stats))
        if talk and (k in (start, steps - 1) or (k + 1 - start) % options.log_every == 0):
            elapsed = time.perf_counter() - began
            eta = elapsed / (k + 1 - start) * (steps - 1 - k)
            say(f"step {k:>3}  loss {loss:.6f}  {step_s * 1e3:8.2f} ms  elapsed {elapsed:.1f} s, eta {eta:.1f} s")
        every = options.checkpoint_every
        if writer is not None and (k + 1 == steps or (every and (k + 1) % every == 0)):
            writer.write(k + 1)
    status.phase = "after the last step"
    result = summarise(program, runner, records, options, say if talk else None, status, start, writer)
    status.runner = None
    status.phase = "set-up"
    return result


class NonFiniteError(PipecError):
    """A loss or gradient was NaN or inf (without --allow-nonfinite): every rank stops after the step's stream,
    before the optimizer step."""

    exit_code = 3
    located = True  # the message names the rank and the step itself


def _stop_nonfinite(step: int, rank: int, mine: list[str], layout: Layout | None = None) -> None:
    """Every rank reaches this in the same step (the flag was all-reduced); each says what it found, or who did.
    With replicas, each rank also names its replica: a NaN in one replica's data shows there first."""
    found = all_gather_objects(mine)
    who = f"rank {rank}"
    if layout is not None and layout.replicas > 1:
        who += f" (replica {layout.replica(rank)})"
    if mine:
        text = "; ".join(mine)
        raise NonFiniteError(
            f"{who}: step {step}: {text}; stopped before the optimizer step (--allow-nonfinite trains on)"
        )
    others = ", ".join(str(r) for r, items in enumerate(found) if items)
    raise NonFiniteError(f"{who}: step {step}: stopped with the others (non-finite values on rank {others})")


def run_worker(program: Program, options: Options, status: RankStatus) -> None:
    """The function every `pipec run` worker runs (rank 0 prints and writes); `status` is the one its guard
    reads (launch.spawn and launch.join_torchrun with pass_status=True)."""
    train(program, options, say=_print, status=status)


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `pipec run ... | head`: keep training, stop printing
        pass
