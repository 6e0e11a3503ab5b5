"""check_deadlock, the deadlock pass: decide with the fast engine, explain with the full one.

It decides with `streams_finish` (or an untimed `run_compute_orders`) and reruns the full engine only to explain
a deadlock: pipec.verify.deadlock.explain follows the chain of waits to its cycle and draws the step-by-rank grid
around it. This module sits above the engines and the explanation (which imports pipec.verify.diagnose, which
runs the engines), so none of them imports it.
"""

from __future__ import annotations

from pipec.ir import Program
from pipec.verify.deadlock.compute_orders import run_compute_orders
from pipec.verify.deadlock.explain import explain_stuck_compute_orders, explain_stuck_streams
from pipec.verify.deadlock.finish import streams_finish
from pipec.verify.deadlock.rule import check_model, flat_for
from pipec.verify.deadlock.streams import run_streams
from pipec.verify.flat import Flat


def check_deadlock(
    program: Program, p2p: str = "nccl", flat: Flat | None = None, placed: bool | None = None
) -> list[str]:
    """Problems (empty when every rank runs to the end), with the chain of waits and a grid when stuck. `placed`:
    whether pipec placed the send/recv (None: the explanation finds out, only if it is needed)."""
    check_model(p2p)
    flat = flat_for(program, p2p, flat)
    if program.has_comms:
        # the fast verdict knows no collectives: a program with SYNCs is decided by the op-by-op run
        if not any(flat.syncs) and streams_finish(program, p2p, flat):
            return []
        stream_run = run_streams(program, p2p, flat)  # the same run, with the state the explanation reads
        if not stream_run.stuck:
            return []
        return explain_stuck_streams(program, stream_run, placed).splitlines()
    run = run_compute_orders(program, p2p, flat, timed=False)
    if not run.stuck:
        return []
    run = run_compute_orders(program, p2p, flat, timed=True)  # the same run, with the steps the grid shows
    return explain_stuck_compute_orders(program, run, placed).splitlines()
