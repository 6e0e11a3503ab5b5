"""waits: why a simulated timeline is later than the schedule's compute order allows.

Under the nccl p2p rule (version 2) a rank can lose time to its batches in two ways the `ideal` model does not
have:
- *batch*: a compute op waits for the whole batch holding its receive (rule 2), so a receive that arrived early
  still waits for another op of the same batch (often a receive needed only later, or a send whose receiver has
  not posted yet);
- *fifo*: a batch cannot start running before the rank's previous batch has completed (rule 4, one NCCL stream),
  so a send or receive posted in time is held behind an earlier batch that waits for a peer;
- *post* (only with message time): a transfer starts when both batches run, so a receive posted just before the
  op that needs it does not hide the message time the ideal model hides behind the receiver's previous work.
``find_waits`` lists every such wait of a recorded nccl result (``simulate(..., record=True)``), earliest first,
naming the rank, the op or batch that waits, and the op (and peer rank) it waits for. A SYNC (a collective, on the
timeline as a batch of its one op) is no p2p wait: its time is the sync cost and the wait for the last member, and
the walk back along the critical path stops at one.
"""

from __future__ import annotations

from typing import NamedTuple

from pipec.ir import Action, Kind
from pipec.p2p_rule import SENDS, receive_for

_EPS = 1e-9


class Wait(NamedTuple):
    time: float  # when the waiting op or batch could have started
    until: float  # when it did
    rank: int
    kind: str  # "batch", "fifo" or "post"
    text: str


def _is_sync(op) -> bool:
    """A timed SYNC (recorded as a batch of its one op)."""
    return op.is_comm and len(op.instruction) == 1 and op.instruction[0].kind is Kind.SYNC


def _names(actions) -> str:
    return " ".join(map(str, actions))


def find_waits(result) -> list[Wait]:
    """Every wait of a recorded result that the compute order alone would not have (see the module doc)."""
    program = result.program
    if not program.has_comms or not result.timeline:
        return []
    costs = result.costs
    post_cost = 0.0 if costs.overlap else costs.message_time
    arrival: dict[tuple[int, Action], tuple[float, int]] = {}  # (rank, op) -> (completion, peer)
    for m in result.messages:
        arrival[(m.dst, m.recv)] = (m.end, m.src)
        arrival[(m.src, m.send)] = (m.end, m.dst)
    waits: list[Wait] = []
    for rank, line in enumerate(result.timeline):
        compute = iter(op for op in line if not op.is_comm)
        batches = iter(op for op in line if op.is_comm and not _is_sync(op))
        syncs = iter(op for op in line if _is_sync(op))
        batch_of: dict[Action, object] = {}
        stream = program.streams[rank]
        host = 0.0
        previous = None
        pos = 0
        while pos < len(stream):
            instruction = stream[pos]
            if type(instruction) is Action and instruction.kind is Kind.SYNC:
                host = next(syncs).end
                pos += 1
                continue
            if type(instruction) is Action and instruction.kind.is_comm:
                batch = next(batches)
                pos += len(batch.instruction)
                for action in batch.instruction:
                    batch_of[action] = batch
                if previous is not None and batch.start > host + _EPS:
                    last = _latest(previous.instruction, rank, arrival)
                    end, peer = arrival[(rank, last)]
                    waits.append(
                        Wait(
                            host,
                            batch.start,
                            rank,
                            "fifo",
                            f"rank {rank}: batch [{_names(batch.instruction)}] posted at {host:g} starts at "
                            f"{batch.start:g}, behind [{_names(previous.instruction)}], whose {last} completes at "
                            f"{end:g} (rank {peer})",
                        )
                    )
                host += post_cost * sum(1 for a in batch.instruction if a.kind in SENDS)
                previous = batch
                continue
            op = next(compute)
            pos += 1
            ready, needed = host, None
            for action in op.instruction.parts:
                recv = receive_for(action)
                if recv in batch_of and (rank, recv) in arrival:
                    needed = recv
                    ready = max(ready, arrival[(rank, recv)][0])
            if needed is not None and op.start > ready + _EPS:
                batch = batch_of[needed]
                last = _latest(batch.instruction, rank, arrival)
                end, peer = arrival[(rank, last)]
                waits.append(
                    Wait(
                        ready,
                        op.start,
                        rank,
                        "batch",
                        f"rank {rank}: {op.instruction} could start at {ready:g} ({needed} done) but waits until "
                        f"{op.start:g} for its batch [{_names(batch.instruction)}], whose {last} completes then "
                        f"(rank {peer})",
                    )
                )
            host = op.end
    waits.sort(key=lambda w: (w.time, w.rank))
    return waits


def _latest(actions, rank: int, arrival) -> Action:
    return max(actions, key=lambda a: arrival.get((rank, a), (-1.0, -1))[0])


def critical_waits(result) -> list[Wait]:
    """The waits on the critical path: walk back from the op that ends last, each time to what fixed its start
    (the rank's previous instruction, the batch it waited for, the peer batch that completed that batch, or the
    batch ahead on the same NCCL stream; on a tie between a receive's batch and its sender's, the sender's), and keep
    the steps that are batch, fifo or post waits, earliest first. An empty
    list on a result later than the compute order would mean the ideal model's makespan was never reachable."""
    program = result.program
    if not program.has_comms or not result.timeline:
        return []
    post_cost = 0.0 if result.costs.overlap else result.costs.message_time
    peer_of: dict[tuple[int, Action], tuple[int, Action, float]] = {}
    for m in result.messages:
        peer_of[(m.dst, m.recv)] = (m.src, m.send, m.end)
        peer_of[(m.src, m.send)] = (m.dst, m.recv, m.end)
    items, where, batch_of = _host_items(result, post_cost)
    last = max((item for mine in items for item in mine), key=lambda item: item[0].end, default=None)
    waits: list[Wait] = []
    # what to explain: ("start", op) for a compute op or a batch, ("end", batch), ("host", rank, index)
    node: tuple | None = (("end" if last[1] else "start"), last[0]) if last else None
    for _ in range(sum(len(mine) for mine in items) * 4 + 1):
        if node is None:
            break
        if node[0] == "host":  # when the host reached item index: the end of the instruction before it
            rank, index = node[1], node[2]
            node = (
                None
                if index == 0
                else ("start", items[rank][index - 1][0])
                if not items[rank][index - 1][1]
                else ("host", rank, index - 1)
            )
            continue
        op = node[1]
        if _is_sync(op):
            break  # what holds a collective is its last member: not a p2p wait of this rank
        rank, index = where[id(op)]
        _, is_batch, reached = items[rank][index]
        if node[0] == "end":  # a batch completes with its last op, when the later of the two batches started
            latest = _latest_done(op.instruction, rank, peer_of)
            peer, counterpart, _ = peer_of[(rank, latest)]
            other = batch_of[(peer, counterpart)]
            node = ("start", other if other.start > op.start + _EPS else op)
            continue
        if op.start <= reached + _EPS:
            node = ("host", rank, index)
            continue
        if is_batch:  # started after it was posted: held behind the rank's previous batch
            previous = next(items[rank][j][0] for j in range(index - 1, -1, -1) if items[rank][j][1])
            behind = _latest_done(previous.instruction, rank, peer_of)
            waits.append(
                Wait(
                    reached,
                    op.start,
                    rank,
                    "fifo",
                    f"rank {rank}: batch [{_names(op.instruction)}] posted at {reached:g} starts at {op.start:g}, "
                    f"behind [{_names(previous.instruction)}], whose {behind} completes then "
                    f"(rank {peer_of[(rank, behind)][0]})",
                )
            )
            node = ("end", previous)
            continue
        receives = (receive_for(a) for a in op.instruction.parts)
        needed = [(rank, recv) for recv in receives if recv is not None and (rank, recv) in batch_of]
        batch = max((batch_of[key] for key in needed), key=lambda b: b.end)
        data = max([reached] + [peer_of[key][2] for key in needed])
        if data < op.start - _EPS:
            latest = _latest_done(batch.instruction, rank, peer_of)
            waits.append(
                Wait(
                    data,
                    op.start,
                    rank,
                    "batch",
                    f"rank {rank}: {op.instruction} has its data at {data:g} but waits until {op.start:g} for its "
                    f"batch [{_names(batch.instruction)}], whose {latest} completes then "
                    f"(rank {peer_of[(rank, latest)][0]})",
                )
            )
            node = ("end", batch)
            continue
        # no wait beyond the data: follow the receive that arrived last (a data dependency, preferred over a tie
        # with another op of its batch)
        key = max(needed, key=lambda k: peer_of[k][2])
        own, other = batch_of[key], batch_of[peer_of[key][:2]]
        # the transfer started with the later of the two batches; on a tie follow the sender: this rank sat idle
        # waiting for the data, so its own host chain (the receive posted as it got there) explains nothing
        if other.start > own.start - _EPS:
            node = ("start", other)
            continue
        if own.start > other.start + _EPS and peer_of[key][2] > own.start + _EPS:
            # the transfer could only start once this rank had posted the receive: its time is not hidden
            waits.append(
                Wait(
                    other.start,
                    own.start,
                    rank,
                    "post",
                    f"rank {rank}: {key[1]} is posted (batch [{_names(own.instruction)}]) at {own.start:g}, after "
                    f"rank {peer_of[key][0]}'s {peer_of[key][1]} was running at {other.start:g}; {op.instruction} "
                    f"gets its data only at {peer_of[key][2]:g}",
                )
            )
        node = ("start", own)
    waits.reverse()
    return waits


def _host_items(result, post_cost: float) -> tuple[list[list[tuple]], dict[int, tuple[int, int]], dict]:
    """Per rank, the host's items in stream order: (op, is_batch, when the host reached it); where each op is
    (id(op) -> (rank, index in items[rank])); and the batch holding each (rank, send/recv action)."""
    items: list[list[tuple]] = []
    where: dict[int, tuple[int, int]] = {}
    batch_of: dict[tuple[int, Action], object] = {}
    for rank, line in enumerate(result.timeline):
        compute = iter(op for op in line if not op.is_comm)
        batches = iter(op for op in line if op.is_comm and not _is_sync(op))
        syncs = iter(op for op in line if _is_sync(op))
        stream, host, pos, mine = result.program.streams[rank], 0.0, 0, []
        while pos < len(stream):
            instruction = stream[pos]
            if type(instruction) is Action and instruction.kind is Kind.SYNC:
                op = next(syncs)
                mine.append((op, False, host))
                pos += 1
                host = op.end
            elif type(instruction) is Action and instruction.kind.is_comm:
                op = next(batches)
                mine.append((op, True, host))
                for action in op.instruction:
                    batch_of[(rank, action)] = op
                pos += len(op.instruction)
                host += post_cost * sum(1 for a in op.instruction if a.kind in SENDS)
            else:
                op = next(compute)
                mine.append((op, False, host))
                pos += 1
                host = op.end
            where[id(op)] = (rank, len(mine) - 1)
        items.append(mine)
    return items, where, batch_of


def _latest_done(actions, rank: int, peer_of) -> Action:
    return max(actions, key=lambda a: peer_of.get((rank, a), (0, a, -1.0))[2])
