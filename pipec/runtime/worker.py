"""One rank's run: set-up, steps, statistics, the report, the trace and the saved weights.

Runs inside an initialised default process group (launch.py starts it, or torchrun does). Set-up, in order:
build the workload with the shared seed (every rank holds the same model and data), agree on the schedule and
the partition (a rank that compiled something else stops every rank here, before any message), learn the
activation shapes once (each stage's owner runs it on one micro-batch and broadcasts its output shape), then
build the interpreter's context and plan.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipec.errors import PipecError, PipecInputError
from pipec.ir import Program
from pipec.runtime import interpreter, stages, workload
from pipec.runtime.interpreter import Context
from pipec.runtime.objects import all_gather_objects, broadcast_object
from pipec.verify.memory import peak_activations


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


@dataclass
class StepStats:
    wall_s: float  # this rank's step, optimizer included
    loop_s: float  # the interpreter loop
    compute_s: float  # inside torch compute calls of the loop
    comm_s: float  # inside p2p calls: posting batches and waiting for them
    optimizer_s: float
    loss: float | None


@dataclass
class Runner:
    """A rank's interpreter set up for one program and workload; `step` runs one training (or inference) step."""

    program: Program
    work: workload.Workload
    rank: int
    sizes: tuple[int, ...]
    ctx: Context
    entries: list
    optimizer: object
    params: list
    step_index: int = -1
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
    ):
        rank = dist.get_rank()
        if dist.get_world_size() != program.ranks:
            raise PipecInputError(f"the schedule is compiled for {program.ranks} ranks but {dist.get_world_size()} run")
        device = _device()
        inputs, _ = workload.split(work.batches[0], program.microbatches)
        sizes = _agree(program, work, partition, inputs[0])
        mine = stages.build_stages(work.layers, sizes, program.stages_of(rank))
        for stage in mine.values():
            stage.to(device)
        mine = stages.build_stages(work.layers, sizes, program.stages_of(rank))  # parameter lists after .to()
        shapes = _exchange_shapes(program, mine, inputs[0].to(device))
        ctx = Context(
            rank=rank,
            stages=mine,
            stage_to_rank=program.stage_to_rank,
            shapes=shapes,
            microbatches=program.microbatches,
            loss_fn=work.loss_fn,
            device=device,
            training=not program.forward_only,
            tracing=tracing,
            p2p_timeout=timedelta(seconds=p2p_timeout_s),
        )
        params = [p for stage in mine.values() for p in stage.parameters()]
        optimizer = workload.make_optimizer(work, params) if ctx.training else None
        interpreter.check_program(program)
        entries = interpreter.plan(program.streams[rank])
        return cls(program, work, rank, sizes, ctx, entries, optimizer, params, time_base=_common_time_base(device))

    def step(self, batch) -> StepStats:
        """One step: split the batch, clear gradients, run the stream, step the optimizer (all timed)."""
        start = time.perf_counter()
        self.step_index += 1
        ctx = self.ctx
        inputs, targets = workload.split(batch, self.program.microbatches)
        inputs = [x.to(ctx.device) for x in inputs]
        targets = [t.to(ctx.device) for t in targets]
        ctx.compute_s = ctx.comm_s = 0.0
        for p in self.params:
            p.grad = None
        loop_s = interpreter.run(ctx, self.entries, inputs, targets)
        opt_start = time.perf_counter()
        if self.optimizer is not None:
            self.optimizer.step()
        end = time.perf_counter()
        self.events.extend((self.step_index, *event) for event in ctx.events)
        ctx.events.clear()
        loss = float(ctx.loss) if self.program.stage_to_rank[-1] == self.rank else None
        return StepStats(end - start, loop_s, ctx.compute_s, ctx.comm_s, end - opt_start, loss)

    def where(self) -> str:
        """The current step and instruction (and the batch it waits for), for error messages and the watchdog."""
        pc, waiting = self.ctx.pc, self.ctx.waiting
        if pc < 0:
            return f"step {self.step_index}, between instructions"
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

    def trace_events(self) -> list[tuple]:
        base = self.time_base
        return [(self.rank, step, acts, cat, start - base, dur) for step, acts, cat, start, dur in self.events]


def _common_time_base(device: torch.device) -> float:
    """The trace's time origin in this process's perf_counter terms: the earliest wall-clock time any rank reads
    here (wall clocks agree across processes and, NTP permitting, across nodes; perf_counter is precise)."""
    offset = time.time() - time.perf_counter()
    earliest = torch.tensor([time.time()], dtype=torch.float64, device=device)
    dist.all_reduce(earliest, op=dist.ReduceOp.MIN)
    return float(earliest[0]) - offset


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        index = torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cpu")


def fingerprint(program: Program) -> str:
    text = repr((program.name, program.ranks, program.microbatches, program.chunks, program.stage_to_rank))
    text += "\n".join(" ".join(map(str, stream)) for stream in program.streams)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _agree(program: Program, work: workload.Workload, partition: str, sample) -> tuple[int, ...]:
    """Every rank must run the same schedule on the same partition; the partition is rank 0's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = None
    if rank == 0 or partition != "profile":
        sizes = stages.partition(work.layers, program.num_stages, partition, sample)
    mine = (fingerprint(program), f"{program.name} P={program.ranks} M={program.microbatches} V={program.chunks}")
    views = all_gather_objects((mine, sizes))
    base = views[0]
    differing = [r for r in range(world) if views[r][0][0] != base[0][0]]
    if differing:
        lines = [f"rank {r} runs {views[r][0][1]} (fingerprint {views[r][0][0]})" for r in range(world)]
        raise PipecInputError(
            f"ranks {', '.join(map(str, differing))} disagree with rank 0 about the schedule:\n  " + "\n  ".join(lines)
        )
    return tuple(base[1])


def _exchange_shapes(program: Program, mine: dict, sample) -> dict:
    """Each stage's output shape and dtype, learnt once: the owner runs the stage on an input of the right
    shape (no grad) and broadcasts the result to every rank, in stage order."""
    shapes: dict = {}
    in_shape, in_dtype = tuple(sample.shape), sample.dtype
    for s in range(program.num_stages - 1):
        owner = program.stage_to_rank[s]
        shape = None
        if owner == dist.get_rank():
            x = sample if s == 0 else torch.zeros(in_shape, dtype=in_dtype, device=sample.device)
            with torch.no_grad():
                y = mine[s].forward(x)
            shape = (tuple(y.shape), y.dtype)
        shapes[s] = broadcast_object(shape, src=owner)
        in_shape, in_dtype = shapes[s]
    return shapes


# --- the run: steps, per-step lines, summary, report, trace, weights ---------------------------------------


def train(program: Program, options: Options, say=print) -> dict:
    """Run every step on this rank; rank 0 prints and writes the files. Returns this rank's result."""
    rank, world = dist.get_rank(), dist.get_world_size()
    work = workload.build(options.model, options.seed)
    runner = Runner.setup(program, work, options.partition, options.trace is not None, options.timeout_s)
    _CURRENT.append(runner)
    talk = rank == 0 and not options.quiet
    if talk:
        say(f"{program.name}: P={program.ranks} M={program.microbatches} V={program.chunks}, {world} processes")
        say("partition:\n" + stages.describe(work.layers, runner.sizes, program.stage_to_rank))
    steps = options.steps or len(work.batches)
    records = []
    for k in range(steps):
        stats = runner.step(work.batches[k % len(work.batches)])
        # Outside the timed step: the slowest rank's time and the loss (held by the last stage's rank).
        summary = torch.tensor(
            [stats.wall_s, -1e300 if stats.loss is None else stats.loss], dtype=torch.float64, device=runner.ctx.device
        )  # on the rank's device: NCCL reduces CUDA tensors only
        dist.all_reduce(summary, op=dist.ReduceOp.MAX)
        step_s, loss = float(summary[0]), float(summary[1])
        records.append((step_s, loss, stats))
        if talk:
            say(f"step {k:>3}  loss {loss:.6f}  {step_s * 1e3:8.2f} ms")
    result = _summarise(program, runner, records, options, say if talk else None)
    _CURRENT.pop()
    return result


_CURRENT: list[Runner] = []  # the runner of this process, for the watchdog and error messages


def where() -> str:
    return _CURRENT[-1].where() if _CURRENT else "set-up"


def _summarise(program: Program, runner: Runner, records: list, options: Options, say) -> dict:
    rank = runner.rank
    step_times = [r[0] for r in records]
    instructions = len(program.streams[rank])
    compute = sum(r[2].compute_s for r in records)
    comm = sum(r[2].comm_s for r in records)
    optimizer = sum(r[2].optimizer_s for r in records)
    # the interpreter's own cost: the loop's time outside torch's compute calls and the p2p batches
    interpreter_s = sum(r[2].loop_s for r in records) - compute - comm
    mine = {
        "rank": rank,
        "compute_s": compute + optimizer,
        "comm_wait_s": comm,
        "idle_s": sum(r[0] - r[2].wall_s for r in records),  # waiting for the slowest rank to finish the step
        "interpreter_s": interpreter_s,
        "instructions_per_step": instructions,
        "interpreter_us_per_instruction": 1e6 * interpreter_s / max(1, instructions * len(records)),
        "peak_activations": runner.ctx.peak,
        "peak_activations_predicted": peak_activations(program)[rank],
    }
    gathered = all_gather_objects((mine, runner.trace_events() if options.trace else []))
    weights = None
    if options.save:
        parts = all_gather_objects(runner.state_dict())
        weights = {k: v for part in parts for k, v in part.items()}
    microbatch = workload.split(runner.work.batches[0], program.microbatches)[0][0].shape[0]
    samples = microbatch * program.microbatches
    median = statistics.median(step_times)
    report = {
        "schedule": program.name,
        "ranks_count": program.ranks,
        "microbatches": program.microbatches,
        "chunks": program.chunks,
        "partition": list(runner.sizes),
        "step_times": step_times,
        "median_step_s": median,
        "losses": [r[1] for r in records],
        "samples_per_s": samples / median if median > 0 else None,
        "ranks": [g[0] for g in gathered],
    }
    if program.forward_only:
        report["baseline_samples_per_s"] = _baseline_throughput(runner, len(step_times)) if rank == 0 else None
        dist.barrier()
    if rank == 0:
        _write_outputs(report, [e for g in gathered for e in g[1]], weights, options, say)
    return {"report": report, "weights": runner.state_dict()}


def _baseline_throughput(runner: Runner, steps: int) -> float:
    """One process running the whole model forward on the full batch, as many times as the pipelined run."""
    layers = runner.work.layers
    times = []
    with torch.no_grad():
        for k in range(max(1, steps)):
            x = runner.work.batches[k % len(runner.work.batches)][0].to(runner.ctx.device)
            start = time.perf_counter()
            layers.to(runner.ctx.device)(x)
            times.append(time.perf_counter() - start)
    size = runner.work.batches[0][0].shape[0]
    return size / statistics.median(times)


def _write_outputs(report: dict, events: list, weights, options: Options, say) -> None:
    if say is not None:
        say(f"median step {report['median_step_s'] * 1e3:.2f} ms, {report['samples_per_s']:.1f} samples/s")
        if "baseline_samples_per_s" in report:
            say(f"one process, whole model: {report['baseline_samples_per_s']:.1f} samples/s")
        say("rank  compute_s  comm_wait_s  idle_s  interp_us/instr  peak_activations  predicted")
        for r in report["ranks"]:
            say(
                f"{r['rank']:>4}  {r['compute_s']:9.4f}  {r['comm_wait_s']:11.4f}  {r['idle_s']:6.4f}  "
                f"{r['interpreter_us_per_instruction']:15.1f}  {r['peak_activations']:16g}  "
                f"{r['peak_activations_predicted']:9g}"
            )
    if options.report:
        _write(options.report, json.dumps(report, indent=2) + "\n")
    if options.trace:
        write_trace(options.trace, events, f"pipec run {report['schedule']} (measured)")
    if options.save and weights is not None:
        try:
            torch.save(weights, options.save)
        except OSError as e:
            raise PipecInputError(f"cannot write {options.save}: {e.strerror or e}") from None


def write_trace(path: str, events: list, title: str) -> None:
    """The measured timeline as a Chrome trace, in the format of `pipec viz --trace` (pipec.viz.trace): one
    track per rank, one slice per compute instruction, two per p2p batch (posting it, "comm", and waiting for
    it, "wait"), an arrow from each send's posting to the end of the wait that delivered it."""
    from pipec.ir import Kind
    from pipec.viz.trace import TraceEvent, TraceFlow
    from pipec.viz.trace import write_trace as write

    items, sends, receives = [], {}, {}
    for rank, step, actions, category, start, duration in events:
        name = " ".join(map(str, actions))
        items.append(TraceEvent(rank, name, category, start, duration, {"step": step}))
        for stage, kind, mb in actions:  # a send's arrow leaves when it was posted, arrives when the wait ended
            if kind is Kind.SEND_F and category == "comm":
                sends[step, stage + 1, "F", mb] = (rank, start + duration)
            elif kind is Kind.SEND_B and category == "comm":
                sends[step, stage - 1, "B", mb] = (rank, start + duration)
            elif kind in (Kind.RECV_F, Kind.RECV_B) and category == "wait":
                receives[step, stage, kind.value[-1], mb] = (rank, start + duration)
    flows = [TraceFlow(*sends[key], *receives[key]) for key in sends if key in receives]
    try:
        write(path, items, flows, title=title)
    except OSError as e:
        raise PipecInputError(f"cannot write {path}: {e.strerror or e}") from None


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise PipecInputError(f"cannot write {path}: {e.strerror or e}") from None


def describe_failure(error: BaseException, rank: int) -> str:
    text = error.message if isinstance(error, PipecError) else f"{type(error).__name__}: {error}"
    text = text.strip() or type(error).__name__
    if len(text) > 800:
        text = text[:800] + " ..."
    return f"rank {rank}: {where()}: {text}"


def progress() -> tuple | None:
    """What changes while this rank runs its stream (the watchdog compares it over time); None outside the
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


def validate(program: Program, options: Options) -> None:
    """The checks that need no process group, done once before any worker starts (exit 2 on bad input)."""
    work = workload.build(options.model, options.seed)
    workload.split(work.batches[0], program.microbatches)
    if options.partition != "profile":
        stages.partition(work.layers, program.num_stages, options.partition)
    elif len(work.layers) < program.num_stages:
        stages.optimal_partition([1.0] * len(work.layers), program.num_stages)
