"""Shared by the stream loaders: build a Program from per-rank instruction lists read from a file."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipec.errors import PipecInputError
from pipec.ir import Instruction, Program


def infer_placement(streams: Sequence[Sequence[Instruction]], where: str) -> tuple[int, ...]:
    """Stage -> rank from the streams themselves; each stage must appear on exactly one rank."""
    placement: dict[int, int] = {}
    for rank, stream in enumerate(streams):
        for instruction in stream:
            for action in instruction.parts:
                if not action.kind.is_compute:
                    continue
                other = placement.setdefault(action.stage, rank)
                if other != rank:
                    raise PipecInputError(
                        f"{where}: stage {action.stage} appears on rank {other} and on rank {rank} ({action}); "
                        "each stage must live on one rank"
                    )
    if not placement:
        raise PipecInputError(f"{where}: the schedule has no compute actions")
    stages = max(placement) + 1
    missing = [s for s in range(stages) if s not in placement]
    if missing:
        raise PipecInputError(f"{where}: stage(s) {missing} never appear, so their rank is unknown")
    return tuple(placement[s] for s in range(stages))


def program_from_streams(
    streams: Sequence[Sequence[Instruction]],
    where: str,
    name: str,
    expected: Mapping[str, int | None],
    microbatches: int | None = None,
    placement: tuple[int, ...] | None = None,
) -> Program:
    """Infer P, M, V from the actions and check them against the caller's flags (`expected`)."""
    ranks = len(streams)
    if placement is None:
        placement = infer_placement(streams, where)
    if microbatches is None:
        mbs = [a.mb for stream in streams for i in stream for a in i.parts]
        microbatches = max(mbs) + 1
    stages = len(placement)
    if stages % ranks:
        raise PipecInputError(f"{where}: {stages} stages do not divide evenly over {ranks} ranks")
    inferred = {"P": ranks, "M": microbatches, "V": stages // ranks}
    flags = {"P": "--ranks", "M": "--microbatches", "V": "--chunks"}
    for key, value in expected.items():
        if value is not None and value != inferred[key]:
            raise PipecInputError(
                f"{where}: {flags[key]} {value} disagrees with the file, which has {key} = {inferred[key]}"
            )
    has_comms = any(not a.kind.is_compute for stream in streams for i in stream for a in i.parts)
    return Program(
        name=name,
        ranks=ranks,
        microbatches=microbatches,
        chunks=stages // ranks,
        stage_to_rank=placement,
        streams=tuple(tuple(s) for s in streams),
        params=dict(inferred),
        source=where,
        has_comms=has_comms,
    )
