"""Hypothesis strategies for testing schedules and the tools around them."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import strategies as st

from pipec.frontend import ast
from pipec.testing.space import ParamSpace


def _schedule_ast(schedule: str | ast.Schedule) -> ast.Schedule:
    if isinstance(schedule, ast.Schedule):
        return schedule
    from pipec.compiler import parse_schedule

    return parse_schedule(schedule)


def schedule_params(
    schedule: str | ast.Schedule,
    max_ranks: int | None = None,
    max_microbatches: int | None = None,
    max_chunks: int | None = None,
    fixed: Mapping[str, int] | None = None,
) -> st.SearchStrategy[dict[str, int]]:
    """Valid parameter sets of a schedule (bundled name, path or source text): {"P": .., "M": .., "V": .., ...}.

    Values come from the ranges the schedule declares (`P in 1 .. 9`), capped by the maxima, and satisfy its
    `require` lines, `stages` and placement by construction (no filtering, no rejection storms); `fixed` holds
    values not to draw (`{"V": 2}`). A schedule that never names a chunk is drawn at V = 1 only, a literal-list one
    at the size its lists fix (see ParamSpace). Shrinks towards small values.
    """
    maxima: dict[str, int] = {}
    for key, value in (("P", max_ranks), ("M", max_microbatches), ("V", max_chunks)):
        if value is not None:
            maxima[key] = value
    return space_params(ParamSpace(_schedule_ast(schedule), maxima, fixed))


def space_params(space: ParamSpace) -> st.SearchStrategy[dict[str, int]]:
    """The parameter sets of an existing ParamSpace, drawn one parameter at a time from its valid values."""
    if not space.valid_values({}):
        raise ValueError(f"{space.schedule.name}: no valid parameter set: {space.why_empty()}")

    @st.composite
    def draw_params(draw: st.DrawFn) -> dict[str, int]:
        env: dict[str, int] = {}
        for name in space.order:
            env[name] = draw(st.sampled_from(space.valid_values(env)))
        return env

    return draw_params()


def as_compile_args(params: Mapping[str, int]) -> dict[str, int]:
    """{"P": 4, "M": 8, "V": 2, "x": 1} -> keyword arguments for pipec.compile."""
    named = {k: v for k, v in params.items() if k not in ("P", "M", "V")}
    return {"ranks": params["P"], "microbatches": params["M"], "chunks": params["V"], **named}
