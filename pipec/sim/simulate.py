"""simulate: run compiled instruction streams through an event-driven model with durations.

Execution follows version 2 of the point-to-point rule shared with the verifier's ``nccl`` model and the runtime:
- each rank (its host) runs its stream in order; a compute instruction takes its duration from the cost model (an
  overlapped pair takes the sum of its halves);
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
  any order (completing at max(both posted) + ``message_time``).
The simulation is a worklist over ranks (no global event heap: every time is fixed as soon as the batches it
depends on have started): a rank's host runs until a compute needs a batch that has not completed, and its batches
start as soon as they are posted and their predecessor has completed; a completion wakes the rank. Each
instruction is handled a bounded number of times, so the cost is linear in the number of instructions.

Peak activation memory comes from the one liveness function, ``pipec.verify.memory.peak_activations``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from pipec.errors import PipecInputError, ScheduleError
from pipec.gcpause import without_cyclic_gc
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
    comm: tuple[float, ...]  # time per rank waiting for its receives (rule 2) and, at the end, for its batches
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
        """Time each rank does no compute within the step (waiting for p2p batches included)."""
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
    try:
        with without_cyclic_gc():
            return _simulate(program, costs, record, input_fraction, p2p)
    except IndexError:  # a stage index beyond the placement; the structure check names it precisely
        raise ScheduleError(
            "an instruction names a stage outside the schedule's placement (run `pipec check` for details)"
        ) from None


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
    # without overlap the sender's rank pushes each message itself: posting a batch holds it message_time per send
    post_cost = 0.0 if costs.overlap else message_time
    streams = program.streams
    # Enum members hash through Python code, so the hot loop compares kinds by identity only.
    k_f, k_i, k_w = Kind.F, Kind.I, Kind.W
    k_sf, k_rf, k_sb, k_rb = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
    comm_kinds = (k_sf, k_rf, k_sb, k_rb)  # `in` on a tuple compares by identity first: no Enum hashing

    # Completion times for the data dependencies, flat arrays indexed stage * n_mb + mb (-1: not done yet).
    n_mb = program.microbatches
    forward_done = [-1.0] * (S * n_mb)
    grad_done = [-1.0] * (S * n_mb)  # B or I: the input gradient exists
    # A message is an int: (sending stage * n_mb + mb) * 2 + (0 forward, 1 backward). recv_batch[message]: the
    # batch (global id) holding its receive on the consuming rank, -1 until posted.
    recv_batch = [-1] * (S * n_mb * 2)

    # Batches, global ids in posting order: the rank, the stream slice, when posted, when it started running
    # (-1: not yet), when its last completed op completed, and how many of its ops still wait for a counterpart.
    b_rank: list[int] = []
    b_lo: list[int] = []
    b_hi: list[int] = []
    b_post: list[float] = []
    b_start: list[float] = []
    b_done: list[float] = []
    b_missing: list[int] = []
    b_ops: list[list[tuple]] = []  # per batch: (is_send, ordered pair of ranks, message, stream position) per op
    # per rank: its batches in order, the first one not yet completed (its NCCL stream's head), and when the
    # previous one completed
    batches: list[list[int]] = [[] for _ in range(P)]
    head = [0] * P
    stream_free = [0.0] * P
    # nccl: per ordered pair (src * P + dst), the running sends and receives in issue order; tagged: per message.
    # An entry: (start time of its batch, message, rank, stream position, batch).
    sends: list[list] = [[] for _ in range(P * P)]
    recvs: list[list] = [[] for _ in range(P * P)]
    tagged_sends: dict[int, tuple] = {}
    tagged_recvs: dict[int, tuple] = {}
    # the ordered pair of ranks of the message stage s sends forward (to s+1) or backward (to s-1); -1: none.
    # Indexed with stage + 1 for RECV_B and stage - 1 for RECV_F; index -1 and S hit the sentinel -1 entries.
    fwd_pair = [where[s] * P + where[s + 1] for s in range(S - 1)] + [-1, -1]
    bwd_pair = [-1] + [where[s] * P + where[s - 1] for s in range(1, S)] + [-1]

    time = [0.0] * P  # the host: when its next instruction may start
    position = [0] * P
    busy = [0.0] * P
    waited = [0.0] * P  # time the host waits for receives (rule 2) and, at the end, for its outstanding batches
    finish = [0.0] * P
    done = [False] * P
    first = [-1.0] * P
    premature = [-1] * P  # per rank: the position of the send it is stuck at (its value not computed yet)
    timeline: list[list[TimedOp]] = [[] for _ in range(P)]
    messages: list[Message] = []
    ready = deque(range(P))

    def matched(send_entry: tuple, recv_entry: tuple) -> None:
        """Both ends of one message are running (nccl) or posted (tagged): fix its times and tell both batches."""
        if send_entry[1] != recv_entry[1]:
            raise ScheduleError(_mismatch(program, send_entry, recv_entry))
        start = send_entry[0] if send_entry[0] > recv_entry[0] else recv_entry[0]
        end = start + message_time
        # tagged: the send was buffered and completed when posted (its batch was told then)
        for entry in (recv_entry,) if tagged else (send_entry, recv_entry):
            b = entry[4]
            if b_done[b] < end:
                b_done[b] = end
            b_missing[b] -= 1
            if b_missing[b] == 0:
                ready.append(b_rank[b])
        if record:
            s_rank, r_rank = send_entry[2], recv_entry[2]
            send, recv = streams[s_rank][send_entry[3]], streams[r_rank][recv_entry[3]]
            messages.append(Message(send, recv, s_rank, r_rank, start, end))

    def run_batch(b: int, start: float) -> None:
        """Batch ``b`` starts running at ``start``: match each of its ops with its counterpart if that runs."""
        b_start[b] = start
        b_done[b] = start
        rank = b_rank[b]
        stream = streams[rank]
        for is_send, pair, message, pos in b_ops[b]:
            entry = (start, message, rank, pos, b)
            if tagged:
                if is_send:
                    if message in tagged_sends:
                        raise ScheduleError(f"rank {rank}: op {pos} {stream[pos]} sends a message a second time")
                    tagged_sends[message] = entry
                    b_missing[b] -= 1  # buffered: complete when posted
                    waiting = tagged_recvs.pop(message, None)
                    if waiting is not None:
                        matched(entry, waiting)
                elif message in tagged_sends:
                    matched(tagged_sends[message], entry)
                else:
                    tagged_recvs[message] = entry
                continue
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
                    continue
                # matched(), inlined: the hot path of the nccl model
                end = (start if start > other[0] else other[0]) + message_time
                if b_done[b] < end:
                    b_done[b] = end
                b_missing[b] -= 1
                if b_missing[b] == 0:
                    ready.append(rank)
                peer = other[4]
                if b_done[peer] < end:
                    b_done[peer] = end
                b_missing[peer] -= 1
                if b_missing[peer] == 0:
                    ready.append(other[2])

    def advance(rank: int) -> None:
        """Run the rank's posted batches in order (rule 4; tagged: each at once) as far as completions allow."""
        mine = batches[rank]
        h = head[rank]
        while h < len(mine):
            b = mine[h]
            if b_start[b] < 0:
                free = stream_free[rank]
                run_batch(b, b_post[b] if b_post[b] > free else free)
            if b_missing[b]:
                break
            stream_free[rank] = b_done[b]
            h += 1
        head[rank] = h

    while ready:
        rank = ready.popleft()
        if done[rank]:
            continue
        advance(rank)
        stream = streams[rank]
        n = len(stream)
        pos = position[rank]
        t = time[rank]
        line = timeline[rank]
        work = 0.0  # compute time in this run of the rank, added to busy[rank] when it stops
        blocked = False
        while pos < n:
            instruction = stream[pos]
            if type(instruction) is Action and instruction[1] in comm_kinds:
                # a batch: posted at once, no waiting (rule 1)
                end = pos
                sent = 0
                unsent = -1  # the position of a send whose value this rank has not computed yet
                ops = []
                while end < n:
                    action = stream[end]
                    if type(action) is not Action:
                        break
                    stage, kind, mb = action
                    # pair tables: ordered pair of ranks (src * P + dst) per stage, -1 where none exists
                    if kind is k_rf:
                        is_send, pair, message = False, fwd_pair[stage - 1], ((stage - 1) * n_mb + mb) * 2
                    elif kind is k_rb:
                        is_send, pair, message = False, bwd_pair[stage + 1], ((stage + 1) * n_mb + mb) * 2 + 1
                    elif kind is k_sf:
                        is_send, pair, message = True, fwd_pair[stage], (stage * n_mb + mb) * 2
                    elif kind is k_sb:
                        is_send, pair, message = True, bwd_pair[stage], (stage * n_mb + mb) * 2 + 1
                    else:
                        break
                    if pair < 0 or where[stage] != rank or mb < 0 or mb >= n_mb:
                        raise ScheduleError(
                            f"rank {rank}: op {end} {action} names a stage or micro-batch out of range, "
                            "or a stage this rank does not hold"
                        )
                    if is_send:
                        # the runtime posts a send with the tensor its rank has computed: a send ahead of its
                        # producer leaves the rank stuck here for good (its stream runs in order), as in the verifier
                        if (forward_done if kind is k_sf else grad_done)[stage * n_mb + mb] < 0:
                            unsent = end
                            break
                        sent += 1
                    else:
                        recv_batch[message] = len(b_rank)
                    ops.append((is_send, pair, message, end))
                    end += 1
                if unsent >= 0:  # not posted: forget the receives noted above, the rank stops at the batch
                    for is_send, _, message, _ in ops:
                        if not is_send:
                            recv_batch[message] = -1
                    premature[rank] = unsent
                    blocked = True
                    break
                b_rank.append(rank)
                b_ops.append(ops)
                b_lo.append(pos)
                b_hi.append(end)
                b_post.append(t)
                b_start.append(-1.0)
                b_done.append(-1.0)
                b_missing.append(end - pos)
                batches[rank].append(len(b_rank) - 1)
                if tagged:  # no FIFO: every batch runs once posted
                    run_batch(len(b_rank) - 1, t)
                t += sent * post_cost
                pos = end
                if head[rank] == len(batches[rank]) - 1:  # else it starts when its predecessor completes
                    advance(rank)
                continue
            # compute: wait for the batches holding the receives it consumes (rule 2), then run
            start = t
            if type(instruction) is Action:  # the common case, inlined (the general loop below handles pairs)
                stage, kind, mb = instruction
                if mb < 0 or mb >= n_mb:
                    raise ScheduleError(f"rank {rank}: op {pos} {instruction} names a micro-batch out of range")
                index = stage * n_mb + mb
                if kind is k_f:
                    message = ((stage - 1) * n_mb + mb) * 2 if stage > 0 and where[stage - 1] != rank else -1
                elif kind is k_w:
                    message = -1
                else:
                    message = ((stage + 1) * n_mb + mb) * 2 + 1 if stage < S - 1 and where[stage + 1] != rank else -1
                if message >= 0:
                    b = recv_batch[message]
                    if b < 0 or b_rank[b] != rank:
                        _no_receive(instruction, rank, pos)
                    if b_start[b] < 0 or b_missing[b]:
                        break  # blocked: woken when the batch completes
                    if b_done[b] > start:
                        start = b_done[b]
                if kind is k_f:
                    if stage > 0 and not 0 <= forward_done[index - n_mb] <= start:
                        _early(instruction, rank, pos, f"the forward of stage {stage - 1}")
                    end_time = start + d_f[stage]
                    forward_done[index] = end_time
                elif kind is k_w:
                    if not 0 <= grad_done[index] <= start:
                        _early(instruction, rank, pos, f"the input-gradient backward (I) of stage {stage}")
                    end_time = start + d_w[stage]
                else:
                    if not 0 <= forward_done[index] <= start:
                        _early(instruction, rank, pos, f"its forward {Action(stage, Kind.F, mb)}")
                    if stage < S - 1 and not 0 <= grad_done[index + n_mb] <= start:
                        _early(instruction, rank, pos, f"the backward of stage {stage + 1}")
                    end_time = start + (d_i[stage] if kind is k_i else d_b[stage])
                    grad_done[index] = end_time
                if first[rank] < 0:
                    first[rank] = start
                if record:
                    line.append(TimedOp(rank, start, end_time, instruction))
                waited[rank] += start - t
                work += end_time - start
                t = end_time
                pos += 1
                continue
            parts = instruction.parts
            for stage, kind, mb in parts:
                if kind is k_f:
                    message = ((stage - 1) * n_mb + mb) * 2 if stage > 0 and where[stage - 1] != rank else -1
                elif kind is k_w:
                    message = -1
                elif kind in comm_kinds:
                    raise ScheduleError(f"rank {rank}: op {pos} {instruction} pairs a send/recv with compute")
                else:
                    message = ((stage + 1) * n_mb + mb) * 2 + 1 if stage < S - 1 and where[stage + 1] != rank else -1
                if message >= 0:
                    b = recv_batch[message]
                    if b < 0 or b_rank[b] != rank:
                        _no_receive(Action(stage, kind, mb), rank, pos)
                    if b_start[b] < 0 or b_missing[b]:
                        blocked = True
                        break
                    if b_done[b] > start:
                        start = b_done[b]
            if blocked:
                break
            end_time = start
            for stage, kind, mb in parts:
                index = stage * n_mb + mb
                if mb < 0 or mb >= n_mb:
                    raise ScheduleError(f"rank {rank}: op {pos} {instruction} names a micro-batch out of range")
                if kind is k_f:
                    if stage > 0 and not 0 <= forward_done[index - n_mb] <= start:
                        _early(instruction, rank, pos, f"the forward of stage {stage - 1}")
                    end_time += d_f[stage]
                elif kind is k_w:
                    if not 0 <= grad_done[index] <= start:
                        _early(instruction, rank, pos, f"the input-gradient backward (I) of stage {stage}")
                    end_time += d_w[stage]
                else:
                    if not 0 <= forward_done[index] <= start:
                        _early(instruction, rank, pos, f"its forward {Action(stage, Kind.F, mb)}")
                    if stage < S - 1 and not 0 <= grad_done[index + n_mb] <= start:
                        _early(instruction, rank, pos, f"the backward of stage {stage + 1}")
                    end_time += d_i[stage] if kind is k_i else d_b[stage]
            for stage, kind, mb in parts:
                if kind is k_f:
                    forward_done[stage * n_mb + mb] = end_time
                elif kind is not k_w:
                    grad_done[stage * n_mb + mb] = end_time
            if first[rank] < 0:
                first[rank] = start
            if record:
                line.append(TimedOp(rank, start, end_time, instruction))
            waited[rank] += start - t
            work += end_time - start
            t = end_time
            pos += 1
        position[rank] = pos
        time[rank] = t
        busy[rank] += work
        if pos == n and head[rank] == len(batches[rank]):  # end of step: every batch has completed
            done[rank] = True
            end_time = stream_free[rank] if stream_free[rank] > t else t
            waited[rank] += end_time - t
            finish[rank] = end_time

    stuck = [r for r in range(P) if not done[r]]
    if stuck:
        unsent = [_premature_send(program, r, position[r], premature[r]) for r in stuck if premature[r] >= 0]
        if tagged:
            header = f"deadlock under the tagged p2p model: rank(s) {stuck} cannot finish"
            raise ScheduleError("\n".join([header, *unsent]))
        if not unsent:  # a send ahead of its value is the cause; a mismatch on the channel comes second
            _check_pair_order(program)
        state = (position, batches, head, b_lo, b_hi, b_start, sends, recvs)
        raise ScheduleError(_deadlock_message(program, stuck, unsent, premature, *state))
    if record:
        for b, rank in enumerate(b_rank):
            timeline[rank].append(TimedOp(rank, b_start[b], b_done[b], tuple(streams[rank][b_lo[b] : b_hi[b]])))
        for line in timeline:
            line.sort(key=lambda op: (op.start, not op.is_comm))
    return SimResult(
        program=program,
        costs=costs,
        makespan=max(finish, default=0.0),
        busy=tuple(busy),
        comm=tuple(waited),
        finish=tuple(finish),
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


def _no_receive(action: Action, rank: int, pos: int) -> None:
    stage, kind, _ = action
    what = f"activation from stage {stage - 1}" if kind is Kind.F else f"gradient from stage {stage + 1}"
    raise ScheduleError(
        f"rank {rank}: op {pos} {action} runs before its input {what} is received "
        "(no receive for it is posted before it)"
    )


def _early(action: Action, rank: int, pos: int, what: str) -> None:
    raise ScheduleError(f"rank {rank}: op {pos} {action} runs before {what} has finished")


def _check_pair_order(program: Program) -> None:
    """Raise the p2p order mismatch, if any, that a deadlock kept the simulation from reaching: the k-th send from
    src to dst against the k-th receive on dst from src, over the whole streams."""
    P, where = program.ranks, program.stage_to_rank  # noqa: N806
    sent: dict[int, list] = {}
    received: dict[int, list] = {}
    for rank, stream in enumerate(program.streams):
        for pos, action in enumerate(stream):
            if type(action) is not Action or not action.kind.is_comm:
                continue
            stage, kind, mb = action
            step = 1 if kind in (Kind.SEND_F, Kind.RECV_B) else -1
            peer = where[stage + step]
            if kind in _SEND:
                message = (stage * program.microbatches + mb) * 2 + (kind is Kind.SEND_B)
                sent.setdefault(rank * P + peer, []).append((0.0, message, rank, pos, -1))
            else:
                message = ((stage + step) * program.microbatches + mb) * 2 + (kind is Kind.RECV_B)
                received.setdefault(peer * P + rank, []).append((0.0, message, rank, pos, -1))
    for pair, entries in sent.items():
        for send_entry, recv_entry in zip(entries, received.get(pair, ()), strict=False):
            if send_entry[1] != recv_entry[1]:
                raise ScheduleError(_mismatch(program, send_entry, recv_entry))


def _deadlock_message(
    program: Program, stuck, unsent, premature, position, batches, head, b_lo, b_hi, b_start, sends, recvs
) -> str:
    """Each stuck rank: a send ahead of its value it cannot post (``unsent``, lines already written), or the
    instruction its host waits at (or the end of the step) and the batch at the head of its NCCL stream with the ops
    whose counterparts never run."""
    P, where = program.ranks, program.stage_to_rank  # noqa: N806
    lines = [f"deadlock under the nccl p2p model: {len(stuck)} rank(s) cannot finish", *unsent]
    for rank in (r for r in stuck if premature[r] < 0):
        stream = program.streams[rank]
        pos = position[rank]
        at = f"is stuck at op {pos} {stream[pos]}" if pos < len(stream) else "is stuck at the end of the step"
        if head[rank] == len(batches[rank]):  # cannot happen: the host stops at a compute or at the end
            lines.append(f"rank {rank} {at}")
            continue
        b = batches[rank][head[rank]]
        batch = " ".join(map(str, stream[b_lo[b] : b_hi[b]]))
        if b_start[b] < 0:  # cannot happen: a posted head batch always runs; kept for a clear message
            lines.append(f"rank {rank} {at}; its batch [{batch}] (op {b_lo[b]}) never starts")
            continue
        waiting = []
        for i in range(b_lo[b], b_hi[b]):
            stage, kind, _ = action = stream[i]
            if kind in _SEND:
                peer = where[stage + (1 if kind is Kind.SEND_F else -1)]
                mine, theirs, what = sends[rank * P + peer], recvs[rank * P + peer], f"receive from rank {rank}"
            else:
                peer = where[stage + (-1 if kind is Kind.RECV_F else 1)]
                mine, theirs, what = recvs[peer * P + rank], sends[peer * P + rank], f"send to rank {rank}"
            k = next((j for j, e in enumerate(mine) if e[2] == rank and e[3] == i), None)
            if k is not None and k >= len(theirs):
                waiting.append(f"{action} waits for rank {peer}'s {_ordinal(k + 1)} {what} to run")
        lines.append(f"rank {rank} {at}, waiting for batch [{batch}] (op {b_lo[b]}): " + "; ".join(waiting))
    return "\n".join(lines)


def _premature_send(program: Program, rank: int, pos: int, send_pos: int) -> str:
    """The line for a rank stuck at a batch holding a send of a value it has not computed: which value, and where
    its stream computes it (later, or nowhere)."""
    stream = program.streams[rank]
    send = stream[send_pos]
    producers = (Kind.F,) if send.kind is Kind.SEND_F else (Kind.B, Kind.I)
    value = "output" if send.kind is Kind.SEND_F else "input gradient"
    what = f"stage {send.stage}'s {value} for micro-batch {send.mb}"
    later = next(
        (f"op {i} {x}" for i, x in enumerate(stream) for a in x.parts
         if a.stage == send.stage and a.mb == send.mb and a.kind in producers),
        None,
    )
    where = f"its stream computes it only later, at {later}" if later else "its stream never computes it"
    batch = "" if pos == send_pos else f" (in the batch at op {pos}, which it cannot post)"
    return f"rank {rank} is stuck at op {send_pos} {send}{batch}: it sends {what}, not computed yet; {where}"
