"""run_compute_orders: a program without send/recv (compute orders, as `pipec.load` gives them) run on its data
dependencies: each compute waits for the computes it reads, wherever they run.

Without messages the p2p models agree. Every condition is monotone ("rank q's host got past unit u"), so the point
where no rank can move is unique; a worklist with per-rank heaps of sleeping waiters reaches it.
"""

from __future__ import annotations

import heapq
from collections import deque

from pipec.ir import Program, chain_links
from pipec.verify.deadlock.rule import check_model, flat_for
from pipec.verify.deadlock.runs import ComputeRun, Units, Wait, cut_units
from pipec.verify.flat import B, F, Flat, I, W


def _data_waits(program: Program, flat: Flat, units: Units) -> tuple[tuple[tuple[Wait, ...], ...], ...]:
    """The waits of every unit of compute orders that has any: F(s,m) waits for F(s-1,m), B/I(s,m) for F(s,m) and
    the backward of (s+1,m), W for I, wherever those run."""
    where, mbs = flat.where, flat.mbs
    has_next, has_previous = chain_links(program.num_stages, program.pipelines)  # where each copy's chain ends
    step = mbs * 8
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
                needs = (base - step + F,) if has_previous[stage] else ()
            elif code == B or code == I:
                gradient = base + step + B if base + step + B in where else base + step + I
                needs = (base + F, gradient) if has_next[stage] else (base + F,)
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
    check_model(model)
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
