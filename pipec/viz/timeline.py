"""Timed events for traces from a simulated timeline (one cost unit is written as one millisecond)."""

from __future__ import annotations

from pipec.viz.trace import TraceEvent, TraceFlow, chrome_trace

UNIT_S = 1e-3  # cost units are shown as milliseconds in trace viewers


def sim_trace(result, title: str | None = None) -> dict:
    """The Chrome trace of a SimResult recorded with ``record=True``: true simulated durations, one track per
    rank for its compute and, when the program has send/recv, one beside it for its p2p batches (they run on the
    communication stream, overlapping compute), and a flow from each send (when its transfer starts) to its
    receive (when the data has arrived)."""
    p = result.program
    P = p.ranks  # noqa: N806
    events = []
    for rank, line in enumerate(result.timeline):
        for op in line:
            if op.is_comm:
                name, category, track = " ".join(map(str, op.instruction)), "comm", P + rank
            else:
                name, track = str(op.instruction), rank
                category = "+".join(a.kind.value for a in op.instruction.parts)
            events.append(TraceEvent(track, name, category, op.start * UNIT_S, (op.end - op.start) * UNIT_S))
    # a flow binds to the slice around its ends: the batches on the p2p tracks (compute ops without send/recv)
    offset = P if p.has_comms else 0
    flows = [
        TraceFlow(offset + m.src, m.start * UNIT_S, offset + m.dst, m.end * UNIT_S, f"{m.send}->{m.recv}")
        for m in result.messages
    ]
    if title is None:
        title = f"{p.name} P={p.ranks} M={p.microbatches} V={p.chunks} (simulated, {result.costs.describe()})"
    tracks = {P + r: (f"rank {r} p2p", 2 * r + 1) for r in range(P)} if p.has_comms else {}
    tracks.update({r: (f"rank {r}", 2 * r) for r in range(P)})
    return chrome_trace(events, flows, title, ranks=range(P), tracks=tracks)
