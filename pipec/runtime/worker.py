"""One rank's run: set-up, steps, statistics, checkpoints, the report, the trace and the saved weights.

Runs inside an initialised default process group of P x D ranks (launch.py starts it, or torchrun does; the
layout is replicas.Layout's). Set-up, in order: build the workload with the shared seed (every rank holds the
same model and data), agree on the schedule, --dp, the partition and the step to resume from (a rank that
compiled something else stops every rank here, before any message), learn the activation shapes once (each
stage's owner in replica 0 runs it on one micro-batch and broadcasts its output shape), create the replica
groups, build the interpreter's context and plan, then load the checkpoint being resumed (after the shape pass,
so that a layer with side effects, BatchNorm, does not see that extra forward after its state was restored).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import BinaryIO

import torch
import torch.distributed as dist

from pipec.errors import PipecError, PipecInputError
from pipec.ir import Program
from pipec.outputs import write_with
from pipec.runtime import checkpoint, interpreter, stages, timing, workload
from pipec.runtime.feed import Feed
from pipec.runtime.interpreter import Context
from pipec.runtime.launch import RunError, group_timeout, parent_gone
from pipec.runtime.objects import all_gather_objects, broadcast_object, gather_objects
from pipec.runtime.replicas import Layout, average_gradients, replica_group
from pipec.verify.memory import peak_activations, stage_units_note


@dataclass
class Options:
    model: str
    steps: int | None = None
    seed: int = 0
    partition: str = "params"
    save: str | None = None
    report: str | None = None
    trace: str | None = None
    quiet: bool = False
    timeout_s: float = 30.0  # each p2p batch
    allow_nonfinite: bool = False  # train on through NaN/inf losses and gradients (no check, no cost)
    dp: int = 1  # D: pipeline replicas (data parallel); the world is P x D processes
    checkpoint: str | None = None  # DIR: write checkpoints there
    checkpoint_every: int | None = None  # K: a checkpoint every K steps (and always after the last step)
    resume: str | None = None  # the step directory to resume from (chosen and checked before workers start)
    resume_step: int = 0  # the steps it holds: training continues at this step index
    job: str | None = None  # torchrun's run id (TORCHELASTIC_RUN_ID), recorded in manifests; None otherwise
    dtype: str = "fp32"  # --dtype: fp32, or bf16/fp16 (autocast, boundary tensors in that dtype; docs/runtime.md)
    log_every: int = 1  # --log-every K: a step line every K steps (and for the first and last)


@dataclass
class StepStats:
    wall_s: float  # this rank's step, optimizer included (on a GPU, until the GPU has finished it)
    loop_s: float  # the interpreter loop (host)
    compute_s: float  # the compute actions of the loop: the host's time in torch's calls, or the GPU's (events)
    comm_s: float  # inside p2p calls: posting batches and waiting for them
    allreduce_s: float  # averaging the gradients over the replicas (0 when D = 1)
    optimizer_s: float  # the optimizer step: the host's time in it, or the GPU's (events); 0 if none ran
    loss: float | None
    nonfinite: list[str] = field(default_factory=list)  # what this rank found not finite (then no optimizer step)
    host_compute_s: float = 0.0  # the host's time inside torch's compute calls (= compute_s on the CPU)
    op_s: dict = field(default_factory=dict)  # (stage, kind) -> mean seconds of one action of it this step


@dataclass
class Runner:
    """A rank's interpreter set up for one program and workload; `step` runs one training (or inference) step."""

    program: Program
    work: workload.Workload
    rank: int  # global rank
    sizes: tuple[int, ...]
    ctx: Context
    entries: list
    optimizer: object
    params: list
    layout: Layout
    group: object  # this rank's replica group (None when D = 1)
    names: dict  # id(parameter) -> its name in the unsplit model (checkpoints key the optimizer state by it)
    feed: Feed  # each step's micro-batches on the device
    seed: int = 0
    step_index: int = -1
    activity: str | None = None  # what the rank does outside its stream within a step (for messages)
    check_finite: bool = True
    time_base: float = field(default_factory=time.perf_counter)
    events: list = field(default_factory=list)  # (step, actions, category, start, duration), when tracing

    @classmethod
    def setup(
        cls,
        program: Program,
        work: workload.Workload,
        partition: str = "params",
        tracing: bool = False,
        p2p_timeout_s: float = 30.0,
        dp: int = 1,
        seed: int = 0,
        resume_step: int = 0,
        dtype: str = "fp32",
    ):
        rank, world = dist.get_rank(), dist.get_world_size()
        compute_dtype = stages.compute_dtype(dtype)
        layout = Layout(program.ranks, dp)
        if world != layout.world:
            raise PipecInputError(
                f"the schedule is compiled for {program.ranks} ranks x --dp {dp} = {layout.world} processes, "
                f"but {world} run"
            )
        replica, prank = layout.replica(rank), layout.pipeline_rank(rank)
        device = _device()
        inputs, _ = workload.split(work.batches[0], program.microbatches, replica, dp)
        sizes = _agree(program, work, partition, inputs[0], dp, resume_step, device)
        if not program.forward_only:  # (inference steps nothing: every copy of a tied weight stays the same)
            stages.check_tied(work.layers, sizes, program.stage_to_rank)  # a profiled partition: known only here
        mine = stages.build_stages(work.layers, sizes, program.stages_of(prank))
        for stage in mine.values():
            stage.to(device)
        mine = stages.build_stages(work.layers, sizes, program.stages_of(prank))  # parameter lists after .to()
        shapes = _exchange_shapes(program, mine, inputs[0].to(device), compute_dtype)
        # Every rank creates every replica group, in the same order (new_group is collective).
        group = replica_group(layout, rank, group_timeout(dist.get_backend(), p2p_timeout_s))
        generators = [torch.default_generator]
        if device.type == "cuda":
            generators.append(torch.cuda.default_generators[device.index or 0])
        ctx = Context(
            rank=prank,
            stages=mine,
            # p2p peers: the same pipeline ranks of this replica (pipeline-major: offset by replica * P)
            stage_to_rank=tuple(r + replica * program.ranks for r in program.stage_to_rank),
            shapes=shapes,
            microbatches=program.microbatches,
            loss_fn=work.loss_fn,
            device=device,
            training=not program.forward_only,
            tracing=tracing,
            p2p_timeout=timedelta(seconds=p2p_timeout_s),
            generators=tuple(generators),
            dtype=compute_dtype,
            loss_scale=FP16_LOSS_SCALE if dtype == "fp16" else 1.0,
            clock=timing.clock_for(device),
            direct=_direct_group(device, shapes),
        )
        # Each parameter once, under its first name (weights tied between stages of this rank: one parameter).
        names: dict[int, str] = {}
        params = []
        for stage in mine.values():
            for name, p in stage.named_parameters():
                if id(p) not in names:
                    names[id(p)] = name
                    params.append(p)
        optimizer = workload.make_optimizer(work, params) if ctx.training else None
        interpreter.check_program(program)
        entries = interpreter.plan(program.streams[prank], GLOO_RECEIVES_AHEAD if ctx.direct is not None else 0)
        held = program.stages_of(prank)
        feed = Feed(device, program.microbatches, replica, dp, 0 in held, program.num_stages - 1 in held)
        return cls(
            program, work, rank, sizes, ctx, entries, optimizer, params, layout, group, names, feed, seed,
            time_base=_common_time_base(device),
        )  # fmt: skip

    @property
    def replica(self) -> int:
        return self.layout.replica(self.rank)

    @property
    def pipeline_rank(self) -> int:
        return self.layout.pipeline_rank(self.rank)

    def step(self, batch, upcoming=None) -> StepStats:
        """One step: take this replica's share of the batch, clear gradients, run the stream, average the
        gradients over the replicas, step the optimizer (all timed). `upcoming`, the next step's batch, is copied
        to a GPU while it finishes this step (feed.py)."""
        start = time.perf_counter()
        self.ctx.clock.begin_step()
        self.step_index += 1
        ctx, layout, microbatches = self.ctx, self.layout, self.program.microbatches
        inputs, targets = self.feed.take(batch)
        # Random numbers derive from (seed, step, layer, micro-batch): nothing to save in a checkpoint.
        first = self.replica * microbatches
        ctx.seeds = [stages.microbatch_seed(self.seed, self.step_index, first + m) for m in range(microbatches)]
        ctx.compute_s = ctx.comm_s = 0.0
        for p in self.params:
            p.grad = None
        loop_s = interpreter.run(ctx, self.entries, inputs, targets)
        # A GPU: the next batch's copy starts while the step's kernels are still queued (the finite check below
        # waits for them).
        self.feed.prefetch(upcoming)
        if ctx.loss_scale != 1.0 and ctx.training:  # fp16: the gradients of the scaled loss, back to the loss's
            _unscale([p.grad for p in self.params if p.grad is not None], ctx.loss_scale)
        # Checked before the optimizer step, so that a NaN never reaches the weights; train() stops every rank.
        # Checked before averaging, so that the message names the replica where it appeared.
        nonfinite = self.nonfinite() if self.check_finite else []
        allreduce_s, peer_nonfinite = 0.0, False
        if self.group is not None and ctx.training:
            # After the stream: every p2p op of this rank has completed, so this collective cannot interleave
            # with the verified p2p order (docs/runtime.md, "Why the all-reduce cannot deadlock").
            flag = bool(nonfinite) if self.check_finite else None
            events = ctx.events if ctx.tracing else None
            self.activity = "averaging the gradients over the replicas"
            allreduce_s, peer_nonfinite = average_gradients(ctx.stages, self.group, layout.replicas, flag, events)
            self.activity = None
        opt_start = opt_end = time.perf_counter()
        if self.optimizer is not None and not nonfinite and not peer_nonfinite:
            ctx.clock.begin_optimizer()
            self.optimizer.step()
            ctx.clock.end_optimizer()
            opt_end = time.perf_counter()
        ctx.clock.finish_step()  # a GPU: the step ends when its work is done (one synchronize)
        end = time.perf_counter()
        timed = ctx.clock.resolve(ctx.timed)
        compute_s, op_s = _per_op(timed)
        if ctx.tracing:
            ctx.events.extend(((action,), action.kind.value, begin, seconds) for action, begin, seconds in timed)
        self.events.extend((self.step_index, *event) for event in ctx.events)
        ctx.events.clear()
        loss = float(ctx.loss) if self.program.stage_to_rank[-1] == self.pipeline_rank else None
        return StepStats(
            end - start, loop_s, compute_s, ctx.comm_s, allreduce_s, ctx.clock.optimizer_s(opt_end - opt_start), loss,
            nonfinite, ctx.compute_s, op_s,
        )  # fmt: skip

    def nonfinite(self) -> list[str]:
        """What this rank holds that is not finite after the stream: the loss of a micro-batch (last stage), or
        a stage's gradients. One fused check over all the rank's gradients, and one reading of the step's loss
        (the sum of the micro-batches' losses is finite only if each is); the culprits are looked for only if
        one fails."""
        ctx, found = self.ctx, []
        if ctx.losses and not math.isfinite(float(ctx.loss)):
            values = torch.stack([loss.reshape(()).float() for _, loss in ctx.losses])
            finite = torch.isfinite(values)
            if not bool(finite.all()):
                oks = finite.tolist()
                bad = [(m, float(v)) for (m, _), v, ok in zip(ctx.losses, values, oks, strict=True) if not ok]
                more = f" (and {len(bad) - 1} more micro-batches)" if len(bad) > 1 else ""
                found.append(f"the loss is {bad[0][1]} at micro-batch {bad[0][0]} of stage {ctx.last_stage}{more}")
        if ctx.training and not _all_finite([p.grad for p in self.params if p.grad is not None]):
            for s in sorted(ctx.stages):
                grads = [p.grad for p in ctx.stages[s].parameters() if p.grad is not None]
                if grads and not _all_finite(grads):
                    found.append(f"stage {s} has non-finite gradients")
        return found

    def where(self) -> str:
        """The current step and instruction (and the batch it waits for), for error messages and the guard thread."""
        pc, waiting = self.ctx.pc, self.ctx.waiting
        if self.step_index < 0:
            return "before the first step"
        if pc < 0:
            return f"step {self.step_index}, {self.activity or 'between instructions'}"
        if pc >= len(self.entries):
            text = f"step {self.step_index}, end of step"
        else:
            entry = self.entries[pc]
            text = f"step {self.step_index}, instruction {entry.first} ({entry.label})"
        if waiting >= 0:
            batch = self.entries[waiting]
            text += f", waiting for the batch at instruction {batch.first} ({batch.label})"
        return text

    def state_dict(self) -> dict:
        out = {}
        for stage in self.ctx.stages.values():
            out.update(stage.state_dict())
        return out

    def optimizer_state(self) -> dict | None:
        """This rank's optimizer state keyed by unsplit parameter name (None without an optimizer)."""
        if self.optimizer is None:
            return None
        return checkpoint.optimizer_state(self.optimizer, self.names)

    def restore(self, path: str) -> None:
        """Load a checkpoint's model entries for this rank's stages and its optimizer state for their
        parameters, whatever schedule, P, V, D or partition wrote it (both are keyed by unsplit names)."""
        model = torch.load(os.path.join(path, checkpoint.MODEL_FILE), map_location="cpu", weights_only=True)
        by_layer: dict[str, dict] = {}
        for key, value in model.items():
            layer, _, rest = key.partition(".")
            by_layer.setdefault(layer, {})[rest] = value
        for stage in self.ctx.stages.values():
            for i, layer in enumerate(stage.layers):
                layer.load_state_dict(by_layer.get(str(stage.first_layer + i), {}), strict=True)
        if self.optimizer is not None:
            saved = torch.load(os.path.join(path, checkpoint.OPTIMIZER_FILE), map_location="cpu", weights_only=True)
            checkpoint.load_optimizer_state(self.optimizer, self.names, saved)

    def trace_events(self) -> list[tuple]:
        base = self.time_base
        return [(self.rank, step, acts, cat, start - base, dur) for step, acts, cat, start, dur in self.events]


def _per_op(timed: list) -> tuple[float, dict]:
    """A step's compute seconds and, per (stage, kind), the mean seconds of one action (the measured costs)."""
    sums: dict = {}
    total = 0.0
    for (stage, kind, _), _, seconds in timed:
        total += seconds
        row = sums.get((stage, kind.value))
        if row is None:
            sums[stage, kind.value] = [seconds, 1]
        else:
            row[0] += seconds
            row[1] += 1
    return total, {key: seconds / count for key, (seconds, count) in sums.items()}


def _common_time_base(device: torch.device) -> float:
    """The trace's time origin in this process's perf_counter terms: the earliest wall-clock time any rank reads
    here (wall clocks agree across processes and, NTP permitting, across nodes; perf_counter is precise)."""
    offset = _clock_offset()
    earliest = torch.tensor([time.time()], dtype=torch.float64, device=device)
    dist.all_reduce(earliest, op=dist.ReduceOp.MIN)
    return float(earliest[0]) - offset


def _clock_offset(samples: int = 7) -> float:
    """time.time() - time.perf_counter(), from the reading bracketed most tightly by two perf_counter() calls: on a
    loaded machine a process can be descheduled between the two clock reads, which would shift this rank's whole
    trace by milliseconds against the others' (a receive could then appear to end before its send was posted)."""
    best = (float("inf"), 0.0)
    for _ in range(samples):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        best = min(best, (after - before, wall - (before + after) / 2))
    return best[1]


def _unscale(grads: list, scale: float) -> None:
    """Divide the gradients by the loss scale (a power of two: exact), in one fused call for the dense ones."""
    dense = [g for g in grads if not g.is_sparse]
    if dense:
        torch._foreach_mul_(dense, 1.0 / scale)
    for g in grads:
        if g.is_sparse:
            g.mul_(1.0 / scale)


def _all_finite(grads: list) -> bool:
    """One fused pass per device and dtype: the kernel GradScaler uses to find inf/NaN (it also multiplies the
    gradients by 1.0, which changes nothing); a plain isfinite where it does not apply (sparse gradients)."""
    groups: dict = {}
    for g in grads:
        if g.is_sparse:
            if not bool(torch.isfinite(g.coalesce().values()).all()):
                return False
            continue
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in groups.items():
        found = torch.zeros(1, device=device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, torch.ones(1, device=device))
        except (RuntimeError, TypeError, NotImplementedError):  # a dtype or device the fused kernel lacks
            found.fill_(0.0 if all(bool(torch.isfinite(g).all()) for g in group) else 1.0)
        if bool(found.item()):
            return False
    return True


# Batches by which gloo's receives are posted early (interpreter.plan): gloo's rendezvous sends at once when the
# receive is already posted. On 4 processes on 2 cores (bench/runtime.py's workload, paired rounds), pipec/torch
# was 0.67-1.00 with one batch ahead and 0.58-0.91 with two; three and four did no better.
GLOO_RECEIVES_AHEAD = 2


def _direct_group(device: torch.device, shapes: dict) -> object:
    """The default process group when its backend does not coalesce (gloo): batch_isend_irecv would only call
    its send/recv op by op, so the interpreter makes those calls itself (interpreter.Context.direct); None for a
    backend that coalesces a batch (NCCL) or a complex boundary tensor (isend sends those as real views)."""
    group = dist.group.WORLD
    if type(group) is not dist.ProcessGroup or group._get_backend(device).supports_coalescing:
        return None
    if any(dtype.is_complex for boundary in shapes.values() for _, dtype in boundary.specs):
        return None
    return group


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        index = torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cpu")


def fingerprint(program: Program) -> str:
    text = repr((program.name, program.ranks, program.microbatches, program.chunks, program.stage_to_rank))
    text += "\n".join(" ".join(map(str, stream)) for stream in program.streams)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _agree(
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
        sizes = stages.partition(work.layers, program.num_stages, partition, sample, device)  # profiled there
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


FP16_LOSS_SCALE = 1024.0  # --dtype fp16: a static loss scale (a power of two, so unscaling is exact)


def _exchange_shapes(program: Program, mine: dict, sample, dtype=None) -> dict[int, stages.Boundary]:
    """What each stage but the last sends (a stages.Boundary: each tensor's shape and dtype as sent, in --dtype
    for floating-point ones), learnt once: the owner runs the stage on an input of the right shapes (no grad,
    under --dtype's autocast) and broadcasts the result to every rank, in stage order. What a stage returns
    must be a tensor or a tuple of tensors and, when training, hold a floating-point one (the gradients flow
    back through it): otherwise every rank stops here with the same message (bad input)."""
    shapes: dict = {}
    precision = torch.autocast(sample.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    for s in range(program.num_stages - 1):
        owner = program.stage_to_rank[s]
        found = None
        if owner == dist.get_rank():
            x = sample if s == 0 else shapes[s - 1].zeros(sample.device)
            with torch.no_grad(), precision:
                y = mine[s].forward(x)
            found = _boundary_problem(y, not program.forward_only)
            if found is not None:
                found = f"stage {s + 1}'s input {found}"
            else:
                found = stages.Boundary.of(stages.to_boundary(y, dtype))
        found = broadcast_object(found, src=owner)
        if isinstance(found, str):
            raise PipecInputError(found)
        shapes[s] = found
    return shapes


def _boundary_problem(value, training: bool) -> str | None:
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


# --- the run: steps, per-step lines, summary, report, trace, weights ---------------------------------------


def train(program: Program, options: Options, say=print) -> dict:
    """Run every step on this rank; rank 0 prints and writes the files. Returns this rank's result."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _PHASE[:] = ["set-up"]
    work = workload.build(options.model, options.seed)
    runner = Runner.setup(
        program, work, options.partition, options.trace is not None, options.timeout_s, options.dp, options.seed,
        options.resume_step if options.resume else 0, options.dtype,
    )  # fmt: skip
    runner.check_finite = not options.allow_nonfinite
    talk = rank == 0 and not options.quiet
    steps = options.steps or len(work.batches)
    start = options.resume_step if options.resume else 0
    if options.resume:
        _PHASE[:] = [f"loading the checkpoint {options.resume}"]
        runner.restore(options.resume)  # after set-up's shape pass: see the module's docstring
    _CURRENT.append(runner)
    _PHASE[:] = ["steps"]
    if talk:
        replicas = f" x {options.dp} replicas" if options.dp > 1 else ""
        shape = f"P={program.ranks} M={program.microbatches} V={program.chunks}{replicas}"
        precision = f", --dtype {options.dtype} (autocast, float32 weights)" if options.dtype != "fp32" else ""
        say(f"{program.name}: {shape}, {world} processes{precision}")
        say("partition:\n" + stages.describe(work.layers, runner.sizes, program.stage_to_rank))
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if options.job is not None else "0"
        if restart != "0":
            say(f"torchrun restart {restart} of job {options.job}")
        if options.resume:
            say(f"resuming from {options.resume}: step {start} of {steps}")
    writer = _CheckpointWriter(runner, options, say if talk else None) if options.checkpoint else None
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
    _PHASE[:] = ["after the last step"]
    result = _summarise(program, runner, records, options, say if talk else None, start, writer)
    _CURRENT.pop()
    _PHASE[:] = ["set-up"]
    return result


CHECKPOINT_WAIT_S = 1800.0  # how long the other ranks wait for rank 0 to write a checkpoint (or --timeout)


class _CheckpointWriter:
    """Writes the checkpoint of a step: replica 0's ranks send their model entries and optimizer state to rank 0
    (the other replicas hold the same), rank 0 writes and commits it (pipec.runtime.checkpoint.write), and every
    rank learns whether that worked (a failure stops the run, exit 3: a run that cannot checkpoint is not
    protected, and should not look as if it were)."""

    def __init__(self, runner: Runner, options: Options, say) -> None:
        self.runner, self.options, self.say = runner, options, say
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
        _PHASE[:] = [f"writing the checkpoint of step {step}"]
        start = time.perf_counter()
        mine = (runner.state_dict(), runner.optimizer_state()) if runner.replica == 0 else None
        parts = gather_objects(mine, dst=0)
        error, path = None, ""
        if parts is not None:
            try:
                if parent_gone():  # pipec run was killed: nothing it would report is written
                    raise checkpoint.CheckpointWriteError("the launching process is gone")
                path = self._commit(step, [part for part in parts if part is not None])
            except checkpoint.CheckpointWriteError as e:
                error = e.message
            except Exception as e:  # torch.save of a state it cannot pickle, say
                error = f"cannot write the checkpoint of step {step}: {type(e).__name__}: {e}"
        error = broadcast_object(error, src=0, group=self.wait_group)
        if error is not None:
            _PHASE[:] = ["steps"]
            text = f"{error}; the previous checkpoint is intact" if runner.rank == 0 else "stopped with rank 0"
            raise checkpoint.CheckpointWriteError(f"rank {runner.rank}: after step {step - 1}: {text}")
        seconds = time.perf_counter() - start
        self.times.append({"step": step, "seconds": seconds})
        if self.say is not None:
            self.say(f"checkpoint {path} ({seconds:.2f} s)")
        _PHASE[:] = ["steps"]

    def _commit(self, step: int, parts: list[tuple]) -> str:
        runner, options = self.runner, self.options
        model: dict = {}
        for state, _ in parts:
            model.update(state)
        # In the unsplit model's layer order (a rank's stages need not be consecutive: a V placement), as --save writes.
        model = dict(sorted(model.items(), key=lambda item: int(item[0].partition(".")[0])))
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
        return checkpoint.write(options.checkpoint, step, files, manifest, on_temporary=_track_directory)


def _track_directory(path: str | None) -> None:
    """The temporary directory of the checkpoint being written, for `abandon_outputs` (None: no longer any)."""
    _PARTIAL_DIRS.clear()
    if path is not None:
        _PARTIAL_DIRS.add(path)


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


_CURRENT: list[Runner] = []  # the runner of this process, for the guard and error messages
_PHASE: list[str] = ["set-up"]  # set-up, steps, writing a checkpoint, after the last step, writing the outputs
_PARTIAL: set[str] = set()  # temporary files of outputs being written (removed if the process is stopped)
_PARTIAL_DIRS: set[str] = set()  # the temporary directory of a checkpoint being written (likewise)


def where() -> str:
    if _PHASE[0] == "steps" and _CURRENT:
        return _CURRENT[-1].where()
    return _PHASE[0]


def where_stopped() -> str:
    """Where this rank was, for the message of a rank stopped by a signal."""
    phase = _PHASE[0]
    if phase == "steps" and _CURRENT:
        return "at " + _CURRENT[-1].where()
    if phase == "writing the outputs":
        return "while writing the outputs (none kept)"
    if phase.startswith("writing the checkpoint"):
        return f"while {phase} (not committed; the previous one is intact)"
    return "during set-up" if phase == "set-up" else phase


def abandon_outputs() -> None:
    """Remove the temporary files of outputs being written, and the temporary directory of a checkpoint: the
    process is about to end without finishing."""
    import shutil

    for path in list(_PARTIAL):
        with contextlib.suppress(OSError):
            os.unlink(path)
    for path in list(_PARTIAL_DIRS):
        shutil.rmtree(path, ignore_errors=True)


def _summarise(
    program: Program, runner: Runner, records: list, options: Options, say, first_step: int = 0, writer=None
) -> dict:
    rank, prank = runner.rank, runner.pipeline_rank
    step_times = [r[0] for r in records]
    instructions = len(program.streams[prank])
    compute = sum(r[2].compute_s for r in records)
    comm = sum(r[2].comm_s for r in records)
    allreduce = sum(r[2].allreduce_s for r in records)
    optimizer = sum(r[2].optimizer_s for r in records)
    # the interpreter's own cost: the loop's time outside torch's compute calls and the p2p batches (the host's
    # time in those calls, also on a GPU, where compute_s is the GPU's)
    interpreter_s = sum(r[2].loop_s for r in records) - sum(r[2].host_compute_s for r in records) - comm
    mine = {
        "rank": rank,
        "replica": runner.replica,
        "pipeline_rank": prank,
        "compute_s": compute,  # the stream's compute actions: what the trace's F, B, I and W slices add up to
        "optimizer_s": optimizer,
        "comm_wait_s": comm,
        "allreduce_s": allreduce,
        "idle_s": sum(r[0] - r[2].wall_s for r in records),  # waiting for the slowest rank to finish the step
        "interpreter_s": interpreter_s,
        "instructions_per_step": instructions,
        "interpreter_us_per_instruction": 1e6 * interpreter_s / max(1, instructions * len(records)),
        "peak_activations": runner.ctx.peak,
        "peak_activations_predicted": peak_activations(program)[prank],
        "stage_ms": _stage_times([r[2].op_s for r in records]),
        "timing": "cuda events" if runner.ctx.clock.device else "host clock",
    }
    gathered = all_gather_objects((mine, runner.trace_events() if options.trace else []))
    weights = None
    if options.save:  # replica 0 holds the whole model (every replica holds the same weights)
        parts = gather_objects(runner.state_dict() if runner.replica == 0 else {}, dst=0)
        weights = {k: v for part in parts for k, v in part.items()} if parts is not None else None
    samples = runner.work.batches[0][0].shape[0]  # the D replicas' micro-batches make the whole batch
    median = statistics.median(step_times) if step_times else None
    report = {
        "format": REPORT_FORMAT,
        "schedule": program.name,
        "ranks_count": program.ranks,
        "microbatches": program.microbatches,
        "chunks": program.chunks,
        "dp": runner.layout.replicas,
        "world_size": runner.layout.world,
        "partition": list(runner.sizes),
        "first_step": first_step,
        "step_times": step_times,
        "median_step_s": median,
        "losses": [r[1] if math.isfinite(r[1]) else None for r in records],  # strict JSON: null for NaN/inf
        "samples_per_s": samples / median if median else None,
        "ranks": [g[0] for g in gathered],
    }
    costs = measured_costs(program, [g[0] for g in gathered])
    if costs is not None:
        report["costs"] = costs
    if options.resume:
        report["resumed_from"] = options.resume
    if writer is not None:
        report["checkpoints"] = writer.times
    if program.forward_only:
        report["baseline_samples_per_s"] = _baseline_throughput(runner, len(step_times)) if rank == 0 else None
        dist.barrier()
    if rank == 0:
        _write_outputs(report, [e for g in gathered for e in g[1]], weights, options, say)
    return {"report": report, "weights": runner.state_dict()}


REPORT_FORMAT = "pipec-run-report"  # lets `--cost report.json` find the measured costs (pipec.sim.costs)


def _stage_times(steps: list[dict]) -> dict[str, dict[str, float]]:
    """Per stage this rank runs and kind: the median over steps of the step's mean action time, in ms, leaving
    out the first step when there are more (warm-up: allocator, caches, lazy initialisation)."""
    kept = steps[1:] if len(steps) > 1 else steps
    values: dict = {}
    for op_s in kept:
        for (stage, kind), seconds in op_s.items():
            values.setdefault(str(stage), {}).setdefault(kind, []).append(seconds)
    return {
        stage: {kind: 1e3 * statistics.median(times) for kind, times in kinds.items()}
        for stage, kinds in sorted(values.items(), key=lambda item: int(item[0]))
    }


def measured_costs(program: Program, ranks: list[dict]) -> dict | None:
    """The run's measured compute costs in the cost-file format (pipec.sim.costs), in milliseconds, describing
    the model as P consecutive segments (its stages at V=1): segment k sums stages kV .. kV+V-1, the units of
    `--per-rank-share` and of `pipec tune`; at V=1 a segment is a stage. With replicas, the median over them.
    Schedules with a split backward give F, I, W; those with B give F, and I = W = B / 2 (the split is not
    measured; B = I + W is kept). Forward-only runs give F only. None without a step to measure."""
    per_stage: dict[int, dict[str, list[float]]] = {}
    for row in ranks:
        for stage, kinds in row.get("stage_ms", {}).items():
            for kind, ms in kinds.items():
                per_stage.setdefault(int(stage), {}).setdefault(kind, []).append(ms)
    if len(per_stage) != program.num_stages:
        return None
    med = {s: {k: statistics.median(v) for k, v in kinds.items()} for s, kinds in per_stage.items()}
    if program.forward_only:
        names = ("F",)
    else:
        for kinds in med.values():  # a stage run with B (or partly): its I and W halves of B
            if "I" not in kinds or "W" not in kinds:
                kinds["I"] = kinds["W"] = kinds.get("B", 0.0) / 2
        names = ("F", "I", "W")
    chunks = program.chunks
    out = {}
    for name in names:
        row = [sum(med[k * chunks + c].get(name, 0.0) for c in range(chunks)) for k in range(program.ranks)]
        out[name] = [round(v, 6) for v in row]  # ms to the nanosecond: the cost file's precision is plenty
    return out


def _baseline_throughput(runner: Runner, steps: int) -> float:
    """One process running the whole model forward on the full batch, as many times as the pipelined run."""
    layers = runner.work.layers
    times = []
    with torch.no_grad():
        for k in range(max(1, steps)):
            x = runner.work.batches[k % len(runner.work.batches)][0].to(runner.ctx.device)
            runner.ctx.clock.finish_step()  # a GPU: time the work, not its launch (nothing on the CPU)
            start = time.perf_counter()
            stages.run_layers(layers.to(runner.ctx.device), x)  # a tuple output: positional arguments
            runner.ctx.clock.finish_step()
            times.append(time.perf_counter() - start)
    size = runner.work.batches[0][0].shape[0]
    return size / statistics.median(times)


def _write_outputs(report: dict, events: list, weights, options: Options, say) -> None:
    if say is not None:
        if report["median_step_s"] is None:
            say(f"no step left to train: the checkpoint is at step {report['first_step']}")
        else:
            say(f"median step {report['median_step_s'] * 1e3:.2f} ms, {report['samples_per_s']:.1f} samples/s")
        if "baseline_samples_per_s" in report:
            say(f"one process, whole model: {report['baseline_samples_per_s']:.1f} samples/s")
        replicated = report["dp"] > 1  # the all-reduce column only where there is one
        say(
            "rank  compute_s  comm_wait_s  " + ("allreduce_s  " if replicated else "")
            + "idle_s  interp_us/instr  peak_activations  predicted"
        )  # fmt: skip
        for r in report["ranks"]:
            allreduce = f"{r['allreduce_s']:11.4f}  " if replicated else ""
            say(
                f"{r['rank']:>4}  {r['compute_s']:9.4f}  {r['comm_wait_s']:11.4f}  {allreduce}{r['idle_s']:6.4f}  "
                f"{r['interpreter_us_per_instruction']:15.1f}  {r['peak_activations']:16g}  "
                f"{r['peak_activations_predicted']:9g}"
            )
        if report["chunks"] > 1:
            say(stage_units_note(report["chunks"], max(r["peak_activations_predicted"] for r in report["ranks"])))
    outputs: list[tuple[str, Callable[[BinaryIO], object]]] = []
    if options.report:
        report_bytes = (json.dumps(report, indent=2) + "\n").encode()
        outputs.append((options.report, lambda stream: stream.write(report_bytes)))
    if options.trace:
        title = f"pipec run {report['schedule']} (measured)"
        trace_bytes = trace_text(events, title, report["ranks_count"]).encode()
        outputs.append((options.trace, lambda stream: stream.write(trace_bytes)))
    if options.save and weights is not None:
        outputs.append((options.save, lambda stream: torch.save(weights, stream)))
    if not outputs:
        return
    if parent_gone():  # pipec run was killed: what it would have reported is gone, so write nothing
        raise RunError("rank 0: the launching process is gone; no outputs written")
    # Each output on its own, atomically (a temporary file renamed into place): a failure loses neither the
    # previous file of that name nor the other outputs. Every failure is reported, then the run fails (exit 3).
    _PHASE[:] = ["writing the outputs"]
    written, failed = [], []
    for path, writer in outputs:
        try:
            write_with(path, _tracked(writer))
            written.append(path)
            if say is not None:
                say(f"wrote {path}")
        except PipecError as e:
            failed.append(e.message)
        except Exception as e:  # torch.save of an object it cannot pickle, say
            failed.append(f"cannot write {path}: {type(e).__name__}: {e}")
    _PHASE[:] = ["after the last step"]
    if failed:
        kept = f"; written: {', '.join(written)}" if written else ""
        raise OutputError(f"rank 0: after the last step: {'; '.join(failed)}{kept}")


def _tracked(writer: Callable[[BinaryIO], object]) -> Callable[[BinaryIO], object]:
    """`writer`, with the temporary file it writes known to `abandon_outputs` while it is being written."""

    def write(stream: BinaryIO) -> object:
        name = None
        with contextlib.suppress(OSError, ValueError):
            name = os.readlink(f"/proc/self/fd/{stream.fileno()}")  # Linux: the temporary file's path
        if name:
            _PARTIAL.add(name)
        try:
            return writer(stream)
        finally:
            _PARTIAL.discard(name or "")

    return write


class OutputError(PipecError):
    """The run finished but an output could not be written (exit 3, like any failure after the workers
    started); the other outputs were written, and a previous file of a failed output's name is unchanged."""

    exit_code = 3
    located = True


def trace_text(events: list, title: str, ranks_per_replica: int | None = None) -> str:
    """The measured timeline as a Chrome trace, in the format of `pipec viz --trace` (pipec.viz.trace): one
    track per (global) rank, one slice per compute instruction, two per p2p batch (posting it, "comm", and
    waiting for it, "wait"), one per gradient all-reduce ("allreduce", with --dp), an arrow from each send's
    posting to the end of the wait that delivered it (within its replica: `ranks_per_replica` is P)."""
    from pipec.ir import Kind
    from pipec.viz.trace import TraceEvent, TraceFlow, chrome_trace

    items, sends, receives = [], {}, {}
    for rank, step, actions, category, start, duration in events:
        if isinstance(actions, str):  # an all-reduce: a name, no actions
            items.append(TraceEvent(rank, actions, category, start, duration, {"step": step}))
            continue
        name = " ".join(map(str, actions))
        items.append(TraceEvent(rank, name, category, start, duration, {"step": step}))
        replica = rank // ranks_per_replica if ranks_per_replica else 0
        for stage, kind, mb in actions:  # a send's arrow leaves when it was posted, arrives when the wait ended
            if kind is Kind.SEND_F and category == "comm":
                sends[step, replica, stage + 1, "F", mb] = (rank, start + duration)
            elif kind is Kind.SEND_B and category == "comm":
                sends[step, replica, stage - 1, "B", mb] = (rank, start + duration)
            elif kind.is_recv and category == "wait":
                receives[step, replica, stage, kind.value[-1], mb] = (rank, start + duration)
    flows = [TraceFlow(*sends[key], *receives[key]) for key in sends if key in receives]
    return json.dumps(chrome_trace(items, flows, title=title))


def describe_failure(error: BaseException, rank: int) -> str:
    text = error.message if isinstance(error, PipecError) else f"{type(error).__name__}: {error}"
    text = text.strip() or type(error).__name__
    if len(text) > 800:
        text = text[:800] + " ..."
    if getattr(error, "located", False):  # the message already names the rank and where it was
        return text
    return f"rank {rank}: {where()}: {text}"


def progress() -> tuple | None:
    """What changes while this rank runs its stream (the guard thread compares it over time); None outside the
    stream (set-up, between steps), where only collectives block and the process group's timeout bounds them."""
    if not _CURRENT or _CURRENT[-1].ctx.pc < 0:
        return None
    runner = _CURRENT[-1]
    return (id(runner), runner.step_index, runner.ctx.pc, runner.ctx.waiting)


def rank_or_unknown() -> str:
    return str(dist.get_rank()) if dist.is_initialized() else "?"


def run_worker(program: Program, options: Options) -> None:
    """The function every `pipec run` worker runs (rank 0 prints and writes)."""
    train(program, options, say=_print)


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `pipec run ... | head`: keep training, stop printing
        pass


def validate(program: Program, options: Options) -> Options:
    """The checks that need no process group, done once before any worker starts (exit 2 on bad input): the
    workload's protocol (workload.build), the batch split (by D x M) and the partition, then a dry run of the
    whole model and the loss on one micro-batch, without gradients, so that a model that cannot run on its own
    batches fails here with a message rather than in every worker; then the checkpoints (`_plan_checkpoints`).
    Returns the options with the checkpoint to resume from filled in."""
    work = workload.build(options.model, options.seed)
    inputs, targets = workload.split(work.batches[0], program.microbatches, 0, options.dp)
    sizes = None
    if options.partition != "profile":
        sizes = stages.partition(work.layers, program.num_stages, options.partition)
    elif len(work.layers) < program.num_stages:
        stages.optimal_partition([1.0] * len(work.layers), program.num_stages)
    dtype = stages.compute_dtype(options.dtype)
    _dry_run(options.model, work, sizes, inputs[0], targets[0], training=not program.forward_only, dtype=dtype)
    if sizes is not None and not program.forward_only:
        stages.check_tied(work.layers, sizes, program.stage_to_rank, options.model)
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
    import dataclasses

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


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


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
                problem = _boundary_problem(x, training)
                if problem is not None:
                    raise PipecInputError(f"--model {spec}: stage {stage} starts at layer {i}, whose input {problem}")
                x = stages.to_boundary(x, dtype)
            try:
                x = stages.call(layer, x)
            except PipecError:
                raise
            except Exception as e:
                shape = f"{tuple(sample.shape)} {sample.dtype}"
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
