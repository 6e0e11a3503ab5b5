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
  any order (completing at max(both posted) + ``message_time``);
- ``torch``: torch's ``_PipelineScheduleRuntime``, the ``nccl`` rule with every SEND/RECV instruction a batch of
  its own (torch posts each action by itself; the verifier's ``torch`` model, cut by ``batched``).
The simulation is a worklist over ranks (no global event heap: every time is fixed as soon as the batches it
depends on have started): a rank's host runs until a compute needs a batch that has not completed, and its batches
start as soon as they are posted and their predecessor has completed; a completion wakes the rank. Each
instruction is handled a bounded number of times, so the cost is linear in the number of instructions.

A structurally invalid program (what `pipec check`'s structure pass refuses) is not simulated: ``simulate`` raises
that pass's verdict. The run proves soundness from its own arrays (``_Run.sound``) and asks the pass only when
that proof fails or the run stops at an error, so the check costs no second pass over the streams.

Peak activation memory comes from the one liveness function, ``pipec.verify.memory.peak_activations``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from pipec.errors import PipecInputError, ScheduleError
from pipec.gcpause import without_cyclic_gc
from pipec.ir import Action, Instruction, Kind, Overlap, Program
from pipec.sim.costs import DEFAULT_COSTS, Costs, length_mismatch
from pipec.verify.deadlock import batched
from pipec.verify.memory import peak_activations

_SEND = (Kind.SEND_F, Kind.SEND_B)
P2P_MODELS = ("nccl", "tagged", "torch", "ideal")


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
        return tuple(_clean(self.makespan - b, self.makespan) for b in self.busy)

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
        return tuple(_clean(f - s - b, f) for f, s, b in zip(self.finish, self.start, self.busy, strict=True))

    def to_json(self) -> dict:
        p = self.program
        idle, span_idle = self.idle, self.span_idle  # properties building a tuple of P: once, not once per rank
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
                    "idle": idle[r],
                    "comm": self.comm[r],
                    "span_idle": span_idle[r],
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
    a receive waits for the send of its (stage, micro-batch) in any order), ``torch`` (torch's runtime: ``nccl``
    with each send/recv posted as a batch of its own) or ``ideal`` (the compute order alone,
    send/recv instructions ignored: every op starts once its rank is free and its inputs have arrived, a message
    taking ``message_time``; the timeline the papers draw, independent of where send/recv were placed).
    Raises ScheduleError with `pipec check`'s structure verdict on a structurally invalid program (under
    ``ideal``: invalid compute orders, the send/recv being ignored), and on a p2p order mismatch, a deadlock, or
    a compute op that runs before its input.
    """
    if p2p not in P2P_MODELS:
        raise PipecInputError(f"unknown p2p model {p2p!r}; expected one of {', '.join(P2P_MODELS)}")
    # The run keeps one small record per message until the end; the cyclic garbage collector would rescan them
    # again and again (it halves the speed at 800k instructions) and nothing here forms a cycle.
    try:
        with without_cyclic_gc():
            result, sound = _simulate(program, costs, record, input_fraction, p2p)
    except (ScheduleError, IndexError) as error:
        # What the run tripped over is most often a symptom (`7I0 runs before its forward 7F0` when stage 7 never
        # runs a forward at all): the structure pass names the cause, so its verdict wins when it has one.
        verdict = _structure_verdict(program, p2p)
        if verdict:
            raise ScheduleError(verdict) from None
        if isinstance(error, IndexError):  # cannot happen on a sound structure; kept for a clear message
            raise ScheduleError(
                "an instruction names a stage outside the schedule's placement (run `pipec check` for details)"
            ) from None
        raise
    if not sound:  # the run could not vouch for the structure (see _Run.sound): the structure pass decides
        verdict = _structure_verdict(program, p2p)
        if verdict:
            raise ScheduleError(verdict)
    return result


def _structure_verdict(program: Program, p2p: str) -> str:
    """`pipec check`'s structure verdict on what the model runs ("" when sound): the whole program, or under
    ``ideal``, which ignores send/recv, its compute orders."""
    from pipec.verify import check_structure

    if p2p == "ideal" and program.has_comms:
        program = program.with_streams(program.compute_streams(), has_comms=False)
    problems = check_structure(program)
    if not problems:
        return ""
    head = "structure FAILED (as `pipec check` reports it), so the schedule is not simulated:"
    return "\n".join([head, *("  " + line for line in problems)])


def _simulate(
    program: Program, costs: Costs, record: bool, input_fraction: float | None, p2p: str
) -> tuple[SimResult, bool]:
    """The result, and whether the run proved the structure sound (False: ask the structure pass)."""
    if p2p == "ideal":
        return _simulate_dataflow(program, costs, record, input_fraction)
    if not program.has_comms:
        from pipec.compiler import place_p2p

        program = place_p2p(program, costs)  # placed for the costs simulated, as `pipec simulate` does
    run = _Run(program, costs, p2p)
    _run_hosts(run, record)
    stuck = [r for r in range(run.P) if not run.done[r]]
    if stuck:
        raise ScheduleError(_deadlock(run, stuck))
    sound = run.sound()
    return run.result(costs, record, input_fraction), sound


class _Run:
    """The state of one run of the streams under the p2p rule: flat arrays indexed by value (stage * M + mb), by
    message and by batch, and per-rank clocks. ``__init__`` builds them; ``_run_hosts`` (the host loop) and the
    steps of ``_p2p_steps`` update them; ``sound``, ``result`` and ``_deadlock`` read them once the worklist is
    empty."""

    def __init__(self, program: Program, costs: Costs, p2p: str) -> None:
        self.program = program
        self.p2p = p2p
        self.tagged = p2p == "tagged"
        # whether a run of consecutive send/recv is one batch (else one batch per instruction)
        self.joined = batched(p2p)
        self.P = P = program.ranks  # noqa: N806 - the papers' names
        self.S = S = program.num_stages  # noqa: N806
        self.where = where = program.stage_to_rank
        self.streams = program.streams
        durations = costs.per_stage(S)
        self.d_f, self.d_b, self.d_i, self.d_w = (durations[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W))
        self.message_time = message_time = costs.message_time
        # without overlap the sender's rank pushes each message itself: posting a batch holds it message_time per
        # send
        self.post_cost = 0.0 if costs.overlap else message_time

        # Completion times for the data dependencies, flat arrays indexed stage * n_mb + mb (-1: not done yet).
        self.n_mb = n_mb = program.microbatches
        self.forward_done = [-1.0] * (S * n_mb)
        self.grad_done = [-1.0] * (S * n_mb)  # B or I: the input gradient exists
        # when the value's I finished, for its W (-1: no I yet; -2: its W has run, so a second W finds none and a B
        # never serves as one): every I meets exactly one W, which sound checks
        self.input_done = [-1.0] * (S * n_mb)
        self.pair_parts = 0  # the second halves of the overlapped pairs run, for the count in sound
        self.odd_pairs = False  # an overlapped pair of a shape the structure pass may refuse
        # A message is an int: (sending stage * n_mb + mb) * 2 + (0 forward, 1 backward). recv_batch[message]: the
        # batch (global id) holding its receive on the consuming rank, -1 until posted.
        self.recv_batch = [-1] * (S * n_mb * 2)

        # Batches, global ids in posting order: the rank, the stream slice, when posted, when it started running
        # (-1: not yet), when its last completed op completed, and how many of its ops still wait for a
        # counterpart.
        self.b_rank: list[int] = []
        self.b_lo: list[int] = []
        self.b_hi: list[int] = []
        self.b_post: list[float] = []
        self.b_start: list[float] = []
        self.b_done: list[float] = []
        self.b_missing: list[int] = []
        self.b_ops: list[list[tuple]] = []  # per batch: (is_send, pair number, message, stream position) per op
        # per rank: its batches in order, the first one not yet completed (its NCCL stream's head), and when the
        # previous one completed
        self.batches: list[list[int]] = [[] for _ in range(P)]
        self.head = [0] * P
        self.stream_free = [0.0] * P
        # the ordered pair of ranks of the message stage s sends forward (to s+1) or backward (to s-1); -1: none.
        # Indexed with stage + 1 for RECV_B and stage - 1 for RECV_F; index -1 and S hit the sentinel -1 entries.
        # Pairs are numbered densely (pair_ids: src * P + dst -> number) as the stage boundaries name them: at most
        # 2 S of them, where lists over all P * P ordered pairs would be quadratic (20,000 ranks: 4 * 10^8 lists).
        self.pair_ids = pair_ids = {}
        self.fwd_pair = [pair_ids.setdefault(where[s] * P + where[s + 1], len(pair_ids)) for s in range(S - 1)]
        self.fwd_pair += [-1, -1]
        self.bwd_pair = [-1] + [pair_ids.setdefault(where[s] * P + where[s - 1], len(pair_ids)) for s in range(1, S)]
        self.bwd_pair += [-1]
        # nccl: per ordered pair (its number), the running sends and receives in issue order; tagged: per message.
        # An entry: (start time of its batch, message, rank, stream position, batch).
        self.sends: list[list] = [[] for _ in range(len(pair_ids))]
        self.recvs: list[list] = [[] for _ in range(len(pair_ids))]
        self.tagged_sends: dict[int, tuple] = {}
        self.tagged_recvs: dict[int, tuple] = {}

        self.time = [0.0] * P  # the host: when its next instruction may start
        self.position = [0] * P
        self.busy = [0.0] * P
        self.waited = [0.0] * P  # time the host waits for receives (rule 2) and, at the end, for its batches
        self.finish = [0.0] * P
        self.done = [False] * P
        self.first = [-1.0] * P
        self.premature = [-1] * P  # per rank: the position of the send it is stuck at (its value not computed yet)
        self.timeline: list[list[TimedOp]] = [[] for _ in range(P)]
        self.messages: list[Message] = []
        self.ready = deque(range(P))

    def sound(self) -> bool:
        """Whether this completed run proves what `check_structure` checks, in a few C-speed passes over the
        arrays rather than the structure pass itself (flattening the program costs as much as the simulation).

        The run refused ops out of range and compute off its stage's rank as they came (ScheduleError). On top:
        every value has its forward and (unless forward-only) its input gradient; every I its W, each W after
        its I; the compute count is exactly that (so nothing ran twice); and there are exactly two send/recv per
        message between ranks: every consumer found the receive of its own message on its rank, each receive met
        a send of that message, and a completed run left nothing unmatched, so with that count nothing is extra,
        duplicated or on the wrong pair. False whenever any of this fails, even if the program is sound after all
        (an overlapped pair of another shape): the caller then asks the structure pass."""
        program, input_done = self.program, self.input_done
        values = self.S * self.n_mb
        if min(self.forward_done, default=0.0) < 0 or max(input_done, default=-1.0) >= 0 or self.odd_pairs:
            return False  # a forward never run, an I without its W, or a pair to leave to the structure pass
        if program.forward_only:
            if max(self.grad_done, default=-1.0) >= 0:
                return False
        elif min(self.grad_done, default=0.0) < 0:
            return False
        comm = sum(self.b_hi) - sum(self.b_lo)
        compute = sum(map(len, self.streams)) - comm + self.pair_parts
        if compute != values * (1 if program.forward_only else 2) + input_done.count(-2.0):  # + one W per I
            return False
        where = self.where
        boundaries = sum(1 for s in range(self.S - 1) if where[s] != where[s + 1])
        return comm == 2 * boundaries * self.n_mb * (1 if program.forward_only else 2)

    def result(self, costs: Costs, record: bool, input_fraction: float | None) -> SimResult:
        """The report; with ``record``, each rank's batches join its timeline, in time order (a batch before the
        compute that starts at the same moment)."""
        program, timeline, streams = self.program, self.timeline, self.streams
        if record:
            b_start, b_done, b_lo, b_hi = self.b_start, self.b_done, self.b_lo, self.b_hi
            for b, rank in enumerate(self.b_rank):
                timeline[rank].append(TimedOp(rank, b_start[b], b_done[b], tuple(streams[rank][b_lo[b] : b_hi[b]])))
            for line in timeline:
                line.sort(key=lambda op: (op.start, not op.is_comm))
        return SimResult(
            program=program,
            costs=costs,
            makespan=max(self.finish, default=0.0),
            busy=tuple(self.busy),
            comm=tuple(self.waited),
            finish=tuple(self.finish),
            start=tuple(max(f, 0.0) for f in self.first),
            peak_memory=_peaks(program, costs, input_fraction),
            timeline=tuple(tuple(t) for t in timeline) if record else (),
            messages=tuple(self.messages),
        )


class _Steps(NamedTuple):
    """The steps of the p2p rule that the host loop calls (see _p2p_steps)."""

    start_tagged: Callable[[int, float], None]
    start_in_order: Callable[[int, float], None]
    advance_stream: Callable[[int], None]
    run_pair: Callable[[int, int, Overlap, float], tuple[float, float]]


# The steps are closures over the run's arrays, not methods of _Run: a method would load each array as an attribute
# on every call. The host loop (_run_hosts) is a plain function, so that the arrays it reads for every instruction
# are fast locals there; it posts batches and runs single compute ops itself (a call per batch measured 4-5% of
# the run).
def _p2p_steps(run: _Run, record: bool) -> _Steps:
    """The steps of the rule bound to ``run``'s arrays: start a batch, complete its messages, advance a rank's
    NCCL stream, run an overlapped pair."""
    program, streams, where, S, n_mb = run.program, run.streams, run.where, run.S, run.n_mb  # noqa: N806
    tagged, message_time = run.tagged, run.message_time
    d_f, d_b, d_i, d_w = run.d_f, run.d_b, run.d_i, run.d_w
    forward_done, grad_done, input_done, recv_batch = run.forward_done, run.grad_done, run.input_done, run.recv_batch
    b_rank, b_post, b_start, b_done, b_missing, b_ops = (
        run.b_rank, run.b_post, run.b_start, run.b_done, run.b_missing, run.b_ops
    )
    batches, head, stream_free = run.batches, run.head, run.stream_free
    sends, recvs, tagged_sends, tagged_recvs = run.sends, run.recvs, run.tagged_sends, run.tagged_recvs
    messages, ready = run.messages, run.ready
    # Enum members hash through Python code, so the hot paths compare kinds by identity only.
    k_f, k_i, k_w = Kind.F, Kind.I, Kind.W
    comm_kinds = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)  # `in` compares by identity first

    def complete(send_entry: tuple, recv_entry: tuple) -> None:
        """Both ends of one message are running (nccl) or posted (tagged): fix its times and tell both batches
        (rule 3); a batch with nothing left to match wakes its rank."""
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

    def start_tagged(b: int, start: float) -> None:
        """Batch ``b`` starts running at ``start`` under ``tagged``: a send is buffered (complete at once) and meets
        the receive of its message if posted; a receive meets the send of its message if posted, else waits."""
        b_start[b] = start
        b_done[b] = start
        rank = b_rank[b]
        for is_send, _, message, pos in b_ops[b]:
            entry = (start, message, rank, pos, b)
            if is_send:
                if message in tagged_sends:
                    raise ScheduleError(f"rank {rank}: op {pos} {streams[rank][pos]} sends a message a second time")
                tagged_sends[message] = entry
                b_missing[b] -= 1  # buffered: complete when posted
                waiting = tagged_recvs.pop(message, None)
                if waiting is not None:
                    complete(entry, waiting)
            elif message in tagged_sends:
                complete(tagged_sends[message], entry)
            else:
                tagged_recvs[message] = entry

    def start_in_order(b: int, start: float) -> None:
        """Batch ``b`` starts running at ``start`` under ``nccl`` or ``torch``: each of its ops meets the k-th op
        of the other side on its pair of ranks (rule 3) if that one already runs, else waits in the pair's list."""
        b_start[b] = start
        b_done[b] = start
        rank = b_rank[b]
        for is_send, pair, message, pos in b_ops[b]:
            entry = (start, message, rank, pos, b)
            if is_send:
                mine, theirs = sends[pair], recvs[pair]
            else:
                mine, theirs = recvs[pair], sends[pair]
            k = len(mine)
            mine.append(entry)
            if k < len(theirs):
                other = theirs[k]
                if record or other[1] != message:
                    complete(entry, other) if is_send else complete(other, entry)
                    continue
                # complete(), inlined: the hot path of the nccl model
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

    start_batch = start_tagged if tagged else start_in_order

    def advance_stream(rank: int) -> None:
        """Run the rank's posted batches in order (rule 4, one NCCL stream; tagged: each at once) as far as
        completions allow: a batch starts at max(posted, previous completed)."""
        mine = batches[rank]
        h = head[rank]
        while h < len(mine):
            b = mine[h]
            if b_start[b] < 0:
                free = stream_free[rank]
                start_batch(b, b_post[b] if b_post[b] > free else free)
            if b_missing[b]:
                break
            stream_free[rank] = b_done[b]
            h += 1
        head[rank] = h

    def run_pair(rank: int, pos: int, instruction: Overlap, t: float) -> tuple[float, float]:
        """An overlapped pair (the general case of _run_hosts' inlined single op): it waits for the batches of
        both halves' receives (rule 2) and takes the sum of their durations. Returns its start and end, or -1.0
        twice when a batch it waits for has not completed."""
        parts = instruction.parts
        for stage, kind, mb in parts:
            if kind in comm_kinds:
                raise ScheduleError(f"rank {rank}: op {pos} {instruction} pairs a send/recv with compute")
            if mb < 0 or mb >= n_mb or stage < 0 or where[stage] != rank:
                _misplaced(program, rank, pos, instruction, Action(stage, kind, mb))
        start = t
        for stage, kind, mb in parts:
            if kind is k_f:
                message = ((stage - 1) * n_mb + mb) * 2 if stage > 0 and where[stage - 1] != rank else -1
            elif kind is k_w:
                message = -1
            else:
                message = ((stage + 1) * n_mb + mb) * 2 + 1 if stage < S - 1 and where[stage + 1] != rank else -1
            if message >= 0:
                b = recv_batch[message]
                if b < 0 or b_rank[b] != rank:
                    _no_receive(Action(stage, kind, mb), rank, pos)
                if b_start[b] < 0 or b_missing[b]:
                    return -1.0, -1.0
                if b_done[b] > start:
                    start = b_done[b]
        end_time = start
        for stage, kind, mb in parts:
            index = stage * n_mb + mb
            if kind is k_f:
                if stage > 0 and not 0 <= forward_done[index - n_mb] <= start:
                    _early(instruction, rank, pos, f"the forward of stage {stage - 1}")
                end_time += d_f[stage]
            elif kind is k_w:
                if not 0 <= input_done[index] <= start:
                    _early(instruction, rank, pos, f"the input-gradient backward (I) of stage {stage}")
                end_time += d_w[stage]
            else:
                if not 0 <= forward_done[index] <= start:
                    _early(instruction, rank, pos, f"its forward {Action(stage, Kind.F, mb)}")
                if stage < S - 1 and not 0 <= grad_done[index + n_mb] <= start:
                    _early(instruction, rank, pos, f"the backward of stage {stage + 1}")
                end_time += d_i[stage] if kind is k_i else d_b[stage]
        for stage, kind, mb in parts:
            index = stage * n_mb + mb
            if kind is k_f:
                forward_done[index] = end_time
            elif kind is k_w:
                input_done[index] = -2.0
            else:
                grad_done[index] = end_time
                if kind is k_i:
                    input_done[index] = end_time
        run.pair_parts += len(parts) - 1
        # the shape the structure pass accepts today (one forward, one backward, two micro-batches): any other
        # leaves the verdict to it
        first_part, second = parts
        if (first_part.kind is k_f) == (second.kind is k_f) or first_part.mb == second.mb:
            run.odd_pairs = True
        return start, end_time

    return _Steps(start_tagged, start_in_order, advance_stream, run_pair)


def _run_hosts(run: _Run, record: bool) -> None:
    """The worklist over ranks. The host of a rank runs its stream in order from where it stopped: it posts each
    batch (below: without waiting, rule 1) and runs compute (below: single ops; run_pair: overlapped pairs) until
    a compute needs a batch that has not completed (rule 2) or a batch cannot be posted; at the end of its stream
    it waits for its outstanding batches (the step's end). A batch completion puts its rank back on the worklist."""
    start_tagged, start_in_order, advance_stream, run_pair = _p2p_steps(run, record)
    program, streams, where, S, n_mb = run.program, run.streams, run.where, run.S, run.n_mb  # noqa: N806
    tagged, joined, post_cost = run.tagged, run.joined, run.post_cost
    d_f, d_b, d_i, d_w = run.d_f, run.d_b, run.d_i, run.d_w
    forward_done, grad_done, input_done, recv_batch = run.forward_done, run.grad_done, run.input_done, run.recv_batch
    b_rank, b_lo, b_hi, b_post = run.b_rank, run.b_lo, run.b_hi, run.b_post
    b_start, b_done, b_missing, b_ops = run.b_start, run.b_done, run.b_missing, run.b_ops
    batches, head, stream_free, fwd_pair, bwd_pair = run.batches, run.head, run.stream_free, run.fwd_pair, run.bwd_pair
    time, position, busy, waited, finish = run.time, run.position, run.busy, run.waited, run.finish
    done, first, premature, timeline, ready = run.done, run.first, run.premature, run.timeline, run.ready
    # Enum members hash through Python code, so the hot loop compares kinds by identity only.
    k_f, k_i, k_w = Kind.F, Kind.I, Kind.W
    k_sf, k_rf, k_sb, k_rb = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
    comm_kinds = (k_sf, k_rf, k_sb, k_rb)  # `in` on a tuple compares by identity first: no Enum hashing
    while ready:
        rank = ready.popleft()
        if done[rank]:
            continue
        advance_stream(rank)
        stream = streams[rank]
        n = len(stream)
        pos = position[rank]
        t = time[rank]
        line = timeline[rank]
        work = 0.0  # compute time in this run of the rank, added to busy[rank] when it stops
        # the rank's waiting time and first start, in locals while it runs (the same additions in the same order)
        wait, first_start = waited[rank], first[rank]
        while pos < n:
            instruction = stream[pos]
            if type(instruction) is not Action:
                start, end_time = run_pair(rank, pos, instruction, t)
                if start < 0:
                    break  # blocked: woken when the batch completes
            else:
                stage, kind, mb = instruction
                if kind in comm_kinds:
                    # post a batch: the maximal run of send/recv from here (or this one alone when not joined),
                    # without waiting (rule 1); overlap=0 charges the host message_time per send
                    end = pos
                    sent = 0
                    unsent = -1  # the position of a send whose value this rank has not computed yet
                    ops = []
                    last_op = n if joined else pos + 1
                    while end < last_op:
                        action = stream[end]
                        if type(action) is not Action:
                            break
                        stage, kind, mb = action
                        # pair tables: the number of the ordered pair of ranks per stage, -1 where none exists
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
                        # a negative stage would index the tables from their end
                        if pair < 0 or stage < 0 or where[stage] != rank or mb < 0 or mb >= n_mb:
                            raise ScheduleError(
                                f"rank {rank}: op {end} {action} names a stage or micro-batch out of range, "
                                "or a stage this rank does not hold"
                            )
                        if is_send:
                            # the runtime posts a send with the tensor its rank has computed: a send ahead of its
                            # producer leaves the rank stuck here for good (its stream runs in order), as in the
                            # verifier
                            if (forward_done if kind is k_sf else grad_done)[stage * n_mb + mb] < 0:
                                unsent = end
                                break
                            sent += 1
                        else:
                            recv_batch[message] = len(b_rank)
                        ops.append((is_send, pair, message, end))
                        end += 1
                    if unsent >= 0:  # not posted: forget the receives noted above, the rank is stuck here for good
                        for is_send, _, message, _ in ops:
                            if not is_send:
                                recv_batch[message] = -1
                        premature[rank] = unsent
                        break
                    b = len(b_rank)
                    b_rank.append(rank)
                    b_ops.append(ops)
                    b_lo.append(pos)
                    b_hi.append(end)
                    b_post.append(t)
                    b_start.append(-1.0)
                    b_done.append(-1.0)
                    b_missing.append(end - pos)
                    batches[rank].append(b)
                    if tagged:  # no FIFO: every batch runs once posted
                        start_tagged(b, t)
                    # at the head of the rank's NCCL stream (its predecessors completed), it starts now:
                    # advance_stream for this one batch, inlined; else it starts when its predecessor completes
                    if head[rank] == len(batches[rank]) - 1:
                        if not tagged:
                            free = stream_free[rank]
                            start_in_order(b, t if t > free else free)
                        if not b_missing[b]:
                            stream_free[rank] = b_done[b]
                            head[rank] += 1
                    t += sent * post_cost
                    pos = end
                    continue
                # compute: wait for the batch holding the receive it consumes (rule 2), then run
                if mb < 0 or mb >= n_mb or stage < 0 or where[stage] != rank:
                    _misplaced(program, rank, pos, instruction, instruction)
                start = t
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
                    if not 0 <= input_done[index] <= start:  # after a B, or a second W: the structure pass says more
                        _early(instruction, rank, pos, f"the input-gradient backward (I) of stage {stage}")
                    end_time = start + d_w[stage]
                    input_done[index] = -2.0  # consumed
                else:
                    if not 0 <= forward_done[index] <= start:
                        _early(instruction, rank, pos, f"its forward {Action(stage, Kind.F, mb)}")
                    if stage < S - 1 and not 0 <= grad_done[index + n_mb] <= start:
                        _early(instruction, rank, pos, f"the backward of stage {stage + 1}")
                    if kind is k_i:
                        end_time = input_done[index] = start + d_i[stage]
                    else:
                        end_time = start + d_b[stage]
                    grad_done[index] = end_time
            if first_start < 0:
                first_start = first[rank] = start
            if record:
                line.append(TimedOp(rank, start, end_time, instruction))
            wait += start - t
            work += end_time - start
            t = end_time
            pos += 1
        position[rank] = pos
        time[rank] = t
        busy[rank] += work
        if pos == n and head[rank] == len(batches[rank]):  # end of step: every batch has completed
            done[rank] = True
            end_time = stream_free[rank] if stream_free[rank] > t else t
            wait += end_time - t
            finish[rank] = end_time
        waited[rank] = wait


def _simulate_dataflow(
    program: Program, costs: Costs, record: bool, input_fraction: float | None
) -> tuple[SimResult, bool]:
    """The ``ideal`` model: compute instructions in program order, each starting once its rank is free and its
    inputs exist (plus ``message_time`` when the producer lives on another rank). Send/recv are ignored.
    Also returns whether the run proved the compute orders' structure sound (as _Run.sound)."""
    compute = program.compute_streams()
    ranks, stages = program.ranks, program.num_stages
    where = program.stage_to_rank
    durations = costs.per_stage(stages)
    delay = costs.message_time
    n_mb = program.microbatches  # an op beyond it is refused as it comes, as is one off its stage's rank
    # when each value exists, flat: (stage * n_mb + mb) * 2 + (0: the forward output, 1: the input gradient)
    done = [-1.0] * (stages * n_mb * 2)
    split = bytearray(stages * n_mb)  # per value: 1 after its I, 2 once its W followed, 3 a W without its I
    unsound = False  # a value computed twice, or an overlapped pair of a shape the structure pass may refuse
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
                if mb < 0 or mb >= n_mb or stage < 0 or where[stage] != rank:
                    _misplaced(program, rank, pos, instruction, Action(stage, kind, mb))
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
        peak_memory=_peaks(program, costs, input_fraction),
        timeline=tuple(tuple(line) for line in timeline) if record else (),
        messages=_ideal_messages(program, timeline, delay) if record else (),
    )
    return result, sound


def _ideal_messages(program: Program, timeline: list[list[TimedOp]], delay: float) -> tuple[Message, ...]:
    """The ideal model's messages, for pictures and traces: one per value a compute op hands to another rank, sent
    when the op ends and arriving ``delay`` later."""
    where, stages = program.stage_to_rank, program.num_stages
    messages = []
    for rank, line in enumerate(timeline):
        for op in line:
            for stage, kind, mb in op.instruction.parts:
                target = stage + 1 if kind is Kind.F else stage - 1
                if kind is Kind.W or not 0 <= target < stages or where[target] == rank:
                    continue
                send_kind, recv_kind = (Kind.SEND_F, Kind.RECV_F) if kind is Kind.F else (Kind.SEND_B, Kind.RECV_B)
                messages.append(
                    Message(
                        Action(stage, send_kind, mb), Action(target, recv_kind, mb), rank, where[target], op.end,
                        op.end + delay,
                    )
                )
    return tuple(messages)


def _peaks(program: Program, costs: Costs, input_fraction: float | None) -> tuple[float, ...]:
    """Peak activations per rank from the one liveness function, with the cost model's memory settings."""
    fraction = costs.input_fraction if input_fraction is None else input_fraction
    sizes = None
    if costs.activation is not None:
        sizes = costs.activation if isinstance(costs.activation, tuple) else (costs.activation,) * program.num_stages
        if len(sizes) != program.num_stages:
            raise PipecInputError(length_mismatch("activation", len(sizes), program.num_stages))
    return peak_activations(program, fraction, sizes)


def _clean(difference: float, scale: float) -> float:
    """A difference of sums of float durations, with the rounding error that makes a zero -8.9e-16 set to 0."""
    return 0.0 if abs(difference) <= 1e-9 * max(1.0, abs(scale)) else difference


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


def _misplaced(program: Program, rank: int, pos: int, instruction: Instruction, action: Action) -> None:
    """A compute op out of range or on a rank that does not hold its stage (the structure pass then says more)."""
    stage, _, mb = action
    if not 0 <= mb < program.microbatches:
        why = f"names micro-batch {mb}, outside 0..{program.microbatches - 1}"
    elif not 0 <= stage < program.num_stages:
        why = f"names stage {stage}, outside 0..{program.num_stages - 1}"
    else:
        why = f"runs stage {stage}, which lives on rank {program.stage_to_rank[stage]}"
    raise ScheduleError(f"rank {rank}: op {pos} {instruction} {why}")


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


def _deadlock(run: _Run, stuck: list[int]) -> str:
    """The message for a run that ended with ranks ``stuck``. Each stuck rank: a send ahead of its value it cannot
    post, or the instruction its host waits at (or the end of the step) and the batch at the head of its NCCL
    stream with the ops whose counterparts never run. Raises the p2p order mismatch instead when one on a channel
    is what kept the run from reaching it (and no send ahead of its value is the cause)."""
    program, position, premature = run.program, run.position, run.premature
    unsent = [_premature_send(program, r, position[r], premature[r]) for r in stuck if premature[r] >= 0]
    if run.tagged:
        return "\n".join([f"deadlock under the tagged p2p model: rank(s) {stuck} cannot finish", *unsent])
    if not unsent:  # a send ahead of its value is the cause; a mismatch on the channel comes second
        _check_pair_order(program)
    P, where = program.ranks, program.stage_to_rank  # noqa: N806
    batches, head, b_lo, b_hi, b_start = run.batches, run.head, run.b_lo, run.b_hi, run.b_start
    lines = [f"deadlock under the {run.p2p} p2p model: {len(stuck)} rank(s) cannot finish", *unsent]
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
                pair = run.pair_ids[rank * P + peer]
                mine, theirs, what = run.sends[pair], run.recvs[pair], f"receive from rank {rank}"
            else:
                peer = where[stage + (-1 if kind is Kind.RECV_F else 1)]
                pair = run.pair_ids[peer * P + rank]
                mine, theirs, what = run.recvs[pair], run.sends[pair], f"send to rank {rank}"
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
