"""simulate: run compiled instruction streams through an event-driven model with durations.

Execution follows the point-to-point rule shared with the verifier's ``nccl`` model and the runtime:
- each rank runs its stream in order; a compute instruction starts when the previous one ends and takes its
  duration from the cost model (an overlapped pair takes the sum of its halves);
- a maximal run of consecutive SEND/RECV instructions is one *batch*, posted at once when the rank reaches it;
- messages on one ordered pair of ranks match in issue order (the k-th send from a to b meets the k-th receive
  on b from a); if they name different (stage, kind, micro-batch) the schedule is invalid (p2p order mismatch);
- a message's transfer starts once both ends are posted and takes ``costs.message_time``; the batch ends when
  its last message is done (without overlap, sends included; with ``overlap`` a send is released at the
  transfer's start). A rank blocked in a batch is idle.
The simulation is a worklist over ranks (no global event heap is needed because a rank only ever waits for a
peer to *post*, which fixes every time at once): each rank runs until it posts a batch whose counterparts are not
all posted yet, and is woken when the last one is. Cost is linear in the number of instructions.

Peak activation memory comes from the one liveness function, ``pipec.verify.memory.peak_activations``.
"""

from __future__ import annotations

import gc
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from pipec.errors import PipecInputError, ScheduleError
from pipec.ir import Action, Instruction, Kind, Program
from pipec.sim.costs import DEFAULT_COSTS, Costs
from pipec.verify.memory import peak_activations

_SEND = (Kind.SEND_F, Kind.SEND_B)
P2P_MODELS = ("nccl", "tagged", "ideal")


class TimedOp(NamedTuple):
    """One executed instruction (or one p2p batch, then ``instruction`` is a tuple of actions) on one rank."""

    rank: int
    start: float
    end: float
    instruction: Instruction | tuple[Action, ...]

    @property
    def is_comm(self) -> bool:
        return type(self.instruction) is tuple


class Message(NamedTuple):
    """One matched send -> receive: the transfer runs from ``start`` to ``end``."""

    send: Action
    recv: Action
    src: int
    dst: int
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    program: Program
    costs: Costs
    makespan: float
    busy: tuple[float, ...]  # compute time per rank
    comm: tuple[float, ...]  # time per rank spent inside p2p batches (waiting or transferring)
    finish: tuple[float, ...]  # when each rank's last instruction ends
    start: tuple[float, ...]  # when each rank's first compute starts
    peak_memory: tuple[float, ...]
    timeline: tuple[tuple[TimedOp, ...], ...] = field(default=(), repr=False)  # per rank, when recorded
    messages: tuple[Message, ...] = field(default=(), repr=False)

    @property
    def ranks(self) -> int:
        return self.program.ranks

    @property
    def idle(self) -> tuple[float, ...]:
        """Time each rank does no compute within the step (waiting in p2p batches included)."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """idle / (P x makespan)."""
        total = self.ranks * self.makespan
        return sum(self.idle) / total if total else 0.0

    @property
    def ideal(self) -> float:
        """Total compute / P: the makespan with no bubble at all."""
        return sum(self.busy) / self.ranks

    @property
    def efficiency(self) -> float:
        return self.ideal / self.makespan if self.makespan else 1.0

    @property
    def span_idle(self) -> tuple[float, ...]:
        """Idle time inside each rank's own span (its first compute to its last op): the bubble a rank would
        still see if steps overlapped (the Zero Bubble paper's post-validation removes the step boundary)."""
        return tuple(f - s - b for f, s, b in zip(self.finish, self.start, self.busy, strict=True))

    def to_json(self) -> dict:
        p = self.program
        return {
            "schedule": p.name,
            "P": p.ranks,
            "M": p.microbatches,
            "V": p.chunks,
            "costs": self.costs.describe(),
            "makespan": self.makespan,
            "ideal": self.ideal,
            "efficiency": self.efficiency,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_max": max(self.peak_memory, default=0.0),
            "ranks": [
                {
                    "rank": r,
                    "busy": self.busy[r],
                    "idle": self.idle[r],
                    "comm": self.comm[r],
                    "span_idle": self.span_idle[r],
                    "finish": self.finish[r],
                    "peak_memory": self.peak_memory[r],
                }
                for r in range(p.ranks)
            ],
        }


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
    a receive waits for the send of its (stage, micro-batch) in any order) or ``ideal`` (the compute order alone,
    send/recv instructions ignored: every op starts once its rank is free and its inputs have arrived, a message
    taking ``message_time``; the timeline the papers draw, independent of where send/recv were placed).
    Raises ScheduleError on a p2p order mismatch, a deadlock, or a compute op that runs before its input.
    """
    # The run keeps one small record per message until the end; the cyclic garbage collector would rescan them
    # again and again (it halves the speed at 800k instructions) and nothing here forms a cycle.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _simulate(program, costs, record, input_fraction, p2p)
    except IndexError:  # a stage index beyond the placement; the structure check names it precisely
        raise ScheduleError(
            "an instruction names a stage outside the schedule's placement (run `pipec check` for details)"
        ) from None
    finally:
        if collecting:
            gc.enable()


def _simulate(program: Program, costs: Costs, record: bool, input_fraction: float | None, p2p: str) -> SimResult:
    if not program.has_comms and p2p != "ideal":
        from pipec.passes.p2p import insert_p2p_ops

        program = insert_p2p_ops(program)
    if p2p not in P2P_MODELS:
        raise PipecInputError(f"unknown p2p model {p2p!r}; expected one of {', '.join(P2P_MODELS)}")
    if p2p == "ideal":
        return _simulate_dataflow(program, costs, record, input_fraction)
    tagged = p2p == "tagged"
    P, S = program.ranks, program.num_stages  # noqa: N806 - the papers' names
    where = program.stage_to_rank
    durations = costs.per_stage(S)
    d_f, d_b, d_i, d_w = (durations[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W))
    message_time = costs.message_time
    send_release = 0.0 if costs.overlap else message_time
    streams = program.streams
    # Enum members hash through Python code, so the hot loop compares kinds by identity only.
    k_f, k_b, k_i, k_w = Kind.F, Kind.B, Kind.I, Kind.W
    k_sf, k_rf, k_sb, k_rb = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B

    # Completion times for the data dependencies, flat arrays indexed stage * n_mb + mb (-1: not done yet).
    n_mb = program.microbatches
    forward_done = [-1.0] * (S * n_mb)
    grad_done = [-1.0] * (S * n_mb)  # B or I: the input gradient exists

    # A message is an int: (sending stage * n_mb + mb) * 2 + (0 forward, 1 backward).
    # nccl: per ordered pair (src * P + dst), the posted sends and receives in issue order.
    # tagged: per message, the posted send or the receive waiting for it.
    # An entry: [post_time, message, rank, position]. A rank has at most one posted batch, so the batch's
    # bookkeeping is per rank: how many of its ops still wait for a counterpart, and when it may end so far.
    sends: list[list] = [[] for _ in range(P * P)]
    recvs: list[list] = [[] for _ in range(P * P)]
    tagged_sends: dict[int, list] = {}
    tagged_recvs: dict[int, list] = {}
    missing = [0] * P
    release_at = [0.0] * P
    # the ordered pair of ranks of the message stage s sends forward (to s+1) or backward (to s-1); -1: none.
    # Indexed with stage + 1 for RECV_B and stage - 1 for RECV_F; index -1 and S hit the sentinel -1 entries.
    fwd_pair = [where[s] * P + where[s + 1] for s in range(S - 1)] + [-1, -1]
    bwd_pair = [-1] + [where[s] * P + where[s - 1] for s in range(1, S)] + [-1]

    time = [0.0] * P
    position = [0] * P
    busy = [0.0] * P
    comm = [0.0] * P
    # when each rank's first compute starts: 0 unless it opens with a send/recv batch
    first = [0.0 if s and not (type(s[0]) is Action and s[0].kind.is_comm) else -1.0 for s in streams]
    posted = [False] * P  # is the batch at position[r] posted?
    batch_end_pos = [0] * P
    timeline: list[list[TimedOp]] = [[] for _ in range(P)]
    messages: list[Message] = []
    ready = deque(range(P))
    active = [True] * P  # queued or running: a release need not wake it

    def matched(send_entry: tuple, recv_entry: tuple) -> None:
        """Both ends of one message are posted: fix its times and tell both batches."""
        if send_entry[1] != recv_entry[1]:
            raise ScheduleError(_mismatch(program, send_entry, recv_entry))
        if tagged:  # the data left when the send was posted; the sender did not wait
            end = max(recv_entry[0], send_entry[0] + message_time)
            start = end - message_time
            ends = ((recv_entry[2], end),)
        else:
            start = max(send_entry[0], recv_entry[0])
            end = start + message_time
            ends = ((send_entry[2], start + send_release), (recv_entry[2], end))
        for who, when in ends:
            if release_at[who] < when:
                release_at[who] = when
            missing[who] -= 1
            if missing[who] == 0 and not active[who]:
                active[who] = True
                ready.append(who)
        if record:
            s_rank, r_rank = send_entry[2], recv_entry[2]
            send, recv = streams[s_rank][send_entry[3]], streams[r_rank][recv_entry[3]]
            messages.append(Message(send, recv, s_rank, r_rank, start, end))

    def post_tagged(entry: tuple, is_send: bool) -> None:
        message = entry[1]
        if is_send:
            if message in tagged_sends:
                rank, i = entry[2], entry[3]
                raise ScheduleError(f"rank {rank}: op {i} {streams[rank][i]} sends a message a second time")
            tagged_sends[message] = entry
            waiting = tagged_recvs.pop(message, None)
            if waiting is not None:
                matched(entry, waiting)
            return
        missing[entry[2]] += 1
        if message in tagged_sends:
            matched(tagged_sends[message], entry)
        else:
            tagged_recvs[message] = entry

    while ready:
        rank = ready.popleft()
        stream = streams[rank]
        n = len(stream)
        pos = position[rank]
        t = time[rank]
        line = timeline[rank]
        work = 0.0  # compute time in this run of the rank, added to busy[rank] when it stops
        while pos < n:
            instruction = stream[pos]
            if type(instruction) is Action:
                stage, kind, mb = instruction
                index = stage * n_mb + mb
                if (mb < 0 or mb >= n_mb) and kind.is_compute:
                    raise ScheduleError(f"rank {rank}: op {pos} {instruction} names a micro-batch out of range")
                if kind is k_f:
                    if stage > 0 and not 0 <= forward_done[index - n_mb] <= t:
                        _early(instruction, rank, pos, f"the forward of stage {stage - 1}")
                    end_time = t + d_f[stage]
                    forward_done[index] = end_time
                elif kind is k_i or kind is k_b:
                    if not 0 <= forward_done[index] <= t:
                        _early(instruction, rank, pos, f"its forward {Action(stage, Kind.F, mb)}")
                    if stage < S - 1 and not 0 <= grad_done[index + n_mb] <= t:
                        _early(instruction, rank, pos, f"the backward of stage {stage + 1}")
                    end_time = t + (d_i[stage] if kind is k_i else d_b[stage])
                    grad_done[index] = end_time
                elif kind is k_w:
                    if not 0 <= grad_done[index] <= t:
                        _early(instruction, rank, pos, f"the input-gradient backward (I) of stage {stage}")
                    end_time = t + d_w[stage]
                else:  # a send/recv: the start of a batch
                    if not posted[rank]:
                        posted[rank] = True
                        release_at[rank] = t
                        end = pos
                        while end < n:
                            action = stream[end]
                            if type(action) is not Action:
                                break
                            stage, kind, mb = action
                            # pair tables: ordered pair of ranks (src * P + dst) per stage, -1 where none exists
                            if kind is k_sf:
                                is_send, pair, message = True, fwd_pair[stage], (stage * n_mb + mb) * 2
                            elif kind is k_rf:
                                is_send, pair, message = False, fwd_pair[stage - 1], ((stage - 1) * n_mb + mb) * 2
                            elif kind is k_sb:
                                is_send, pair, message = True, bwd_pair[stage], (stage * n_mb + mb) * 2 + 1
                            elif kind is k_rb:
                                is_send, pair, message = False, bwd_pair[stage + 1], ((stage + 1) * n_mb + mb) * 2 + 1
                            else:
                                break
                            if pair < 0 or where[stage] != rank or mb < 0 or mb >= n_mb:
                                raise ScheduleError(
                                    f"rank {rank}: op {end} {action} names a stage or micro-batch out of range, "
                                    "or a stage this rank does not hold"
                                )
                            entry = (t, message, rank, end)
                            end += 1
                            if tagged:
                                post_tagged(entry, is_send)
                                continue
                            missing[rank] += 1
                            if is_send:
                                mine, theirs = sends[pair], recvs[pair]
                            else:
                                mine, theirs = recvs[pair], sends[pair]
                            k = len(mine)
                            mine.append(entry)
                            if k < len(theirs):
                                other = theirs[k]
                                if record or other[1] != message:
                                    matched(entry, other) if is_send else matched(other, entry)
                                else:  # matched(), inlined: the hot path of the nccl model
                                    start = t if t > other[0] else other[0]
                                    mine_end = start + (send_release if is_send else message_time)
                                    peer = other[2]
                                    if release_at[rank] < mine_end:
                                        release_at[rank] = mine_end
                                    missing[rank] -= 1
                                    peer_end = start + (message_time if is_send else send_release)
                                    if release_at[peer] < peer_end:
                                        release_at[peer] = peer_end
                                    missing[peer] -= 1
                                    if missing[peer] == 0 and not active[peer]:
                                        active[peer] = True
                                        ready.append(peer)
                        batch_end_pos[rank] = end
                    if missing[rank]:
                        active[rank] = False
                        break  # blocked: woken when the last counterpart is posted
                    end_time = release_at[rank]
                    posted[rank] = False
                    comm[rank] += end_time - t
                    if first[rank] < 0:  # a rank that starts by receiving starts computing after that batch
                        first[rank] = end_time
                    if record:
                        line.append(TimedOp(rank, t, end_time, tuple(stream[pos : batch_end_pos[rank]])))
                    t = end_time
                    pos = batch_end_pos[rank]
                    continue
                if record:
                    line.append(TimedOp(rank, t, end_time, instruction))
                work += end_time - t
                t = end_time
                pos += 1
                continue
            # an overlapped pair: both halves back to back, as one instruction
            end_time = t
            for action in instruction.parts:
                stage, kind, mb = action
                if kind.is_comm:
                    raise ScheduleError(f"rank {rank}: op {pos} {instruction} pairs a send/recv with compute")
                index = stage * n_mb + mb
                if kind is k_f:
                    if stage > 0 and not 0 <= forward_done[index - n_mb] <= t:
                        _early(action, rank, pos, f"the forward of stage {stage - 1}")
                    end_time += d_f[stage]
                else:
                    if kind is not k_w and not 0 <= forward_done[index] <= t:
                        _early(action, rank, pos, f"its forward {Action(stage, Kind.F, mb)}")
                    if kind is not k_w and stage < S - 1 and not 0 <= grad_done[index + n_mb] <= t:
                        _early(action, rank, pos, f"the backward of stage {stage + 1}")
                    end_time += durations[kind][stage]
            for stage, kind, mb in instruction.parts:
                if kind is k_f:
                    forward_done[stage * n_mb + mb] = end_time
                elif kind is not k_w:
                    grad_done[stage * n_mb + mb] = end_time
            if record:
                line.append(TimedOp(rank, t, end_time, instruction))
            work += end_time - t
            t = end_time
            pos += 1
        position[rank] = pos
        time[rank] = t
        busy[rank] += work

    stuck = [r for r in range(P) if position[r] < len(streams[r])]
    if stuck:
        if tagged:
            raise ScheduleError(f"deadlock under the tagged p2p model: rank(s) {stuck} cannot finish")
        raise ScheduleError(_deadlock_message(program, stuck, position, sends, recvs))
    makespan = max(time, default=0.0)
    return SimResult(
        program=program,
        costs=costs,
        makespan=makespan,
        busy=tuple(busy),
        comm=tuple(comm),
        finish=tuple(time),
        start=tuple(max(f, 0.0) for f in first),
        peak_memory=_peaks(program, costs, input_fraction),
        timeline=tuple(tuple(t) for t in timeline) if record else (),
        messages=tuple(messages),
    )


def _simulate_dataflow(program: Program, costs: Costs, record: bool, input_fraction: float | None) -> SimResult:
    """The ``ideal`` model: compute instructions in program order, each starting once its rank is free and its
    inputs exist (plus ``message_time`` when the producer lives on another rank). Send/recv are ignored."""
    compute = program.compute_streams()
    ranks, stages = program.ranks, program.num_stages
    where = program.stage_to_rank
    durations = costs.per_stage(stages)
    delay = costs.message_time
    n_mb = 1 + max((a.mb for st in compute for ins in st for a in ins.parts), default=0)
    # when each value exists, flat: (stage * n_mb + mb) * 2 + (0: the forward output, 1: the input gradient)
    done = [-1.0] * (stages * n_mb * 2)
    waiting: dict[int, list[int]] = {}
    time, position, busy, first = [0.0] * ranks, [0] * ranks, [0.0] * ranks, [-1.0] * ranks
    timeline: list[list[TimedOp]] = [[] for _ in range(ranks)]
    ready = deque(range(ranks))
    k_f, k_w, k_i = Kind.F, Kind.W, Kind.I
    d_f, d_b, d_i, d_w = (durations[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W))
    last = stages - 1

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
                base = (stage * n_mb + mb) * 2
                if kind is k_f:
                    needs = (base - 2 * n_mb,) if stage > 0 else ()
                    end += d_f[stage]
                elif kind is k_w:
                    needs = (base + 1,)
                    end += d_w[stage]
                else:
                    needs = (base, base + 2 * n_mb + 1) if stage < last else (base,)
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
            end += start
            for stage, kind, mb in instruction.parts:
                if kind is not k_w:
                    key = (stage * n_mb + mb) * 2 + (0 if kind is k_f else 1)
                    done[key] = end
                    if key in waiting:
                        ready.extend(waiting.pop(key))
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
    messages = []
    if record:
        for rank, line in enumerate(timeline):
            for op in line:
                for stage, kind, mb in op.instruction.parts:
                    target = stage + 1 if kind is Kind.F else stage - 1
                    if kind is Kind.W or not 0 <= target < stages or where[target] == rank:
                        continue
                    send_kind, recv_kind = (Kind.SEND_F, Kind.RECV_F) if kind is Kind.F else (Kind.SEND_B, Kind.RECV_B)
                    messages.append(
                        Message(
                            Action(stage, send_kind, mb),
                            Action(target, recv_kind, mb),
                            rank,
                            where[target],
                            op.end,
                            op.end + delay,
                        )
                    )
    del n_mb
    return SimResult(
        program=program.with_streams(compute, has_comms=False),
        costs=costs,
        makespan=max(time, default=0.0),
        busy=tuple(busy),
        comm=(0.0,) * ranks,
        finish=tuple(time),
        start=tuple(max(f, 0.0) for f in first),
        peak_memory=_peaks(program, costs, input_fraction),
        timeline=tuple(tuple(line) for line in timeline) if record else (),
        messages=tuple(messages),
    )


def _peaks(program: Program, costs: Costs, input_fraction: float | None) -> tuple[float, ...]:
    """Peak activations per rank from the one liveness function, with the cost model's memory settings."""
    fraction = costs.input_fraction if input_fraction is None else input_fraction
    sizes = None
    if costs.activation is not None:
        sizes = costs.activation if isinstance(costs.activation, tuple) else (costs.activation,) * program.num_stages
        if len(sizes) != program.num_stages:
            raise PipecInputError(
                f"cost 'activation' has {len(sizes)} entries, the schedule has {program.num_stages} stages"
            )
    return peak_activations(program, fraction, sizes)


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _mismatch(program: Program, send_entry: list, recv_entry: list) -> str:
    src, dst = send_entry[2], recv_entry[2]
    send, recv = program.streams[src][send_entry[3]], program.streams[dst][recv_entry[3]]
    k = sum(1 for a in program.streams[src][: send_entry[3] + 1] if _is_send_to(program, a, src, dst))
    return (
        f"p2p order mismatch between rank {src} and rank {dst}: the {_ordinal(k)} message from rank {src} to "
        f"rank {dst} is {send} (op {send_entry[3]} on rank {src}), but the {_ordinal(k)} receive on rank {dst} "
        f"from rank {src} is {recv} (op {recv_entry[3]}); messages on one pair of ranks match in issue order"
    )


def _is_send_to(program: Program, instruction: Instruction, src: int, dst: int) -> bool:
    if not isinstance(instruction, Action) or instruction.kind not in _SEND:
        return False
    step = 1 if instruction.kind is Kind.SEND_F else -1
    return program.stage_to_rank[instruction.stage + step] == dst


def _early(action: Action, rank: int, pos: int, what: str) -> None:
    raise ScheduleError(f"rank {rank}: op {pos} {action} runs before {what} has finished")


def _deadlock_message(program: Program, stuck: list[int], position: list[int], sends, recvs) -> str:
    P = program.ranks  # noqa: N806
    lines = [f"deadlock under the nccl p2p model: {len(stuck)} rank(s) cannot finish"]
    for rank in stuck:
        stream = program.streams[rank]
        pos = end = position[rank]
        while end < len(stream) and isinstance(stream[end], Action) and stream[end].kind.is_comm:
            end += 1
        waiting = []
        for i in range(pos, end):
            action = stream[i]
            stage, kind, _ = action
            if kind in _SEND:
                peer = program.stage_to_rank[stage + (1 if kind is Kind.SEND_F else -1)]
                mine, theirs = sends[rank * P + peer], recvs[rank * P + peer]
            else:
                peer = program.stage_to_rank[stage + (-1 if kind is Kind.RECV_F else 1)]
                mine, theirs = recvs[peer * P + rank], sends[peer * P + rank]
            k = next((j for j, e in enumerate(mine) if e[2] == rank and e[3] == i), None)
            if k is not None and k >= len(theirs):
                what = "receive" if kind in _SEND else "send"
                waiting.append(f"{action} waits for rank {peer} to post its {_ordinal(k + 1)} {what}")
        batch = " ".join(map(str, stream[pos:end]))
        lines.append(f"rank {rank} is stuck at op {pos}, batch [{batch}]: " + "; ".join(waiting))
    return "\n".join(lines)
