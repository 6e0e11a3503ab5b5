"""A schedule's parameters: evaluating declaration expressions and binding P, M, V and the named parameters from
the caller's values and the declared defaults and ranges."""

from __future__ import annotations

from collections.abc import Mapping

from pipec.errors import PipecInputError, PipecSyntaxError, ScheduleProgramError
from pipec.frontend import ast
from pipec.frontend.closures import Compiler
from pipec.frontend.state import RankState

BUILTIN_PARAMS = ("P", "M", "V")
_PARAM_FLAGS = {"P": "--ranks", "M": "--microbatches", "V": "--chunks"}


def evaluate(e: ast.Expr, env: Mapping[str, int], exact_division: bool = False) -> int:
    """The value of a declaration's expression (a default, a range bound, a `let`, a `require` test, `stages`, a
    placement entry; with ``exact_division``, a `memory` or `expect` line) for these parameters, as `expand`
    computes it. Raises ScheduleProgramError when it has none (a division by zero) and PipecSyntaxError for
    count()/pending(), which belong to per-rank programs. Public for tools that reason about a schedule's
    parameters without expanding it (pipec.testing's parameter spaces)."""
    if isinstance(e, (ast.Count, ast.Pending)):
        raise PipecSyntaxError("count() and pending() only make sense inside a per-rank program", e.span)
    st = RankState(vars=dict(env), rank=-1, stages=())
    return Compiler(env, exact_division).expr(e)(st)


def param_range(param: ast.Param, env: Mapping[str, int]) -> range | None:
    """The declared valid values of a parameter (`P in 1 .. 9`), given the parameters before it."""
    if param.low is None or param.high is None:
        return None
    try:
        return range(evaluate(param.low, env), evaluate(param.high, env))
    except ScheduleProgramError as e:
        raise PipecInputError(e.message, e.span) from None



def bind_params(
    schedule: ast.Schedule,
    ranks: int | None,
    microbatches: int | None = None,
    chunks: int | None = None,
    overrides: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """P, M, V and the schedule's named parameters, from the caller's values and the declared defaults."""
    given = {"P": ranks, "M": microbatches, "V": chunks}
    declared = {p.name: p for p in schedule.params}
    overrides = dict(overrides or {})
    for name in overrides:
        if name in BUILTIN_PARAMS:
            raise PipecInputError(f"set {name} with {_PARAM_FLAGS[name]}, not --set")
        if name not in declared:
            known = [p for p in declared if p not in BUILTIN_PARAMS]
            raise PipecInputError(
                f"schedule {schedule.name!r} has no parameter {name!r}"
                + (f"; its parameters: {', '.join(known)}" if known else "; it takes only P, M and V")
            )
    env: dict[str, int] = {}
    order = list(BUILTIN_PARAMS) + [name for name in declared if name not in BUILTIN_PARAMS]
    for name in order:
        value = given.get(name) if name in BUILTIN_PARAMS else overrides.get(name)
        if value is None and name in declared and declared[name].default is not None:
            try:
                value = evaluate(declared[name].default, env)
            except ScheduleProgramError as e:
                raise PipecInputError(e.message, e.span) from None
        if value is None and name == "V":
            value = 1
        if value is None:
            how = _PARAM_FLAGS.get(name, f"--set {name}=VALUE")
            raise PipecInputError(f"schedule {schedule.name!r} needs parameter {name} ({how})")
        if not isinstance(value, int) or isinstance(value, bool):
            raise PipecInputError(f"parameter {name} must be an integer, got {value!r}")
        if name in BUILTIN_PARAMS and value < 1:
            raise PipecInputError(f"{name} must be at least 1 ({_PARAM_FLAGS[name]}), got {value}")
        valid = param_range(declared[name], env) if name in declared else None
        if valid is not None and value not in valid:
            raise PipecInputError(
                f"{schedule.name}: {name} = {value} is outside its declared range {valid.start} .. {valid.stop} "
                "(half-open)",
                declared[name].span,
            )
        env[name] = value
    return env


# ---- from AST to Program -----------------------------------------------------------------------
