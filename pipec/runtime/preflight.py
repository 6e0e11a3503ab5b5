"""The checks of `pipec run` that need no process group, done once before any worker starts (exit 2 on bad
input): the workload, the batch split, the partition, a dry run of the model and the loss on one micro-batch,
the optimizer, and the checkpoints to resume from (`validate`)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os

import torch

from pipec.errors import PipecError, PipecInputError
from pipec.ir import Program
from pipec.runtime import checkpoint, stages, ties, workload
from pipec.runtime.agreement import boundary_problem
from pipec.runtime.options import Options

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def validate(program: Program, options: Options) -> Options:
    """The checks that need no process group, done once before any worker starts (exit 2 on bad input): the
    workload's protocol (workload.build), the batch split (by D x M) and the partition, then a dry run of the
    whole model and the loss on one micro-batch, without gradients, so that a model that cannot run on its own
    batches fails here with a message rather than in every worker; then the checkpoints (`_plan_checkpoints`).
    Returns the options with the checkpoint to resume from filled in."""
    work = workload.build(options.model, options.seed)
    inputs, targets = workload.split(work.batches[0], program.microbatches, 0, options.dp)
    sizes = None
    length = program.stages_per_pipeline  # the stages of one copy of the model (all of them with one pipeline)
    if options.partition != "profile":
        sizes = stages.partition(work.layers, length, options.partition, copies=program.pipelines)
    elif len(work.layers) < length:
        stages.optimal_partition([1.0] * len(work.layers), length)
    dtype = stages.compute_dtype(options.dtype)
    _dry_run(options.model, work, sizes, inputs[0], targets[0], training=not program.forward_only, dtype=dtype)
    if sizes is not None:  # parameters shared across ranks (tied, or copies): the synced program must verify (exit 1)
        ties.with_syncs(program, work.layers, sizes, options.model)
    if not program.forward_only:
        params = [p for p in work.layers.parameters() if p.requires_grad]
        try:
            workload.make_optimizer(work, params)
        except PipecError:
            raise
        except Exception as e:
            text = f"{type(e).__name__}: {str(e)[:300]}"
            raise PipecInputError(f"--model {options.model}: optimizer(params) raised {text}") from None
    if options.checkpoint or options.resume:
        return _plan_checkpoints(program, options, work)
    return options


def _plan_checkpoints(program: Program, options: Options, work: workload.Workload) -> Options:
    """Where to resume from, decided before any worker starts; a checkpoint that cannot be used is refused here
    (exit 2), and nothing is written but the --checkpoint directory itself (created if missing).

    - `--resume DIR`: DIR's committed checkpoint (DIR/latest), checked; DIR must hold one.
    - `--checkpoint DIR` holding a checkpoint: a fresh run refuses it (it would mix two runs' checkpoints), unless
      DIR is also the --resume directory, or the checkpoint was written by this torchrun job (the manifest holds
      the job's run id, TORCHELASTIC_RUN_ID): a worker restarted by torchrun resumes from DIR's newest
      checkpoint without --resume. The job's id decides, not TORCHELASTIC_RESTART_COUNT: torchrun counts only
      the restarts a node's own workers caused, so after a failure on another node this node's restarted workers
      still see 0. torchrun's default id, "none" (multi-node without --rdzv-id), names no job: no automatic
      resume then.
    """
    if program.forward_only:
        raise PipecInputError(f"--checkpoint and --resume need a training schedule; {program.name} runs forward only")
    params = [p for p in work.layers.parameters() if p.requires_grad]
    optimizer = workload.make_optimizer(work, params)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise PipecInputError(
            f"--model {options.model}: checkpoints need a torch.optim.Optimizer (its state_dict is resharded by "
            f"parameter name); optimizer(params) returned {workload.describe(optimizer)}"
        )
    kind = checkpoint.optimizer_kind(optimizer)
    steps = options.steps or len(work.batches)
    found, flag = None, "--resume"
    same = bool(options.resume and options.checkpoint) and _same_path(options.resume, options.checkpoint)
    if options.checkpoint and os.path.isdir(options.checkpoint) and not same:  # (same: checked as --resume below)
        own = checkpoint.find(options.checkpoint, "--checkpoint")
        if own is not None:
            job = options.job
            writer = own.manifest.get("written_by", {}).get("job")
            if job not in (None, "", "none") and writer == job:  # this torchrun job's own: a restart resumes
                found, flag = own, "--checkpoint"
            else:
                name = os.path.basename(own.path)
                text = f"--checkpoint {options.checkpoint} already holds checkpoints (latest: {name}, step {own.step})"
                if options.resume:
                    raise PipecInputError(
                        f"{text}; --resume reads {options.resume}: write the resumed run's checkpoints into "
                        f"{options.resume} or into a directory without checkpoints"
                    )
                if job is not None:  # under torchrun: why a restart would not resume from them either
                    who = (
                        "torchrun's job has no id (give torchrun a unique --rdzv-id)"
                        if job in ("", "none")
                        else f"written by torchrun job {writer or '(none: pipec run)'}, this is job {job}"
                    )
                    raise PipecInputError(
                        f"{text}, not resumed automatically: {who}; add --resume {options.checkpoint} to continue "
                        "from them, or name a directory without checkpoints"
                    )
                raise PipecInputError(
                    f"{text}; to continue that run add --resume {options.checkpoint}, or name a directory without "
                    "checkpoints (refusing to mix two runs' checkpoints)"
                )
    if found is None and options.resume:
        found = checkpoint.find(options.resume)
        if found is None:
            raise PipecInputError(
                f"--resume {options.resume}: no checkpoint there yet (no {checkpoint.LATEST} file); "
                "run without --resume to start from the beginning"
            )
    if found is not None:
        where = f"{flag} {os.path.dirname(found.path)}"
        state = checkpoint.state_spec(work.layers.state_dict())
        checkpoint.check_compatible(found, state, kind, options.seed, len(work.batches), where)
        if found.step > steps:
            raise PipecInputError(
                f"{where}: {os.path.basename(found.path)} has trained {found.step} steps, past --steps {steps}"
            )
        options = dataclasses.replace(options, resume=found.path, resume_step=found.step, steps=steps)
    if options.checkpoint:
        for flag, path in (("--save", options.save), ("--report", options.report), ("--trace", options.trace)):
            if path and _same_path(path, options.checkpoint):  # the directory is made next: caught only here
                raise PipecInputError(f"{flag} {path} is the --checkpoint directory; give a file name")
        checkpoint.prepare_directory(options.checkpoint)
    return options


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _dry_run(spec: str, work: workload.Workload, sizes, sample, target, training: bool, dtype=None) -> None:
    """Every layer on one micro-batch, then the loss, as the stages will run them (a tuple output is the next
    layer's positional arguments; under --dtype bf16|fp16, CPU autocast, and boundary tensors cast to it). What
    crosses a stage boundary must be a tensor or a tuple of tensors, and, when training, hold a floating-point
    one (gradients flow back through it). An op that the compute dtype does not support fails here."""
    starts = set(itertools.accumulate(sizes[:-1])) if sizes else set()
    x = sample
    precision = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with torch.no_grad(), precision:
        for i, layer in enumerate(work.layers):
            if i in starts:
                stage = sorted(starts).index(i) + 1
                problem = boundary_problem(x, training)
                if problem is not None:
                    raise PipecInputError(f"--model {spec}: stage {stage} starts at layer {i}, whose input {problem}")
                x = stages.to_boundary(x, dtype)
            try:
                x = stages.call(layer, x)
            except PipecError:
                raise
            except Exception as e:
                # what this layer received (the previous layer's output), not the batch
                shape = workload.received(x) + (f", the output of layer {i - 1}" if i else "")
                under = f" under --dtype {_DTYPE_NAMES[dtype]} (CPU autocast)" if dtype is not None else ""
                raise PipecInputError(
                    f"--model {spec}: layer {i} ({type(layer).__name__}) fails on a micro-batch of batches[0] "
                    f"(input {shape}){under}: {type(e).__name__}: {str(e)[:300]}"
                ) from None
        try:
            loss = work.loss_fn(x, target)
        except PipecError:
            raise
        except Exception as e:
            raise PipecInputError(
                f"--model {spec}: loss_fn fails on the model's output ({workload.describe(x)}) and a micro-batch of "
                f"targets ({workload.describe(target)}): {type(e).__name__}: {str(e)[:300]}"
            ) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:  # (a tuple output reaches loss_fn as it is)
        raise PipecInputError(
            f"--model {spec}: loss_fn returned {workload.describe(loss)}; expected a scalar tensor (the mean)"
        )
