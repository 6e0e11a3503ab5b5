"""The measured costs: each step's compute seconds per (stage, kind) (`per_op`), a rank's per-stage medians over the
steps (`stage_times`), and the run's costs in the cost-file format (`measured_costs`, pipec.sim.costs)."""

from __future__ import annotations

import statistics

from pipec.ir import Program


def per_op(timed: list) -> tuple[float, dict]:
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


def stage_times(steps: list[dict]) -> dict[str, dict[str, float]]:
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
    `--per-rank-share` and of `pipec tune`; at V=1 a segment is a stage. With replicas, the median over them;
    a replicated program describes one copy of the model (L stages, L / P a segment), the median over its copies.
    Schedules with a split backward give F, I, W; those with B give F, and I = W = B / 2 (the split is not
    measured; B = I + W is kept). Forward-only runs give F only. With parameters tied across ranks, `sync`: one
    SYNC's time (the smallest measured, see below). None without a step to measure."""
    per_stage: dict[int, dict[str, list[float]]] = {}  # per stage of one copy of the model
    length = program.stages_per_pipeline
    for row in ranks:
        for stage, kinds in row.get("stage_ms", {}).items():
            for kind, ms in kinds.items():  # a replicated program: each copy's measurement of the logical stage
                per_stage.setdefault(int(stage) % length, {}).setdefault(kind, []).append(ms)
    if len(per_stage) != length or length % program.ranks:
        return None
    med = {s: {k: statistics.median(v) for k, v in kinds.items()} for s, kinds in per_stage.items()}
    if program.forward_only:
        names = ("F",)
    else:
        for kinds in med.values():  # a stage run with B (or partly): its I and W halves of B
            if "I" not in kinds or "W" not in kinds:
                kinds["I"] = kinds["W"] = kinds.get("B", 0.0) / 2
        names = ("F", "I", "W")
    chunks = length // program.ranks  # V with one pipeline
    out = {}
    for name in names:
        row = [sum(med[k * chunks + c].get(name, 0.0) for c in range(chunks)) for k in range(program.ranks)]
        out[name] = [round(v, 6) for v in row]  # ms to the nanosecond: the cost file's precision is plenty
    synced = [ms for kinds in per_stage.values() for ms in kinds.get("SYNC", [])]
    if synced:
        # A SYNC blocks until every member has reached it: the member that arrives last measures the collective
        # alone, the others also their wait for it. The smallest measured is the simulator's `sync`.
        out["sync"] = round(min(synced), 6)
    return out
