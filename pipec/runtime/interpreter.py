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

Point-to-point rule (the one the verifier proves deadlock-free): a maximal run of consecutive SEND/RECV
instructions is one batch, posted with one `batch_isend_irecv` call in stream order, every op of it (sends
included) waited for before the next instruction. Every message uses tag 0, so messages between two ranks
match in issue order, as NCCL matches them. Shapes are known from start-up (`shapes`), never sent.

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
    # Per step.
    inputs: list = field(default_factory=list)
    targets: list = field(default_factory=list)
    acts: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)
    partial: dict = field(default_factory=dict)
    loss: Any = 0.0
    # Measurements: seconds inside torch compute calls and inside p2p batches, peak live activations, events.
    compute_s: float = 0.0
    comm_s: float = 0.0
    peak: float = 0.0
    events: list = field(default_factory=list)  # (actions, category, start, duration)
    pc: int = -1  # the plan entry being executed (read by the watchdog and error messages)

    @property
    def last_stage(self) -> int:
        return len(self.stage_to_rank) - 1


# --- compute ----------------------------------------------------------------------------------------------


def forward(ctx: Context, action: Action) -> None:
    s, _, m = action
    last = s == ctx.last_stage
    x = ctx.inputs[m] if s == 0 else ctx.acts.pop((s, m))
    start = perf()
    if not ctx.training:
        with torch.no_grad():
            y = ctx.stages[s].forward(x)
            if last and ctx.loss_fn is not None:
                ctx.loss += ctx.loss_fn(y, ctx.targets[m]).detach() / ctx.microbatches
    else:
        if s > 0:
            x.requires_grad_()
        y, recorded = ctx.stages[s].forward_recording(x)
        if last:
            # The mean of the micro-batch losses is the full-batch loss: each backward starts from loss / M.
            y = ctx.loss_fn(y, ctx.targets[m]) / ctx.microbatches
            ctx.loss += y.detach()
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


def compute(ctx: Context, actions: tuple[Action, ...]) -> None:
    for action in actions:
        DISPATCH[action.kind](ctx, action)
    live = len(ctx.saved) + (1.0 - ctx.input_fraction) * len(ctx.partial)
    if live > ctx.peak:
        ctx.peak = live


def communicate(ctx: Context, actions: tuple[Action, ...]) -> None:
    ops, arrivals = [], []
    for action in actions:
        op, box, key = DISPATCH[action.kind](ctx, action)
        ops.append(op)
        if box is not None:
            arrivals.append((box, key, op.tensor))
    start = perf()
    for work in dist.batch_isend_irecv(ops):
        work.wait(ctx.p2p_timeout)
    if ctx.tracing:
        ctx.events.append((actions, "comm", start, perf() - start))
    ctx.comm_s += perf() - start
    for box, key, tensor in arrivals:
        box[key] = tensor


def _mark(ctx: Context, action: Action, start: float) -> float:
    elapsed = perf() - start
    if ctx.tracing:
        ctx.events.append(((action,), action.kind.value, start, elapsed))
    return elapsed


class Entry(NamedTuple):
    run: Callable[[Context, tuple[Action, ...]], None]
    actions: tuple[Action, ...]
    first: int  # index of its first instruction in the rank's stream (for messages)

    @property
    def label(self) -> str:
        return " ".join(map(str, self.actions))


def plan(stream: tuple[Instruction, ...]) -> list[Entry]:
    """The stream as plan entries: each compute instruction alone, each maximal run of SEND/RECV one batch."""
    entries: list[Entry] = []
    batch: list[Action] = []
    for index, instruction in enumerate(stream):
        if isinstance(instruction, Action) and instruction.kind.is_comm:
            batch.append(instruction)
            continue
        if batch:
            entries.append(Entry(communicate, tuple(batch), index - len(batch)))
            batch = []
        parts = instruction.parts if isinstance(instruction, Overlap) else (instruction,)
        entries.append(Entry(compute, parts, index))
    if batch:
        entries.append(Entry(communicate, tuple(batch), len(stream) - len(batch)))
    return entries


def run(ctx: Context, entries: list[Entry], inputs: list, targets: list) -> float:
    """One step of this rank's stream. Returns the loop's wall time."""
    ctx.inputs, ctx.targets, ctx.loss = inputs, targets, 0.0
    start = perf()
    for ctx.pc, (step, actions, _) in enumerate(entries):
        step(ctx, actions)
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
