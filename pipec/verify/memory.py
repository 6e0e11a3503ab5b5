"""peak_activations and check_memory: activation memory along each rank's program order.

The model (one liveness function, shared by the verifier, the simulator and the runtime): F(s, m) allocates
one unit (one stage's activations for one micro-batch); B(s, m) frees it; with a split backward, I(s, m)
frees `input_fraction` of it and W(s, m) the rest. Send/recv instructions hold no activations.
"""

from __future__ import annotations

from pipec.ir import Kind, Program

DEFAULT_INPUT_FRACTION = 0.5


def activation_deltas(input_fraction: float = DEFAULT_INPUT_FRACTION) -> dict[Kind, float]:
    return {Kind.F: 1.0, Kind.B: -1.0, Kind.I: -input_fraction, Kind.W: input_fraction - 1.0}


def memory_profile(stream, input_fraction: float = DEFAULT_INPUT_FRACTION) -> list[float]:
    """Live activations after each instruction of one rank's stream."""
    deltas = activation_deltas(input_fraction)
    live, out = 0.0, []
    for instruction in stream:
        for action in instruction.parts:
            live += deltas.get(action.kind, 0.0)
        out.append(live)
    return out


def peak_activations(program: Program, input_fraction: float = DEFAULT_INPUT_FRACTION) -> tuple[float, ...]:
    if program.forward_only:  # inference frees each activation as soon as it has been sent on
        return (0.0,) * program.ranks
    return tuple(max(memory_profile(stream, input_fraction), default=0.0) for stream in program.streams)


def check_memory(program: Program, peaks: tuple[float, ...], limit: int | None = None) -> list[str]:
    problems = []
    for rank, stream in enumerate(program.streams):
        bound = limit if limit is not None else (program.memory_bound[rank] if program.memory_bound else None)
        if bound is None or peaks[rank] <= bound:
            continue
        profile = memory_profile(stream)
        step = next(i for i, live in enumerate(profile) if live > bound)
        alive = _alive_at(stream, step)
        source = "--memory-limit" if limit is not None else "the schedule's memory bound"
        problems.append(
            f"rank {rank} holds {profile[step]:g} units of activations at op {step} ({stream[step]}), over "
            f"{source} of {bound}; alive: {', '.join(alive)}"
        )
    return problems


def _alive_at(stream, step: int) -> list[str]:
    alive: dict[tuple[int, int], str] = {}
    for instruction in stream[: step + 1]:
        for stage, kind, mb in instruction.parts:
            if kind is Kind.F:
                alive[(stage, mb)] = f"stage {stage} mb {mb}"
            elif kind in (Kind.B, Kind.W):
                alive.pop((stage, mb), None)
    return list(alive.values())
