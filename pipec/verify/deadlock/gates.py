"""The gates of `streams_finish` (pipec.verify.deadlock.finish): the p2p rule's conditions folded per rank.

Every condition of the rule is a threshold on a monotone per-rank counter, and a rank's host passes its units in
order and (nccl) completes its batches in order, so the conditions fold into *gates*: per rank and per rank whose
counter it reads, a nondecreasing (item, threshold) array. The first item a gate holds up is one bisect, and the
arrays are filled by map/zip/accumulate (C loops).

`find_batches` finds each rank's batches and the batch each compute consumes from; `nccl_gates` or
`tagged_gates` build the model's gates; `add_local_waits` adds the few waits on a rank's own ops.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import accumulate, chain, repeat
from typing import NamedTuple

from pipec.verify.flat import RECV_B, RECV_F, SEND_F, B, F, Flat, I, W, counterpart_shift, receive_shift

# A gate: (rank q whose counter it reads, items, thresholds). Items and thresholds are nondecreasing; the gate
# holds up every item from the first whose threshold q's counter has not reached. Which counter, and what the items
# are, depends on the list the gate is in (`Gates`).
Gate = tuple[int, list[int], list[int]]
NEVER = 1 << 62  # above every item and every counter: "never", and the sentinel that ends every gate


def gate(rank: int, events: list[tuple[int, int]]) -> Gate:
    """(item, threshold) events in item order -> a sealed gate: the items and the running maximum of the
    thresholds (an item is held up by its own threshold and by those of the items before it)."""
    return sealed(rank, [e[0] for e in events], list(accumulate([e[1] for e in events], max)))


def sealed(rank: int, items: list[int], thresholds: list[int]) -> Gate:
    """The gate with a sentinel at its end: a bisect for a counter below NEVER then always lands on an item."""
    items.append(NEVER)
    thresholds.append(NEVER)
    return rank, items, thresholds


class Batches(NamedTuple):
    """Where each rank's batches are, and which of them its computes consume from."""

    ends: list[int]  # per rank, its number of units: where its host stands at the end of its stream
    comm_ops: list[list[int]]  # per rank, the op indices of its send/recv ops
    units: list[list[int]]  # per rank, the unit of each batch, in stream order
    of_op: list[list[int]]  # per rank, op index -> its batch (-1 for a compute)
    # per rank, (unit, batch) for each compute and the batch holding a receive it consumes (earlier on its rank)
    needs: list[list[tuple[int, int]]]


@dataclass
class Gates:
    """The rule's conditions per rank.

    `host`: what holds up the host; items are units. Under tagged, one gate per rank q it waits for, reading q's
    host position (the send a receive needs is posted); under nccl a single gate on the rank's own completed
    batches (a compute waits until its batch completed, and batches complete in order). `batch` (nccl only): one
    gate per peer, items are the rank's batches, reading the peer's started batches (an op completes once its
    counterpart's batch runs). `local`: per rank, (unit, [(q, threshold unit)]) in unit order, the few waits on a
    rank's own ops or on a compute of another rank (Flat.local), checked one by one.
    """

    host: list[list[Gate]]
    batch: list[list[Gate]]
    dead: list[int]  # nccl: the first batch that never completes; tagged: the first unit that never runs
    tagged_dead: list[bool]  # tagged: some batch never completes (the end of the step waits for it)
    depends: list[set[int]]  # rank -> the ranks whose counters its gates read
    local: list[list[tuple[int, list[tuple[int, int]]]]]

    @classmethod
    def empty(cls, ranks: int) -> Gates:
        return cls(
            [[] for _ in range(ranks)], [[] for _ in range(ranks)], [NEVER] * ranks, [False] * ranks,
            [set() for _ in range(ranks)], [[] for _ in range(ranks)],
        )


def find_batches(flat: Flat) -> Batches:
    """Each rank's batches (the units holding send/recv ops) and, per compute, the batch it consumes from."""
    starts, unit_of, where = flat.starts, flat.unit_of, flat.where
    ops_keys = flat.ops
    ranks = len(starts)
    ends = [len(s) - 1 for s in starts]
    comm_ops = [[i for i, k in ops if k & 7 >= SEND_F] for ops in ops_keys]
    # a batch is a unit holding send/recv ops: the units of those ops, each once, in order
    batch_units = [list(dict.fromkeys(map(uo.__getitem__, c))) for uo, c in zip(unit_of, comm_ops, strict=True)]
    batch_of_op = []
    for rank in range(ranks):
        of_unit = [-1] * (ends[rank] + 1)
        deque(map(of_unit.__setitem__, batch_units[rank], range(len(batch_units[rank]))), maxlen=0)  # a C loop
        batch_of_op.append(list(map(of_unit.__getitem__, unit_of[rank])))
    needs: list[list[tuple[int, int]]] = []
    feeds = (receive_shift(F), receive_shift(B), receive_shift(I))  # by code
    for rank, ops in enumerate(ops_keys):
        computes = [(i, k) for i, k in ops if k & 7 < W]  # F, B, I
        hits = map(where.get, [k + feeds[k & 7] for _, k in computes])  # the receive that feeds it
        rank_starts, rank_unit_of, rank_batch = starts[rank], unit_of[rank], batch_of_op[rank]
        needs.append(
            [
                (rank_unit_of[i], rank_batch[hit[1]])
                for (i, _), hit in zip(computes, hits, strict=True)
                if hit is not None and hit[0] == rank and hit[1] < rank_starts[rank_unit_of[i]]
            ]
        )
    return Batches(ends, comm_ops, batch_units, batch_of_op, needs)


def nccl_gates(flat: Flat, batches: Batches) -> Gates:
    """nccl and torch: the k-th send on a channel meets its k-th receive; each one's batch completes only once the
    other one's batch has started. An op its channel never matches holds its batch (and every later one) forever."""
    ranks = len(batches.ends)
    gates = Gates.empty(ranks)
    batch_of_op, depends = batches.of_op, gates.depends
    matched = [bytearray(len(s)) for s in flat.unit_of]
    toward: dict[tuple[int, int], list[tuple[list[int], list[int]]]] = {}  # (rank, peer) -> (items, thresholds)
    for (src, dst), (sends, recvs) in flat.channels.items():
        k = min(len(sends), len(recvs))
        if not k:
            continue
        send_ops, recv_ops = [i for i, _ in sends[:k]], [j for j, _ in recvs[:k]]
        deque(map(matched[src].__setitem__, send_ops, repeat(1, k)), maxlen=0)
        deque(map(matched[dst].__setitem__, recv_ops, repeat(1, k)), maxlen=0)
        send_batches = list(map(batch_of_op[src].__getitem__, send_ops))
        recv_batches = list(map(batch_of_op[dst].__getitem__, recv_ops))
        # the k-th send's batch waits for the k-th receive's batch to start, and the other way round; both lists
        # follow their streams, so items and thresholds are already nondecreasing
        toward.setdefault((src, dst), []).append((send_batches, [b + 1 for b in recv_batches]))
        toward.setdefault((dst, src), []).append((recv_batches, [b + 1 for b in send_batches]))
        depends[src].add(dst)
        depends[dst].add(src)
    for (rank, q), found in toward.items():  # one gate per peer: its sends and receives merged by batch
        if len(found) == 1:
            (items, thresholds), = found
        else:
            merged = sorted(zip(chain(*(f[0] for f in found)), chain(*(f[1] for f in found)), strict=True))
            items, thresholds = [e[0] for e in merged], list(accumulate([e[1] for e in merged], max))
        gates.batch[rank].append(sealed(q, items, thresholds))
    for rank in range(ranks):
        # an op its channel never matches (or on no channel at all): its batch never completes
        unmatched = next((i for i in batches.comm_ops[rank] if not matched[rank][i]), None)
        if unmatched is not None:
            gates.dead[rank] = batch_of_op[rank][unmatched]
        # batches complete in order, so a compute waits until `done` passes the batch it needs
        gates.host[rank].append(gate(rank, [(u, b + 1) for u, b in batches.needs[rank]]))
    return gates


def tagged_gates(flat: Flat, batches: Batches) -> Gates:
    """tagged: a receive completes once the send of its message is posted, so a compute waits for the sender's
    host to pass that send. A receive whose message no stream sends never completes."""
    ranks = len(batches.ends)
    gates = Gates.empty(ranks)
    where, unit_of = flat.where, flat.unit_of
    to_send_f, to_send_b = counterpart_shift(RECV_F, flat.mbs), counterpart_shift(RECV_B, flat.mbs)
    conditions: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(ranks)]  # batch -> (q, threshold)
    for (_, dst), (_, recvs) in flat.channels.items():
        rank_conditions, rank_batch = conditions[dst], batches.of_op[dst]
        for j, key in recvs:  # the key of the send of the same message: the stage before (RECV_F) or after
            hit = where.get(key + (to_send_f if key & 7 == RECV_F else to_send_b))
            batch = rank_batch[j]
            if hit is None:
                gates.tagged_dead[dst] = True
                rank_conditions.setdefault(batch, []).append((-1, NEVER))
            else:
                rank_conditions.setdefault(batch, []).append((hit[0], unit_of[hit[0]][hit[1]] + 1))
    for rank in range(ranks):
        events: dict[int, list[tuple[int, int]]] = {}
        rank_conditions = conditions[rank]
        for unit, batch in batches.needs[rank]:
            for q, threshold in rank_conditions.get(batch, ()):
                if q < 0:
                    gates.dead[rank] = min(gates.dead[rank], unit)
                else:
                    events.setdefault(q, []).append((unit, threshold))
        for q, found in events.items():
            gates.host[rank].append(gate(q, found))
            if q != rank:
                gates.depends[rank].add(q)
    return gates


def add_local_waits(flat: Flat, gates: Gates) -> None:
    """The waits the gates leave out: an op waiting for one of its own rank's ops (out of order) or for a compute
    on another rank. Flat.local lists them; they are few, so the host checks them one by one."""
    where, unit_of, local, depends = flat.where, flat.unit_of, gates.local, gates.depends
    for rank, index, need in flat.local:
        hit = next((where[k] for k in need if k in where), None)
        if hit is not None:
            q, j = hit
            unit = unit_of[rank][index]
            if not local[rank] or local[rank][-1][0] != unit:
                local[rank].append((unit, []))
            local[rank][-1][1].append((q, unit_of[q][j] + 1))
            if q != rank:
                depends[rank].add(q)
    for rank_waits in local:
        rank_waits.sort(key=lambda w: w[0])
