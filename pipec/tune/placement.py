"""Send/recv placed for a solved compute order under nccl (`pipec tune`'s exact phase, issue #23 item 3).

pipec.passes.p2p's timed replay posts every receive at the moment its message is made (the producer's end). Under
nccl a receive is posted when its rank's host reaches it, that is after the compute it follows in the stream: a
message made while the receiver computes is posted only when that compute ends, and the consumer then waits
`message_time` more (measured at P=4, M=8, F=1, I=2, W=1, comm=0.5, limit 4: 47 against the solver's 45.5). Two
steps close most of that (45.5 there; tests/tune/test_tune_placement.py):

- `ahead`: each send where the solver posts it (`cpsat.SolverResult.timing`: without overlap a post holds the
  host, and the solver may post after a later compute); each receive before the first compute of its rank that
  ends after its send is posted, so its batch is already posted when the sender's starts (the pair completes at
  the later start plus message_time); then, while a receive shares its batch with the receive of the compute
  right after and its message comes later than that compute starts (a compute waits for its whole batch), it
  moves one compute later (`_spread`); each channel's receives keep its sends' order on both sides;
- `improve_placement`: local moves on where the sends and receives sit (one swapped with a neighbouring compute,
  which changes which batch it joins and when it is posted, never the order of the messages on a channel), kept
  when the nccl makespan, then the sum of the compute ends, decreases; the simulator is the judge, and the caller
  verifies what it keeps (a move can make a deadlock, which the simulator refuses).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from itertools import pairwise

from pipec.errors import PipecError
from pipec.ir import Action, Instruction, Kind, Program
from pipec.p2p_rule import counterpart, message_id, send_for
from pipec.sim.costs import Costs
from pipec.sim.simulate import simulate
from pipec.tune.clock import PLACEMENT_SECONDS_PER_OP, Clock, simulation_seconds
from pipec.tune.cpsat import model_times

_EPSILON = 1e-9


def ahead(
    orders: Program, costs: Costs, timing: Mapping[Action, tuple[float, float | None]] | None = None
) -> Program | None:
    """The compute-only `orders` with send/recv placed as the module docstring says (None: the order cannot run).
    `timing`: per compute op its start and when its send is posted, as the solver timed them (cpsat.SolverResult);
    None: every op and post as early as the order allows. A solver may post a send after a later compute (the
    post holds the host without overlap), and the stream must say so: the sim posts a send where it sits."""
    times = model_times(orders, costs)
    if times is None:
        return None
    if timing is not None:
        if set(timing) != set(times):
            return None
        times = {op: (at, at + times[op][1] - times[op][0]) for op, (at, _) in timing.items()}
    n_mb = orders.microbatches
    where = orders.stage_to_rank
    delay = costs.message_time
    # per rank, its computes by start: a receive sits in slot j, after compute j - 1 and before compute j
    computes = [sorted(stream, key=lambda op: times[op][0]) for stream in orders.streams]
    index_of = [{op: j for j, op in enumerate(mine)} for mine in computes]
    ends = [[times[op][1] for op in mine] for mine in computes]
    items: list[list[tuple[tuple[float, ...], Instruction]]] = [[] for _ in orders.streams]
    # per receiving rank, [slot, posted, ident, receive, consumer's slot]; per channel, its receives in send order
    receives: list[list[list]] = [[] for _ in orders.streams]
    channels: dict[tuple[int, int], list[list]] = {}
    for rank, stream in enumerate(orders.streams):
        for index, action in enumerate(stream):
            start, end = times[action]
            items[rank].append(((start, 1, index, 0), action))
            send = send_for(action)
            if send is None or not 0 <= send.stage + (1 if action.kind is Kind.F else -1) < orders.num_stages:
                continue
            receive = counterpart(send)
            peer = where[receive.stage]
            if peer == rank:
                continue
            ident = message_id(send, n_mb)
            if timing is not None and timing[action][1] is not None:
                end = timing[action][1]  # type: ignore[assignment]
            items[rank].append(((end, 0, end, ident), send))
            consumer = (
                Action(receive.stage, Kind.F, receive.mb)
                if receive.kind is Kind.RECV_F
                else Action(receive.stage, Kind.I, receive.mb)
            )
            # first, right after the receiver's last compute that ends by the time the send is posted: its batch
            # is posted before the sender's starts
            entry = [bisect.bisect_right(ends[peer], end + _EPSILON), end, ident, receive, index_of[peer][consumer]]
            receives[peer].append(entry)
            channels.setdefault((rank, peer), []).append(entry)
    for _ in range(3):
        moved = _spread(receives, computes, times, delay)
        for chain in channels.values():  # a channel's receives keep its sends' order
            chain.sort(key=lambda entry: (entry[1], entry[2]))
            for earlier, later in pairwise(chain):
                if later[0] < earlier[0]:
                    later[0], moved = earlier[0], True
        if not moved:
            break
    for rank, mine in enumerate(receives):
        for slot, posted, ident, receive, _ in mine:
            after = ends[rank][slot - 1] if slot else 0.0
            items[rank].append(((after, 0, posted, ident), receive))
    streams = tuple(tuple(instruction for _, instruction in sorted(mine, key=lambda item: item[0])) for mine in items)
    return orders.with_streams(streams, has_comms=True)


def _spread(receives: list[list[list]], computes: list[list[Action]], times, delay: float) -> bool:
    """Move a receive one slot later while it shares its batch with the receive of the compute right after and
    its message would arrive after that compute's start (the batch completes with its last op: the compute would
    wait for a message it does not need). Returns whether any moved."""
    moved = False
    for rank, mine in enumerate(receives):
        by_slot: dict[int, list[list]] = {}
        for entry in mine:
            by_slot.setdefault(entry[0], []).append(entry)
        for slot in sorted(by_slot):
            if slot >= len(computes[rank]):
                continue
            members = by_slot[slot]
            if not any(entry[4] == slot for entry in members):
                continue  # the compute after the batch consumes none of it: it does not wait for it
            begins = times[computes[rank][slot]][0]
            for entry in members:
                if entry[4] > slot and entry[1] + delay > begins + _EPSILON:
                    entry[0] = slot + 1
                    by_slot.setdefault(slot + 1, []).append(entry)
                    moved = True
    return moved


def nccl_score(program: Program, costs: Costs) -> tuple[float, float] | None:
    """(nccl makespan, the sum of the compute ends) of a placed program, or None when it does not run."""
    try:
        sim = simulate(program, costs, p2p="nccl", record=True)
    except PipecError:
        return None
    return sim.makespan, sum(op.end for line in sim.timeline for op in line if not op.is_comm)


def improve_placement(program: Program, costs: Costs, clock: Clock, deadline: float) -> tuple[Program, bool]:
    """First-improvement moves of single sends/receives past a neighbouring compute (module docstring), until none
    helps or `clock` passes `deadline`. Returns the placed program and whether no move helps (False:
    the deadline stopped it)."""
    best = nccl_score(program, costs)
    each = simulation_seconds(PLACEMENT_SECONDS_PER_OP, program)  # the clock's charge for one score
    clock.charge(each)
    if best is None:
        return program, True
    streams = [list(stream) for stream in program.streams]
    while True:
        improved = False
        for stream in streams:
            for i in range(len(stream) - 1):
                if clock.passed(deadline):
                    return program.with_streams(tuple(map(tuple, streams)), has_comms=True), False
                a, b = stream[i], stream[i + 1]
                if _is_comm(a) == _is_comm(b):
                    continue  # two computes, or two messages (their order on a channel is fixed)
                stream[i], stream[i + 1] = b, a
                score = nccl_score(program.with_streams(tuple(map(tuple, streams)), has_comms=True), costs)
                clock.charge(each)
                if score is not None and (
                    score[0] < best[0] - _EPSILON or (score[0] <= best[0] + _EPSILON and score[1] < best[1] - _EPSILON)
                ):
                    best, improved = score, True
                else:
                    stream[i], stream[i + 1] = a, b
        if not improved:
            return program.with_streams(tuple(map(tuple, streams)), has_comms=True), True


def _is_comm(instruction: Instruction) -> bool:
    return type(instruction) is Action and instruction.kind.is_comm


__all__ = ["ahead", "improve_placement", "nccl_score"]
