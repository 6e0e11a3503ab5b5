"""The measured timeline: a time origin common to every rank (`common_time_base`), and the Chrome trace of the
events the ranks recorded (`trace_text`)."""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist


def common_time_base(device: torch.device) -> float:
    """The trace's time origin in this process's perf_counter terms: the earliest wall-clock time any rank reads
    here (wall clocks agree across processes and, NTP permitting, across nodes; perf_counter is precise)."""
    offset = clock_offset()
    earliest = torch.tensor([time.time()], dtype=torch.float64, device=device)
    dist.all_reduce(earliest, op=dist.ReduceOp.MIN)
    return float(earliest[0]) - offset


def clock_offset(samples: int = 7) -> float:
    """time.time() - time.perf_counter(), from the reading bracketed most tightly by two perf_counter() calls: on a
    loaded machine a process can be descheduled between the two clock reads, which would shift this rank's whole
    trace by milliseconds against the others' (a receive could then appear to end before its send was posted)."""
    best = (float("inf"), 0.0)
    for _ in range(samples):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        best = min(best, (after - before, wall - (before + after) / 2))
    return best[1]


def trace_text(events: list, title: str, ranks_per_replica: int | None = None) -> str:
    """The measured timeline as a Chrome trace, in the format of `pipec viz --trace` (pipec.viz.trace): one
    track per (global) rank, one slice per compute instruction, two per p2p batch (posting it, "comm", and
    waiting for it, "wait"), one per gradient all-reduce ("allreduce", with --dp) and per bucket of a SYNC of
    tied parameters ("sync"), an arrow from each send's
    posting to the end of the wait that delivered it (within its replica: `ranks_per_replica` is P)."""
    from pipec.ir import Kind
    from pipec.viz.trace import TraceEvent, TraceFlow, chrome_trace

    items, sends, receives = [], {}, {}
    for rank, step, actions, category, start, duration in events:
        if isinstance(actions, str):  # an all-reduce or a SYNC's bucket: a name, no actions
            items.append(TraceEvent(rank, actions, category, start, duration, {"step": step}))
            continue
        name = " ".join(map(str, actions))
        items.append(TraceEvent(rank, name, category, start, duration, {"step": step}))
        replica = rank // ranks_per_replica if ranks_per_replica else 0
        for stage, kind, mb in actions:  # a send's arrow leaves when it was posted, arrives when the wait ended
            if kind is Kind.SEND_F and category == "comm":
                sends[step, replica, stage + 1, "F", mb] = (rank, start + duration)
            elif kind is Kind.SEND_B and category == "comm":
                sends[step, replica, stage - 1, "B", mb] = (rank, start + duration)
            elif kind.is_recv and category == "wait":
                receives[step, replica, stage, kind.value[-1], mb] = (rank, start + duration)
    flows = [TraceFlow(*sends[key], *receives[key]) for key in sends if key in receives]
    return json.dumps(chrome_trace(items, flows, title=title))
