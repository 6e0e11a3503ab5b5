"""A schedule's header, bound to its parameters: the `pipelines` line, the `let` and `require` lines, `stages`,
the placement, the routes, the `memory` bound and the `expect` figures."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from pipec.errors import PipecInputError, PipecSyntaxError, ScheduleProgramError
from pipec.frontend import ast
from pipec.frontend.closures import Compiler
from pipec.frontend.params import evaluate
from pipec.frontend.state import RankState
from pipec.ir import loop_placement, v_placement


@dataclass(frozen=True)
class Header:
    """What the header lines give, for one binding of the parameters."""

    stages: int
    placement: tuple[int, ...]  # stage -> rank
    memory: tuple[int | float, ...] | None  # the declared memory bound per rank
    expected: dict[str, int | Fraction]  # the `expect` lines
    pipelines: int = 1  # C, the copies of the model (`pipelines`)
    routes: tuple[int, ...] = ()  # per micro-batch its copy; () when C = 1 (every micro-batch through copy 0)


def bind_header(schedule: ast.Schedule, env: dict[str, int]) -> Header:
    """Run the header lines in order; the lets and S are added to ``env``. A header expression that divides by zero
    is bad input (exit 2), reported at its line."""
    try:
        pipelines = bind_pipelines(schedule, env)
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
        if stages % pipelines:
            assert schedule.pipelines is not None  # C = 1 divides every stage count
            raise PipecInputError(
                f"the schedule has {stages} stages, which {pipelines} pipelines cannot share: each copy of the model "
                f"holds S / C stages (S % C == 0)",
                schedule.pipelines.span,
            )
        env["S"] = stages
        placement = stage_placement(schedule, env, stages)
        routes = micro_batch_routes(schedule, env, pipelines)
        memory = memory_bound(schedule, env)
        expected = {e.what: evaluate(e.value, env, exact_division=True) for e in schedule.expects}
    except ScheduleProgramError as e:  # a header expression divided by zero
        raise PipecInputError(e.message, e.span) from None
    return Header(stages, placement, memory, expected, pipelines, routes)


def bind_pipelines(schedule: ast.Schedule, env: dict[str, int]) -> int:
    """C from the `pipelines` line (1 without one), bound to the name C for the lines after it. It is read before
    the lets, so it may use the parameters only; the lets, requires, placement, route and programs may use C."""
    declared = schedule.pipelines
    if declared is None:
        env.setdefault("C", 1)  # a schedule's own parameter C keeps its meaning when it declares no pipelines
        return 1
    if "C" in env:
        raise PipecInputError("'pipelines' names the copies C, which is already a parameter; rename the parameter",
                              declared.span)
    pipelines = evaluate(declared.value, env)
    if pipelines < 1:
        raise PipecInputError(f"pipelines must be at least 1, got {pipelines}", declared.span)
    env["C"] = pipelines
    return pipelines


def micro_batch_routes(schedule: ast.Schedule, env: Mapping[str, int], pipelines: int) -> tuple[int, ...]:
    """Each micro-batch's copy, from the `route` line or the default, equal contiguous blocks (m * C // M); ()
    when every micro-batch goes through copy 0 of one pipeline, the IR's single chain."""
    microbatches = env["M"]
    route = schedule.route
    if route is None:
        return tuple(m * pipelines // microbatches for m in range(microbatches)) if pipelines > 1 else ()
    if route.var in env:
        raise PipecInputError(f"the route's variable '{route.var}' hides the parameter or let of the same name",
                              route.span)
    if isinstance(route.value, (ast.Count, ast.Pending)):
        raise PipecSyntaxError("count() and pending() only make sense inside a per-rank program", route.value.span)
    copy_of = Compiler({*env, route.var}).expr(route.value)  # compiled once, run M times
    state = RankState(vars=dict(env), rank=-1, stages=())
    routes = []
    for m in range(microbatches):
        state.vars[route.var] = m
        copy = copy_of(state)
        if not 0 <= copy < pipelines:
            raise PipecInputError(
                f"the route sends micro-batch {m} to copy {copy}, outside 0..{pipelines - 1} (C = {pipelines})",
                route.value.span,
            )
        routes.append(copy)
    return tuple(routes) if pipelines > 1 else ()


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
