"""After the last step: the run's report (every rank's statistics, the measured costs, the checkpoints' times),
the lines rank 0 prints, and the outputs rank 0 writes (--report, --trace, --save), each atomically."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from typing import BinaryIO

import torch
import torch.distributed as dist

from pipec.errors import PipecError
from pipec.ir import Program
from pipec.outputs import write_with
from pipec.runtime import stages
from pipec.runtime.costs import measured_costs, stage_times
from pipec.runtime.launch import RunError
from pipec.runtime.objects import all_gather_objects, gather_objects
from pipec.runtime.options import Options
from pipec.runtime.runner import Runner
from pipec.runtime.status import RankStatus
from pipec.runtime.ties import one_model
from pipec.runtime.trace import trace_text
from pipec.verify.memory import peak_activations, stage_units_note

REPORT_FORMAT = "pipec-run-report"  # lets `--cost report.json` find the measured costs (pipec.sim.costs)


def summarise(
    program: Program,
    runner: Runner,
    records: list,
    options: Options,
    say,
    status: RankStatus,
    first_step: int = 0,
    writer=None,
) -> dict:
    """The report of the steps in `records` ((step_s, loss, StepStats) each), gathered from every rank; rank 0
    prints it (`say`, None: quiet) and writes the outputs. Returns this rank's result: the report, its weights."""
    rank, prank = runner.rank, runner.pipeline_rank
    step_times = [r[0] for r in records]
    instructions = len(program.streams[prank])
    compute = sum(r[2].compute_s for r in records)
    comm = sum(r[2].comm_s for r in records)
    allreduce = sum(r[2].allreduce_s for r in records)
    optimizer = sum(r[2].optimizer_s for r in records)
    # the interpreter's own cost: the loop's time outside torch's compute calls and the p2p batches (the host's
    # time in those calls, also on a GPU, where compute_s is the GPU's)
    sync = sum(r[2].sync_s for r in records)
    interpreter_s = sum(r[2].loop_s for r in records) - sum(r[2].host_compute_s for r in records) - comm - sync
    mine = {
        "rank": rank,
        "replica": runner.replica,
        "pipeline_rank": prank,
        "compute_s": compute,  # the stream's compute actions: what the trace's F, B, I and W slices add up to
        "optimizer_s": optimizer,
        "comm_wait_s": comm,
        "allreduce_s": allreduce,
        "sync_s": sync,  # the SYNCs of parameters tied across ranks (0 without): waiting for the group included
        "idle_s": sum(r[0] - r[2].wall_s for r in records),  # waiting for the slowest rank to finish the step
        "interpreter_s": interpreter_s,
        "instructions_per_step": instructions,
        "interpreter_us_per_instruction": 1e6 * interpreter_s / max(1, instructions * len(records)),
        "peak_activations": runner.ctx.peak,
        "peak_activations_predicted": peak_activations(program)[prank],
        "stage_ms": stage_times([r[2].op_s for r in records]),
        "timing": "cuda events" if runner.ctx.clock.device else "host clock",
    }
    gathered = all_gather_objects((mine, runner.trace_events() if options.trace else []))
    weights = None
    if options.save:  # replica 0 holds the whole model (every replica holds the same weights), copy 0 of it
        parts = gather_objects(runner.model_part() if runner.replica == 0 else ({}, []), dst=0)
        weights = one_model(parts, runner.ties) if parts is not None else None  # a tied parameter saved once
    samples = runner.work.batches[0][0].shape[0]  # the D replicas' micro-batches make the whole batch
    median = statistics.median(step_times) if step_times else None
    report = {
        "format": REPORT_FORMAT,
        "schedule": program.name,
        "ranks_count": program.ranks,
        "microbatches": program.microbatches,
        "chunks": program.chunks,
        "pipelines": program.pipelines,  # copies of the model: a stage is C/V of a rank's share
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
        if say is not None:
            _say_summary(report, say)
        _write_outputs(report, [e for g in gathered for e in g[1]], weights, options, status, say)
    return {"report": report, "weights": runner.state_dict()}


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


def _say_summary(report: dict, say: Callable[[str], None]) -> None:
    """What rank 0 prints after the last step: the median step, and a line per rank."""
    if report["median_step_s"] is None:
        say(f"no step left to train: the checkpoint is at step {report['first_step']}")
    else:
        say(f"median step {report['median_step_s'] * 1e3:.2f} ms, {report['samples_per_s']:.1f} samples/s")
    if "baseline_samples_per_s" in report:
        say(f"one process, whole model: {report['baseline_samples_per_s']:.1f} samples/s")
    replicated = report["dp"] > 1  # the all-reduce column only where there is one
    synced = any(r["sync_s"] for r in report["ranks"])  # the sync column only with ties across ranks
    say(
        "rank  compute_s  comm_wait_s  " + ("allreduce_s  " if replicated else "") + ("sync_s  " if synced else "")
        + "idle_s  interp_us/instr  peak_activations  predicted"
    )  # fmt: skip
    for r in report["ranks"]:
        allreduce = f"{r['allreduce_s']:11.4f}  " if replicated else ""
        allreduce += f"{r['sync_s']:6.4f}  " if synced else ""
        say(
            f"{r['rank']:>4}  {r['compute_s']:9.4f}  {r['comm_wait_s']:11.4f}  {allreduce}{r['idle_s']:6.4f}  "
            f"{r['interpreter_us_per_instruction']:15.1f}  {r['peak_activations']:16g}  "
            f"{r['peak_activations_predicted']:9g}"
        )
    copies = report.get("pipelines", 1)  # reports written before copies existed have one
    if report["chunks"] > 1 or copies > 1:
        peak = max(r["peak_activations_predicted"] for r in report["ranks"])
        say(stage_units_note(report["chunks"], peak, copies))


def _write_outputs(
    report: dict, events: list, weights, options: Options, status: RankStatus, say: Callable[[str], None] | None
) -> None:
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
    if status.parent_gone():  # pipec run was killed: what it would have reported is gone, so write nothing
        raise RunError("rank 0: the launching process is gone; no outputs written")
    # Each output on its own, atomically (a temporary file renamed into place): a failure loses neither the
    # previous file of that name nor the other outputs. Every failure is reported, then the run fails (exit 3).
    status.phase = "writing the outputs"
    written, failed = [], []
    for path, writer in outputs:
        try:
            write_with(path, status.tracked(writer))
            written.append(path)
            if say is not None:
                say(f"wrote {path}")
        except PipecError as e:
            failed.append(e.message)
        except Exception as e:  # torch.save of an object it cannot pickle, say
            failed.append(f"cannot write {path}: {type(e).__name__}: {e}")
    status.phase = "after the last step"
    if failed:
        kept = f"; written: {', '.join(written)}" if written else ""
        raise OutputError(f"rank 0: after the last step: {'; '.join(failed)}{kept}")


class OutputError(PipecError):
    """The run finished but an output could not be written (exit 3, like any failure after the workers
    started); the other outputs were written, and a previous file of a failed output's name is unchanged."""

    exit_code = 3
    located = True
