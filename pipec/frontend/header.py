"""A schedule's header, bound to its parameters: the `let` and `require` lines, `stages`, the placement, the
`memory` bound and the `expect` figures."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from pipec.errors import PipecInputError, ScheduleProgramError
from pipec.frontend import ast
from pipec.frontend.params import evaluate
from pipec.ir import loop_placement, v_placement


@dataclass(frozen=True)
class Header:
    """What the header lines give, for one binding of the parameters."""

    stages: int
    placement: tuple[int, ...]  # stage -> rank
    memory: tuple[int | float, ...] | None  # the declared memory bound per rank
    expected: dict[str, int | Fraction]  # the `expect` lines


def bind_header(schedule: ast.Schedule, env: dict[str, int]) -> Header:
    """Run the header lines in order; the lets and S are added to ``env``. A header expression that divides by zero
    is bad input (exit 2), reported at its line."""
    try:
        for item in schedule.header:
            if isinstance(item, ast.Let):
                if item.name in env or item.name in ("S", schedule.rank_var):
                    message = f"'let {item.name}' would rebind {item.name}, which is already defined"
                    raise PipecInputError(message, item.span)
                env[item.name] = evaluate(item.value, env)
            elif not evaluate(item.test, env):
                raise PipecInputError(f"{schedule.name}: {item.message}", item.span)
        stages = evaluate(schedule.stages, env) if schedule.stages is not None else env["P"] * env["V"]
        if stages != env["P"] * env["V"]:
            raise PipecInputError(
                f"the schedule declares {stages} stages, but P * V = {env['P']} * {env['V']} = "
                f"{env['P'] * env['V']}: each of the P ranks holds V stages",
                schedule.stages.span if schedule.stages is not None else schedule.span,
            )
        env["S"] = stages
        placement = stage_placement(schedule, env, stages)
        memory = memory_bound(schedule, env)
        expected = {e.what: evaluate(e.value, env, exact_division=True) for e in schedule.expects}
    except ScheduleProgramError as e:  # a header expression divided by zero
        raise PipecInputError(e.message, e.span) from None
    return Header(stages, placement, memory, expected)


def stage_placement(schedule: ast.Schedule, env: Mapping[str, int], stages: int) -> tuple[int, ...]:
    ranks = env["P"]
    p = schedule.placement
    if p is None or p.style == "loop":
        return loop_placement(ranks, stages)
    if p.style == "v":
        return v_placement(ranks, stages)
    if p.style == "list":
        mapping = tuple(evaluate(item, env) for item in p.items)
        if len(mapping) != stages:
            raise PipecInputError(
                f"the placement lists {len(mapping)} stage(s) but the schedule has {stages} (stages = {stages})",
                p.span,
            )
    else:
        assert p.var is not None
        mapping = tuple(evaluate(p.items[0], {**env, p.var: s}) for s in range(stages))
    for stage, rank in enumerate(mapping):
        if not 0 <= rank < ranks:
            raise PipecInputError(f"the placement puts stage {stage} on rank {rank}, outside 0..{ranks - 1}", p.span)
    return mapping


def memory_bound(schedule: ast.Schedule, env: Mapping[str, int]) -> tuple[int | float, ...] | None:
    memory = schedule.memory
    if memory is None:
        return None
    if memory.rank_var is None:
        return (_number(evaluate(memory.value, env, exact_division=True)),) * env["P"]
    return tuple(
        _number(evaluate(memory.value, {**env, memory.rank_var: r}, exact_division=True)) for r in range(env["P"])
    )


def _number(value: int | Fraction) -> int | float:
    return value if isinstance(value, int) else float(value)
