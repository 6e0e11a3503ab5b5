"""The valid parameter sets of a schedule, found without trial and error.

A schedule declares its parameters (P, M, V and named ones, each optionally `in low .. high`) and constrains
them with `require` lines and its `stages` count. `ParamSpace` walks the parameters in order; for each one it
keeps only the values that satisfy every constraint already decidable and that still leave at least one
complete assignment for the parameters after it. Drawing from those values never produces a rejected set,
so property tests spend their examples on real schedules, and shrinking moves towards the smallest values.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from pipec.errors import PipecError, PipecInputError
from pipec.frontend import ast
from pipec.frontend.expand import BUILTIN_PARAMS, _evaluate, param_range

DEFAULT_MAX = {"P": 8, "M": 24, "V": 4}


def free_names(e: object) -> set[str]:
    """The variable names an expression reads."""
    if isinstance(e, ast.Var):
        return {e.name}
    names: set[str] = set()
    if isinstance(e, ast.Call):
        for a in e.args:
            names |= free_names(a)
    elif isinstance(e, ast.BinOp):
        names = free_names(e.left) | free_names(e.right)
    elif isinstance(e, ast.Unary):
        names = free_names(e.operand)
    elif isinstance(e, ast.Cond):
        names = free_names(e.test) | free_names(e.then) | free_names(e.otherwise)
    return names


class ParamSpace:
    def __init__(self, schedule: ast.Schedule, maxima: Mapping[str, int] | None = None) -> None:
        self.schedule = schedule
        self.maxima = {**DEFAULT_MAX, **(maxima or {})}
        declared = {p.name: p for p in schedule.params}
        self.declared = declared
        self.order = tuple(BUILTIN_PARAMS) + tuple(n for n in declared if n not in BUILTIN_PARAMS)
        self._valid = lru_cache(maxsize=None)(self._valid_values)
        self._complete = lru_cache(maxsize=None)(self._has_completion)

    def candidates(self, name: str, env: Mapping[str, int]) -> range | tuple[int, ...]:
        declared = self.declared.get(name)
        values = param_range(declared, env) if declared is not None else None
        if name in BUILTIN_PARAMS:
            top = self.maxima[name] + 1
            if values is None:
                return range(1, top)
            return range(max(1, values.start), min(values.stop, top))
        if values is not None:
            return values
        if declared is None or declared.default is None:
            raise PipecInputError(
                f"{self.schedule.name}: parameter {name} has no default and no range ('{name} in LOW .. HIGH'), "
                "so there is nothing to test it with"
            )
        return (_evaluate(declared.default, env),)

    def consistent(self, env: Mapping[str, int]) -> bool:
        """False if a constraint whose names are all bound fails (lets are computed as their inputs appear)."""
        values = dict(env)
        try:
            for item in self.schedule.header:
                if not free_names(item.value if isinstance(item, ast.Let) else item.test) <= values.keys():
                    continue
                if isinstance(item, ast.Let):
                    values[item.name] = _evaluate(item.value, values)
                elif not _evaluate(item.test, values):
                    return False
            if "P" in values and "V" in values and self.schedule.stages is not None:
                if free_names(self.schedule.stages) <= values.keys():
                    return _evaluate(self.schedule.stages, values) == values["P"] * values["V"]
        except PipecError:
            return False  # e.g. a division by zero for these values
        return True

    def _valid_values(self, prefix: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
        env = dict(prefix)
        name = self.order[len(prefix)]
        out = []
        for value in self.candidates(name, env):
            extended = (*prefix, (name, value))
            if self.consistent(dict(extended)) and self._complete(extended):
                out.append(value)
        return tuple(out)

    def _has_completion(self, prefix: tuple[tuple[str, int], ...]) -> bool:
        if len(prefix) == len(self.order):
            return True
        return bool(self._valid(prefix))

    def valid_values(self, env: Mapping[str, int]) -> tuple[int, ...]:
        """The values the next parameter (in declaration order) may take, given the ones before it."""
        return self._valid(tuple((n, env[n]) for n in self.order[: len(env)]))

    def all_params(self, limit: int = 100_000) -> list[dict[str, int]]:
        """Every valid parameter set (depth first, smallest first), up to `limit` of them."""
        out: list[dict[str, int]] = []

        def walk(env: dict[str, int]) -> None:
            if len(out) >= limit:
                return
            if len(env) == len(self.order):
                out.append(dict(env))
                return
            for value in self.valid_values(env):
                walk({**env, self.order[len(env)]: value})

        walk({})
        return out
