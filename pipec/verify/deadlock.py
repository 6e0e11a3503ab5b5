"""check_deadlock: does every rank's stream run to the end under a point-to-point model?

The p2p execution rule (its version 2, shared with the runtime and the simulator, written out in
docs/verification.md):
- each rank runs its stream in order; a maximal run of consecutive SEND/RECV instructions is one *batch*, posted
  at once (one ``batch_isend_irecv``) without waiting; a batch holding a send of a value its rank computes only
  later is never posted;
- before a compute runs, the rank waits for the batches holding the receives it consumes (RECV_F(s, m) for
  F(s, m), RECV_B(s, m) for B/I(s, m)); its other inputs are computes of its own rank that must come earlier
  (F(s-1, m), F(s, m), the backward of (s+1, m), I(s, m) for W). At the end of the step it waits for every batch;
- ``nccl``: the k-th send from rank a to rank b meets the k-th receive on b from a; a rank's batches run in
  posting order (a batch starts once posted and once the previous one completed); an op completes once its
  counterpart's batch is running; a batch completes when all of its ops have;
- ``tagged``: sends complete when posted; a RECV completes once the SEND of the same message has been posted;
- ``torch``: torch's ``_PipelineScheduleRuntime`` (docs/torch.md): ``nccl`` with every SEND/RECV instruction a
  batch of its own (torch posts each action by itself), so a compute waits for exactly its receive and, the
  batches of a rank completing in order, for everything the rank posted before it.

Three engines find where the ranks stop. Every condition is monotone ("rank q's host got past unit u", "rank q
completed k batches"), so that point is unique and each engine reaches it by waking ranks until none can move:
- `run_compute_orders`: a program without send/recv (compute orders, as `pipec.load` gives them) run on its data
  dependencies: each compute waits for the computes it reads, wherever they run (a `ComputeRun`);
- `run_streams`: a program with send/recv run under the rule, op by op: per rank its host position and its
  completed batches, a worklist with per-rank heaps of sleeping waiters, time linear in the instructions (times a
  log). Its `StreamRun` records why each stuck rank waits (`Blocked`), which the explanation reads;
- `streams_finish`: only the verdict of `run_streams` (does every rank finish?), reached on per-rank *gates*
  (sorted threshold arrays built by C loops, bisected), about twice as fast.
`check_deadlock` decides with `streams_finish` (or an untimed `run_compute_orders`) and reruns the full engine
only to explain a deadlock: pipec.verify.explain follows the chain of waits to its cycle and draws the
step-by-rank grid around it.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate, chain, repeat
from typing import NamedTuple

from pipec.gcpause import without_cyclic_gc
from pipec.ir import Action, Kind, Program
from pipec.verify.flat import RECV_B, RECV_F, SEND_F, B, F, Flat, I, W, flatten

MODELS = ("nccl", "tagged", "torch")
# The models under which a rank's batches run in posting order (one NCCL stream) and a channel's k-th send meets
# its k-th receive; `tagged` is the other kind.
IN_ORDER = ("nccl", "torch")


def batched(model: str) -> bool:
    """Whether consecutive send/recv instructions form one batch (one unit) under `model`: pipec's runtime posts
    such a run with one batch_isend_irecv; torch's runtime posts every SEND/RECV action on its own."""
    return model != "torch"


def flat_for(program: Program, model: str, flat: Flat | None = None) -> Flat:
    """`flat` when its units are cut as `model` posts them, else the program flattened that way."""
    if flat is not None and flat.batched == batched(model):
        return flat
    with without_cyclic_gc():  # millions of small acyclic tuples: the collector would rescan them
        return flatten(program, batched=batched(model))


# A wait: (rank q, threshold T, op index j on q, op index i of the waiting op on its own rank). It holds once rank
# q's unit pointer is >= T. T is the unit of op j when we wait for j to be posted, that unit + 1 when we wait for
# j to complete.
Wait = tuple[int, int, int, int]


@dataclass(frozen=True)
class Units:
    """Each rank's stream cut into units: compute instructions and batches of consecutive send/recv ops."""

    starts: tuple[tuple[int, ...], ...]  # op index where each unit starts, plus a sentinel = len(stream)
    unit_of: tuple[list[int], ...]  # op index -> unit index

    def ops(self, rank: int, unit: int) -> range:
        return range(self.starts[rank][unit], self.starts[rank][unit + 1])


@dataclass(frozen=True)
class ComputeRun:
    """A run of compute orders (`run_compute_orders`): where each rank stopped (unit index; == number of units when
    it finished), the wait that holds each stuck rank, and when each unit finished."""

    model: str
    units: Units
    stop: tuple[int, ...]
    blocked: dict[int, Wait]  # stuck rank -> the first wait of its unit that never holds
    finish: tuple[tuple[int, ...], ...]  # step at which each executed unit completed (an ASAP lockstep timing)
    waits: tuple[tuple[tuple[Wait, ...], ...], ...]

    @property
    def stuck(self) -> list[int]:
        return [r for r, u in enumerate(self.stop) if u < len(self.units.starts[r]) - 1]


def cut_units(flat: Flat) -> Units:
    """The units flatten found (kept as a function: the explanation and the tests use Units)."""
    return Units(flat.starts, flat.unit_of)


def peer_of(action: Action, stage_to_rank: tuple[int, ...]) -> int:
    """The rank a SEND goes to or a RECV comes from."""
    stage, kind = action.stage, action.kind
    return stage_to_rank[stage + 1 if kind is Kind.SEND_F or kind is Kind.RECV_B else stage - 1]


def counterpart(action: Action) -> Action:
    """The op a send or receive pairs with by name: SEND_F(s, m) <-> RECV_F(s+1, m), SEND_B(s, m) <-> RECV_B(s-1, m)."""
    stage, kind, mb = action
    return {
        Kind.SEND_F: Action(stage + 1, Kind.RECV_F, mb),
        Kind.RECV_F: Action(stage - 1, Kind.SEND_F, mb),
        Kind.SEND_B: Action(stage - 1, Kind.RECV_B, mb),
        Kind.RECV_B: Action(stage + 1, Kind.SEND_B, mb),
    }[kind]


Channels = dict[tuple[int, int], tuple[list[tuple[int, int]], list[tuple[int, int]]]]


def channels(program: Program, flat: Flat) -> Channels:
    """(src, dst) -> ((op index, key) of src's sends to dst, (op index, key) of dst's receives from src), in order."""
    return flat.channels


def channel_matches(program: Program, flat: Flat) -> dict[tuple[int, int], tuple[int, int]]:
    """nccl matching: (rank, op index) of each send/recv -> (rank, op index) of the op it meets on its channel.

    The k-th send from a to b meets the k-th receive on b from a. Ops beyond the shorter list meet nothing.
    """
    matches: dict[tuple[int, int], tuple[int, int]] = {}
    for (src, dst), (sends, recvs) in channels(program, flat).items():
        for (i, _), (j, _) in zip(sends, recvs, strict=False):
            matches[(src, i)] = (dst, j)
            matches[(dst, j)] = (src, i)
    return matches


def _data_waits(program: Program, flat: Flat, units: Units) -> tuple[tuple[tuple[Wait, ...], ...], ...]:
    """The waits of every unit of compute orders that has any: F(s,m) waits for F(s-1,m), B/I(s,m) for F(s,m) and
    the backward of (s+1,m), W for I, wherever those run."""
    where, mbs = flat.where, flat.mbs
    last, step = program.num_stages - 1, mbs * 8
    unit_of = units.unit_of
    result = []
    for rank, ops in enumerate(flat.ops):
        starts = units.starts[rank]
        waits: dict[int, list[Wait]] = {}
        for index, key in ops:
            code = key & 7
            base = key - code
            stage = (key >> 3) // mbs
            if code == F:
                needs = (base - step + F,) if stage > 0 else ()
            elif code == B or code == I:
                gradient = base + step + B if base + step + B in where else base + step + I
                needs = (base + F, gradient) if stage < last else (base + F,)
            elif code == W:
                needs = (base + I,)
            else:
                needs = ()
            unit = unit_of[rank][index]
            for needed in needs:
                hit = where.get(needed)
                if hit is None:
                    continue
                q, j = hit
                if q == rank and j < starts[unit]:
                    continue  # computed earlier on this rank: always holds when the unit is reached
                waits.setdefault(unit, []).append((q, unit_of[q][j] + 1, j, index))
        rank_waits: list[tuple[Wait, ...]] = [()] * (len(starts) - 1)
        for unit, found in waits.items():
            rank_waits[unit] = tuple(found)
        result.append(tuple(rank_waits))
    return tuple(result)


def run_compute_orders(
    program: Program, model: str = "nccl", flat: Flat | None = None, timed: bool = True
) -> ComputeRun:
    """Run a program without send/recv on its data dependencies to the unique point where no rank can move.

    Without messages the models agree: `model` only names the run (the explanation's first line says it).
    `timed` also records the lockstep step at which each unit finishes (for the grid); the untimed run skips
    over units that wait for nothing, which is most of them. A program with send/recv is `run_streams`'s.
    """
    if model not in MODELS:
        raise ValueError(f"unknown p2p model {model!r}; expected one of {', '.join(MODELS)}")
    if program.has_comms:
        raise ValueError("run_compute_orders runs compute orders; a program with send/recv needs run_streams")
    flat = flat_for(program, model, flat)
    units = cut_units(flat)
    waits = _data_waits(program, flat, units)
    ranks = len(program.streams)
    position = [0] * ranks
    finish: list[list[int]] = [[] for _ in range(ranks)]
    sleeping: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]  # heap of (threshold, waiting rank)
    blocked: dict[int, Wait] = {}
    jumps = [_jumps(rank_waits) for rank_waits in waits] if not timed else None
    ready = deque(range(ranks))
    while ready:
        rank = ready.popleft()
        unit = position[rank]
        rank_waits, fin, starts = waits[rank], finish[rank], units.starts[rank]
        end = len(rank_waits)
        if jumps is not None:  # untimed: only units with waits need looking at
            jump = jumps[rank]
            while True:
                unit = jump[unit]
                if unit == end:
                    break
                for wait in rank_waits[unit]:
                    q, threshold = wait[0], wait[1]
                    if (unit if q == rank else position[q]) < threshold:
                        blocked[rank] = wait
                        if q != rank:  # waiting on its own later op can never end: stay blocked
                            heapq.heappush(sleeping[q], (threshold, rank))
                        break
                else:
                    unit += 1
                    continue
                break
        else:
            while unit < end:
                arrive = (fin[-1] if fin else 0) + starts[unit + 1] - starts[unit]  # one step per instruction
                for wait in rank_waits[unit] or ():
                    q, threshold = wait[0], wait[1]
                    if (unit if q == rank else position[q]) < threshold:
                        blocked[rank] = wait
                        if q != rank:
                            heapq.heappush(sleeping[q], (threshold, rank))
                        break
                    if threshold:  # start no earlier than the step after what it waited for
                        arrive = max(arrive, finish[q][threshold - 1] + 1)
                else:
                    fin.append(arrive)
                    unit += 1
                    continue
                break
        if unit == end:
            blocked.pop(rank, None)
        position[rank] = unit
        heap = sleeping[rank]
        while heap and heap[0][0] <= unit:
            ready.append(heapq.heappop(heap)[1])
    return ComputeRun(model, units, tuple(position), blocked, tuple(tuple(f) for f in finish), waits)


def _jumps(rank_waits: tuple[tuple[Wait, ...], ...]) -> list[int]:
    """For each unit, the first unit at or after it that waits for anything (len(rank_waits) if none)."""
    out = [0] * (len(rank_waits) + 1)
    following = len(rank_waits)
    out[following] = following
    for unit in range(len(rank_waits) - 1, -1, -1):
        if rank_waits[unit]:
            following = unit
        out[unit] = following
    return out


def check_deadlock(
    program: Program, p2p: str = "nccl", flat: Flat | None = None, placed: bool | None = None
) -> list[str]:
    """Problems (empty when every rank runs to the end), with the chain of waits and a grid when stuck. `placed`:
    whether pipec placed the send/recv (None: the explanation finds out, only if it is needed)."""
    if p2p not in MODELS:
        raise ValueError(f"unknown p2p model {p2p!r}; expected one of {', '.join(MODELS)}")
    flat = flat_for(program, p2p, flat)
    if program.has_comms:
        if streams_finish(program, p2p, flat):
            return []
        stream_run = run_streams(program, p2p, flat)  # the same run, with the state the explanation reads
        from pipec.verify.explain import explain_stuck_streams

        return explain_stuck_streams(program, stream_run, placed).splitlines()
    run = run_compute_orders(program, p2p, flat, timed=False)
    if not run.stuck:
        return []
    run = run_compute_orders(program, p2p, flat, timed=True)  # the same run, with the steps the grid shows
    from pipec.verify.explain import explain_stuck_compute_orders

    return explain_stuck_compute_orders(program, run, placed).splitlines()


# ---- run_streams: a program with send/recv, op by op, recording why each stuck rank waits ---------------------


class Blocked(NamedTuple):
    """Why a rank cannot finish in a run of the streams (`run_streams`).

    ``at``: the op index its host stands at (len(stream) when it reached the end of the step). ``state``:
    ``compute`` (a compute waiting for the batch holding one of its receives), ``local`` (an op waiting for one of
    its own later ops, or for a compute on another rank), ``end`` (the end of the step, waiting for every batch).
    ``batch``: the batch waited for (index among the rank's batches), -1 for ``local``; ``behind``: the earlier
    batch of the rank it is queued behind (nccl), or -1. ``op``: the op of the blocking batch that cannot
    complete (or, for ``local``, the op that waits). ``peer``/``peer_op``: what that op waits for (-1: nothing
    that will ever be posted). ``peer_state``: ``posted`` (the peer never posts it), ``queued`` (posted, but the
    peer's earlier batch never completes), ``run`` (a compute of the peer, ``local`` only), ``later`` (its own
    later op), ``none`` (no counterpart in any stream).
    """

    rank: int
    at: int
    state: str
    batch: int
    behind: int
    op: int
    peer: int
    peer_op: int
    peer_state: str


@dataclass(frozen=True)
class StreamRun:
    """A run of the streams (`run_streams`): each rank's host position (unit), completed batches, timing, and why
    each stuck rank is stuck."""

    model: str
    units: Units
    stop: tuple[int, ...]  # host unit per rank (== number of units at the end of the stream)
    batch_units: tuple[tuple[int, ...], ...]  # per rank, the unit of each batch
    complete: tuple[tuple[bool, ...], ...]  # per rank, per batch
    blocked: dict[int, Blocked]
    finish: tuple[tuple[int, ...], ...]  # per rank, the lockstep step at which the host got past each unit

    @property
    def stuck(self) -> list[int]:
        return sorted(self.blocked)


def run_streams(program: Program, model: str = "nccl", flat: Flat | None = None) -> StreamRun:
    """Run a program with send/recv under the p2p rule (docs/verification.md) to the point where nothing moves.

    State per rank: the host's unit (computes run, batches posted) and which batches completed. Every condition
    is monotone ("rank q's host passed unit u", "rank q completed k batches"), so the run's end point is unique; a
    worklist with per-rank heaps of sleeping waiters finds it in time linear in the ops (times a log).
    """
    if model not in MODELS:
        raise ValueError(f"unknown p2p model {model!r}; expected one of {', '.join(MODELS)}")
    flat = flat_for(program, model, flat)
    units = cut_units(flat)
    starts, unit_of, where, mbs = flat.starts, flat.unit_of, flat.where, flat.mbs
    streams = program.streams
    ranks = len(streams)
    nccl = model in IN_ORDER  # nccl and torch: batches in posting order, channels in issue order
    ends = [len(s) - 1 for s in starts]
    # batches: units whose first op is a send/recv
    batch_units: list[list[int]] = []
    batch_of_unit: list[dict[int, int]] = []
    ops_keys = flat.ops
    is_comm_op = []
    for rank in range(ranks):
        comm = bytearray(starts[rank][-1])
        for index, key in ops_keys[rank]:
            if key & 7 >= SEND_F:
                comm[index] = 1
        is_comm_op.append(comm)
        found = [u for u in range(ends[rank]) if comm[starts[rank][u]]]
        batch_units.append(found)
        batch_of_unit.append({u: b for b, u in enumerate(found)})
    # what each send/recv op waits for: nccl its channel partner (rank, op) whose batch must be running; tagged a
    # receive the send of its message (rank, op) that must be posted. (-1, -1): nothing ever will be.
    partner: list[dict[int, tuple[int, int]]] = [{} for _ in range(ranks)]
    for (src, dst), (sends, recvs) in flat.channels.items():
        if nccl:
            for (i, _), (j, _) in zip(sends, recvs, strict=False):
                partner[src][i] = (dst, j)
                partner[dst][j] = (src, i)
        else:
            step = mbs * 8
            for j, key in recvs:
                hit = where.get(key - step - 1 if key & 7 == RECV_F else key + step - 1)
                partner[dst][j] = hit if hit is not None else (-1, -1)
    # per rank, per compute unit: the batches holding the receives it consumes (those before it in the stream)
    needs: list[dict[int, list[int]]] = [{} for _ in range(ranks)]
    for rank in range(ranks):
        rank_needs, rank_starts, rank_unit_of = needs[rank], starts[rank], unit_of[rank]
        for index, key in ops_keys[rank]:
            code = key & 7
            if code == F:
                wanted = key - F + RECV_F
            elif code == B or code == I:
                wanted = key - code + RECV_B
            else:
                continue
            hit = where.get(wanted)
            unit = rank_unit_of[index]
            if hit is not None and hit[0] == rank and hit[1] < rank_starts[unit]:
                rank_needs.setdefault(unit, []).append(batch_of_unit[rank][rank_unit_of[hit[1]]])
    local: list[dict[int, list[tuple[int, int, int, int]]]] = [{} for _ in range(ranks)]
    for rank, index, need in flat.local:  # (q, threshold unit, op j on q, waiting op): a `Wait`
        hit = next((where[k] for k in need if k in where), None)
        if hit is not None:
            q, j = hit
            local[rank].setdefault(unit_of[rank][index], []).append((q, unit_of[q][j] + 1, j, index))

    position = [0] * ranks
    done = [0] * ranks  # nccl: batches completed, in order
    complete = [bytearray(len(b)) for b in batch_units]
    cursor = [[starts[r][u] for u in batch_units[r]] for r in range(ranks)]  # next op of each batch to check
    tail = [0] * ranks  # the first batch not known complete (tagged end of step)
    finish: list[list[int]] = [[] for _ in range(ranks)]
    b_start: list[list[int]] = [[0] * len(b) for b in batch_units]
    b_done: list[list[int]] = [[0] * len(b) for b in batch_units]
    on_position: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]  # heap of (threshold, waiting rank)
    on_done: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]

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
        """Complete the batch if it can (its start known); registers a sleeper when it cannot."""
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

    ready = deque(range(ranks))
    queued = [True] * ranks  # a rank sits in `ready` at most once (a woken rank may have several sleepers)
    while ready:
        rank = ready.popleft()
        queued[rank] = False
        rank_starts, rank_needs, rank_local, fin = starts[rank], needs[rank], local[rank], finish[rank]
        moved = True
        while moved:
            moved = False
            unit = position[rank]
            while unit < ends[rank]:  # the host
                stop = False
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
        for heap, level in ((on_position[rank], position[rank]), (on_done[rank], done[rank])):
            while heap and heap[0][0] <= level:
                woken = heapq.heappop(heap)[1]
                if not queued[woken]:
                    queued[woken] = True
                    ready.append(woken)
    blocked = {}
    for rank in range(ranks):
        if position[rank] < ends[rank] or not all(complete[rank]):
            blocked[rank] = _blocked_reason(rank, position, done, complete, nccl, starts, unit_of, batch_units,
                                            batch_of_unit, needs, local, partner, ends)
    return StreamRun(
        model, units, tuple(position), tuple(tuple(b) for b in batch_units),
        tuple(tuple(bool(x) for x in c) for c in complete), blocked, tuple(tuple(f) for f in finish),
    )


def _blocked_reason(rank, position, done, complete, nccl, starts, unit_of, batch_units, batch_of_unit, needs, local,
                    partner, ends) -> Blocked:
    """The first reason rank `rank` cannot finish, read off the final state of the run."""
    unit = position[rank]
    at = starts[rank][unit]
    if unit < ends[rank]:
        for q, threshold, j, i in local[rank].get(unit, ()):
            if (unit if q == rank else position[q]) < threshold:
                return Blocked(rank, at, "local", -1, -1, i, q, j, "later" if q == rank else "run")
        batch = next(b for b in needs[rank].get(unit, ()) if not complete[rank][b])
        state = "compute"
    else:
        batch = next(b for b, c in enumerate(complete[rank]) if not c)
        state = "end"
    # nccl: a rank's batches run one after another, so the earliest incomplete one holds up every later one
    blocking = done[rank] if nccl and done[rank] < batch else batch
    behind = blocking if blocking != batch else -1
    lo, hi = starts[rank][batch_units[rank][blocking]], starts[rank][batch_units[rank][blocking] + 1]
    for k in range(lo, hi):
        hit = partner[rank].get(k)
        if hit is None:
            if nccl:
                return Blocked(rank, at, state, batch, behind, k, -1, -1, "none")
            continue
        q, j = hit
        if q < 0:
            return Blocked(rank, at, state, batch, behind, k, -1, -1, "none")
        peer_unit = unit_of[q][j]
        if position[q] <= peer_unit:
            return Blocked(rank, at, state, batch, behind, k, q, j, "posted")
        if nccl and done[q] < batch_of_unit[q][peer_unit]:
            return Blocked(rank, at, state, batch, behind, k, q, j, "queued")
    raise AssertionError("a stuck batch with every counterpart running")  # pragma: no cover


# ---- streams_finish: the verdict of run_streams alone, on per-rank gates ----------------------------------------
#
# check_deadlock only needs to know whether run_streams ends with every rank done; the explanation (rare) reruns
# run_streams. Every condition of the rule is a threshold on a monotone per-rank counter, and a rank's host passes
# its units in order and (nccl) completes its batches in order, so the conditions fold into *gates*: per rank and
# per rank whose counter it reads, a nondecreasing (item, threshold) array. The first item a gate holds up is one
# bisect, a rank's state update is a handful of bisects, and the arrays are filled by map/zip/accumulate (C loops).
# The run reaches the same least fixed point as run_streams's, so the verdict is the same.
#
# The steps, in order: `_find_batches` (each rank's batches, and the batch each compute consumes from), the gates
# of the model (`_nccl_gates` or `_tagged_gates`), `_add_local_waits` (the few waits on a rank's own ops), `_settle`
# (wake ranks, each by `_nccl_wake` or `_tagged_wake`, until none moves) and `_everyone_finished` (the verdict,
# with the tagged rule for the end of the step).

# A gate: (rank q whose counter it reads, items, thresholds). Items and thresholds are nondecreasing; the gate
# holds up every item from the first whose threshold q's counter has not reached. Which counter, and what the items
# are, depends on the list the gate is in (`_Gates`).
Gate = tuple[int, list[int], list[int]]
_NEVER = 1 << 62  # above every item and every counter: "never", and the sentinel that ends every gate


def _gate(rank: int, events: list[tuple[int, int]]) -> Gate:
    """(item, threshold) events in item order -> a sealed gate: the items and the running maximum of the
    thresholds (an item is held up by its own threshold and by those of the items before it)."""
    return _sealed(rank, [e[0] for e in events], list(accumulate([e[1] for e in events], max)))


def _sealed(rank: int, items: list[int], thresholds: list[int]) -> Gate:
    """The gate with a sentinel at its end: a bisect for a counter below _NEVER then always lands on an item."""
    items.append(_NEVER)
    thresholds.append(_NEVER)
    return rank, items, thresholds


class _Batches(NamedTuple):
    """Where each rank's batches are, and which of them its computes consume from."""

    ends: list[int]  # per rank, its number of units: where its host stands at the end of its stream
    comm_ops: list[list[int]]  # per rank, the op indices of its send/recv ops
    units: list[list[int]]  # per rank, the unit of each batch, in stream order
    of_op: list[list[int]]  # per rank, op index -> its batch (-1 for a compute)
    # per rank, (unit, batch) for each compute and the batch holding a receive it consumes (earlier on its rank)
    needs: list[list[tuple[int, int]]]


@dataclass
class _Gates:
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
    def empty(cls, ranks: int) -> _Gates:
        return cls(
            [[] for _ in range(ranks)], [[] for _ in range(ranks)], [_NEVER] * ranks, [False] * ranks,
            [set() for _ in range(ranks)], [[] for _ in range(ranks)],
        )


class _Counters(NamedTuple):
    """The state of the run, per rank; every counter only grows."""

    position: list[int]  # the host's unit
    done: list[int]  # nccl: batches completed (in order)
    started: list[int]  # nccl: batches started = min(done + 1, batches posted)
    local_next: list[int]  # the first entry of the rank's local waits not passed yet

    @classmethod
    def zero(cls, ranks: int) -> _Counters:
        return cls([0] * ranks, [0] * ranks, [0] * ranks, [0] * ranks)


def streams_finish(program: Program, model: str = "nccl", flat: Flat | None = None) -> bool:
    """Whether every rank runs to the end of its stream with every batch complete under the p2p rule.

    The verdict of ``not run_streams(...).blocked``, about twice as fast: no timing, no per-op state.
    """
    if model not in MODELS:
        raise ValueError(f"unknown p2p model {model!r}; expected one of {', '.join(MODELS)}")
    flat = flat_for(program, model, flat)
    with without_cyclic_gc():
        return _streams_finish(model in IN_ORDER, flat)


def _streams_finish(nccl: bool, flat: Flat) -> bool:
    """streams_finish on a Flat cut as the model posts its batches; `nccl`: an in-order model (nccl, torch)."""
    batches = _find_batches(flat)
    gates = _nccl_gates(flat, batches) if nccl else _tagged_gates(flat, batches)
    _add_local_waits(flat, gates)
    counters = _Counters.zero(len(batches.ends))
    wake = _nccl_wake(batches, gates, counters) if nccl else _tagged_wake(batches, gates, counters)
    _settle(wake, gates.depends)
    return _everyone_finished(nccl, batches, gates, counters)


def _find_batches(flat: Flat) -> _Batches:
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
    for rank, ops in enumerate(ops_keys):
        computes = [(i, k) for i, k in ops if k & 7 < W]  # F, B, I
        hits = map(where.get, [k + RECV_F if k & 7 == F else k - (k & 7) + RECV_B for _, k in computes])
        rank_starts, rank_unit_of, rank_batch = starts[rank], unit_of[rank], batch_of_op[rank]
        needs.append(
            [
                (rank_unit_of[i], rank_batch[hit[1]])
                for (i, _), hit in zip(computes, hits, strict=True)
                if hit is not None and hit[0] == rank and hit[1] < rank_starts[rank_unit_of[i]]
            ]
        )
    return _Batches(ends, comm_ops, batch_units, batch_of_op, needs)


def _nccl_gates(flat: Flat, batches: _Batches) -> _Gates:
    """nccl and torch: the k-th send on a channel meets its k-th receive; each one's batch completes only once the
    other one's batch has started. An op its channel never matches holds its batch (and every later one) forever."""
    ranks = len(batches.ends)
    gates = _Gates.empty(ranks)
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
        gates.batch[rank].append(_sealed(q, items, thresholds))
    for rank in range(ranks):
        # an op its channel never matches (or on no channel at all): its batch never completes
        unmatched = next((i for i in batches.comm_ops[rank] if not matched[rank][i]), None)
        if unmatched is not None:
            gates.dead[rank] = batch_of_op[rank][unmatched]
        # batches complete in order, so a compute waits until `done` passes the batch it needs
        gates.host[rank].append(_gate(rank, [(u, b + 1) for u, b in batches.needs[rank]]))
    return gates


def _tagged_gates(flat: Flat, batches: _Batches) -> _Gates:
    """tagged: a receive completes once the send of its message is posted, so a compute waits for the sender's
    host to pass that send. A receive whose message no stream sends never completes."""
    ranks = len(batches.ends)
    gates = _Gates.empty(ranks)
    where, unit_of, step = flat.where, flat.unit_of, flat.mbs * 8
    conditions: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(ranks)]  # batch -> (q, threshold)
    for (_, dst), (_, recvs) in flat.channels.items():
        rank_conditions, rank_batch = conditions[dst], batches.of_op[dst]
        for j, key in recvs:  # the key of the send of the same message: the stage before (RECV_F) or after
            hit = where.get(key - step - 1 if key & 7 == RECV_F else key + step - 1)
            batch = rank_batch[j]
            if hit is None:
                gates.tagged_dead[dst] = True
                rank_conditions.setdefault(batch, []).append((-1, _NEVER))
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
            gates.host[rank].append(_gate(q, found))
            if q != rank:
                gates.depends[rank].add(q)
    return gates


def _add_local_waits(flat: Flat, gates: _Gates) -> None:
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


def _settle(wake: Callable[[int], bool], depends: list[set[int]]) -> None:
    """Wake every rank once, then every rank that reads a counter of a rank that moved, until none moves."""
    ranks = len(depends)
    dependents: list[list[int]] = [[] for _ in range(ranks)]
    for rank, found in enumerate(depends):
        for q in found:
            dependents[q].append(rank)
    ready = deque(range(ranks))
    queued = [True] * ranks  # a rank sits in `ready` at most once
    while ready:
        rank = ready.popleft()
        queued[rank] = False
        if wake(rank):
            for woken in dependents[rank]:
                if not queued[woken]:
                    queued[woken] = True
                    ready.append(woken)


def _nccl_wake(batches: _Batches, gates: _Gates, counters: _Counters) -> Callable[[int], bool]:
    """nccl and torch: move one rank as far as it goes; True if a counter of it moved.

    Two steps take turns until neither moves: the host passes its units up to the first compute whose batch has
    not completed (or a local wait that does not hold), posting the batches it passes; then the rank's batches
    complete, in order, up to the first one holding an op whose counterpart's batch has not started (or that no
    counterpart ever matches). A batch completing lets the host on; the host posting a batch may let it complete.
    """
    ends, batch_units, dead, local, depends = batches.ends, batches.units, gates.dead, gates.local, gates.depends
    position, done, started, local_next = counters
    need_gates = [rank_gates[0] for rank_gates in gates.host]  # the one host gate: the rank's own completed batches
    batch_gates = gates.batch

    def wake(rank: int) -> bool:
        end, rank_waits = ends[rank], local[rank]
        _, need_items, need_thresholds = need_gates[rank]
        rank_batch_gates, rank_batch_units, rank_dead = batch_gates[rank], batch_units[rank], dead[rank]
        here, finished = position[rank], done[rank]
        posted = bisect_left(rank_batch_units, here)
        again = rank in depends[rank]  # a channel to itself: its own batches starting can complete others
        fresh = True  # the batch gates need a look: on waking, then whenever more batches got posted
        changed = False
        while True:
            # the host, up to the first compute whose batch has not completed
            limit = need_items[bisect_right(need_thresholds, finished)]
            on_done = limit < end  # the host waits for its own batches (else it reached the end)
            if not on_done:
                limit = end
            if rank_waits:
                cut = _limit_by_local_waits(rank, limit, rank_waits, local_next, position)
                on_done = on_done and cut == limit
                limit = cut
            if limit > here:
                position[rank] = here = limit
                now = bisect_left(rank_batch_units, limit)
                fresh = fresh or now > posted
                posted = now
                started[rank] = posted if posted <= finished else finished + 1
                changed = True
            if not (fresh or again):
                break
            fresh = False
            # the batches, in order: every posted one up to the first a peer holds up (or that never completes)
            last = posted if posted < rank_dead else rank_dead
            for q, items, thresholds in rank_batch_gates:
                item = items[bisect_right(thresholds, started[q])]
                if item < last:
                    last = item
            if last <= finished:
                break
            done[rank] = finished = last
            started[rank] = posted if posted <= last else last + 1
            changed = True
            if not (on_done or again):  # the host did not wait for a batch: completing more cannot move it
                break
        return changed

    return wake


def _tagged_wake(batches: _Batches, gates: _Gates, counters: _Counters) -> Callable[[int], bool]:
    """tagged: move one rank's host as far as it goes (batches need no step: a send completes when posted, a
    receive when its send is, which the host gates read directly); True if it moved."""
    ends, host_gates, dead, local = batches.ends, gates.host, gates.dead, gates.local
    position, _, _, local_next = counters

    def wake(rank: int) -> bool:
        end, rank_waits, rank_host_gates, rank_dead = ends[rank], local[rank], host_gates[rank], dead[rank]
        changed = False
        while True:  # again while it moves: a gate on its own position may open
            # the first unit a gate holds up: a compute whose receive's send is not posted yet (or never will be)
            limit = rank_dead if rank_dead < end else end
            for q, items, thresholds in rank_host_gates:
                item = items[bisect_right(thresholds, position[q])]
                if item < limit:
                    limit = item
            if rank_waits:
                limit = _limit_by_local_waits(rank, limit, rank_waits, local_next, position)
            if limit <= position[rank]:
                break
            position[rank] = limit
            changed = True
        return changed

    return wake


def _limit_by_local_waits(
    rank: int, limit: int, rank_waits: list[tuple[int, list[tuple[int, int]]]], local_next: list[int],
    position: list[int],
) -> int:
    """The host's limit once the local waits of its units before `limit` are checked: the first unit with a wait
    that does not hold (a wait passed stays passed, so `local_next` remembers where to look next)."""
    w = local_next[rank]
    while w < len(rank_waits) and rank_waits[w][0] < limit:
        unit = rank_waits[w][0]
        if any((unit if q == rank else position[q]) < threshold for q, threshold in rank_waits[w][1]):
            limit = unit
            break
        w += 1
    local_next[rank] = w
    return limit


def _everyone_finished(nccl: bool, batches: _Batches, gates: _Gates, counters: _Counters) -> bool:
    """The verdict once no rank moves: every host at the end of its stream, and every batch complete."""
    if counters.position != batches.ends:
        return False
    if nccl:
        return all(d == len(b) for d, b in zip(counters.done, batches.units, strict=True))
    # tagged, the end of the step: each rank waits for all its batches. Every host got to its end, so every send
    # of any stream was posted and every receive with a send completed; only one whose send no stream holds waits
    return not any(gates.tagged_dead)
