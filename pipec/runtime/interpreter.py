"""The interpreter: runs one rank's instruction stream for one step. A context, a dispatch table keyed by Kind,
and a short loop; no schedule is special here.

Where tensors live between instructions (keys are (stage, micro-batch)):
- `acts[s, m]`  the input of stage s for micro-batch m, in transit: F(s-1, m) or RECV_F(s, m) puts it there,
                F(s, m) or SEND_F(s-1, m) takes it;
- `grads[s, m]` the gradient of stage s's output: B/I(s+1, m) or RECV_B(s, m) puts it there, B/I(s, m) or
                SEND_B(s+1, m) takes it;
- `saved[s, m]` what the backward needs, from F(s, m) until B or I: one unit of activations;
- `partial[s, m]` what W needs, from I(s, m) until W(s, m): the layer outputs and their gradients, counted as
                (1 - input_fraction) of a unit (the liveness model of pipec.verify.memory).
Live activations are counted from `saved` and `partial` after every compute instruction; the peak must equal
`peak_activations` of the verifier, since both follow the same stream.

Point-to-point rule, version 2 (the one the verifier proves deadlock-free): a maximal run of consecutive
SEND/RECV instructions is one batch, posted with one `batch_isend_irecv` call in stream order, without waiting.
A compute instruction first waits for the batches holding the receives it consumes (RECV_F(s, m) before
F(s, m), RECV_B(s, m) before B/I(s, m)); nothing waits for a send until the end of the step, where every
outstanding batch is waited for in posting order (before the optimizer step). A posted batch keeps its send
tensors alive until it has been waited for. Every message uses tag 0, so messages between two ranks match in
issue order, as NCCL matches them. Shapes are known from start-up (`shapes`), never sent.

Randomness: F runs each layer after reseeding `generators` from the micro-batch's seed (`seeds`, set per step
by the worker) and the layer's index (stages.Stage.forward): dropout does not depend on the schedule.

Split backward: F records the output of every layer with parameters. I asks autograd for the gradients of the
stage input and of those layer outputs (keeping the graph); W then continues, layer by layer, from each
recorded output and its gradient to that layer's parameters only, so no part of the backward runs twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pipec.ir import Action, Instruction, Kind, Overlap, Program
from pipec.runtime.stages import Stage
from pipec.verify.memory import DEFAULT_INPUT_FRACTION

perf = time.perf_counter


class Saved(NamedTuple):
    x: torch.Tensor | None  # the stage input (a leaf that requires grad); None on stage 0
    out: torch.Tensor  # the stage output, or the scaled loss on the last stage
    recorded: list  # outputs of the layers with parameters


@dataclass
class Context:
    rank: int
    stages: dict[int, Stage]
    stage_to_rank: tuple[int, ...]
    shapes: dict[int, tuple[tuple[int, ...], torch.dtype]]  # each stage's output shape and dtype
    microbatches: int
    loss_fn: Callable | None
    device: torch.device
    training: bool = True
    input_fraction: float = DEFAULT_INPUT_FRACTION
    tracing: bool = False
    p2p_timeout: timedelta = timedelta(seconds=30)  # a p2p batch not done by then raises (a peer hung or died)
    generators: tuple = ()  # the random generators F reseeds per layer (stages.reseed)
    # Per step.
    inputs: list = field(default_factory=list)
    targets: list = field(default_factory=list)
    acts: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)
    partial: dict = field(default_factory=dict)
    loss: Any = 0.0
    losses: list = field(default_factory=list)  # (micro-batch, its loss / M) on the last stage, for the finite check
    seeds: list | None = None  # each micro-batch's seed this step (stages.microbatch_seed); None: no reseeding
    # Measurements: seconds inside torch compute calls and inside p2p batches, peak live activations, events.
    compute_s: float = 0.0
    comm_s: float = 0.0
    peak: float = 0.0
    events: list = field(default_factory=list)  # (actions or a name, category, start, duration)
    pc: int = -1  # the plan entry being executed, len(plan) at the end of the step (the guard thread, error messages)
    waiting: int = -1  # the plan entry of the batch being waited for, or -1
    outstanding: dict = field(default_factory=dict)  # plan entry -> Posted, in posting order
    plan: list = field(default_factory=list)  # the entries being run

    @property
    def last_stage(self) -> int:
        return len(self.stage_to_rank) - 1


# --- compute ----------------------------------------------------------------------------------------------


def forward(ctx: Context, action: Action) -> None:
    s, _, m = action
    last = s == ctx.last_stage
    x = ctx.inputs[m] if s == 0 else ctx.acts.pop((s, m))
    seed = ctx.seeds[m] if ctx.seeds is not None else None
    start = perf()
    if not ctx.training:
        with torch.no_grad():
            y = ctx.stages[s].forward(x, seed, ctx.generators)
            if last and ctx.loss_fn is not None:
                loss = ctx.loss_fn(y, ctx.targets[m]).detach() / ctx.microbatches
                ctx.loss += loss
                ctx.losses.append((m, loss))
    else:
        if s > 0:
            x.requires_grad_()
        y, recorded = ctx.stages[s].forward_recording(x, seed, ctx.generators)
        if last:
            # The mean of the micro-batch losses is the full-batch loss: each backward starts from loss / M.
            y = ctx.loss_fn(y, ctx.targets[m]) / ctx.microbatches
            ctx.loss += y.detach()
            ctx.losses.append((m, y.detach()))
        ctx.saved[s, m] = Saved(x if s > 0 else None, y, recorded)
    ctx.compute_s += _mark(ctx, action, start)
    if not last:
        ctx.acts[s + 1, m] = y.detach()


def backward(ctx: Context, action: Action) -> None:
    s, _, m = action
    x, out, _ = ctx.saved.pop((s, m))
    grad = None if s == ctx.last_stage else ctx.grads.pop((s, m))
    start = perf()
    if out.requires_grad:
        torch.autograd.backward(out, grad)
    ctx.compute_s += _mark(ctx, action, start)
    if x is not None:
        ctx.grads[s - 1, m] = x.grad if x.grad is not None else torch.zeros_like(x)


def backward_input(ctx: Context, action: Action) -> None:
    s, _, m = action
    x, out, recorded = ctx.saved.pop((s, m))
    grad = None if s == ctx.last_stage else ctx.grads.pop((s, m))
    wanted = recorded if x is None else [x, *recorded]
    start = perf()
    got: tuple = ()
    if wanted and out.requires_grad:
        got = torch.autograd.grad(out, wanted, grad, retain_graph=True, allow_unused=True)
    ctx.compute_s += _mark(ctx, action, start)
    if x is not None:
        ctx.grads[s - 1, m] = got[0] if got and got[0] is not None else torch.zeros_like(x)
        got = got[1:]
    ctx.partial[s, m] = (recorded, got)


def backward_weight(ctx: Context, action: Action) -> None:
    s, _, m = action
    recorded, grads = ctx.partial.pop((s, m))
    stage = ctx.stages[s]
    start = perf()
    # Each call stops at its own layer's parameters: the gradient of the layer's output already holds
    # everything downstream, so the layers' subgraphs are disjoint and nothing is computed twice.
    for position, output, grad in zip(stage.param_layers, recorded, grads, strict=False):  # grads is () if no grad
        if grad is not None:
            torch.autograd.backward(output, grad, inputs=stage.layer_parameters(position))
    ctx.compute_s += _mark(ctx, action, start)


# --- communication: each returns the op to post and, for a receive, where its tensor goes ---------------


def send_f(ctx: Context, action: Action):
    s, _, m = action
    tensor = ctx.acts.pop((s + 1, m)).contiguous()
    return dist.P2POp(dist.isend, tensor, ctx.stage_to_rank[s + 1], tag=0), None, None


def recv_f(ctx: Context, action: Action):
    s, _, m = action
    shape, dtype = ctx.shapes[s - 1]
    tensor = torch.empty(shape, dtype=dtype, device=ctx.device)
    return dist.P2POp(dist.irecv, tensor, ctx.stage_to_rank[s - 1], tag=0), ctx.acts, (s, m)


def send_b(ctx: Context, action: Action):
    s, _, m = action
    tensor = ctx.grads.pop((s - 1, m)).contiguous()
    return dist.P2POp(dist.isend, tensor, ctx.stage_to_rank[s - 1], tag=0), None, None


def recv_b(ctx: Context, action: Action):
    s, _, m = action
    shape, dtype = ctx.shapes[s]
    tensor = torch.empty(shape, dtype=dtype, device=ctx.device)
    return dist.P2POp(dist.irecv, tensor, ctx.stage_to_rank[s + 1], tag=0), ctx.grads, (s, m)


DISPATCH: dict[Kind, Callable] = {
    Kind.F: forward,
    Kind.B: backward,
    Kind.I: backward_input,
    Kind.W: backward_weight,
    Kind.SEND_F: send_f,
    Kind.RECV_F: recv_f,
    Kind.SEND_B: send_b,
    Kind.RECV_B: recv_b,
}


# --- plan entries: one compute instruction (an Overlap runs its halves in order), or one p2p batch -------


class Posted(NamedTuple):
    """A batch posted and not yet waited for."""

    works: list  # what batch_isend_irecv returned
    sends: list  # the sent tensors, kept alive until the batch is waited for
    arrivals: list  # (box, key, tensor) of each receive: the tensor goes into its box once the batch completed


def compute(ctx: Context, entry: Entry) -> None:
    for batch in entry.waits:  # the batches holding this instruction's receives (gone if already waited for)
        if batch in ctx.outstanding:
            complete(ctx, batch)
    for action in entry.actions:
        DISPATCH[action.kind](ctx, action)
    live = len(ctx.saved) + (1.0 - ctx.input_fraction) * len(ctx.partial)
    if live > ctx.peak:
        ctx.peak = live


def communicate(ctx: Context, entry: Entry) -> None:
    """Post the batch and go on: rule 1 of version 2, posting never blocks."""
    ops, sends, arrivals = [], [], []
    for action in entry.actions:
        op, box, key = DISPATCH[action.kind](ctx, action)
        ops.append(op)
        if box is None:
            sends.append(op.tensor)
        else:
            arrivals.append((box, key, op.tensor))
    start = perf()
    ctx.outstanding[ctx.pc] = Posted(dist.batch_isend_irecv(ops), sends, arrivals)
    elapsed = perf() - start
    if ctx.tracing:
        ctx.events.append((entry.actions, "comm", start, elapsed))
    ctx.comm_s += elapsed


def complete(ctx: Context, batch: int) -> None:
    """Wait for one posted batch (every op of it, bounded by the p2p timeout) and deliver its receives."""
    posted = ctx.outstanding.pop(batch)
    ctx.waiting = batch
    start = perf()
    for work in posted.works:
        work.wait(ctx.p2p_timeout)
    elapsed = perf() - start
    ctx.waiting = -1
    if ctx.tracing:
        ctx.events.append((ctx.plan[batch].actions, "wait", start, elapsed))
    ctx.comm_s += elapsed
    for box, key, tensor in posted.arrivals:
        box[key] = tensor


def _mark(ctx: Context, action: Action, start: float) -> float:
    elapsed = perf() - start
    if ctx.tracing:
        ctx.events.append(((action,), action.kind.value, start, elapsed))
    return elapsed


class Entry(NamedTuple):
    run: Callable[[Context, Entry], None]
    actions: tuple[Action, ...]
    first: int  # index of its first instruction in the rank's stream (for messages)
    waits: tuple[int, ...] = ()  # compute: plan entries of the batches holding the receives it consumes

    @property
    def label(self) -> str:
        return " ".join(map(str, self.actions))


def _needs(action: Action) -> tuple | None:
    """What a compute action consumes from a receive: RECV_F(s, m) feeds F(s, m), RECV_B(s, m) feeds B/I(s, m)."""
    if action.kind is Kind.F:
        return ("F", action.stage, action.mb)
    if action.kind is Kind.B or action.kind is Kind.I:
        return ("B", action.stage, action.mb)
    return None


def plan(stream: tuple[Instruction, ...]) -> list[Entry]:
    """The stream as plan entries: each compute instruction alone, each maximal run of SEND/RECV one batch.
    Each compute entry lists the batches it must wait for (rule 2), found once here rather than every step."""
    entries: list[Entry] = []
    batch: list[Action] = []
    held: dict[tuple, int] = {}  # what a posted receive will provide -> the plan entry of its batch

    def flush(first: int) -> None:
        for action in batch:
            if action.kind is Kind.RECV_F or action.kind is Kind.RECV_B:
                held["F" if action.kind is Kind.RECV_F else "B", action.stage, action.mb] = len(entries)
        entries.append(Entry(communicate, tuple(batch), first))
        batch.clear()

    for index, instruction in enumerate(stream):
        if isinstance(instruction, Action) and instruction.kind.is_comm:
            batch.append(instruction)
            continue
        if batch:
            flush(index - len(batch))
        parts = instruction.parts if isinstance(instruction, Overlap) else (instruction,)
        waits = [held.pop(key) for key in map(_needs, parts) if key in held]
        entries.append(Entry(compute, parts, index, tuple(dict.fromkeys(waits))))
    if batch:
        flush(len(stream) - len(batch))
    return entries


def run(ctx: Context, entries: list[Entry], inputs: list, targets: list) -> float:
    """One step of this rank's stream, ending with a wait for every batch still outstanding (rule 2: sends are
    waited for only here, before the optimizer step). Returns the loop's wall time."""
    ctx.inputs, ctx.targets, ctx.loss, ctx.plan = inputs, targets, 0.0, entries
    ctx.losses = []
    ctx.outstanding.clear()  # only a failed step could have left any
    start = perf()
    for ctx.pc, entry in enumerate(entries):
        entry.run(ctx, entry)
    ctx.pc = len(entries)
    for batch in list(ctx.outstanding):
        complete(ctx, batch)
    elapsed = perf() - start
    ctx.pc = -1
    leftovers = {name: sorted(box) for name, box in _boxes(ctx).items() if box}
    if leftovers:  # the verifier's structure pass rules this out; never continue silently if it happens
        raise RuntimeError(f"the stream ended with tensors still held: {leftovers}")
    return elapsed


def _boxes(ctx: Context) -> dict[str, dict]:
    return {"acts": ctx.acts, "grads": ctx.grads, "saved": ctx.saved, "partial": ctx.partial}


def check_program(program: Program) -> None:
    """Kinds the interpreter has no handler for would be a compiler bug; refuse them before any process starts."""
    for stream in program.streams:
        for instruction in stream:
            for action in instruction.parts:
                if action.kind not in DISPATCH:
                    raise RuntimeError(f"no handler for {action}")
