"""Timed events for traces from a simulated timeline (one cost unit is written as one millisecond)."""

from __future__ import annotations

from pipec.viz.trace import TraceEvent, TraceFlow, chrome_trace

UNIT_S = 1e-3  # cost units are shown as milliseconds in trace viewers


def sim_trace(result, title: str | None = None) -> dict:
    """The Chrome trace of a SimResult recorded with ``record=True``: true simulated durations, one track per
    rank, a flow from each send (when its transfer starts) to its receive (when the data has arrived)."""
    events = []
    for rank, line in enumerate(result.timeline):
        for op in line:
            if op.is_comm:
                name, category = " ".join(map(str, op.instruction)), "comm"
            else:
                name = str(op.instruction)
                category = "+".join(a.kind.value for a in op.instruction.parts)
            events.append(TraceEvent(rank, name, category, op.start * UNIT_S, (op.end - op.start) * UNIT_S))
    flows = [TraceFlow(m.src, m.start * UNIT_S, m.dst, m.end * UNIT_S, f"{m.send}->{m.recv}") for m in result.messages]
    p = result.program
    if title is None:
        title = f"{p.name} P={p.ranks} M={p.microbatches} V={p.chunks} (simulated, {result.costs.describe()})"
    return chrome_trace(events, flows, title, ranks=range(p.ranks))
