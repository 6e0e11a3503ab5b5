"""The array state of one run of the streams under the p2p rule (``Run``): built once, updated by the host loop
(sim/hosts.py) and the rule's steps (sim/steps.py), read by ``sound``, ``result`` and the deadlock message."""

from __future__ import annotations

from collections import deque

from pipec.ir import Kind, Program, chain_links
from pipec.passes.sync import member_ranks, unsynced_copies
from pipec.sim.costs import Costs
from pipec.sim.result import Message, SimResult, TimedOp, peaks_of
from pipec.verify.deadlock import batched


class Run:
    """The state of one run of the streams under the p2p rule: flat arrays indexed by value (stage * M + mb), by
    message and by batch, and per-rank clocks. ``__init__`` builds them; ``run_hosts`` (the host loop) and the
    steps of ``batch_steps`` and ``pair_runner`` update them; ``sound``, ``result`` and ``deadlock_message`` read
    them once the worklist is empty."""

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
        self.durations = durations
        self.d_fb = costs.pair_per_stage(S)  # an overlapped pair's own duration (None: the sum of its halves)
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
        # A message is an int, pipec.p2p_rule.message_id (inlined in the hot loops). recv_batch[message]: the
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
        # A copy's chain ends (pipec.ir.chain_links) send nothing on: -1 there too.
        self.pair_ids = pair_ids = {}
        self.has_next, self.has_previous = has_next, has_previous = chain_links(S, program.pipelines)
        self.fwd_pair = [
            pair_ids.setdefault(where[s] * P + where[s + 1], len(pair_ids)) if has_next[s] else -1 for s in range(S)
        ]
        self.fwd_pair += [-1]
        self.bwd_pair = [
            pair_ids.setdefault(where[s] * P + where[s - 1], len(pair_ids)) if has_previous[s] else -1 for s in range(S)
        ]
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

        # SYNC collectives (sim/steps.py sync_runner): per group its member ranks; per (group, k) the members at
        # their k-th SYNC of it (rank -> (when it was there, its stage)) and, once all were, when it ends
        self.d_sync = costs.sync_per_stage(S)
        self.sync_members = [frozenset(member_ranks(g, where)) for g in program.sync_groups]
        self.sync_passed: list[dict[int, int]] = [{} for _ in range(P)]
        self.sync_arrived: dict[tuple[int, int], dict[int, tuple[float, int]]] = {}
        self.sync_end: dict[tuple[int, int], float] = {}
        self.sync_ops = 0  # SYNC instructions passed (not compute: for sound's count)

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
        program, input_done, forward_done, grad_done = self.program, self.input_done, self.forward_done, self.grad_done
        values = self.S * self.n_mb
        if program.pipelines > 1:
            # each micro-batch passes its copy's stages only: the checks below over those values, and the others
            # never touched (an op off its route left a mark there); the copies' sync groups declared
            if unsynced_copies(program):
                return False
            on_route, off_route = self._values_by_route()
            untouched = (-1.0,)
            if any(forward_done[i] != -1.0 or grad_done[i] != -1.0 or input_done[i] != -1.0 for i in off_route):
                return False
            forward_done = [forward_done[i] for i in on_route]
            grad_done = [grad_done[i] for i in on_route] if not program.forward_only else untouched
            values = len(on_route)
        if min(forward_done, default=0.0) < 0 or max(input_done, default=-1.0) >= 0 or self.odd_pairs:
            return False  # a forward never run, an I without its W, or a pair to leave to the structure pass
        if program.forward_only:
            if max(grad_done, default=-1.0) >= 0:
                return False
        elif min(grad_done, default=0.0) < 0:
            return False
        comm = sum(self.b_hi) - sum(self.b_lo)
        compute = sum(map(len, self.streams)) - comm - self.sync_ops + self.pair_parts
        if compute != values * (1 if program.forward_only else 2) + input_done.count(-2.0):  # + one W per I
            return False
        return comm == 2 * program.crossings() * (1 if program.forward_only else 2)

    def _values_by_route(self) -> tuple[list[int], list[int]]:
        """The value indices (stage * M + mb) on each micro-batch's route, and the others."""
        program, n_mb = self.program, self.n_mb
        on, off = [], []
        for stage in range(self.S):
            copy = program.pipeline_of(stage)
            for mb in range(n_mb):
                (on if program.route_of(mb) == copy else off).append(stage * n_mb + mb)
        return on, off

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
            peak_memory=peaks_of(program, costs, input_fraction),
            timeline=tuple(tuple(t) for t in timeline) if record else (),
            messages=tuple(self.messages),
        )
