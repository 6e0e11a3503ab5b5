"""What every rank must agree on before the first step, learnt with collectives during set-up: the schedule,
--dp, the first step and the partition (`agree`: rank 0's partition, a rank that compiled something else stops
every rank), and the activation shapes (`exchange_shapes`: each stage's owner runs it once and broadcasts what it
sends); and the process group the interpreter calls directly under gloo (`direct_group`)."""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist

from pipec.errors import PipecInputError
from pipec.ir import Program
from pipec.runtime import stages, workload
from pipec.runtime.objects import all_gather_objects, broadcast_object


def fingerprint(program: Program) -> str:
    text = repr((program.name, program.ranks, program.microbatches, program.chunks, program.stage_to_rank))
    if program.pipelines > 1:  # (one pipeline: the text of before replicated pipelines, unchanged)
        text += repr((program.pipelines, program.routes))
    text += "\n".join(" ".join(map(str, stream)) for stream in program.streams)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def agree(
    program: Program,
    work: workload.Workload,
    partition: str,
    sample,
    dp: int = 1,
    resume_step: int = 0,
    device: torch.device | None = None,
) -> tuple[int, ...]:
    """Every rank must run the same schedule, --dp and first step on the same partition; the partition is rank
    0's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = None
    if rank == 0 or partition != "profile":
        # into the L stages of one copy (a replicated program's copies are the same model)
        length, copies = program.stages_per_pipeline, program.pipelines
        sizes = stages.partition(work.layers, length, partition, sample, device, copies)  # profiled on rank 0
    label = f"{program.name} P={program.ranks} M={program.microbatches} V={program.chunks}"
    if dp > 1:
        label += f" --dp {dp}"
    if resume_step:
        label += f" from step {resume_step}"
    mine = (f"{fingerprint(program)}/{dp}/{resume_step}", label)
    views = all_gather_objects((mine, sizes))
    base = views[0]
    differing = [r for r in range(world) if views[r][0][0] != base[0][0]]
    if differing:
        lines = [f"rank {r} runs {views[r][0][1]} (fingerprint {views[r][0][0]})" for r in range(world)]
        raise PipecInputError(
            f"ranks {', '.join(map(str, differing))} disagree with rank 0 about the schedule:\n  " + "\n  ".join(lines)
        )
    return tuple(base[1])


def exchange_shapes(program: Program, mine: dict, sample, dtype=None) -> dict[int, stages.Boundary]:
    """What each stage but the last (of its copy) sends (a stages.Boundary: each tensor's shape and dtype as sent,
    in --dtype for floating-point ones), learnt once: the owner runs the stage on an input of the right shapes (no
    grad, under --dtype's autocast) and broadcasts the result to every rank, in stage order; the stages of copies
    1 .. C-1 of a replicated program are copy 0's (the same layers) and send the same. What a stage returns
    must be a tensor or a tuple of tensors and, when training, hold a floating-point one (the gradients flow
    back through it): otherwise every rank stops here with the same message (bad input)."""
    shapes: dict = {}
    precision = torch.autocast(sample.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    length = program.stages_per_pipeline
    for s in range(length - 1):  # copy 0's stages: every copy of a replicated program sends what copy 0 sends
        owner = program.stage_to_rank[s]
        found = None
        if owner == dist.get_rank():
            x = sample if s == 0 else shapes[s - 1].zeros(sample.device)
            with torch.no_grad(), precision:
                y = mine[s].forward(x)
            found = boundary_problem(y, not program.forward_only)
            if found is not None:
                found = f"stage {s + 1}'s input {found}"
            else:
                found = stages.Boundary.of(stages.to_boundary(y, dtype))
        found = broadcast_object(found, src=owner)
        if isinstance(found, str):
            raise PipecInputError(found)
        for copy in range(program.pipelines):
            shapes[copy * length + s] = found
    return shapes


def boundary_problem(value, training: bool) -> str | None:
    """Why `value` cannot be a stage's input (the words after "the input"), or None: it must be a tensor or a
    tuple of tensors (the stage's positional arguments) and, when training, hold a floating-point tensor."""
    parts = stages.tensors(value)
    if not parts or not all(isinstance(t, torch.Tensor) for t in parts):
        return f"is {workload.describe(value)}; what flows between stages must be a tensor or a tuple of tensors"
    if training and not any(t.is_floating_point() for t in parts):
        dtypes = ", ".join(str(t.dtype) for t in parts)
        return (
            f"holds no floating-point tensor ({dtypes}); gradients flow back only through floating-point tensors "
            "(cut elsewhere with --partition)"
        )
    return None


def direct_group(device: torch.device, shapes: dict) -> object:
    """The default process group when its backend does not coalesce (gloo): batch_isend_irecv would only call
    its send/recv op by op, so the interpreter makes those calls itself (interpreter.Context.direct); None for a
    backend that coalesces a batch (NCCL) or a complex boundary tensor (isend sends those as real views)."""
    group = dist.group.WORLD
    if type(group) is not dist.ProcessGroup or group._get_backend(device).supports_coalescing:
        return None
    if any(dtype.is_complex for boundary in shapes.values() for _, dtype in boundary.specs):
        return None
    return group
