"""peak_activations and check_memory: activation memory along each rank's program order.

The model (one liveness function, shared by the verifier, the simulator and the runtime): F(s, m) allocates
`size(s)` units, by default 1 (one stage's activations for one micro-batch); B(s, m) frees them; with a split
backward, I(s, m) frees `input_fraction` of them (default 0.5) and W(s, m) the rest. Send/recv instructions hold
no activations. `stage_sizes` gives each stage its own size (e.g. a bigger first stage with the embedding).
A forward-only schedule keeps nothing: each activation is freed once it has been sent on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pipec.errors import PipecInputError
from pipec.ir import DEFAULT_INPUT_FRACTION, MEMORY_TOLERANCE, Action, Instruction, Kind, Program, activation_deltas

# DEFAULT_INPUT_FRACTION and activation_deltas live in pipec/ir.py, so that a pass (layer 3) orders by the same
# liveness rule the verifier checks; they are still importable from here, their former home.


def validate_memory_model(
    program: Program, input_fraction: float, stage_sizes: Sequence[float] | None
) -> tuple[float, ...] | None:
    if not 0.0 <= input_fraction <= 1.0:
        raise PipecInputError(f"the input fraction must be between 0 and 1, got {input_fraction:g}")
    if stage_sizes is None:
        return None
    sizes = tuple(float(x) for x in stage_sizes)
    if len(sizes) != program.num_stages:
        raise PipecInputError(f"{len(sizes)} stage sizes given for {program.num_stages} stages")
    if any(x < 0 for x in sizes):
        raise PipecInputError("stage sizes must not be negative")
    return sizes


SHARE_FLAG = "--per-rank-share"  # the CLI flag that gives costs and memory per rank share of the model


def share_of_stage(chunks: int, pipelines: int = 1) -> float:
    """How much of one rank's share of the model (1/P of one copy) a stage is: 1/V with one copy, C/V with C
    copies of the model over the same ranks (a copy's L = S/C stages cover the whole model; DualPipe's V = C = 2
    stage is a whole share). Written C / V so that C = 1 gives the float 1/V exactly as before."""
    return pipelines / chunks


def spread_segments(
    values: float | Sequence[float], ranks: int, chunks: int, key: str, divide: bool = True, pipelines: int = 1
) -> tuple[float, ...]:
    """Per-segment values -> per-stage values, for units that compare across V (``--per-rank-share``).

    The model is P consecutive segments (its stages at V=1); ``values`` gives one number per segment (or one for
    all). Stages are numbered along each copy of the model (``pipelines`` = C copies of L = P*V/C stages, copy c's
    stage l being stage c*L + l), so stage c*L + l covers [l/L, (l+1)/L) of the model, which lies inside segment
    l // (V/C) when C divides V. With ``divide`` a stage takes C/V of its segment's amount (a duration, an
    activation size); without, the segment's own value (a factor such as ``scale``). Where C does not divide V a
    stage straddles segments: a single number still spreads (C/V of it), a per-segment list is refused.
    """
    uniform = not isinstance(values, Sequence)
    segments = tuple(float(v) for v in values) if not uniform else (float(values),) * ranks
    if len(segments) != ranks:
        raise PipecInputError(
            f"{key} has {len(segments)} entries; under {SHARE_FLAG} a per-stage list describes the model as P "
            f"consecutive segments (its stages at V=1): {ranks} entries expected (P={ranks})"
        )
    share = share_of_stage(chunks, pipelines) if divide else 1.0
    stages = ranks * chunks
    if chunks % pipelines != 0:
        if not uniform and len(set(segments)) > 1:
            raise PipecInputError(
                f"{key}: under {SHARE_FLAG} a per-segment list needs each stage inside one segment, but a copy of "
                f"the model here has {stages // pipelines} stages over P={ranks} segments (V={chunks} is not a "
                f"multiple of the {pipelines} pipelines); give one number, or per-stage values without {SHARE_FLAG}"
            )
        return (segments[0] * share,) * stages
    length, per_segment = stages // pipelines, chunks // pipelines  # a copy's stages; a segment's, of one copy
    return tuple(segments[s % length // per_segment] * share for s in range(stages))


def share_stage_sizes(
    stage_sizes: Sequence[float] | None, ranks: int, chunks: int, pipelines: int = 1
) -> tuple[float, ...]:
    """The verifier's stage sizes under ``--per-rank-share``: ``stage_sizes`` has one entry per segment (default
    1 each: one micro-batch's activations of one rank's share of the model), and a stage holds C/V of its
    segment's (1/V with one copy), so peaks and limits read in units that compare across V and copies."""
    return spread_segments(
        1.0 if stage_sizes is None else stage_sizes, ranks, chunks, "--stage-sizes", pipelines=pipelines
    )


def stage_units_note(chunks: int, peak: float, pipelines: int = 1) -> str:
    """The unit of a peak-activation figure in stage units, named where it differs from the unit `pipec tune` and
    `--per-rank-share` print (micro-batches of a rank's share of the model: V/C stages, V with one copy)."""
    there = peak * share_of_stage(chunks, pipelines)
    if pipelines == 1:
        held = f"of a rank's V={chunks} stages"
    else:
        held = f"of a rank's share of the model, V/C = {chunks}/{pipelines} stages"
    return (
        f"units: micro-batches of one stage's activations (pipec tune, --per-rank-share: {held}, "
        f"so {peak:g} here is {there:g} there)"
    )


def memory_profile(
    stream: Iterable[Instruction],
    input_fraction: float = DEFAULT_INPUT_FRACTION,
    stage_sizes: Sequence[float] | None = None,
) -> list[float]:
    """Live activations after each instruction of one rank's stream."""
    # keyed by the kind's value string: a Kind key would hash through Enum.__hash__ (Python) on every op
    deltas = {kind.value: delta for kind, delta in activation_deltas(input_fraction).items()}
    live, out = 0.0, []
    for instruction in stream:
        for action in (instruction,) if type(instruction) is Action else instruction.parts:
            delta = deltas.get(action.kind._value_)
            if delta is not None:
                live += delta if stage_sizes is None else delta * stage_sizes[action.stage]
        out.append(live)
    return out


def peak_activations(
    program: Program, input_fraction: float = DEFAULT_INPUT_FRACTION, stage_sizes: Sequence[float] | None = None
) -> tuple[float, ...]:
    if program.forward_only:  # inference frees each activation as soon as it has been sent on
        return (0.0,) * program.ranks
    return tuple(
        max(memory_profile(stream, input_fraction, stage_sizes), default=0.0) for stream in program.streams
    )


def check_memory(
    program: Program,
    peaks: tuple[float, ...],
    limit: float | None = None,
    input_fraction: float = DEFAULT_INPUT_FRACTION,
    stage_sizes: Sequence[float] | None = None,
) -> list[str]:
    """One problem per rank whose peak exceeds `limit` (or the schedule's declared per-rank bound)."""
    problems = []
    source = "--memory-limit" if limit is not None else "the schedule's declared memory bound"
    for rank, stream in enumerate(program.streams):
        bound = limit if limit is not None else (program.memory_bound[rank] if program.memory_bound else None)
        if bound is None or peaks[rank] <= bound + MEMORY_TOLERANCE:
            continue
        profile = memory_profile(stream, input_fraction, stage_sizes)
        first = next(i for i, live in enumerate(profile) if live > bound + MEMORY_TOLERANCE)
        step = profile.index(peaks[rank])
        problems.append(
            f"rank {rank} holds {profile[step]:g} units of activations at op {step} {stream[step]}, over {source} "
            f"of {float(bound):g} (first exceeded at op {first} {stream[first]}); alive at the peak: "
            f"{alive_at(stream, step)}"
        )
    return problems


def alive_at(stream: Sequence[Instruction], step: int) -> str:
    """The (stage, micro-batch) activations alive after op `step`, grouped by stage; `~` marks half-freed ones."""
    alive: dict[tuple[int, int], bool] = {}  # -> True while whole, False after its I
    for instruction in stream[: step + 1]:
        for stage, kind, mb in instruction.parts:
            if kind is Kind.F:
                alive[(stage, mb)] = True
            elif kind is Kind.I and (stage, mb) in alive:
                alive[(stage, mb)] = False
            elif kind is Kind.B or kind is Kind.W:
                alive.pop((stage, mb), None)
    by_stage: dict[int, list[str]] = {}
    for (stage, mb), whole in sorted(alive.items()):
        by_stage.setdefault(stage, []).append(f"{mb}" if whole else f"{mb}~")
    text = "; ".join(f"stage {stage} mb {', '.join(mbs)}" for stage, mbs in by_stage.items())
    return text + (" (~: input gradient done, weight gradient pending)" if "~" in text else "")
