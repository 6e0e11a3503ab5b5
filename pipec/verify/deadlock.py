"""check_deadlock: does every rank's stream run to the end under a point-to-point model?

The execution rule (shared with the runtime, written out in docs/verification.md):
- each rank runs its stream in order; a maximal run of consecutive SEND/RECV instructions is one *batch*, posted
  at once (one ``batch_isend_irecv``) and waited for as a whole before the next instruction;
- a compute instruction runs once its inputs are on its rank: F(s, m) needs F(s-1, m) (same rank) or its
  RECV_F(s, m) (other rank); B/I(s, m) need F(s, m) and the backward of (s+1, m) or its RECV_B(s, m); W(s, m)
  needs I(s, m). A SEND needs the compute that produced what it sends. In a program without send/recv
  instructions an input from another rank is simply the producing compute, wherever it runs;
- ``tagged``: sends complete at once; a RECV completes once the SEND of the same message has been posted;
- ``nccl``: the k-th send from rank a to rank b meets the k-th receive on b from a; every op, sends included,
  completes once its counterpart has been posted (the peer reached the batch holding it).

Each unit (a compute instruction or a batch) waits on conditions of the form "rank q has reached unit T"; all of
them are monotone, so the set of units that ever run is unique and a worklist finds it in time linear in the
number of instructions (plus a heap per rank for sleeping waiters). A rank stuck before the end is a deadlock:
`explain` follows the chain of waits to its cycle and draws the step-by-rank grid around it.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from itertools import compress, repeat

from pipec.ir import Action, Kind, Program
from pipec.verify.flat import RECV_F, B, F, Flat, I, W, flatten

MODELS = ("nccl", "tagged")

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
class Execution:
    """Where each rank stopped (unit index; == number of units when it finished) and when each unit finished."""

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


def _build_waits(program: Program, model: str, flat: Flat, units: Units) -> tuple[tuple[tuple[Wait, ...], ...], ...]:
    """The waits of every unit that has any.

    With send/recv instructions every wait across ranks is a message (its channel partner under nccl, the send
    of the same name for a tagged receive) and the only waits on a rank's own ops are the few `flat.local` found
    out of order. A compute-only program waits on the computes it reads, wherever they run.
    """
    if program.has_comms:
        return _message_waits(program, model, flat, units)
    return _data_waits(program, flat, units)


def _data_waits(program: Program, flat: Flat, units: Units) -> tuple[tuple[tuple[Wait, ...], ...], ...]:
    """Compute-only programs: F(s,m) waits for F(s-1,m), B/I(s,m) for F(s,m) and the backward of (s+1,m), W for I."""
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


def _message_waits(program: Program, model: str, flat: Flat, units: Units) -> tuple[list[list[Wait] | None], ...]:
    """Per rank, per unit, its waits or None (lists indexed by unit: cheaper than a dict per rank at 800k ops)."""
    unit_of, where = flat.unit_of, flat.where
    all_waits: list[list[list[Wait] | None]] = [[None] * (len(starts) - 1) for starts in flat.starts]

    def add(rank: int, unit: int, wait: Wait) -> None:
        found = all_waits[rank][unit]
        if found is None:
            all_waits[rank][unit] = [wait]
        else:
            found.append(wait)

    for rank, index, need in flat.local:  # never satisfied: the op it needs is later on this rank, or elsewhere
        hit = next((where[k] for k in need if k in where), None)
        if hit is not None:
            q, j = hit
            add(rank, unit_of[rank][index], (q, unit_of[q][j] + 1, j, index))
    if model == "nccl":  # every send/recv waits for the op it meets on its channel to be posted
        for (src, dst), (sends, recvs) in channels(program, flat).items():
            src_of, dst_of, src_waits, dst_waits = unit_of[src], unit_of[dst], all_waits[src], all_waits[dst]
            for (i, _), (j, _) in zip(sends, recvs, strict=False):
                su, du = src_of[i], dst_of[j]
                found = src_waits[su]
                if found is None:
                    src_waits[su] = [(dst, du, j, i)]
                else:
                    found.append((dst, du, j, i))
                found = dst_waits[du]
                if found is None:
                    dst_waits[du] = [(src, su, i, j)]
                else:
                    found.append((src, su, i, j))
    else:  # tagged: a receive waits for the send of its message to be posted
        step = flat.mbs * 8
        for (_, dst), (_, recvs) in channels(program, flat).items():
            for j, key in recvs:
                sender = key - step - 1 if key & 7 == RECV_F else key + step - 1
                hit = where.get(sender)
                if hit is not None:
                    q, i = hit
                    add(dst, unit_of[dst][j], (q, unit_of[q][i], i, j))
    return tuple(all_waits)


def execute(program: Program, model: str = "nccl", flat: Flat | None = None, timed: bool = True) -> Execution:
    """Run the streams under `model` to the unique point where no rank can move.

    `timed` also records the lockstep step at which each unit finishes (for the grid); the untimed run skips
    over units that wait for nothing, which is most of them.
    """
    if model not in MODELS:
        raise ValueError(f"unknown p2p model {model!r}; expected one of {', '.join(MODELS)}")
    flat = flat or flatten(program)
    units = cut_units(flat)
    waits = _build_waits(program, model, flat, units)
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
    return Execution(model, units, tuple(position), blocked, tuple(tuple(f) for f in finish), waits)


def _runs_to_the_end(program: Program, model: str, flat: Flat) -> bool:
    """The same run as `execute` for a program with send/recv, on flat arrays (the common, passing case).

    Each send/recv op gets its partner's rank and unit in per-rank arrays, filled by `map` over the channels (C
    loops, no tuple per message); only units holding send/recv ops or a local wait are ever looked at.
    """
    starts, unit_of, where = flat.starts, flat.unit_of, flat.where
    ranks = len(starts)
    ends = [len(s) - 1 for s in starts]  # number of units per rank
    partner_rank = [[-1] * s[-1] for s in starts]
    partner_unit = [[0] * s[-1] for s in starts]
    marked = [bytearray(end) for end in ends]  # units that hold a send/recv
    exhaust = deque(maxlen=0).extend  # runs a map to the end without keeping anything

    def link(rank: int, ops: list[int], peer: int, peer_units) -> None:
        exhaust(map(partner_rank[rank].__setitem__, ops, repeat(peer, len(ops))))
        exhaust(map(partner_unit[rank].__setitem__, ops, peer_units))

    for (src, dst), (sends, recvs) in flat.channels.items():
        send_ops, recv_ops = [i for i, _ in sends], [j for j, _ in recvs]
        exhaust(map(marked[src].__setitem__, map(unit_of[src].__getitem__, send_ops), repeat(1)))
        exhaust(map(marked[dst].__setitem__, map(unit_of[dst].__getitem__, recv_ops), repeat(1)))
        if model == "nccl":  # the k-th send meets the k-th receive; each waits for the other to be posted
            k = min(len(send_ops), len(recv_ops))
            link(src, send_ops[:k], dst, map(unit_of[dst].__getitem__, recv_ops[:k]))
            link(dst, recv_ops[:k], src, map(unit_of[src].__getitem__, send_ops[:k]))
        else:  # tagged: a receive waits for the send of its message to be posted
            step = flat.mbs * 8
            for j, key in recvs:
                hit = where.get(key - step - 1 if key & 7 == RECV_F else key + step - 1)
                if hit is not None:
                    partner_rank[dst][j], partner_unit[dst][j] = hit[0], unit_of[hit[0]][hit[1]]
    local: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(ranks)]
    for rank, index, need in flat.local:
        hit = next((where[k] for k in need if k in where), None)
        if hit is not None:
            unit = unit_of[rank][index]
            local[rank].setdefault(unit, []).append((hit[0], unit_of[hit[0]][hit[1]] + 1))
            marked[rank][unit] = 1
    checks = [list(compress(range(end), flags)) for end, flags in zip(ends, marked, strict=True)]
    position, cursor = [0] * ranks, [0] * ranks
    sleeping: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    ready = deque(range(ranks))
    while ready:
        rank = ready.popleft()
        check, k = checks[rank], cursor[rank]
        rank_starts, ranks_of, units_of, rank_local = starts[rank], partner_rank[rank], partner_unit[rank], local[rank]
        while k < len(check):
            unit = check[k]
            for i in range(rank_starts[unit], rank_starts[unit + 1]):
                q = ranks_of[i]
                if q >= 0 and position[q] < units_of[i]:
                    heapq.heappush(sleeping[q], (units_of[i], rank))
                    break
            else:
                waiting = next(
                    (w for w in rank_local.get(unit, ()) if (unit if w[0] == rank else position[w[0]]) < w[1]), None
                )
                if waiting is None:
                    k += 1
                    continue
                if waiting[0] != rank:  # an op of its own that comes later can never run: no wake-up
                    heapq.heappush(sleeping[waiting[0]], (waiting[1], rank))
            break
        cursor[rank] = k
        position[rank] = check[k] if k < len(check) else ends[rank]
        heap = sleeping[rank]
        while heap and heap[0][0] <= position[rank]:
            ready.append(heapq.heappop(heap)[1])
    return position == ends


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


def check_deadlock(program: Program, p2p: str = "nccl", flat: Flat | None = None) -> list[str]:
    """Problems (empty when every rank runs to the end), with the chain of waits and a grid when stuck."""
    if p2p not in MODELS:
        raise ValueError(f"unknown p2p model {p2p!r}; expected one of {', '.join(MODELS)}")
    flat = flat or flatten(program)
    if program.has_comms and _runs_to_the_end(program, p2p, flat):
        return []
    run = execute(program, p2p, flat, timed=False)
    if not run.stuck:
        return []
    run = execute(program, p2p, flat, timed=True)  # the same run, with the steps the grid shows
    from pipec.verify.explain import explain_deadlock

    return explain_deadlock(program, run).splitlines()
