"""Chrome / Perfetto trace files from per-rank timed events.

Shared by the simulator (simulated timelines) and the runtime (measured timelines), so both produce traces that
open the same way in ``chrome://tracing`` or https://ui.perfetto.dev: one process ("pipeline"), one thread track per
rank named ``rank r``, one complete event ("X") per instruction with its true duration, and one flow arrow
("s" -> "f") from each send to the receive it meets. Torch-free on purpose: the runtime imports it in workers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

_PID = 0
_US = 1e6  # Chrome traces count microseconds


class TraceEvent(NamedTuple):
    """One timed instruction on one rank (seconds, from a common origin)."""

    rank: int
    name: str  # e.g. torch's text form "0F1" or "1SEND_B3"
    category: str  # "F", "B", "I", "W", "comm", "idle", ...
    start_s: float
    duration_s: float
    args: dict | None = None  # extra fields shown when the event is selected


class TraceFlow(NamedTuple):
    """An arrow from a send (ends at ``send_rank`` / ``send_s``) to its receive (``recv_rank`` / ``recv_s``)."""

    send_rank: int
    send_s: float
    recv_rank: int
    recv_s: float
    name: str = "p2p"


def chrome_trace(
    events: Iterable[TraceEvent],
    flows: Iterable[TraceFlow] = (),
    title: str = "pipec",
    ranks: Sequence[int] | None = None,
    tracks: Mapping[int, tuple[str, int]] | None = None,
) -> dict:
    """Build the trace object (``{"traceEvents": [...], "displayTimeUnit": "ms"}``).

    ``ranks`` names the tracks to create even if a rank has no events; by default the ranks seen in ``events``.
    ``tracks`` gives other tracks (an event's ``rank`` is its track id) a name and a sort index, e.g. a rank's
    communication stream beside its compute.
    Flow endpoints bind to the enclosing slice on their track ("bp": "e"), so a flow's timestamps should fall
    inside (or at the edge of) the send and receive events.
    """
    events = list(events)
    seen = sorted({e.rank for e in events} | set(ranks or ()))
    out: list[dict] = [{"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": title}}]
    named = dict(tracks or {})
    for r in sorted(set(seen) | set(named)):
        name, order = named.get(r, (f"rank {r}", r))
        out.append({"ph": "M", "pid": _PID, "tid": r, "name": "thread_name", "args": {"name": name}})
        out.append({"ph": "M", "pid": _PID, "tid": r, "name": "thread_sort_index", "args": {"sort_index": order}})
    for e in events:
        ev = {
            "ph": "X",
            "pid": _PID,
            "tid": e.rank,
            "name": e.name,
            "cat": e.category,
            "ts": e.start_s * _US,
            "dur": e.duration_s * _US,
        }
        if e.args:
            ev["args"] = e.args
        out.append(ev)
    for i, f in enumerate(flows):
        common = {"pid": _PID, "name": f.name, "cat": "p2p", "id": i, "bp": "e"}
        out.append({"ph": "s", "tid": f.send_rank, "ts": f.send_s * _US, **common})
        out.append({"ph": "f", "tid": f.recv_rank, "ts": f.recv_s * _US, **common})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"title": title}}


def write_trace(
    path: str | Path,
    events: Iterable[TraceEvent],
    flows: Iterable[TraceFlow] = (),
    title: str = "pipec",
    ranks: Sequence[int] | None = None,
) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path`` and return the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events, flows, title, ranks)))
    return path
