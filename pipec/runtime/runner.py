"""A rank's interpreter set up for one program and workload (`Runner.setup`), and one step of it (`Runner.step`):
this replica's micro-batches, the stream, the replicas' gradient average, the finite check and the optimizer.

Set-up, in order: agree on the schedule, --dp, the partition and the step to resume from (agreement.py: a rank
that compiled something else stops every rank here, before any message), learn the activation shapes once,
create the replica groups, build the interpreter's context and plan. The checkpoint being resumed is loaded
after that (`restore`, called by the worker: after the shape pass, so that a layer with side effects,
BatchNorm, does not see that extra forward after its state was restored).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pipec.errors import PipecInputError
from pipec.ir import Program, chain_links
from pipec.runtime import checkpoint, interpreter, stages, ties, timing, workload
from pipec.runtime.agreement import agree, direct_group, exchange_shapes
from pipec.runtime.costs import per_op
from pipec.runtime.feed import Feed
from pipec.runtime.interpreter import Context
from pipec.runtime.launch import group_timeout
from pipec.runtime.objects import group_device
from pipec.runtime.replicas import Layout, average_gradients, replica_group
from pipec.runtime.trace import common_time_base

FP16_LOSS_SCALE = 1024.0  # --dtype fp16: a static loss scale (a power of two, so unscaling is exact)

# Batches by which gloo's receives are posted early (interpreter.plan): gloo's rendezvous sends at once when the
# receive is already posted. On 4 processes on 2 cores (bench/runtime.py's workload, paired rounds), pipec/torch
# was 0.67-1.00 with one batch ahead and 0.58-0.91 with two; three and four did no better.
GLOO_RECEIVES_AHEAD = 2


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
    sync_s: float = 0.0  # inside the SYNCs of tied parameters (waiting for the group's members included)


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
    ties: list = field(default_factory=list)  # the model's tied parameters (ties.Tie), synced where across ranks

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
        device = group_device()
        inputs, _ = workload.split(work.batches[0], program.microbatches, replica, dp)
        sizes = agree(program, work, partition, inputs[0], dp, resume_step, device)
        # A parameter shared across ranks (tied, or a replicated program's copies of a stage): the SYNCs that sum
        # its copies' gradients (a profiled partition is known only here; every rank derives the same program from
        # the agreed partition, which cuts one copy of the model into its L stages)
        tied = ties.find_ties(work.layers, sizes, program.pipelines)
        program = ties.with_syncs(program, work.layers, sizes)
        # Copies of the model (replicated pipelines): stage s is built from logical stage s % L, from this rank's
        # own model, built from the shared seed: every copy starts from the same weights
        mine = stages.build_stages(work.layers, sizes, program.stages_of(prank))
        for stage in mine.values():
            stage.to(device)
        mine = stages.build_stages(work.layers, sizes, program.stages_of(prank))  # parameter lists after .to()
        shapes = exchange_shapes(program, mine, inputs[0].to(device), compute_dtype)
        # Every rank creates every replica group, in the same order (new_group is collective).
        timeout = group_timeout(dist.get_backend(), p2p_timeout_s)
        group = replica_group(layout, rank, timeout)
        sync_groups = ties.process_groups(program, dp, rank, timeout)  # after the replica groups, on every rank
        tied_params = ties.group_parameters(tied, program.sync_groups, work.layers)
        has_next, has_previous = chain_links(program.num_stages, program.pipelines)
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
            direct=direct_group(device, shapes),
            syncs={g: (sync_groups[g], tied_params[g]) for g in sync_groups},
            has_next=has_next,
            has_previous=has_previous,
        )
        # Each parameter once, under its first name in the unsplit model (a weight tied between stages, of this
        # rank or of several: one parameter, whose optimizer state every copy keys alike).
        canonical = ties.aliases(tied)
        names: dict[int, str] = {}
        params = []
        for stage in mine.values():
            for name, p in stage.named_parameters():
                if id(p) not in names:
                    names[id(p)] = canonical.get(name, name)
                    params.append(p)
        optimizer = workload.make_optimizer(work, params) if ctx.training else None
        interpreter.check_program(program)
        entries = interpreter.plan(program.streams[prank], GLOO_RECEIVES_AHEAD if ctx.direct is not None else 0)
        held = program.stages_of(prank)
        inputs_here, targets_here = any(map(program.is_first, held)), any(map(program.is_last, held))
        feed = Feed(device, program.microbatches, replica, dp, inputs_here, targets_here)
        return cls(
            program, work, rank, sizes, ctx, entries, optimizer, params, layout, group, names, feed, seed,
            time_base=common_time_base(device), ties=tied,
        )  # fmt: skip

    @property
    def holds_loss(self) -> bool:
        """Whether this rank runs a copy's last stage, where micro-batches' losses are computed."""
        return any(not self.ctx.has_next[s] for s in self.ctx.stages)

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
        compute_s, op_s = per_op(timed)
        if ctx.synced:  # each SYNC's mean seconds, under (stage, "SYNC"), beside the compute actions' (costs.py)
            op_s.update(per_op(ctx.synced)[1])
        if ctx.tracing:
            ctx.events.extend(((action,), action.kind.value, begin, seconds) for action, begin, seconds in timed)
        self.events.extend((self.step_index, *event) for event in ctx.events)
        ctx.events.clear()
        # this rank's share of the step's loss: the micro-batches whose copy ends on one of its stages (the worker's
        # all-reduce sums the shares; one chain: the whole loss, on the last stage's rank)
        loss = float(ctx.loss) if self.holds_loss else None
        return StepStats(
            end - start, loop_s, compute_s, ctx.comm_s, allreduce_s, ctx.clock.optimizer_s(opt_end - opt_start), loss,
            nonfinite, ctx.compute_s, op_s, ctx.sync_s,
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
                stage = self.program.stages_of_microbatch(bad[0][0])[-1]  # its copy's last stage
                found.append(f"the loss is {bad[0][1]} at micro-batch {bad[0][0]} of stage {stage}{more}")
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
        if waiting >= 0 and waiting == pc and self.entries[pc].run is interpreter.synchronize:
            text += ", waiting for the sync group's other ranks"
        elif waiting >= 0:
            batch = self.entries[waiting]
            text += f", waiting for the batch at instruction {batch.first} ({batch.label})"
        return text

    def state_dict(self) -> dict:
        """This rank's entries of one model, keyed as in the unsplit model: its stages of copy 0 (a replicated
        program's other copies hold the same weights: `model_part`)."""
        out = {}
        for s, stage in self.ctx.stages.items():
            if self.program.pipeline_of(s) == 0:
                out.update(stage.state_dict())
        return out

    def model_part(self) -> tuple[dict, list[dict]]:
        """What this rank sends for --save and checkpoints (ties.one_model): `state_dict`, and the entries of each
        of its stages of the copies 1 .. C-1, which rank 0 checks against copy 0's (none with one pipeline)."""
        copies = [stage.state_dict() for s, stage in self.ctx.stages.items() if self.program.pipeline_of(s) > 0]
        return self.state_dict(), copies

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

    def progress(self) -> tuple | None:
        """What changes while this rank runs its stream (status.RankStatus.progress); None outside it."""
        if self.ctx.pc < 0:
            return None
        return (id(self), self.step_index, self.ctx.pc, self.ctx.waiting)

    def trace_events(self) -> list[tuple]:
        base = self.time_base
        return [(self.rank, step, acts, cat, start - base, dur) for step, acts, cat, start, dur in self.events]


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
