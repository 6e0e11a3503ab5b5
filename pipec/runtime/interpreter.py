"""The interpreter: runs one rank's instruction stream for one step. A context, a dispatch table keyed by Kind,
and a short loop; no schedule is special here.

Where tensors live between instructions (keys are (stage, micro-batch)):
- `acts[s, m]`  the input of stage s for micro-batch m (a tensor, or a tuple of them that the stage's first
                layer receives as positional arguments), in transit: F(s-1, m) or RECV_F(s, m) puts it there,
                F(s, m) or SEND_F(s-1, m) takes it;
- `grads[s, m]` the gradients of stage s's output, a tuple: one per output tensor that carries a gradient back
                (the floating-point ones, `stages.Boundary.grads`); B/I(s+1, m) or RECV_B(s, m) puts it there,
                B/I(s, m) or SEND_B(s+1, m) takes it;
- `saved[s, m]` what the backward needs, from F(s, m) until B or I: one unit of activations;
- `partial[s, m]` what W needs, from I(s, m) until W(s, m): the layer outputs and their gradients, counted as
                (1 - input_fraction) of a unit (the liveness model of pipec.verify.memory).
Live activations are counted from `saved` and `partial` after every compute instruction; the peak must equal
`peak_activations` of the verifier, since both follow the same stream.

Point-to-point rule, version 2 (the one the verifier proves deadlock-free): a maximal run of consecutive
SEND/RECV instructions is one batch, posted with one `batch_isend_irecv` call in stream order, without waiting
(on a backend without coalescing, gloo, that call is each op's isend/irecv in turn, so the interpreter makes
those calls on the process group itself: the same calls in the same order, without the Python checks and the
P2POp objects, see `Context.direct`).
A compute instruction first waits for the batches holding the receives it consumes (RECV_F(s, m) before
F(s, m), RECV_B(s, m) before B/I(s, m)); nothing waits for a send until the end of the step, where every
outstanding batch is waited for in posting order (before the optimizer step). A posted batch keeps its send
tensors alive until it has been waited for. Every message uses tag 0, so messages between two ranks match in
issue order, as NCCL matches them. Shapes are known from start-up (`shapes`), never sent. A message of several
tensors (a stage returning a tuple) is that many ops, consecutive in the same batch and in the same order on
both sides, so the order the verifier proved holds message by message.

Receives ahead (gloo, `plan(receives_ahead=k)`): the receives of each batch are posted k batches early (with
the first batch, those of the first k + 1), as plan entries of their own right after the batch they go with.
Gloo's transport is a rendezvous: a send whose receive is already posted goes out at once from the sending
thread, while one that comes first waits for the receiver's notice, which a background thread of the sender must
wake up to answer (a scheduling delay per message on a busy machine, the usual case for a rank that runs ahead).
Posting receives early makes the first case the common one, at the price of holding the receive buffers of up to k
more batches (one micro-batch's boundary tensors per receive). The verified order still holds: on gloo posting never
blocks and messages between two ranks match in order per direction; the receives keep their stream order, every op
is posted no later than the stream says, and a compute instruction waits for its receives only (a subset of what it
waited for before, at the same point), so a stream that completes posted in stream order completes with its receives
ahead. NCCL keeps the stream's order exactly.

Receive buffers are reused once nothing else holds them (buffers.py: `_buffers`, `_give_back`, `_recycle`).

Precision: with `dtype` (--dtype bf16|fp16), F runs the stage and the loss under torch.autocast (parameters and
their gradients stay float32: the optimizer's weights are the master weights) and casts the floating-point
tensors it sends to `dtype` inside the graph, so they and their gradients travel in half the bytes and the
backward starts from what was sent. fp16 scales the loss by `loss_scale` (gradients are unscaled after the
stream, see runner.Runner.step).

Randomness: F runs each layer after reseeding `generators` from the micro-batch's seed (`seeds`, set per step
by the worker) and the layer's index (stages.Stage.forward; skipped for torch.nn layers that draw nothing):
dropout does not depend on the schedule.

Split backward: F records the output of every layer with parameters. I asks autograd for the gradients of the
stage input and of those layer outputs (keeping the graph); W then continues, layer by layer, from each
recorded output and its gradient to that layer's parameters only, so no part of the backward runs twice. (In a
stage where two layers share a parameter, I runs the whole backward and W has nothing to do: stages.Stage.tied.)

Replicated pipelines (a program of C > 1 copies of the model, docs/design/replicated.md): stages are numbered
over the copies and a stage's neighbours are still stage +- 1, so nothing above changes but where a chain ends,
read from the per-stage tables `has_next` / `has_previous` (pipec.ir.chain_links): micro-batch m's input enters
at the first stage of its copy, its loss is taken at that copy's last stage (divided by M, the whole step's
micro-batches: the copies' micro-batches make one batch), and the copies' gradients are summed by SYNC.

SYNC(s, g) (parameters shared across ranks, tied or copies, ties.py): the gradients of sync group g's
parameters, complete on this rank once its last W (or B) of the group's stages has run, are summed with the
group's other member ranks (one bucketed all-reduce on the group's process group, `syncs[g]`), blocking until
every member has reached it. It
is an entry of its own. insert_syncs places it after the rank's last send/recv, and it first waits for every
batch still outstanding, as the end of the step does: when a rank enters the collective nothing of its own is in
flight, so the collective never interleaves with the verified p2p order (under NCCL a collective and p2p on two
communicators could otherwise wait for each other), and the verifier proves the stream with its SYNCs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pipec.errors import PipecError
from pipec.ir import Action, Instruction, Kind, Overlap, Program, chain_links
from pipec.p2p_rule import peer_of, receive_for
from pipec.runtime.buffers import _buffers, _give_back
from pipec.runtime.replicas import sum_gradients
from pipec.runtime.stages import Boundary, Stage, detached, tensors, to_boundary
from pipec.runtime.timing import Clock, HostClock
from pipec.verify.memory import DEFAULT_INPUT_FRACTION

perf = time.perf_counter


class Saved(NamedTuple):
    x: tuple  # the stage's input tensors that carry a gradient back (leaves that require grad); () on stage 0
    out: tuple  # the output tensors that carry a gradient back, as sent; (the loss / M, scaled,) on the last stage
    recorded: list  # per layer with parameters, its output tensors that require grad


@dataclass
class Context:
    rank: int
    stages: dict[int, Stage]
    stage_to_rank: tuple[int, ...]
    shapes: dict[int, Boundary]  # what each stage but the last sends: its tensors' shapes and dtypes
    microbatches: int
    loss_fn: Callable | None
    device: torch.device
    training: bool = True
    input_fraction: float = DEFAULT_INPUT_FRACTION
    tracing: bool = False
    p2p_timeout: timedelta = timedelta(seconds=30)  # a p2p batch not done by then raises (a peer hung or died)
    generators: tuple = ()  # the random generators F reseeds per layer (stages.reseed)
    dtype: Any = None  # the compute dtype of --dtype bf16|fp16 (autocast, boundary tensors); None: float32
    loss_scale: float = 1.0  # fp16: the backward starts from the loss times this (static loss scaling)
    clock: Clock = field(default_factory=HostClock)  # CUDA events on a GPU (timing.py); the host clock on CPU
    # The process group to post each op on directly (its send/recv), where batch_isend_irecv would make the same
    # calls one by one (no coalescing: gloo); None: batch_isend_irecv (NCCL coalesces a batch into one launch).
    direct: Any = None
    pool: dict = field(default_factory=dict)  # ("F" or "B", stage) -> per tensor received: (shape, dtype, free ones)
    received: dict = field(default_factory=dict)  # ("F" or "B", stage, micro-batch) -> its receive buffers
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
    timed: list = field(default_factory=list)  # (action, host start, host seconds) of each compute action, per step
    pc: int = -1  # the plan entry being executed, len(plan) at the end of the step (the guard thread, error messages)
    waiting: int = -1  # the plan entry of the batch being waited for, or -1
    outstanding: dict = field(default_factory=dict)  # plan entry -> Posted, in posting order
    plan: list = field(default_factory=list)  # the entries being run
    # SYNC: sync group -> (its process group, this rank's parameters of it: ties.group_parameters), and the
    # step's seconds in them with each SYNC's (action, start, seconds)
    syncs: dict = field(default_factory=dict)
    sync_s: float = 0.0
    synced: list = field(default_factory=list)

    # Per stage: whether its forward hands to stage + 1 and its backward to stage - 1 (pipec.ir.chain_links: False
    # at the ends of each copy's chain of a replicated program, where the input enters and the loss is); empty:
    # one chain over every stage (set by __post_init__)
    has_next: list = field(default_factory=list)
    has_previous: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.has_next:
            self.has_next, self.has_previous = chain_links(len(self.stage_to_rank))


# --- compute ----------------------------------------------------------------------------------------------


def forward(ctx: Context, action: Action) -> None:
    s, _, m = action
    last = not ctx.has_next[s]  # the last stage of its copy: the loss is here
    x = ctx.acts.pop((s, m)) if ctx.has_previous[s] else ctx.inputs[m]
    seed = ctx.seeds[m] if ctx.seeds is not None else None
    start = _begin(ctx)
    if not ctx.training:
        with torch.no_grad(), _precision(ctx):
            y = ctx.stages[s].forward(x, seed, ctx.generators)
            if last and ctx.loss_fn is not None:
                loss = ctx.loss_fn(y, ctx.targets[m]).detach().float() / ctx.microbatches
                ctx.loss += loss
                ctx.losses.append((m, loss))
            elif not last:
                y = to_boundary(y, ctx.dtype)
    else:
        leaves = _leaves(x) if ctx.has_previous[s] else ()
        with _precision(ctx):
            y, recorded = ctx.stages[s].forward_recording(x, seed, ctx.generators)
            if last:
                # The mean of the micro-batch losses is the full-batch loss: each backward starts from loss / M.
                y = ctx.loss_fn(y, ctx.targets[m]) / ctx.microbatches
        if last:
            ctx.loss += y.detach().float()
            ctx.losses.append((m, y.detach()))
            out: tuple = (y * ctx.loss_scale if ctx.loss_scale != 1.0 else y,)
        else:
            y = to_boundary(y, ctx.dtype)  # in the graph: the backward starts from the tensors sent
            out = (y,) if type(y) is not tuple else tuple(t for t in y if t.is_floating_point())
        ctx.saved[s, m] = Saved(leaves, out, recorded)
    ctx.compute_s += _mark(ctx, action, start)
    if not last:
        ctx.acts[s + 1, m] = detached(y)
    if not ctx.training and ctx.received:  # no graph: the received input is free once the stage has run
        del x, y
        _give_back(ctx, "F", s, m)


def _precision(ctx: Context):
    """torch.autocast in the compute dtype of --dtype, or nothing (float32)."""
    if ctx.dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(ctx.device.type, dtype=ctx.dtype)


def _leaves(x) -> tuple:
    """A stage input's floating-point tensors, made leaves that require grad (in place: each is this stage's own,
    received or detached), in the order of `Boundary.grads`. Integer tensors (positions, masks) get none."""
    if type(x) is not tuple:
        return (x.requires_grad_(),)  # one tensor crosses only if floating point when training (set-up checks)
    return tuple(t.requires_grad_() for t in x if t.is_floating_point())


def _roots(out: tuple, grads: tuple | None) -> tuple | None:
    """What a backward starts from: (outputs, their gradients), keeping the outputs that require grad (one that
    depends on nothing trainable has no graph, and its gradient is dropped); None if there are none. On the
    last stage (`grads` None) the output is the loss."""
    if grads is None or len(out) == 1:
        return (out, grads) if out[0].requires_grad else None
    keep = [i for i, t in enumerate(out) if t.requires_grad]
    return ([out[i] for i in keep], [grads[i] for i in keep]) if keep else None


def _input_grads(x: tuple, got) -> tuple:
    """The gradients to send back for the input leaves `x` (zeros for an input the stage did not use)."""
    if len(x) == 1:  # the common case, without a generator
        return (got[0] if got[0] is not None else torch.zeros_like(x[0]),)
    return tuple(g if g is not None else torch.zeros_like(t) for t, g in zip(x, got, strict=True))


def backward(ctx: Context, action: Action) -> None:
    s, _, m = action
    saved = ctx.saved.pop((s, m))
    grads = ctx.grads.pop((s, m)) if ctx.has_next[s] else None
    roots = _roots(saved.out, grads)
    x = saved.x
    start = _begin(ctx)
    if roots is not None:
        torch.autograd.backward(*roots)
    # Dropping the outputs frees the micro-batch's autograd graph (microseconds per layer): torch's work, which
    # its own runtime does in its backward too, so it is timed with the backward rather than as the loop's.
    del saved, roots
    ctx.compute_s += _mark(ctx, action, start)
    if ctx.received:
        del grads
        _give_back(ctx, "B", s, m)
    if ctx.has_previous[s]:
        ctx.grads[s - 1, m] = _input_grads(x, [t.grad for t in x])
        if ("F", s, m) in ctx.received:
            _clear_grads(x)  # a reused buffer must not accumulate into the last step's gradient
            del x
            _give_back(ctx, "F", s, m)


def _clear_grads(leaves: tuple) -> None:
    for t in leaves:
        t.grad = None


def backward_input(ctx: Context, action: Action) -> None:
    s, _, m = action
    if ctx.stages[s].tied:  # the whole backward here: W cannot stop at a layer (stages.Stage.tied)
        backward(ctx, action)
        ctx.partial[s, m] = None  # W: nothing left (still counted live until W, as the verifier counts it)
        return
    x, out, recorded = ctx.saved.pop((s, m))
    grads = ctx.grads.pop((s, m)) if ctx.has_next[s] else None
    roots = _roots(out, grads)
    wanted = [*x, *(t for outputs in recorded for t in outputs)]
    start = _begin(ctx)
    got: tuple = ()
    if wanted and roots is not None:
        got = torch.autograd.grad(roots[0], wanted, roots[1], retain_graph=True, allow_unused=True)
    del out, roots, wanted  # the graph stays (W needs it): held by `recorded` only
    ctx.compute_s += _mark(ctx, action, start)
    if ctx.received:  # the gradients received, unless W needs them (a layer's output that is the stage's)
        del grads
        _give_back(ctx, "B", s, m, later=True)
    if ctx.has_previous[s]:
        ctx.grads[s - 1, m] = _input_grads(x, got[: len(x)] if got else [None] * len(x))
        got = got[len(x) :]
    ctx.partial[s, m] = (recorded, got)


def backward_weight(ctx: Context, action: Action) -> None:
    s, _, m = action
    recorded, grads = ctx.partial.pop((s, m)) or ((), ())
    start = _begin(ctx)
    if recorded:
        _weight_grads(ctx.stages[s], recorded, grads)
    del recorded, grads  # frees what is left of the graph, timed with W (see backward)
    ctx.compute_s += _mark(ctx, action, start)
    if ctx.received:  # the stage's input, saved by its first layer, is free once the graph is gone
        _give_back(ctx, "F", s, m)
        _give_back(ctx, "B", s, m)


def _weight_grads(stage: Stage, recorded: list, grads: tuple) -> None:
    # Each call stops at its own layer's parameters: the gradients of the layer's outputs already hold
    # everything downstream, so the layers' subgraphs are disjoint and nothing is computed twice.
    at = 0
    for position, outputs in zip(stage.param_layers, recorded, strict=True):
        mine, at = grads[at : at + len(outputs)], at + len(outputs)  # grads is () if nothing needed a gradient
        pairs = [(t, g) for t, g in zip(outputs, mine, strict=False) if g is not None]
        if len(pairs) == 1:
            torch.autograd.backward(pairs[0][0], pairs[0][1], inputs=stage.layer_parameters(position))
        elif pairs:
            roots, seeds = zip(*pairs, strict=True)
            torch.autograd.backward(list(roots), list(seeds), inputs=stage.layer_parameters(position))


# --- communication: each returns the ops to post ((is a send, tensor, peer) each), where a receive's value goes
# (box, key; None for a send) and the value (a send's tensors, kept alive until the batch is waited for; a
# receive's tensor or tuple) -------------------------------------------------------------------------------


def send_f(ctx: Context, action: Action):
    s, _, m = action
    value = ctx.acts.pop((s + 1, m))
    _check_sent(ctx.shapes[s], value, s, m)
    return _sends(value, peer_of(action, ctx.stage_to_rank))


def _check_sent(boundary: Boundary, value, s: int, m: int) -> None:
    """What stage s sends must have the shapes and dtypes learnt at start-up: the receiver's buffers have them,
    and a message of another size would be read into one (gloo accepts a shorter one) or fail in the transport."""
    if type(value) is not tuple:
        shape, dtype = boundary.specs[0]
        if value.shape == shape and value.dtype == dtype and not boundary.is_tuple:
            return
    elif len(value) == len(boundary.specs) and all(
        t.shape == shape and t.dtype == dtype for t, (shape, dtype) in zip(value, boundary.specs, strict=True)
    ):
        return
    got = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors(value))
    learnt = ", ".join(f"{shape} {dtype}" for shape, dtype in boundary.specs)
    raise PipecError(
        f"stage {s} sends micro-batch {m} tensors of {got}, where start-up learnt {learnt} from micro-batch 0 of "
        "batches[0]: what crosses a stage boundary must have the same shapes and dtypes for every micro-batch"
    )


def recv_f(ctx: Context, action: Action):
    s, _, m = action
    boundary, peer = ctx.shapes[s - 1], peer_of(action, ctx.stage_to_rank)
    parts = _buffers(ctx, ("F", s), boundary)
    ctx.received["F", s, m] = parts
    value = parts if boundary.is_tuple else parts[0]
    return [(False, t, peer) for t in parts], ctx.acts, (s, m), value


def send_b(ctx: Context, action: Action):
    s, _, m = action
    return _sends(ctx.grads.pop((s - 1, m)), peer_of(action, ctx.stage_to_rank))


def recv_b(ctx: Context, action: Action):
    s, _, m = action
    boundary, peer = ctx.shapes[s], peer_of(action, ctx.stage_to_rank)
    parts = _buffers(ctx, ("B", s), boundary)
    ctx.received["B", s, m] = parts
    return [(False, t, peer) for t in parts], ctx.grads, (s, m), parts


def _sends(value, peer: int):
    """The ops sending a tensor or a tuple of them to `peer`, in order, and the tensors sent."""
    if type(value) is not tuple:
        tensor = value.contiguous()
        return [(True, tensor, peer)], None, None, (tensor,)
    sent = tuple(t.contiguous() for t in value)
    return [(True, t, peer) for t in sent], None, None, sent


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
    for action in entry.actions:  # a message of several tensors is several ops, in the same order on both sides
        posts, box, key, value = DISPATCH[action.kind](ctx, action)
        ops += posts
        if box is None:
            sends.append(value)
        else:
            arrivals.append((box, key, value))
    start = perf()
    ctx.outstanding[ctx.pc] = Posted(_post(ctx.direct, ops), sends, arrivals)
    elapsed = perf() - start
    if ctx.tracing:
        ctx.events.append((entry.actions, "comm", start, elapsed))
    ctx.comm_s += elapsed


def _post(group, ops: list) -> list:
    """Post (is a send, tensor, peer) ops in order: on `group` directly, or as one batch_isend_irecv (None)."""
    if group is not None:
        return [group.send([t], peer, 0) if send else group.recv([t], peer, 0) for send, t, peer in ops]
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend if send else dist.irecv, t, peer, tag=0) for send, t, peer in ops]
    )


def complete(ctx: Context, batch: int) -> None:
    """Wait for one posted batch (every op of it, bounded by the p2p timeout) and deliver its receives."""
    posted = ctx.outstanding.pop(batch)
    ctx.waiting = batch
    start = perf()
    for work in posted.works:
        work.wait(ctx.p2p_timeout)
    ctx.waiting = -1
    for box, key, tensor in posted.arrivals:
        box[key] = tensor
    del posted  # frees the batch's Work objects (microseconds each): the p2p library's cost, timed with the wait
    elapsed = perf() - start
    if ctx.tracing:
        ctx.events.append((ctx.plan[batch].actions, "wait", start, elapsed))
    ctx.comm_s += elapsed


def synchronize(ctx: Context, entry: Entry) -> None:
    """SYNC(s, g): sum the gradients of group g's shared parameters with its other members (see the module's
    docstring); `waiting` names it meanwhile, for the guard thread and error messages."""
    action = entry.actions[0]
    group, params = ctx.syncs[action.mb]
    for batch in list(ctx.outstanding):  # insert_syncs puts it after the rank's last send/recv: wait for them
        complete(ctx, batch)
    ctx.waiting = ctx.pc
    start = perf()
    sum_gradients(params, group, ctx.events if ctx.tracing else None, f"{action} (sync group {action.mb})")
    elapsed = perf() - start
    ctx.waiting = -1
    ctx.sync_s += elapsed
    ctx.synced.append((action, start, elapsed))


def _begin(ctx: Context) -> float:
    """The start of a compute action's torch calls: the host's time, and on a GPU an event on the compute stream
    (what the GPU did, resolved after the step: timing.py). The event's record is a CUDA call like the
    compute's, timed with them: one waits when the GPU's launch queue is full, as any launch does, which is the
    GPU's pace and not the interpreter's cost."""
    start = perf()
    if ctx.clock.device:
        ctx.clock.start()
    return start


def _mark(ctx: Context, action: Action, start: float) -> float:
    """The host's time in a compute action's torch calls since `_begin`; kept per action for the step's
    statistics and trace (on a GPU the clock's events replace it there; the host's time still splits the loop)."""
    if ctx.clock.device:
        ctx.clock.stop(action)
    elapsed = perf() - start
    ctx.timed.append((action, start, elapsed))
    return elapsed


class Entry(NamedTuple):
    run: Callable[[Context, Entry], None]
    actions: tuple[Action, ...]
    first: int  # index of its first instruction in the rank's stream (for messages)
    waits: tuple[int, ...] = ()  # compute: plan entries of the batches holding the receives it consumes

    @property
    def label(self) -> str:
        return " ".join(map(str, self.actions))


def plan(stream: tuple[Instruction, ...], receives_ahead: int = 0) -> list[Entry]:
    """The stream as plan entries: each compute instruction alone, each maximal run of SEND/RECV one batch, each
    SYNC alone (it ends the run of SEND/RECV before it).
    Each compute entry lists the batches it must wait for (rule 2), found once here rather than every step.

    With `receives_ahead` = k > 0 (gloo only: see the module's docstring), the receives of batch j are posted
    right after batch j - k (those of batches 1..k right after batch 0), as an entry of their own, and batch j
    keeps its sends; a compute instruction waits for the entry holding the receives it consumes."""
    batches: list[tuple[int, list[Action]]] = []  # (index of its first instruction, its actions) per batch
    items: list = []  # in stream order: (index, compute instruction), or the number of a batch
    for index, instruction in enumerate(stream):
        if isinstance(instruction, Action) and instruction.kind.is_p2p:
            if not items or type(items[-1]) is not int:
                batches.append((index, []))
                items.append(len(batches) - 1)
            batches[-1][1].append(instruction)
        else:
            items.append((index, instruction))

    entries: list[Entry] = []
    held: dict[Action, int] = {}  # a posted receive -> the plan entry of its batch

    def post(actions: list[Action], first: int) -> None:
        for action in actions:
            if action.kind.is_recv:
                held[action] = len(entries)
        entries.append(Entry(communicate, tuple(actions), first))

    for item in items:
        if type(item) is int:
            first, actions = batches[item]
            if receives_ahead and item > 0:
                actions = [a for a in actions if not a.kind.is_recv]  # its receives went with the batch before
            if actions:
                post(actions, first)
            if receives_ahead:
                for later in range(1, receives_ahead + 1) if item == 0 else (item + receives_ahead,):
                    after, upcoming = batches[later] if later < len(batches) else (0, [])
                    early = [a for a in upcoming if a.kind.is_recv]
                    if early:
                        post(early, after + upcoming.index(early[0]))
            continue
        index, instruction = item
        if isinstance(instruction, Action) and instruction.kind.is_collective:
            entries.append(Entry(synchronize, (instruction,), index))
            continue
        parts = instruction.parts if isinstance(instruction, Overlap) else (instruction,)
        waits = [held.pop(key) for key in map(receive_for, parts) if key in held]  # the receives feeding it
        entries.append(Entry(compute, parts, index, tuple(dict.fromkeys(waits))))
    return entries


def run(ctx: Context, entries: list[Entry], inputs: list, targets: list) -> float:
    """One step of this rank's stream, ending with a wait for every batch still outstanding (rule 2: sends are
    waited for only here, before the optimizer step). Returns the loop's wall time."""
    ctx.inputs, ctx.targets, ctx.loss, ctx.plan = inputs, targets, 0.0, entries
    ctx.losses = []
    ctx.timed = []
    ctx.synced = []
    ctx.sync_s = 0.0
    ctx.outstanding.clear()  # only a failed step could have left any
    ctx.received.clear()  # the same (their buffers are left to be freed, not reused)
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
                if action.kind not in DISPATCH and not action.kind.is_collective:
                    raise RuntimeError(f"no handler for {action}")
