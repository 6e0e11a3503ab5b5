"""Does every rank's stream run to the end under a point-to-point model? The rule, its engines, the explanation.

The rule and its models are in `rule` (written out in docs/verification.md). Three engines find where the ranks
stop. Every condition is monotone ("rank q's host got past unit u", "rank q completed k batches"), so that point
is unique and each engine reaches it by waking ranks until none can move:
- `compute_orders.run_compute_orders`: a program without send/recv (compute orders, as `pipec.load` gives them)
  run on its data dependencies: each compute waits for the computes it reads, wherever they run (a `ComputeRun`);
- `streams.run_streams`: a program with send/recv run under the rule, op by op: per rank its host position and its
  completed batches, a worklist with per-rank heaps of sleeping waiters, time linear in the instructions (times a
  log). Its `StreamRun` records why each stuck rank waits (`Blocked`), which the explanation reads;
- `finish.streams_finish`: only the verdict of `run_streams` (does every rank finish?), reached on per-rank
  *gates* (`gates`: sorted threshold arrays built by C loops, bisected), about twice as fast.
`runs` holds what the runs leave behind. The pass, `check.check_deadlock`, decides with `streams_finish` (or an
untimed `run_compute_orders`) and reruns the full engine only to explain a deadlock (`explain`, which starts with
pipec.verify.diagnose's verdict). This package's namespace holds the rule and the engines, not the pass: the
diagnosis imports the engines from here, and the pass imports the diagnosis (through `explain`).
"""

from __future__ import annotations

from pipec.verify.deadlock.compute_orders import run_compute_orders
from pipec.verify.deadlock.finish import streams_finish
from pipec.verify.deadlock.rule import IN_ORDER, MODELS, batched, check_model, flat_for
from pipec.verify.deadlock.runs import Blocked, ComputeRun, StreamRun, Units, Wait, cut_units
from pipec.verify.deadlock.streams import run_streams

__all__ = [
    "IN_ORDER",
    "MODELS",
    "Blocked",
    "ComputeRun",
    "StreamRun",
    "Units",
    "Wait",
    "batched",
    "check_model",
    "cut_units",
    "flat_for",
    "run_compute_orders",
    "run_streams",
    "streams_finish",
]
