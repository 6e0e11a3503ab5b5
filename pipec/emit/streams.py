"""Shared by the stream loaders: check per-rank instruction lists read from a file and build a Program.

A stream file is untrusted input. Every number in it is checked against what the file itself contains before
anything is sized from it: stages must be numbered 0..S-1 where S is the number of stages the file's compute
actions name (or its declared `stages`), micro-batches 0..M-1 with M x S at most the number of compute actions
(a complete step runs every micro-batch on every stage), and ranks 0..P-1 with P the number of rank lines, CSV
rows or declared ranks. So loading, and verifying or simulating what loaded, stays linear in the file's size.
Each loader says where an instruction came from (`ErrorAt`), so every refusal names its line and column, or its
JSON path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pipec.errors import PipecError, PipecInputError, PipecSyntaxError
from pipec.ir import Instruction, Kind, Program, parse_instruction
from pipec.passes.sync import check_groups

# The longest instruction pipec writes, an overlapped pair of two 18-digit actions, is under 100 characters.
# Longer words are refused before int() sees them (int() of a 4,300-digit number raises, and a huge word would
# be repeated in the error message).
MAX_WORD = 100

# (rank, index of the instruction in that rank's stream, message) -> the error, located in the file
ErrorAt = Callable[[int, int, str], PipecError]


def parse_word(word: str) -> Instruction:
    """``parse_instruction`` for file input: short ASCII words only (``\\d`` would also take other scripts' digits)."""
    if len(word) > MAX_WORD:
        raise PipecSyntaxError(f"{word[:24]!r}... is not an action: longer than {MAX_WORD} characters")
    if not word.isascii():
        raise PipecSyntaxError(f"{word!r} is not an action: it has non-ASCII characters")
    return parse_instruction(word)


def brief(value: object) -> str:
    """A short description of a value for an error message: never the whole of a huge string or list."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else repr(value[:40]) + "..."
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def program_from_streams(
    streams: Sequence[Sequence[Instruction]],
    where: str,
    name: str,
    expected: Mapping[str, int | None],
    error_at: ErrorAt,
    microbatches: int | None = None,
    placement: tuple[int, ...] | None = None,
    sync_groups: Sequence[Sequence[int]] = (),
    pipelines: int = 1,
    routes: Sequence[int] | None = None,
) -> Program:
    """Check the streams against the file's own extent and the caller's flags (`expected`); infer what the file
    does not declare (`microbatches`, `placement`: None for text and CSV). `sync_groups`: the groups the file
    declares; a SYNC must name one of them (its third number is the group, not a micro-batch). `pipelines`: the
    copies of the model the file declares (docs/design/replicated.md); `routes` (None: inferred from the ops, each
    micro-batch through the copy whose stages its ops name) the copy of each micro-batch."""
    ranks = len(streams)
    if ranks == 0:
        raise PipecSyntaxError(f"{where}: the file lists no ranks")
    owner: dict[int, int] = {}  # stage -> rank, inferred from the compute actions
    compute = 0
    top_stage, top_mb = (-1, 0, 0), (-1, 0, 0)  # (number, rank, index) of the highest stage / micro-batch named
    for rank, stream in enumerate(streams):
        for index, instruction in enumerate(stream):
            for action in instruction.parts:
                stage, kind, mb = action
                if stage > top_stage[0]:
                    top_stage = (stage, rank, index)
                if kind is Kind.SYNC:
                    if mb >= len(sync_groups):
                        declared_groups = f"{len(sync_groups)} declared" if sync_groups else "the file declares none"
                        raise error_at(rank, index, f"{action} names sync group {mb}, but {declared_groups}")
                    continue
                if mb > top_mb[0]:
                    top_mb = (mb, rank, index)
                if not kind.is_compute:
                    continue
                compute += 1
                if placement is None:
                    other = owner.setdefault(stage, rank)
                    if other != rank:
                        raise error_at(
                            rank,
                            index,
                            f"stage {stage} appears on rank {other} and on rank {rank} ({action}); "
                            "each stage must live on one rank",
                        )
    if compute == 0:
        raise PipecSyntaxError(f"{where}: the schedule has no compute actions")
    stages = len(placement) if placement is not None else len(owner)
    if top_stage[0] >= stages:
        stage, rank, index = top_stage
        why = (
            f"'stages' is {stages}"
            if placement is not None
            else f"the file's compute actions name {stages} different stage(s), so stages are numbered from 0"
        )
        raise error_at(rank, index, f"stage {stage} is outside 0..{stages - 1} ({why})")
    if placement is None:
        placement = tuple(owner[s] for s in range(stages))  # every stage is there: stages are 0..S-1, distinct
    microbatches = _microbatches(where, error_at, microbatches, top_mb, stages, pipelines, compute)
    length = stages // pipelines  # each micro-batch passes one copy's stages
    if stages % ranks:
        raise PipecInputError(f"{where}: {stages} stages do not divide evenly over {ranks} ranks")
    try:
        groups = check_groups(sync_groups, stages)
    except PipecInputError as e:
        raise PipecSyntaxError(f"{where}: {e.message}") from None
    # V = S / P stages on every rank: the chunk numbers (F[c], the pictures' shades, the runtime's stage objects)
    # assume it, and a rank holding nothing would be a rank that silently idles
    held = [0] * ranks
    for rank in placement:
        held[rank] += 1
    for rank, count in enumerate(held):
        if count != stages // ranks:
            raise PipecSyntaxError(
                f"{where}: rank {rank} holds {count} stage(s), but {stages} stages over {ranks} ranks make "
                f"{stages // ranks} per rank; every rank must hold the same number"
            )
    inferred = {"P": ranks, "M": microbatches, "V": stages // ranks}
    flags = {"P": "--ranks", "M": "--microbatches", "V": "--chunks"}
    for key, value in expected.items():
        if value is not None and value != inferred[key]:
            raise PipecInputError(
                f"{where}: {flags[key]} {value} disagrees with the file, which has {key} = {inferred[key]}"
            )
    has_comms = any(not a.kind.is_compute for stream in streams for i in stream for a in i.parts)
    if pipelines == 1:
        routed: tuple[int, ...] = ()
    elif routes is None:
        routed = _routes_of(streams, length, microbatches, error_at)
    else:
        routed = tuple(routes)
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
        sync_groups=groups,
        pipelines=pipelines,
        routes=routed,
    )


def _microbatches(
    where: str,
    error_at: ErrorAt,
    microbatches: int | None,
    top_mb: tuple[int, int, int],
    stages: int,
    pipelines: int,
    compute: int,
) -> int:
    """M, declared or one past the highest micro-batch named, checked against the file's extent: a complete step
    runs every micro-batch on every stage of its copy, so M x S / C is at most the compute actions."""
    declared = microbatches is not None
    if microbatches is None:
        microbatches = top_mb[0] + 1
    elif top_mb[0] >= microbatches:
        mb, rank, index = top_mb
        raise error_at(
            rank, index, f"micro-batch {mb} is outside 0..{microbatches - 1} ('microbatches' is {microbatches})"
        )
    if stages % pipelines:
        raise PipecSyntaxError(
            f"{where}: {stages} stages do not split into {pipelines} pipelines (copies of the model) of equal length"
        )
    length = stages // pipelines  # each micro-batch passes one copy's stages
    if microbatches * length > compute:
        # A complete step runs every micro-batch on every stage: M x S forwards at least. Past that the file is
        # incomplete anyway, and refusing it keeps everything sized from M x S (the verifier's and the
        # simulator's tables) linear in the file.
        why = "a complete step runs every micro-batch on every stage" + (" of its copy" if pipelines > 1 else "")
        if declared:
            per = "'stages'" if pipelines == 1 else "'stages' / 'pipelines'"
            raise PipecSyntaxError(
                f"{where}: invalid pipec stream file: 'microbatches' x {per} = {microbatches * length} is more "
                f"than the {compute} compute actions in 'streams' ({why})"
            )
        mb, rank, index = top_mb
        raise error_at(
            rank,
            index,
            f"micro-batch {mb} is too large: with {length} stage(s) per micro-batch and {compute} compute actions in "
            f"the file, micro-batches must be below {compute // length} ({why})"
            if pipelines > 1
            else f"micro-batch {mb} is too large: with {stages} stage(s) and {compute} compute actions in the file, "
            f"micro-batches must be below {compute // stages} ({why})",
        )
    return microbatches


def _routes_of(
    streams: Sequence[Sequence[Instruction]], length: int, microbatches: int, error_at: ErrorAt
) -> tuple[int, ...]:
    """Each micro-batch's copy, read from the ops: the copy (stages c*L .. c*L + L-1) of the first op naming it,
    in rank and stream order; an op of it at another copy's stage is refused, named. A micro-batch no op names
    goes through copy 0 (the structure pass then reports its missing ops)."""
    found: dict[int, tuple[int, int, int, Instruction]] = {}  # mb -> (copy, rank, index, op)
    for rank, stream in enumerate(streams):
        for index, instruction in enumerate(stream):
            for action in instruction.parts:
                stage, kind, mb = action
                if kind is Kind.SYNC:
                    continue
                copy = stage // length
                first = found.setdefault(mb, (copy, rank, index, action))
                if first[0] != copy:
                    other, at_rank, at_index, op = first
                    raise error_at(
                        rank,
                        index,
                        f"{action} leaves micro-batch {mb}'s copy: its first op, {op} (rank {at_rank} op {at_index}), "
                        f"is at copy {other}'s stages {other * length}..{other * length + length - 1}; stage {stage} "
                        f"is copy {copy}'s",
                    )
    return tuple(found[mb][0] if mb in found else 0 for mb in range(microbatches))
