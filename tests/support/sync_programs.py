"""Programs with SYNCs placed by hand for the tests: the naive tied placement, SYNCs at random points, and a
stream with its SYNCs taken out."""

from __future__ import annotations

import random

from pipec.ir import Action, Kind, Program
from pipec.passes.sync import member_ranks


def without_syncs(program: Program, rank: int) -> tuple:
    return tuple(i for i in program.streams[rank] if not (isinstance(i, Action) and i.kind is Kind.SYNC))


def sync_after_last_backward(program: Program, rank: int, stage: int) -> Program:
    """The tied SYNC of `rank` placed right after its last B of `stage` and that B's sends (the naive placement)."""
    stream = list(without_syncs(program, rank))
    at = max(i for i, x in enumerate(stream) if isinstance(x, Action) and x.stage == stage and x.kind is Kind.B)
    while isinstance(stream[at + 1], Action) and stream[at + 1].kind in (Kind.SEND_B, Kind.SEND_F):
        at += 1
    stream.insert(at + 1, Action(stage, Kind.SYNC, 0))
    streams = list(program.streams)
    streams[rank] = tuple(stream)
    return program.with_streams(tuple(streams), True)


def random_syncs(program: Program, groups: list[tuple[int, ...]], rng: random.Random) -> Program:
    """One SYNC per member rank and group, each at a random point of its rank's stream."""
    streams = [list(s) for s in program.streams]
    for group, stages in enumerate(groups):
        for rank in member_ranks(stages, program.stage_to_rank):
            stage = min(s for s in stages if program.stage_to_rank[s] == rank)
            streams[rank].insert(rng.randrange(len(streams[rank]) + 1), Action(stage, Kind.SYNC, group))
    return Program(
        program.name, program.ranks, program.microbatches, program.chunks, program.stage_to_rank,
        tuple(map(tuple, streams)), has_comms=True, sync_groups=tuple(groups),
    )
