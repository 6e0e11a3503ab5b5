"""run_streams: a program with send/recv run under the p2p rule (pipec.verify.deadlock.rule), op by op.

State per rank: the host's unit (computes run, batches posted) and which batches completed. Every condition is
monotone ("rank q's host passed unit u", "rank q completed k batches"), so the run's end point is unique; a
worklist with per-rank heaps of sleeping waiters finds it in time linear in the ops (times a log). The run records
a lockstep timing (for the explanation's grid) and why each stuck rank waits (`Blocked`).

The steps: `_plan` (what the run reads: batches, each op's partner, each compute's batches, the local waits),
`_State` (the counters, which only grow), `_batch_completer` (complete a batch once its partners run) and
`_host_mover` (move a rank as far as it goes), driven by `run_streams`; `_blocked_reason` reads the final state.
The two movers are closures over the plan and the state, so the run's inner loops read them as cell variables, as
they did when the run was one function.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from pipec.ir import Program
from pipec.passes.sync import member_ranks
from pipec.verify.deadlock.rule import IN_ORDER, check_model, flat_for
from pipec.verify.deadlock.runs import Blocked, StreamRun, Wait, cut_units
from pipec.verify.flat import RECV_B, RECV_F, SEND_F, B, F, Flat, I, W, counterpart_shift, receive_shift


class _Plan(NamedTuple):
    """What the run reads, fixed before it starts (per rank)."""

    starts: tuple[tuple[int, ...], ...]  # op index where each unit starts, plus len(stream)
    unit_of: tuple[list[int], ...]  # op index -> unit
    ends: list[int]  # the number of units: where the host stands at the end of the stream
    batch_units: list[list[int]]  # the unit of each batch (a unit whose first op is a send/recv)
    batch_of_unit: list[dict[int, int]]  # unit -> its batch, for the batches
    # send/recv op -> what it waits for: nccl its channel partner (rank, op) whose batch must be running; tagged,
    # for a receive, the send of its message (rank, op) that must be posted. (-1, -1): nothing ever will be
    partner: list[dict[int, tuple[int, int]]]
    needs: list[dict[int, list[int]]]  # compute unit -> the batches holding the receives it consumes
    local: list[dict[int, list[Wait]]]  # unit -> its waits on an op of its own rank or a compute of another
    # SYNC unit -> per member rank q of its group (itself included): (q, the unit of q's matching SYNC (-1: q has
    # none), q's batches before it, its op index). The k-th SYNC of a group on each member matches the k-th on
    # the others; it passes once every member's host stands at its match and (in order) has completed the batches
    # before it: the collective is queued on the rank's one stream and blocks the host until all members join.
    syncs: list[dict[int, list[tuple[int, int, int, int]]]]


def _plan(flat: Flat, nccl: bool) -> _Plan:
    starts, unit_of = flat.starts, flat.unit_of
    ends = [len(s) - 1 for s in starts]
    batch_units, batch_of_unit = _batches(flat, ends)
    return _Plan(
        starts, unit_of, ends, batch_units, batch_of_unit, _partners(flat, nccl), _needs(flat, batch_of_unit),
        _local_waits(flat), _sync_waits(flat, batch_units),
    )


def _sync_waits(flat: Flat, batch_units: list[list[int]]) -> list[dict[int, list[tuple[int, int, int, int]]]]:
    """Per rank, per SYNC unit: what it waits for (`_Plan.syncs`)."""
    out: list[dict[int, list[tuple[int, int, int, int]]]] = [{} for _ in flat.starts]
    if not any(flat.syncs):
        return out
    program, unit_of = flat.program, flat.unit_of
    issued: dict[int, dict[int, list[int]]] = {}  # group -> rank -> its SYNC op indices in order
    for rank, rank_syncs in enumerate(flat.syncs):
        for index, _, group in rank_syncs:
            issued.setdefault(group, {}).setdefault(rank, []).append(index)
    for group, by_rank in issued.items():
        known = 0 <= group < len(program.sync_groups)
        members = member_ranks(program.sync_groups[group], program.stage_to_rank) if known else ()
        members = tuple(sorted(set(members) | set(by_rank)))
        for rank, indices in by_rank.items():
            for k, index in enumerate(indices):
                waits = []
                for q in members:
                    theirs = by_rank.get(q, ())
                    if k < len(theirs):
                        unit = unit_of[q][theirs[k]]
                        waits.append((q, unit, bisect_left(batch_units[q], unit), theirs[k]))
                    else:
                        waits.append((q, -1, 0, -1))
                out[rank][unit_of[rank][index]] = waits
    return out


def _batches(flat: Flat, ends: list[int]) -> tuple[list[list[int]], list[dict[int, int]]]:
    """Per rank, the units whose first op is a send/recv, and each one's index among them."""
    batch_units: list[list[int]] = []
    batch_of_unit: list[dict[int, int]] = []
    for rank, rank_ops in enumerate(flat.ops):
        rank_starts = flat.starts[rank]
        comm = bytearray(rank_starts[-1])
        for index, key in rank_ops:
            if key & 7 >= SEND_F:
                comm[index] = 1
        found = [u for u in range(ends[rank]) if comm[rank_starts[u]]]
        batch_units.append(found)
        batch_of_unit.append({u: b for b, u in enumerate(found)})
    return batch_units, batch_of_unit


def _partners(flat: Flat, nccl: bool) -> list[dict[int, tuple[int, int]]]:
    """What each send/recv op waits for (`_Plan.partner`)."""
    partner: list[dict[int, tuple[int, int]]] = [{} for _ in flat.starts]
    where = flat.where
    to_send_f, to_send_b = counterpart_shift(RECV_F, flat.mbs), counterpart_shift(RECV_B, flat.mbs)
    for (src, dst), (sends, recvs) in flat.channels.items():
        if nccl:
            for (i, _), (j, _) in zip(sends, recvs, strict=False):
                partner[src][i] = (dst, j)
                partner[dst][j] = (src, i)
        else:
            for j, key in recvs:  # the key of the send of its message: the stage before (RECV_F) or after
                hit = where.get(key + (to_send_f if key & 7 == RECV_F else to_send_b))
                partner[dst][j] = hit if hit is not None else (-1, -1)
    return partner


def _needs(flat: Flat, batch_of_unit: list[dict[int, int]]) -> list[dict[int, list[int]]]:
    """Per rank, per compute unit: the batches holding the receives it consumes (those before it in the stream)."""
    starts, unit_of, where = flat.starts, flat.unit_of, flat.where
    needs: list[dict[int, list[int]]] = [{} for _ in starts]
    feeds = (receive_shift(F), receive_shift(B), receive_shift(I))  # by code: F, B, I read a message; W does not
    for rank, rank_ops in enumerate(flat.ops):
        rank_needs, rank_starts, rank_unit_of = needs[rank], starts[rank], unit_of[rank]
        for index, key in rank_ops:
            code = key & 7
            if code >= W:
                continue
            hit = where.get(key + feeds[code])
            unit = rank_unit_of[index]
            if hit is not None and hit[0] == rank and hit[1] < rank_starts[unit]:
                rank_needs.setdefault(unit, []).append(batch_of_unit[rank][rank_unit_of[hit[1]]])
    return needs


def _local_waits(flat: Flat) -> list[dict[int, list[Wait]]]:
    """Per rank, per unit: the waits Flat.local lists, as (q, threshold unit, op j on q, waiting op)."""
    where, unit_of = flat.where, flat.unit_of
    local: list[dict[int, list[Wait]]] = [{} for _ in flat.starts]
    for rank, index, need in flat.local:
        hit = next((where[k] for k in need if k in where), None)
        if hit is not None:
            q, j = hit
            local[rank].setdefault(unit_of[rank][index], []).append((q, unit_of[q][j] + 1, j, index))
    return local


class _State(NamedTuple):
    """The run's counters, per rank; each only grows."""

    position: list[int]  # the host's unit
    done: list[int]  # nccl: batches completed, in order
    complete: list[bytearray]  # per batch
    cursor: list[list[int]]  # per batch, the next op of it to check
    tail: list[int]  # the first batch not known complete (tagged end of step)
    finish: list[list[int]]  # the step at which the host got past each unit
    b_start: list[list[int]]  # per batch, the step it started at
    b_done: list[list[int]]  # per batch, the step it completed at
    on_position: list[list[tuple[int, int]]]  # heap of (threshold on the host's unit, waiting rank)
    on_done: list[list[tuple[int, int]]]  # heap of (threshold on the completed batches, waiting rank)

    @classmethod
    def zero(cls, plan: _Plan) -> _State:
        starts, batch_units = plan.starts, plan.batch_units
        ranks = len(starts)
        return cls(
            [0] * ranks, [0] * ranks, [bytearray(len(b)) for b in batch_units],
            [[starts[r][u] for u in batch_units[r]] for r in range(ranks)], [0] * ranks, [[] for _ in range(ranks)],
            [[0] * len(b) for b in batch_units], [[0] * len(b) for b in batch_units],
            [[] for _ in range(ranks)], [[] for _ in range(ranks)],
        )


def run_streams(program: Program, model: str = "nccl", flat: Flat | None = None) -> StreamRun:
    """Run a program with send/recv under the p2p rule (docs/verification.md) to the point where nothing moves."""
    check_model(model)
    flat = flat_for(program, model, flat)
    nccl = model in IN_ORDER  # nccl and torch: batches in posting order, channels in issue order
    plan = _plan(flat, nccl)
    state = _State.zero(plan)
    move = _host_mover(plan, state, nccl, _batch_completer(plan, state, nccl))
    on_position, on_done, position, done = state.on_position, state.on_done, state.position, state.done
    ranks = len(plan.starts)
    ready = deque(range(ranks))
    queued = [True] * ranks  # a rank sits in `ready` at most once (a woken rank may have several sleepers)
    while ready:
        rank = ready.popleft()
        queued[rank] = False
        move(rank)
        for heap, level in ((on_position[rank], position[rank]), (on_done[rank], done[rank])):
            while heap and heap[0][0] <= level:
                woken = heapq.heappop(heap)[1]
                if not queued[woken]:
                    queued[woken] = True
                    ready.append(woken)
    blocked = {
        rank: _blocked_reason(rank, plan, state, nccl)
        for rank in range(ranks)
        if position[rank] < plan.ends[rank] or not all(state.complete[rank])
    }
    return StreamRun(
        model, cut_units(flat), tuple(position), tuple(tuple(b) for b in plan.batch_units),
        tuple(tuple(bool(x) for x in c) for c in state.complete), blocked, tuple(tuple(f) for f in state.finish),
    )


def _batch_completer(plan: _Plan, state: _State, nccl: bool) -> Callable[[int, int], bool]:
    """try_batch(rank, batch): complete the batch if it can (its start known, its partners running or posted);
    registers a sleeper on what it waits for when it cannot."""
    starts, unit_of, batch_units, batch_of_unit, partner = (
        plan.starts, plan.unit_of, plan.batch_units, plan.batch_of_unit, plan.partner
    )
    position, done, complete, cursor, _, finish, b_start, b_done, on_position, on_done = state

    def started(q: int, batch: int) -> int:
        """-1 if batch `batch` of rank q is not running yet, else the step it started at."""
        if position[q] <= batch_units[q][batch]:
            return -1
        if nccl and done[q] < batch:
            return -1
        return b_start[q][batch]

    def wait_start(q: int, batch: int, rank: int) -> None:
        if position[q] <= batch_units[q][batch]:
            heapq.heappush(on_position[q], (batch_units[q][batch] + 1, rank))
        else:
            heapq.heappush(on_done[q], (batch, rank))

    def try_batch(rank: int, batch: int) -> bool:
        if complete[rank][batch]:
            return True
        if started(rank, batch) < 0:
            return False
        k, end = cursor[rank][batch], starts[rank][batch_units[rank][batch] + 1]
        when = b_start[rank][batch]
        rank_partner = partner[rank]
        while k < end:
            hit = rank_partner.get(k)
            if hit is None:  # nccl: an op its channel never matches; tagged: a send (complete when posted)
                if nccl:
                    return False
                k += 1
                continue
            q, j = hit
            if q < 0:
                return False
            peer_batch = batch_of_unit[q][unit_of[q][j]]
            if nccl:
                at = started(q, peer_batch)
                if at < 0:
                    wait_start(q, peer_batch, rank)
                    cursor[rank][batch] = k
                    return False
            else:
                if position[q] <= unit_of[q][j]:
                    heapq.heappush(on_position[q], (unit_of[q][j] + 1, rank))
                    cursor[rank][batch] = k
                    return False
                at = finish[q][unit_of[q][j]]
            when = max(when, at + 1)
            k += 1
        cursor[rank][batch] = k
        complete[rank][batch] = 1
        b_done[rank][batch] = when
        return True

    return try_batch


def _host_mover(
    plan: _Plan, state: _State, nccl: bool, try_batch: Callable[[int, int], bool]
) -> Callable[[int], None]:
    """move(rank): the host passes its units up to the first that waits (posting never blocks; a compute waits for
    the batches of its receives, a local wait for its op), then the batches complete (nccl: in order; tagged: all
    of them at the end of the step); again while anything moved."""
    starts, ends, batch_units, batch_of_unit, needs, local, syncs = (
        plan.starts, plan.ends, plan.batch_units, plan.batch_of_unit, plan.needs, plan.local, plan.syncs
    )
    position, done, complete, _, tail, finish, b_start, b_done, on_position, on_done = state

    def move(rank: int) -> None:
        rank_starts, rank_needs, rank_local, fin = starts[rank], needs[rank], local[rank], finish[rank]
        rank_syncs = syncs[rank]
        moved = True
        while moved:
            moved = False
            unit = position[rank]
            while unit < ends[rank]:  # the host
                stop = False
                if rank_syncs and unit in rank_syncs:  # a collective: every member there, its batches before done
                    arrive = 0
                    for q, their_unit, their_batches, _ in rank_syncs[unit]:
                        if their_unit < 0:
                            stop = True
                        elif position[q] < their_unit:
                            heapq.heappush(on_position[q], (their_unit, rank))
                            stop = True
                        elif nccl and done[q] < their_batches:
                            heapq.heappush(on_done[q], (their_batches, rank))
                            stop = True
                        if stop:
                            break
                        arrive = max(arrive, finish[q][their_unit - 1] if their_unit else 0)
                        if nccl and their_batches:
                            arrive = max(arrive, b_done[q][their_batches - 1])
                    if stop:
                        break
                    fin.append(arrive + 1)
                    unit += 1
                    position[rank] = unit
                    moved = True
                    continue
                for q, threshold, _, _ in rank_local.get(unit, ()):
                    if (unit if q == rank else position[q]) < threshold:
                        if q != rank:
                            heapq.heappush(on_position[q], (threshold, rank))
                        stop = True
                        break
                if stop:
                    break
                arrive = (fin[-1] if fin else 0) + rank_starts[unit + 1] - rank_starts[unit]
                batch = batch_of_unit[rank].get(unit)
                if batch is not None:  # posting never blocks; the batch starts once the one before completed
                    position[rank] = unit + 1
                    b_start[rank][batch] = max(arrive - 1, b_done[rank][batch - 1] if nccl and batch else 0)
                else:
                    for needed in rank_needs.get(unit, ()):
                        if not complete[rank][needed] and not try_batch(rank, needed):
                            stop = True
                            break
                        arrive = max(arrive, b_done[rank][needed] + 1)
                    if stop:
                        break
                fin.append(arrive)
                unit += 1
                position[rank] = unit
                moved = True
            if nccl:  # complete batches in order
                while done[rank] < len(batch_units[rank]) and try_batch(rank, done[rank]):
                    done[rank] += 1
                    if done[rank] < len(batch_units[rank]) and position[rank] > batch_units[rank][done[rank]]:
                        nxt = done[rank]
                        b_start[rank][nxt] = max(b_start[rank][nxt], b_done[rank][nxt - 1])
                    moved = True
            elif unit == ends[rank]:  # the end of the step: every batch
                while tail[rank] < len(batch_units[rank]) and try_batch(rank, tail[rank]):
                    tail[rank] += 1

    return move


def _blocked_reason(rank: int, plan: _Plan, state: _State, nccl: bool) -> Blocked:
    """The first reason rank `rank` cannot finish, read off the final state of the run."""
    starts, unit_of, batch_units, batch_of_unit, partner = (
        plan.starts, plan.unit_of, plan.batch_units, plan.batch_of_unit, plan.partner
    )
    position, done, complete = state.position, state.done, state.complete
    unit = position[rank]
    at = starts[rank][unit]
    if unit < plan.ends[rank] and unit in plan.syncs[rank]:
        for q, their_unit, their_batches, j in plan.syncs[rank][unit]:
            if their_unit < 0:
                return Blocked(rank, at, "sync", -1, -1, at, q, -1, "none")
            if position[q] < their_unit:
                return Blocked(rank, at, "sync", -1, -1, at, q, j, "posted")
            if nccl and done[q] < their_batches and q != rank:
                return Blocked(rank, at, "sync", -1, -1, at, q, j, "queued")
            if nccl and done[q] < their_batches:
                break  # its own earlier batch never completes: read below like a compute waiting for it
        batch = done[rank]
        state_name = "sync"
    elif unit < plan.ends[rank]:
        for q, threshold, j, i in plan.local[rank].get(unit, ()):
            if (unit if q == rank else position[q]) < threshold:
                return Blocked(rank, at, "local", -1, -1, i, q, j, "later" if q == rank else "run")
        batch = next(b for b in plan.needs[rank].get(unit, ()) if not complete[rank][b])
        state_name = "compute"
    else:
        batch = next(b for b, c in enumerate(complete[rank]) if not c)
        state_name = "end"
    # nccl: a rank's batches run one after another, so the earliest incomplete one holds up every later one
    blocking = done[rank] if nccl and done[rank] < batch else batch
    behind = blocking if blocking != batch else -1
    lo, hi = starts[rank][batch_units[rank][blocking]], starts[rank][batch_units[rank][blocking] + 1]
    for k in range(lo, hi):
        hit = partner[rank].get(k)
        if hit is None:
            if nccl:
                return Blocked(rank, at, state_name, batch, behind, k, -1, -1, "none")
            continue
        q, j = hit
        if q < 0:
            return Blocked(rank, at, state_name, batch, behind, k, -1, -1, "none")
        peer_unit = unit_of[q][j]
        if position[q] <= peer_unit:
            return Blocked(rank, at, state_name, batch, behind, k, q, j, "posted")
        if nccl and done[q] < batch_of_unit[q][peer_unit]:
            return Blocked(rank, at, state_name, batch, behind, k, q, j, "queued")
    raise AssertionError("a stuck batch with every counterpart running")  # pragma: no cover
