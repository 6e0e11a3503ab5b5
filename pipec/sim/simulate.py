"""simulate: run compiled instruction streams through an event-driven model with durations.

Execution follows version 2 of the point-to-point rule shared with the verifier's ``nccl`` model and the runtime
(its shared pieces in pipec/p2p_rule.py):
- each rank (its host) runs its stream in order; a compute instruction takes its duration from the cost model (an
  overlapped pair takes FB when the costs give it, else the sum of its halves);
- a maximal run of consecutive SEND/RECV instructions is one *batch*, posted when the host reaches it, without
  waiting (``overlap=0`` charges the sender ``message_time`` per send posted);
- a compute instruction starts at max(rank free, completion of the batches holding the receives it consumes);
  sends are never waited for, except at the end of the step, when the rank waits for all its batches;
- ``nccl``: a rank's batches *run* in posting order (one NCCL stream): a batch starts at max(posted, previous
  batch of the rank completed). Messages on one ordered pair of ranks match in issue order (the k-th send from a
  to b meets the k-th receive on b from a; different (stage, kind, micro-batch) is a p2p order mismatch); a
  matched pair completes at max(start of both batches) + ``message_time``, a batch when all its ops have;
- a batch is posted only once its rank has computed every value it sends (the runtime sends the tensor); a send
  ahead of its value leaves the rank stuck there for good, a deadlock under both models (as in the verifier);
- ``tagged``: every batch runs once posted, sends complete at once, a receive meets the send of its message in
  any order (completing at max(both posted) + ``message_time``);
- ``torch``: torch's ``_PipelineScheduleRuntime``, the ``nccl`` rule with every SEND/RECV instruction a batch of
  its own (torch posts each action by itself; the verifier's ``torch`` model, cut by ``batched``).
The simulation is a worklist over ranks (no global event heap: every time is fixed as soon as the batches it
depends on have started): a rank's host runs until a compute needs a batch that has not completed, and its batches
start as soon as they are posted and their predecessor has completed; a completion wakes the rank. Each
instruction is handled a bounded number of times, so the cost is linear in the number of instructions.


The pieces, one a file: sim/result.py (what a run reports), sim/state.py (the arrays of a run), sim/hosts.py (the
host loop), sim/steps.py (the rule's steps it calls), sim/ideal.py (the ``ideal`` model), sim/engine.py (one run and
the checks around it), sim/refusals.py (why a program is not simulated), sim/placement.py (send/recv placed for the
costs simulated). This module is the entry point.

A structurally invalid program (what `pipec check`'s structure pass refuses) is not simulated: ``simulate`` raises
that pass's verdict (sim/engine.py). Peak activation memory comes from the one liveness function,
``pipec.verify.memory.peak_activations``.
"""

from __future__ import annotations

from pipec.errors import PipecInputError
from pipec.ir import Program
from pipec.sim.costs import DEFAULT_COSTS, Costs
from pipec.sim.engine import checked, run_model
from pipec.sim.placement import fastest_placement
from pipec.sim.result import Message, SimResult, TimedOp

__all__ = ["P2P_MODELS", "Message", "SimResult", "TimedOp", "simulate"]

P2P_MODELS = ("nccl", "tagged", "torch", "ideal")


def simulate(
    program: Program,
    costs: Costs = DEFAULT_COSTS,
    record: bool = False,
    input_fraction: float | None = None,
    p2p: str = "nccl",
) -> SimResult:
    """Simulate ``program`` (with send/recv, as ``pipec.compile`` returns it) under ``costs``.

    ``record`` keeps the per-rank timeline and the messages (for pictures and traces). ``p2p`` is the
    point-to-point model: ``nccl`` (the runtime's rule, above), ``tagged`` (sends buffered and released at once,
    a receive waits for the send of its (stage, micro-batch) in any order), ``torch`` (torch's runtime: ``nccl``
    with each send/recv posted as a batch of its own) or ``ideal`` (the compute order alone,
    send/recv instructions ignored: every op starts once its rank is free and its inputs have arrived, a message
    taking ``message_time``; the timeline the papers draw, independent of where send/recv were placed).
    Raises ScheduleError with `pipec check`'s structure verdict on a structurally invalid program (under
    ``ideal``: invalid compute orders, the send/recv being ignored), and on a p2p order mismatch, a deadlock, or
    a compute op that runs before its input.
    """
    if p2p not in P2P_MODELS:
        raise PipecInputError(f"unknown p2p model {p2p!r}; expected one of {', '.join(P2P_MODELS)}")
    routing = program.routing_problem()
    if routing:
        raise PipecInputError(routing)

    def simulation() -> tuple[SimResult, bool]:
        placed = program
        if p2p != "ideal" and not program.has_comms:
            placed = fastest_placement(program, costs)  # placed for the costs simulated, as `pipec simulate` does
        return run_model(placed, costs, record, input_fraction, p2p)

    return checked(program, p2p, simulation)
