"""insert_p2p_ops: add SEND/RECV instructions on every edge that crosses ranks.

Contract (Program -> Program, compute-only in, with comms out):
- which messages: SEND_F(s, m) on the rank of stage s and RECV_F(s+1, m) on the rank of stage s+1 when the two
  stages live on different ranks and F(s, m) runs; SEND_B(s, m) and RECV_B(s-1, m) likewise when B/I(s, m) runs
  and stage s-1 lives elsewhere. W never communicates; stages on the same rank exchange nothing.
- where: the compute streams are replayed in lockstep rounds, ranks in order within a round, each rank running
  its next compute instruction once its inputs have been computed (F(s, m) after F(s-1, m), B/I(s, m) after
  F(s, m) and the backward of (s+1, m), W(s, m) after I(s, m)). When an instruction runs, its SENDs (in the order
  of its halves) are appended to its own rank's stream right after it, and the matching RECVs are appended to
  the receiving ranks' streams at that same moment. So a message is posted by both of its ranks at the same
  point of one global order, every receive comes before the compute that needs it, and each channel carries its
  messages in the same order on both sides (the nccl model's order rule holds by construction).
- if the replay stops because no rank can run its next instruction (the compute order itself deadlocks, or an
  input is never computed), the rest of each stream keeps the plain rule: the RECVs of an instruction whose
  inputs were not computed before it, then the instruction, then its SENDs. The verifier then reports the
  deadlock with its chain of waits.
The relative order of compute instructions is unchanged. Under the runtime's batching rule (docs/verification.md:
a maximal run of sends/receives is one batch_isend_irecv, waited for as a whole) the result cannot deadlock when
the compute order is valid: the op with the earliest global position among all stuck ops would have its
counterpart posted, and a blocked op always points at a stuck op that is earlier still.
"""

from __future__ import annotations

from pipec.errors import PipecInputError
from pipec.ir import Action, Instruction, Kind, Program


def insert_p2p_ops(program: Program) -> Program:
    if program.has_comms:
        raise PipecInputError("the program already has send/recv instructions")
    where = program.stage_to_rank
    last = program.num_stages - 1
    streams = program.streams
    out: list[list[Instruction]] = [[] for _ in streams]
    # Keys are plain (stage, tag, mb) tuples: hashing an Action would run Enum.__hash__ in Python. Tags: F the
    # forward ran, G the input gradient exists (B or I ran), I the I ran (W may run).
    done: set[tuple[int, str, int]] = set()
    # per stage, the rank its output goes to (forward: stage + 1, backward: stage - 1), None at the ends
    forward_to = [where[s + 1] if s < last else None for s in range(last + 1)]
    backward_to = [where[s - 1] if s > 0 else None for s in range(last + 1)]
    new = tuple.__new__  # builds an Action without the NamedTuple's Python-level __new__ (800k of them at scale)
    f, b, i_ = Kind.F, Kind.B, Kind.I
    send_f, recv_f, send_b, recv_b = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B

    def run(rank: int, instruction: Instruction) -> None:
        mine = out[rank]
        mine.append(instruction)
        for stage, kind, mb in (instruction,) if type(instruction) is Action else instruction.parts:
            if kind is f:
                done.add((stage, "F", mb))
                peer = forward_to[stage] if 0 <= stage <= last else None
                if peer is not None and peer != rank:
                    mine.append(new(Action, (stage, send_f, mb)))
                    out[peer].append(new(Action, (stage + 1, recv_f, mb)))
            elif kind is b or kind is i_:
                done.add((stage, "G", mb))
                if kind is i_:
                    done.add((stage, "I", mb))
                peer = backward_to[stage] if 0 <= stage <= last else None
                if peer is not None and peer != rank:
                    mine.append(new(Action, (stage, send_b, mb)))
                    out[peer].append(new(Action, (stage - 1, recv_b, mb)))

    position = [0] * len(streams)
    waiting = [_needs(stream[0], last) if stream else () for stream in streams]  # what each next instruction reads
    active = [rank for rank, stream in enumerate(streams) if stream]
    while active:
        progress = False
        for rank in active:
            if done.issuperset(waiting[rank]):
                stream, k = streams[rank], position[rank]
                run(rank, stream[k])
                position[rank] = k = k + 1
                if k < len(stream):
                    waiting[rank] = _needs(stream[k], last)
                progress = True
        active = [rank for rank in active if position[rank] < len(streams[rank])]
        if not progress:
            break

    # The replay stopped early only if the compute order cannot run: place the rest by the plain rule.
    for rank, stream in enumerate(streams):
        for instruction in stream[position[rank] :]:
            for action in instruction.parts:
                receive = _remote_input(action, rank, where, last)
                if receive is not None and _producer(action) not in done:
                    out[rank].append(receive)
            out[rank].append(instruction)
            for action in instruction.parts:
                message = _remote_output(action, rank, where, last)
                if message is not None:
                    out[rank].append(message[0])
    return program.with_streams(tuple(tuple(s) for s in out), has_comms=True)


def _needs(instruction: Instruction, last: int) -> tuple[tuple[int, str, int], ...]:
    """The keys that must be done before the instruction runs (see `done` in insert_p2p_ops)."""
    if type(instruction) is Action:  # the common case, without building a list
        stage, kind, mb = instruction
        if kind is Kind.F:
            return ((stage - 1, "F", mb),) if stage > 0 else ()
        if kind is Kind.B or kind is Kind.I:
            return ((stage, "F", mb), (stage + 1, "G", mb)) if stage < last else ((stage, "F", mb),)
        return ((stage, "I", mb),) if kind is Kind.W else ()
    out = []
    for stage, kind, mb in instruction.parts:
        if kind is Kind.F:
            if stage > 0:
                out.append((stage - 1, "F", mb))
        elif kind is Kind.B or kind is Kind.I:
            out.append((stage, "F", mb))
            if stage < last:
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


def _remote_input(action: Action, rank: int, where: tuple[int, ...], last: int) -> Action | None:
    """The RECV this compute action needs, if its input comes from another rank."""
    stage, kind, mb = action
    if kind is Kind.F and 0 < stage <= last and where[stage - 1] != rank:
        return Action(stage, Kind.RECV_F, mb)
    if (kind is Kind.B or kind is Kind.I) and 0 <= stage < last and where[stage + 1] != rank:
        return Action(stage, Kind.RECV_B, mb)
    return None


def _remote_output(action: Action, rank: int, where: tuple[int, ...], last: int) -> tuple[Action, int, Action] | None:
    """(SEND, receiving rank, RECV) for an output another rank consumes."""
    stage, kind, mb = action
    if kind is Kind.F and 0 <= stage < last and where[stage + 1] != rank:
        return Action(stage, Kind.SEND_F, mb), where[stage + 1], Action(stage + 1, Kind.RECV_F, mb)
    if (kind is Kind.B or kind is Kind.I) and 0 < stage <= last and where[stage - 1] != rank:
        return Action(stage, Kind.SEND_B, mb), where[stage - 1], Action(stage - 1, Kind.RECV_B, mb)
    return None
