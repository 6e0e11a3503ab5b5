"""insert_p2p_ops: add SEND/RECV instructions on every edge that crosses ranks.

Contract (Program -> Program, compute-only in, with comms out):
- which messages: SEND_F(s, m) on the rank of stage s and RECV_F(s+1, m) on the rank of stage s+1 when the two
  stages live on different ranks and F(s, m) runs; SEND_B(s, m) and RECV_B(s-1, m) likewise when B/I(s, m) runs
  and stage s-1 lives elsewhere. W never communicates; stages on the same rank exchange nothing.
- where: a *timed replay*. The compute orders are list-scheduled with the default costs (F=1, B=2, I=1, W=1, an
  overlapped pair the sum of its halves, messages free): each instruction starts once its rank is free and its
  inputs exist (F(s, m) after F(s-1, m), B/I(s, m) after F(s, m) and the backward of (s+1, m), W(s, m) after
  I(s, m)). Every message gets the time its producer ends. Each rank's stream is then its items sorted by one key:
  a compute instruction at (start, 1, rank-local index), a SEND or RECV at (message time, 0, message id), the
  message id being the same number on both ranks. So a receive comes before the compute that needs it (its time
  is <= that compute's start, and communication sorts first at equal times), a send comes after the compute that
  produced it, and each channel carries its messages in the same order on both sides (the nccl model's order rule
  holds by construction). Receives sit at the moment their data exist, not grouped with ones needed later, which
  is what lets the simulator reach the compute order's own makespan (docs/simulator.md).
- why it cannot deadlock under rule version 2 (docs/verification.md) when the compute order is valid: show by
  induction on the key that every item completes (a compute runs, a send/recv op completes). Take an item with
  key k, everything with a smaller key done. A compute waits only for the batches holding its receives; they
  stand before it in its stream, so all their ops have keys < k and are done. A send/recv op completes once its
  batch and its counterpart's batch (same key k on the peer) are running; a batch runs once posted (the rank got
  past every compute before it: keys < k, done) and once the rank's previous batch completed (keys < k, done).
  So both batches run and the op completes; the end of the step then finds every batch complete. The same
  induction works for ``tagged`` (fewer waits) and for version 1 (a rank waits for each whole batch, sends
  included): every unit before an item holds only smaller keys. Each wait points to an item with a smaller key,
  or to the counterpart with the same key on a peer that can only be held up by smaller keys.
- the replay is linear in the instructions (a worklist woken by the value each rank waits for), the sort
  n log n per rank.
- if the replay stops because no rank can run its next instruction (the compute order itself deadlocks, or an
  input is never computed), the streams keep the timed part for what ran (with every message it produced) and
  the rest keeps the plain rule: the RECVs of an instruction whose inputs were not computed before it, then the
  instruction, then its SENDs. The verifier then reports the deadlock with its chain of waits.
The relative order of compute instructions is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipec.errors import PipecInputError
from pipec.ir import Action, ChainLinks, Instruction, Kind, Program, chain_links
from pipec.p2p_rule import (
    DEFAULT_DURATION,
    CostModel,
    is_default,
    pair_duration,
    receiving_ranks,
    remote_input,
    remote_output,
)


def insert_p2p_ops(program: Program, costs: CostModel | None = None) -> Program:
    """The program with SEND/RECV placed by a timed replay of its compute orders under ``costs`` (None: the
    default costs, F=1, B=2, I=1, W=1, messages free)."""
    if program.has_comms:
        raise PipecInputError("the program already has send/recv instructions")
    routing = program.routing_problem()
    if routing:
        raise PipecInputError(routing)
    if costs is None or is_default(costs, program.num_stages):
        # the integer replay: the default costs are whole numbers, so keys pack into ints (the fast path, and the
        # placement every existing output was made with)
        items, done, position = _replay_default(program)
    else:
        items, done, position = _replay_timed(program, costs)
    return _place(program, items, done, position)


def _replay_default(program: Program) -> tuple[list[list[tuple]], dict, list[int]]:
    """The list schedule with the default costs, times and keys in ints (see the module docstring)."""
    where = program.stage_to_rank
    last = program.num_stages - 1
    streams = program.streams
    ranks = len(streams)
    # Keys are plain (stage, tag, mb) tuples: hashing an Action would run Enum.__hash__ in Python. Tags: F the
    # forward ran, G the input gradient exists (B or I ran), I the I ran (W may run). Value: when it ends.
    done: dict[tuple[int, str, int], int] = {}
    # per stage, the rank its output goes to (forward: stage + 1, backward: stage - 1), None at the ends
    forward_to, backward_to = receiving_ranks(where, program.pipelines)
    duration = DEFAULT_DURATION
    new = tuple.__new__  # builds an Action without the NamedTuple's Python-level __new__ (800k of them at scale)
    f, b, i_ = Kind.F, Kind.B, Kind.I
    send_f, recv_f, send_b, recv_b = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
    n_mb = 1 + max((a.mb for stream in streams for ins in stream for a in ins.parts), default=0)
    # per rank, (sort key, instruction). The key (time, 0 for a message / 1 for a compute, message id / index)
    # packed in one int, unique on its rank, so that the sort compares ints only.
    span = max(2 * n_mb * (last + 1), max((len(s) for s in streams), default=0)) + 1
    items: list[list[tuple[int, Instruction]]] = [[] for _ in streams]

    def run(rank: int, index: int, instruction: Instruction, start: int) -> list[tuple[int, str, int]]:
        """Time one instruction; its messages go to both ranks' items. Returns the keys it made."""
        mine = items[rank]
        mine.append((((start << 1) | 1) * span + index, instruction))
        if type(instruction) is Action:
            parts: tuple[Action, ...] = (instruction,)
            end = start + duration.get(instruction[1], 0)
        else:
            parts = instruction.parts
            end = start + sum(duration.get(kind, 0) for _, kind, _ in parts)
        at = (end << 1) * span  # messages sort before computes at equal times
        made = []
        for stage, kind, mb in parts:
            if kind is f:
                made.append((stage, "F", mb))
                peer = forward_to[stage] if 0 <= stage <= last else None
                if peer is not None and peer != rank:
                    key = at + (stage * n_mb + mb) * 2  # p2p_rule.message_id, inlined: the same on both ranks
                    mine.append((key, new(Action, (stage, send_f, mb))))
                    items[peer].append((key, new(Action, (stage + 1, recv_f, mb))))
            elif kind is b or kind is i_:
                made.append((stage, "G", mb))
                if kind is i_:
                    made.append((stage, "I", mb))
                peer = backward_to[stage] if 0 <= stage <= last else None
                if peer is not None and peer != rank:
                    key = at + (stage * n_mb + mb) * 2 + 1
                    mine.append((key, new(Action, (stage, send_b, mb))))
                    items[peer].append((key, new(Action, (stage - 1, recv_b, mb))))
        for key in made:
            done[key] = end
        free[rank] = end
        return made

    free = [0] * ranks
    position = _run_list(streams, chain_links(last + 1, program.pipelines), where, done, free, run)
    return items, done, position


def _replay_timed(program: Program, costs: CostModel) -> tuple[list[list[tuple]], dict, list[int]]:
    """The list schedule with the user's costs, the same rules as _replay_default, in float times.

    A time is (t, eps): eps counts zero-length steps at time t, so that an op's end is always strictly after its
    start, even for a zero cost or a cost too small to change a large float t (1e15 + 1e-12 == 1e15). The proof in
    the module docstring needs exactly that: a send's key (its producer's end) sorts after its producer's key
    (the start), and a receive's key (the same end) is at most its consumer's start. A message reaches another
    rank message_time after its producer ends (as the simulator's models have it); without overlap the sender
    also spends message_time per send it posts, so the replay's timeline is the one the simulator will run.
    """
    where = program.stage_to_rank
    last = program.num_stages - 1
    streams = program.streams
    ranks = len(streams)
    table = costs.per_stage(last + 1)
    duration = {kind: table[kind] for kind in (Kind.F, Kind.B, Kind.I, Kind.W)}
    pair = costs.pair_per_stage(last + 1)  # an overlapped pair's own duration (None: the sum of its halves)
    delay = costs.message_time
    post = 0.0 if costs.overlap else delay
    done: dict[tuple[int, str, int], tuple[float, int]] = {}
    forward_to, backward_to = receiving_ranks(where, program.pipelines)
    new = tuple.__new__
    f, b, i_ = Kind.F, Kind.B, Kind.I
    send_f, recv_f, send_b, recv_b = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
    n_mb = 1 + max((a.mb for stream in streams for ins in stream for a in ins.parts), default=0)
    # per rank, (key, instruction); key (t, eps, 0 for a message / 1 for a compute, message id / index): unique on
    # its rank, so the instructions are never compared
    items: list[list[tuple]] = [[] for _ in streams]
    zero = (0.0, 0)
    free = [zero] * ranks

    def run(rank: int, index: int, instruction: Instruction, start: tuple[float, int]) -> list[tuple[int, str, int]]:
        mine = items[rank]
        mine.append(((start[0], start[1], 1, index), instruction))
        length = 0.0
        for stage, kind, _ in instruction.parts:
            row = duration.get(kind)
            if row is not None and 0 <= stage <= last:
                length += row[stage]
        if pair is not None and type(instruction) is not Action:
            length = pair_duration(instruction.parts, length, table, pair)
        t = start[0] + length
        end = (t, start[1]) if t > start[0] else (start[0], start[1] + 1)
        made = []
        sends = 0
        for stage, kind, mb in instruction.parts:
            if kind is f:
                made.append((stage, "F", mb))
                peer = forward_to[stage] if 0 <= stage <= last else None
                if peer is not None and peer != rank:
                    key = (end[0], end[1], 0, (stage * n_mb + mb) * 2)  # p2p_rule.message_id, inlined
                    mine.append((key, new(Action, (stage, send_f, mb))))
                    items[peer].append((key, new(Action, (stage + 1, recv_f, mb))))
                    sends += 1
            elif kind is b or kind is i_:
                made.append((stage, "G", mb))
                if kind is i_:
                    made.append((stage, "I", mb))
                peer = backward_to[stage] if 0 <= stage <= last else None
                if peer is not None and peer != rank:
                    key = (end[0], end[1], 0, (stage * n_mb + mb) * 2 + 1)
                    mine.append((key, new(Action, (stage, send_b, mb))))
                    items[peer].append((key, new(Action, (stage - 1, recv_b, mb))))
                    sends += 1
        for key in made:
            done[key] = end
        # posting the sends holds the rank without overlap; the messages themselves keep the producer's end
        free[rank] = (end[0] + post * sends, end[1]) if sends and post else end
        return made

    position = _run_list(streams, chain_links(last + 1, program.pipelines), where, done, free, run, delay)
    return items, done, position


def _run_list(
    streams: Sequence[Sequence[Instruction]],
    links: ChainLinks,
    where: Sequence[int],
    done: dict,
    free: list,
    run: Callable[[int, int, Instruction, Any], list[tuple[int, str, int]]],
    delay: float = 0.0,
) -> list[int]:
    """The list schedule both replays share: each rank runs its instructions while their inputs exist (`done`:
    key -> when it was made; `free`: when each rank is next free; `run` times one instruction and returns the keys
    it made); one that waits registers on its first missing key and is woken when that key is made, so start
    times do not depend on the order ranks are visited in. An input made on another rank arrives `delay` later.
    Returns how far each rank got (its whole stream unless the compute order cannot run)."""
    has_next, has_previous = links
    stages = len(has_next)
    position = [0] * len(streams)
    waiting: dict[tuple[int, str, int], list[int]] = {}
    ready = list(range(len(streams)))
    while ready:
        rank = ready.pop()
        stream, k = streams[rank], position[rank]
        while k < len(stream):
            instruction = stream[k]
            start = free[rank]
            missing = None
            for key in _needs(instruction, has_next, has_previous):
                when = done.get(key)
                if when is None:
                    missing = key
                    break
                if delay and 0 <= key[0] < stages and where[key[0]] != rank:
                    when = (when[0] + delay, when[1])  # it crosses ranks: it arrives message_time later
                if when > start:
                    start = when
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                break
            for key in run(rank, k, instruction, start):
                woken = waiting.pop(key, None)
                if woken:
                    ready.extend(woken)
            k += 1
        position[rank] = k
    return position


def _place(program: Program, items: list[list[tuple]], done: dict, position: list[int]) -> Program:
    """Each rank's stream: its timed items sorted by key, then the part the replay could not run by the plain
    rule."""
    where = program.stage_to_rank
    links = chain_links(program.num_stages, program.pipelines)
    streams = program.streams
    out: list[list[Instruction]] = []
    for rank, rank_items in enumerate(items):
        rank_items.sort()  # keys are unique on a rank: the instructions are never compared
        placed = [instruction for _, instruction in rank_items]
        # The replay stopped early only if the compute order cannot run: place the rest by the plain rule.
        for instruction in streams[rank][position[rank] :]:
            for action in instruction.parts:
                receive = remote_input(action, rank, where, links)
                if receive is not None and _producer(action) not in done:
                    placed.append(receive)
            placed.append(instruction)
            for action in instruction.parts:
                message = remote_output(action, rank, where, links)
                if message is not None:
                    placed.append(message[0])
        out.append(placed)
    return program.with_streams(tuple(tuple(s) for s in out), has_comms=True)


def _needs(
    instruction: Instruction, has_next: Sequence[bool], has_previous: Sequence[bool]
) -> tuple[tuple[int, str, int], ...]:
    """The keys that must be done before the instruction runs (see `done` in insert_p2p_ops); the chain's ends
    are pipec.ir.chain_links' (a copy's first stage needs no activation, its last no gradient)."""
    if type(instruction) is Action:  # the common case, without building a list
        stage, kind, mb = instruction
        if kind is Kind.F:
            return ((stage - 1, "F", mb),) if has_previous[stage] else ()
        if kind is Kind.B or kind is Kind.I:
            return ((stage, "F", mb), (stage + 1, "G", mb)) if has_next[stage] else ((stage, "F", mb),)
        return ((stage, "I", mb),) if kind is Kind.W else ()
    out = []
    for stage, kind, mb in instruction.parts:
        if kind is Kind.F:
            if has_previous[stage]:
                out.append((stage - 1, "F", mb))
        elif kind is Kind.B or kind is Kind.I:
            out.append((stage, "F", mb))
            if has_next[stage]:
                out.append((stage + 1, "G", mb))
        elif kind is Kind.W:
            out.append((stage, "I", mb))
    return tuple(out)


def _producer(action: Action) -> tuple[int, str, int] | None:
    """The key of what `action` would receive from another rank."""
    stage, kind, mb = action
    if kind is Kind.F:
        return (stage - 1, "F", mb)
    if kind is Kind.B or kind is Kind.I:
        return (stage + 1, "G", mb)
    return None
