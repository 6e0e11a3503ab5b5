"""The ``ideal`` p2p model: the compute orders alone, send/recv ignored. Each compute op starts once its rank is
free and its inputs exist (``message_time`` later when the producer lives on another rank): the timeline the papers
draw, independent of where send/recv were placed.

``simulate_dataflow`` is a measured hot loop (locals for every array it reads per op, the value ids of
pipec.p2p_rule.message_id inlined); its benchmark is bench/simulate.py (the ideal column).
"""

from __future__ import annotations

from collections import deque

from pipec.errors import ScheduleError
from pipec.ir import Action, Kind, Program, chain_links
from pipec.p2p_rule import pair_duration, remote_output
from pipec.sim.costs import Costs
from pipec.sim.refusals import misplaced
from pipec.sim.result import Message, SimResult, TimedOp, peaks_of


def simulate_dataflow(
    program: Program, costs: Costs, record: bool, input_fraction: float | None
) -> tuple[SimResult, bool]:
    """The ``ideal`` model: compute instructions in program order, each starting once its rank is free and its
    inputs exist (plus ``message_time`` when the producer lives on another rank). Send/recv are ignored.
    Also returns whether the run proved the compute orders' structure sound (as Run.sound)."""
    compute = program.compute_streams()
    ranks, stages = program.ranks, program.num_stages
    where = program.stage_to_rank
    durations = costs.per_stage(stages)
    delay = costs.message_time
    n_mb = program.microbatches  # an op beyond it is refused as it comes, as is one off its stage's rank
    # when each value exists, flat, by the id of the message carrying it (pipec.p2p_rule.output_message)
    done = [-1.0] * (stages * n_mb * 2)
    split = bytearray(stages * n_mb)  # per value: 1 after its I, 2 once its W followed, 3 a W without its I
    unsound = False  # a value computed twice, or an overlapped pair of a shape the structure pass may refuse
    waiting: dict[int, list[int]] = {}
    time, position, busy, first = [0.0] * ranks, [0] * ranks, [0.0] * ranks, [-1.0] * ranks
    timeline: list[list[TimedOp]] = [[] for _ in range(ranks)]
    ready = deque(range(ranks))
    k_f, k_w, k_i = Kind.F, Kind.W, Kind.I
    d_f, d_b, d_i, d_w = (durations[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W))
    d_fb = costs.pair_per_stage(stages)  # an overlapped pair's own duration (None: the sum of its halves)
    has_next, has_previous = chain_links(stages, program.pipelines)

    while ready:
        rank = ready.popleft()
        stream = compute[rank]
        n = len(stream)
        pos = position[rank]
        t = time[rank]
        while pos < n:
            instruction = stream[pos]
            start, blocked, end = t, -1, 0.0
            for stage, kind, mb in instruction.parts:
                if mb < 0 or mb >= n_mb or stage < 0 or where[stage] != rank:
                    misplaced(program, rank, pos, instruction, Action(stage, kind, mb))
                base = (stage * n_mb + mb) * 2
                if kind is k_f:
                    needs = (base - 2 * n_mb,) if has_previous[stage] else ()
                    end += d_f[stage]
                elif kind is k_w:
                    needs = (base + 1,)
                    end += d_w[stage]
                else:
                    needs = (base, base + 2 * n_mb + 1) if has_next[stage] else (base,)
                    end += d_i[stage] if kind is k_i else d_b[stage]
                for key in needs:
                    when = done[key]
                    if when < 0:
                        blocked = key
                        break
                    if where[key // (2 * n_mb)] != rank:
                        when += delay
                    if when > start:
                        start = when
                if blocked >= 0:
                    break
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(rank)
                break
            if d_fb is not None and type(instruction) is not Action:
                end = pair_duration(instruction.parts, end, durations, d_fb)
            end += start
            for stage, kind, mb in instruction.parts:
                if kind is k_w:
                    index = stage * n_mb + mb
                    split[index] = 2 if split[index] == 1 else 3
                    continue
                key = (stage * n_mb + mb) * 2 + (0 if kind is k_f else 1)
                if done[key] >= 0:
                    unsound = True
                done[key] = end
                if kind is k_i:
                    split[stage * n_mb + mb] = 1
                if key in waiting:
                    ready.extend(waiting.pop(key))
            if type(instruction) is not Action:
                first_part, second = instruction.parts  # the shape the structure pass accepts today
                if (first_part.kind is k_f) == (second.kind is k_f) or first_part.mb == second.mb:
                    unsound = True
            if first[rank] < 0:
                first[rank] = start
            if record:
                timeline[rank].append(TimedOp(rank, start, end, instruction))
            busy[rank] += end - start
            t = end
            pos += 1
        position[rank] = pos
        time[rank] = t
    stuck = [r for r in range(ranks) if position[r] < len(compute[r])]
    if stuck:
        raise ScheduleError(f"the compute order deadlocks: rank(s) {stuck} wait for inputs that are never computed")
    # sound: every forward and (unless forward-only) input gradient computed, once (the run ran every op), every I
    # followed by its W and no W without its I
    forwards, grads = done[0::2], done[1::2]
    sound = not unsound and min(forwards, default=0.0) >= 0 and 1 not in split and 3 not in split
    sound = sound and program.pipelines == 1  # a micro-batch runs its copy's stages only: the structure pass's
    if program.forward_only:
        sound = sound and max(grads, default=-1.0) < 0
    else:
        sound = sound and min(grads, default=0.0) >= 0
    result = SimResult(
        program=program.with_streams(compute, has_comms=False),
        costs=costs,
        makespan=max(time, default=0.0),
        busy=tuple(busy),
        comm=(0.0,) * ranks,
        finish=tuple(time),
        start=tuple(max(f, 0.0) for f in first),
        peak_memory=peaks_of(program, costs, input_fraction),
        timeline=tuple(tuple(line) for line in timeline) if record else (),
        messages=_ideal_messages(program, timeline, delay) if record else (),
    )
    return result, sound


def _ideal_messages(program: Program, timeline: list[list[TimedOp]], delay: float) -> tuple[Message, ...]:
    """The ideal model's messages, for pictures and traces: one per value a compute op hands to another rank, sent
    when the op ends and arriving ``delay`` later."""
    where, links = program.stage_to_rank, chain_links(program.num_stages, program.pipelines)
    messages = []
    for rank, line in enumerate(timeline):
        for op in line:
            for action in op.instruction.parts:
                message = remote_output(action, rank, where, links)
                if message is not None:
                    send, peer, recv = message
                    messages.append(Message(send, recv, rank, peer, op.end, op.end + delay))
    return tuple(messages)

