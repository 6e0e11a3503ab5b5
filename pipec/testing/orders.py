"""Hypothesis strategies for random schedules, valid and broken, for testing verifiers and other tools.

- `placements(P, V)`: a stage -> rank map: looped, V-shaped or a random one with V stages per rank.
- `valid_programs()`: compute-only Programs whose per-rank orders come from one random linear extension of the
  data dependencies (F(s,m) after F(s-1,m); B/I(s,m) after F(s,m) and the backward of (s+1,m); W after its I),
  with a random mix of full and split backwards, on 1-4 ranks with 1-3 chunks and 1-5 micro-batches. Valid by
  construction: program order plus data dependencies have no cycle, so the tagged model accepts them and
  `insert_p2p_ops` lowers them without a deadlock.
- `mutated(program, rng)` / `broken_programs()`: one random mistake: two ops of a rank swapped (anywhere or
  adjacent), an op dropped, duplicated or moved to another rank; for a compute-only program, the naive lowering
  below; for a lowered one, two sends (or two receives) of a rank trading places, or one receive pushed down
  to just before the compute that reads it. Many deadlock, or break the message order, under nccl only.
- `naive_lowering(program)`: send after the producer, receive right before the consumer.
The random choices are drawn through `st.randoms`, so examples replay from hypothesis' database.
"""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import strategies as st

from pipec.ir import Action, Instruction, Kind, Program, chain_links, loop_placement, v_placement
from pipec.p2p_rule import consumers, producers, remote_input, remote_output
from pipec.passes.p2p import insert_p2p_ops
from pipec.passes.sync import with_copy_syncs

COMPUTE_MUTATIONS = ("swap", "swap_adjacent", "drop", "duplicate", "misplace", "naive_recvs")
COMM_MUTATIONS = ("swap", "swap_adjacent", "drop", "duplicate", "misplace", "reorder_comms", "sink_recv")
MUTATIONS = tuple(dict.fromkeys(COMPUTE_MUTATIONS + COMM_MUTATIONS))
STRUCTURAL = frozenset({"drop", "duplicate", "misplace"})  # these always break the structure check


def placements(ranks: int, chunks: int, rng: random.Random) -> tuple[int, ...]:
    stages = ranks * chunks
    style = rng.choice(("loop", "v", "random"))
    if style == "loop":
        return loop_placement(ranks, stages)
    if style == "v":
        return v_placement(ranks, stages)
    owners = [r for r in range(ranks) for _ in range(chunks)]
    rng.shuffle(owners)
    return tuple(owners)


def random_program(
    rng: random.Random, max_ranks: int = 4, max_microbatches: int = 5, max_chunks: int = 3, pipelines: int = 1
) -> Program:
    """One random valid compute-only program (see the module docstring). ``pipelines`` > 1: that many copies of
    the model (docs/design/replicated.md), each micro-batch routed to a random one; V is raised to make the copies
    divide the stages. With one pipeline the draws are those of every earlier version."""
    ranks = rng.randint(1, max_ranks)
    chunks = rng.randint(1, max_chunks)
    while ranks * chunks % pipelines:
        chunks += 1
    mbs = rng.randint(1, max_microbatches)
    placement = placements(ranks, chunks, rng)
    stages = ranks * chunks
    forward_only = rng.random() < 0.1
    split_share = rng.choice((0.0, 0.5, 1.0))
    split = {(s, m): rng.random() < split_share for s in range(stages) for m in range(mbs)}
    routes = tuple(rng.randrange(pipelines) for _ in range(mbs)) if pipelines > 1 else ()
    length = stages // pipelines  # a copy's stages: c * length .. c * length + length - 1
    done: set[Action] = set()
    ready = [Action((routes[m] if routes else 0) * length, Kind.F, m) for m in range(mbs)]
    streams: list[list[Instruction]] = [[] for _ in range(ranks)]
    backward_done: set[tuple[int, int]] = set()
    while ready:
        action = ready.pop(rng.randrange(len(ready)))
        streams[placement[action.stage]].append(action)
        done.add(action)
        stage, kind, mb = action
        if kind is Kind.F:
            if (stage + 1) % length:
                ready.append(Action(stage + 1, Kind.F, mb))
            elif not forward_only:
                ready.append(Action(stage, Kind.I if split[(stage, mb)] else Kind.B, mb))
        elif kind in (Kind.B, Kind.I):
            backward_done.add((stage, mb))
            if kind is Kind.I:
                ready.append(Action(stage, Kind.W, mb))
            if stage % length:
                ready.append(Action(stage - 1, Kind.I if split[(stage - 1, mb)] else Kind.B, mb))
    return Program(
        name="random",
        ranks=ranks,
        microbatches=mbs,
        chunks=chunks,
        stage_to_rank=placement,
        streams=tuple(tuple(s) for s in streams),
        forward_only=forward_only,
        pipelines=pipelines,
        routes=routes,
    )


@st.composite
def valid_programs(
    draw, max_ranks: int = 4, max_microbatches: int = 5, max_chunks: int = 3, pipelines: int = 1
) -> Program:
    return random_program(draw(st.randoms(use_true_random=False)), max_ranks, max_microbatches, max_chunks, pipelines)


def naive_lowering(program: Program) -> Program:
    """Receives right before their consumer, sends right after their producer (deadlocks under nccl often)."""
    where, links = program.stage_to_rank, chain_links(program.num_stages, program.pipelines)
    streams = []
    for rank, stream in enumerate(program.streams):
        out: list[Instruction] = []
        for instruction in stream:
            after = []
            for action in instruction.parts:
                receive, message = remote_input(action, rank, where, links), remote_output(action, rank, where, links)
                if receive is not None:
                    out.append(receive)
                if message is not None:
                    after.append(message[0])
            out.append(instruction)
            out.extend(after)
        streams.append(tuple(out))
    return program.with_streams(tuple(streams), has_comms=True)


def mutated(program: Program, rng: random.Random, mutation: str | None = None) -> tuple[Program, str]:
    """Apply one mistake; returns the program and the mutation's name ('none' when it could not apply)."""
    mutation = mutation or rng.choice(COMM_MUTATIONS if program.has_comms else COMPUTE_MUTATIONS)
    streams = [list(s) for s in program.streams]
    busy = [r for r, s in enumerate(streams) if s]
    if not busy:
        return program, "none"
    rank = rng.choice(busy)
    stream = streams[rank]
    if mutation == "swap" and len(stream) >= 2:
        i, j = sorted(rng.sample(range(len(stream)), 2))
        stream[i], stream[j] = stream[j], stream[i]
    elif mutation == "swap_adjacent" and len(stream) >= 2:
        i = rng.randrange(len(stream) - 1)
        stream[i], stream[i + 1] = stream[i + 1], stream[i]
    elif mutation == "drop" and any(not _is_comm(x) for x in stream):
        compute = [i for i, x in enumerate(stream) if not _is_comm(x)]
        del stream[rng.choice(compute)]
    elif mutation == "duplicate":
        i = rng.randrange(len(stream))
        stream.insert(rng.randrange(len(stream) + 1), stream[i])
    elif mutation == "misplace" and program.ranks > 1 and any(not _is_comm(x) for x in stream):
        compute = [i for i, x in enumerate(stream) if not _is_comm(x)]
        instruction = stream.pop(rng.choice(compute))
        other = rng.choice([r for r in range(program.ranks) if r != rank])
        streams[other].insert(rng.randrange(len(streams[other]) + 1), instruction)
    elif mutation == "reorder_comms" and program.has_comms:
        # two sends, or two receives, of one rank trade places: the channel order changes, the data flow does not
        sends = [i for i, x in enumerate(stream) if _is_comm(x) and x.kind in (Kind.SEND_F, Kind.SEND_B)]
        recvs = [i for i, x in enumerate(stream) if _is_comm(x) and x.kind.is_recv]
        def keeps_data_flow(i: int, j: int) -> bool:  # the moved send still follows its producer, recv its reader
            if stream[i].kind in (Kind.SEND_F, Kind.SEND_B):
                return _position(stream, producers(stream[j])) < i
            return _position(stream, consumers(stream[i])) > j

        pairs = [(i, j) for g in (sends, recvs) for i in g for j in g if i < j and keeps_data_flow(i, j)]
        if not pairs:
            return program, "none"
        i, j = rng.choice(pairs)
        stream[i], stream[j] = stream[j], stream[i]
    elif mutation == "sink_recv" and program.has_comms:
        # one receive moves down to just before the compute that reads it (the naive placement)
        recvs = [i for i, x in enumerate(stream) if _is_comm(x) and x.kind.is_recv]
        if not recvs:
            return program, "none"
        i = rng.choice(recvs)
        recv = stream.pop(i)
        j = _position(stream, consumers(recv), i)
        stream.insert(j, recv)
    elif mutation == "naive_recvs" and not program.has_comms:
        return naive_lowering(program), mutation
    else:
        return program, "none"
    return replace(program, streams=tuple(tuple(s) for s in streams)), mutation


@st.composite
def broken_programs(draw, lowered: bool | None = None, pipelines: int = 1) -> tuple[Program, str]:
    """A random valid program, lowered by insert_p2p_ops (with the SYNCs of its copies, if it has several) or not,
    then one random mistake."""
    rng = draw(st.randoms(use_true_random=False))
    program = random_program(rng, pipelines=pipelines)
    if lowered if lowered is not None else rng.random() < 0.6:
        program = with_copy_syncs(insert_p2p_ops(program))
    return mutated(program, rng)


def _position(stream: list[Instruction], wanted: tuple[Action, ...], start: int = 0) -> int:
    """The index of the first instruction from ``start`` on holding one of ``wanted`` (len(stream) if none)."""
    return next((k for k in range(start, len(stream)) for a in stream[k].parts if a in wanted), len(stream))


def _is_comm(instruction: Instruction) -> bool:
    return isinstance(instruction, Action) and instruction.kind.is_comm
