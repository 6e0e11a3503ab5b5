"""The valid parameter sets of a schedule, found without trial and error.

A schedule declares its parameters (P, M, V and named ones, each optionally `in low .. high`) and constrains
them with `require` lines, its `stages` count and its `placement`. `ParamSpace` walks the parameters in order; for
each one it keeps only the values that satisfy every constraint already decidable and that still leave at least
one complete assignment for the parameters after it. Drawing from those values never produces a rejected set,
so property tests spend their examples on real schedules, and shrinking moves towards the smallest values.
The walk visits every valid assignment once; it stops with an error after TEST_MAX_SPACE_STEPS constraint checks
(a declared range such as `x in 0 .. 10**15` would otherwise never end).

Two shapes of schedule fix sizes that no declaration states, so the space fixes them too (`ParamSpace.notes`
says so in one line each):
- a schedule that leaves V at 1 (no V parameter, or `V = 1` without a range) and never reads V nor names a chunk
  (`F[c]`) runs chunk 0 only: at V > 1 the other stages would never run, so V = 1 only;
- literal `rank N:` lists name their stages and micro-batches, so they fix P and V (and M, unless padded
  micro-batches are dropped).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import fields, is_dataclass
from functools import lru_cache

from pipec.errors import PipecError, PipecInputError, PipecSyntaxError, Span
from pipec.frontend import ast
from pipec.frontend.params import BUILTIN_PARAMS, evaluate, param_range
from pipec.ir import parse_instruction
from pipec.limits import TEST_MAX_SPACE_STEPS

DEFAULT_MAX = {"P": 8, "M": 24, "V": 4}
FLAGS = {"P": "--ranks", "M": "--microbatches", "V": "--chunks"}


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


def _nodes(root: object) -> Iterator[object]:
    """Every syntax node under `root` (an explicit stack: a deep program must not exhaust Python's recursion)."""
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(node)
        elif is_dataclass(node) and not isinstance(node, Span):
            yield node
            stack.extend(getattr(node, f.name) for f in fields(node))


def uses_chunks(schedule: ast.Schedule) -> bool:
    """Whether anything in the schedule reads V or names a chunk (`F[c]`, `count(W[1])`): a schedule that does
    neither emits every op on chunk 0, whatever V is."""
    for node in _nodes(schedule):
        if isinstance(node, ast.Var) and node.name == "V":
            return True
        if isinstance(node, ast.OpRef) and node.chunk is not None:
            return True
    return False


def literal_sizes(schedule: ast.Schedule) -> dict[str, int] | None:
    """P, V and M as a literal-list schedule's `rank N:` lines fix them (None for a per-rank program): P from the
    highest rank listed, V from the stages named (rounded up: uneven lists are the structure check's to report),
    M from the highest micro-batch. An action that does not parse is reported where it is written."""
    if schedule.body is not None or not schedule.rank_lists:
        return None
    top_rank, top_stage, top_mb = 0, 0, 0
    for rank_list in schedule.rank_lists:
        top_rank = max(top_rank, rank_list.rank)
        for text, span in rank_list.actions:
            try:
                instruction = parse_instruction(text)
            except PipecSyntaxError as e:
                raise PipecSyntaxError(e.message, span) from None
            for action in instruction.parts:
                top_stage = max(top_stage, action.stage)
                top_mb = max(top_mb, action.mb)
    ranks = top_rank + 1
    return {"P": ranks, "V": max(1, -(-(top_stage + 1) // ranks)), "M": top_mb + 1}


class ParamSpace:
    """The valid parameter sets of one schedule, within `maxima` (P, M, V) and with the `fixed` values
    (`{"P": 4, "extra": 2}`: the command line's --ranks and --set), walked in the order P, M, V, named ones."""

    def __init__(
        self,
        schedule: ast.Schedule,
        maxima: Mapping[str, int] | None = None,
        fixed: Mapping[str, int] | None = None,
    ) -> None:
        self.schedule = schedule
        self.maxima = {**DEFAULT_MAX, **(maxima or {})}
        declared = {p.name: p for p in schedule.params}
        self.declared = declared
        self.order = tuple(BUILTIN_PARAMS) + tuple(n for n in declared if n not in BUILTIN_PARAMS)
        self.fixed = dict(fixed or {})
        for name in self.fixed:
            if name not in self.order:
                known = [n for n in self.order if n not in BUILTIN_PARAMS]
                raise PipecInputError(
                    f"schedule {schedule.name!r} has no parameter {name!r}"
                    + (f"; its parameters: {', '.join(known)}" if known else "; it takes only P, M and V")
                )
        # the values the schedule's shape allows although no declaration states them (see the module's docstring)
        self.implied: dict[str, tuple[int, ...]] = {}
        self.notes: list[str] = []
        self._imply_sizes()
        self._valid = lru_cache(maxsize=None)(self._valid_values)
        self._complete = lru_cache(maxsize=None)(self._has_completion)
        self._placement_ok = lru_cache(maxsize=None)(self._placement_problem)
        self._steps = 0  # constraint checks so far, bounded by TEST_MAX_SPACE_STEPS

    def _imply_sizes(self) -> None:
        literal = literal_sizes(self.schedule)
        if literal is not None:
            names = ("P", "V") if self.schedule.drop_padded else ("P", "V", "M")
            for name in names:
                given = self.fixed.get(name)
                if given is not None and given != literal[name]:
                    raise PipecInputError(
                        f"{self.schedule.name}: {FLAGS[name]} {given} disagrees with the literal rank lists, which "
                        f"fix {name} = {literal[name]}"
                    )
                self.implied[name] = (literal[name],)
            if self.schedule.drop_padded:  # padded micro-batches are dropped: any M up to the lists' own
                self.implied["M"] = tuple(range(1, literal["M"] + 1))
            shown = [f"{name} = {literal[name]}" for name in names]
            sizes = ", ".join(shown[:-1]) + " and " + shown[-1]
            if self.schedule.drop_padded:
                sizes += f" (M up to {literal['M']}: padded micro-batches are dropped)"
            self.notes.append(f"the literal rank lists fix {sizes}: tested at that size only")
            return
        v = self.declared.get("V")
        defaults_to_one = v is None or (v.low is None and isinstance(v.default, ast.Int) and v.default.value == 1)
        if "V" not in self.fixed and defaults_to_one and not uses_chunks(self.schedule):
            self.implied["V"] = (1,)
            if self.maxima["V"] > 1:
                self.notes.append(
                    "V = 1 only: the schedule never reads V nor names a chunk (F[c]), so at V > 1 its ops would all "
                    "run on chunk 0 and the other chunks never (to test V > 1, name the chunks: F[c], B[c])"
                )

    def candidates(self, name: str, env: Mapping[str, int]) -> range | tuple[int, ...]:
        declared = self.declared.get(name)
        values = param_range(declared, env) if declared is not None else None
        if name in self.fixed:  # a value the caller chose: no maximum applies, the declared range still does
            value = self.fixed[name]
            return (value,) if values is None or value in values else ()
        if name in self.implied:
            return tuple(value for value in self.implied[name] if values is None or value in values)
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
        return (evaluate(declared.default, env),)

    def consistent(self, env: Mapping[str, int]) -> bool:
        """False if a constraint whose names are all bound fails (lets are computed as their inputs appear)."""
        self._steps += 1
        if self._steps > TEST_MAX_SPACE_STEPS:
            raise PipecInputError(
                f"{self.schedule.name}: enumerating the valid parameter sets took more than {TEST_MAX_SPACE_STEPS:,} "
                f"constraint checks, pipec's limit; lower the maxima ({self._maxima_text()}) or narrow the "
                "parameters' declared ranges ('NAME in LOW .. HIGH')"
            )
        return self.refusal(env) is None

    def refusal(self, env: Mapping[str, int]) -> str | None:
        """Why the schedule refuses these (possibly partial) parameters, from the constraints they decide: a
        `require`'s message, the stage count or the placement; None when nothing decided refuses them."""
        found = self._refusal(env)
        return None if found is None else found[1]

    def _refusal(self, env: Mapping[str, int]) -> tuple[str, str] | None:
        """(what refused, why): what is "require", "stages", "placement" or "error" (no value, e.g. a division
        by zero)."""
        values = dict(env)
        try:
            for item in self.schedule.header:
                if not free_names(item.value if isinstance(item, ast.Let) else item.test) <= values.keys():
                    continue
                if isinstance(item, ast.Let):
                    values[item.name] = evaluate(item.value, values)
                elif not evaluate(item.test, values):
                    return "require", item.message
            if "P" not in values or "V" not in values:
                return None
            stages = self.schedule.stages
            if stages is not None and free_names(stages) <= values.keys():
                declared = evaluate(stages, values)
                if declared != values["P"] * values["V"]:
                    return "stages", f"the schedule declares {declared} stages, but P * V = {values['P'] * values['V']}"
            problem = self._placement_refusal(values)
            return None if problem is None else ("placement", problem)
        except PipecError as e:
            return "error", e.message

    def _placement_refusal(self, values: Mapping[str, int]) -> str | None:
        """A list or formula placement must give each of the P ranks exactly V of the P * V stages (loop and v
        always do); refused here, not at compile time, so that no example is spent on a set it cannot place."""
        placement = self.schedule.placement
        if placement is None or placement.style not in ("list", "formula"):
            return None
        needed = set().union(*(free_names(item) for item in placement.items)) - {placement.var}
        bound = {**values, "S": values["P"] * values["V"]}
        if not needed <= bound.keys():
            return None
        key = tuple(sorted((name, bound[name]) for name in needed | {"P", "V"}))
        return self._placement_ok(key)

    def _placement_problem(self, key: tuple[tuple[str, int], ...]) -> str | None:
        env = dict(key)
        placement = self.schedule.placement
        assert placement is not None
        ranks, chunks = env["P"], env["V"]
        stages = ranks * chunks
        env["S"] = stages
        if placement.style == "list":
            if len(placement.items) != stages:
                return f"the placement lists {len(placement.items)} stage(s), not P * V = {stages}"
            mapping = [evaluate(item, env) for item in placement.items]
        else:
            mapping = [evaluate(placement.items[0], {**env, str(placement.var): s}) for s in range(stages)]
        held = [0] * ranks
        for stage, rank in enumerate(mapping):
            if not 0 <= rank < ranks:
                return f"the placement puts stage {stage} on rank {rank}, outside 0..{ranks - 1}"
            held[rank] += 1
        for rank, count in enumerate(held):
            if count != chunks:
                return f"the placement gives rank {rank} {count} stage(s), not V = {chunks}"
        return None

    def _maxima_text(self) -> str:
        return ", ".join(f"{name} <= {value:,}" for name, value in self.maxima.items())

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

    def refused_chunks(self) -> list[tuple[int, str]]:
        """The V values within the maximum that no valid set takes because of the placement, each with the
        placement's reason at the smallest P it refuses (a `require` or `stages` line states V's limits itself;
        a placement only implies them, so `pipec test` says which V it did not draw, and why)."""
        if "V" in self.fixed or "V" in self.implied or self.schedule.placement is None:
            return []
        taken: set[int] = set()
        for p in self.valid_values({}):
            for m in self.valid_values({"P": p}):
                taken.update(self.valid_values({"P": p, "M": m}))
        out = []
        for v in range(1, self.maxima["V"] + 1):
            if v in taken:
                continue
            for p in self.candidates("P", {}):
                microbatches = self.candidates("M", {"P": p})
                if not microbatches:
                    continue
                found = self._refusal({"P": p, "M": microbatches[0], "V": v})
                if found is not None and found[0] == "placement":
                    out.append((v, f"at P = {p}, {found[1]}"))
                    break
        return out

    def why_empty(self) -> str:
        """One line on why no parameter set is valid: the first refusal met at the smallest values."""
        env: dict[str, int] = {}
        for name in self.order:
            values = self.candidates(name, env)
            if not values:
                declared = self.declared.get(name)
                if name in self.fixed and declared is not None:
                    valid = param_range(declared, env)
                    assert valid is not None
                    return f"{name} = {self.fixed[name]} is outside its declared range {valid.start} .. {valid.stop}"
                return f"no value of {name} is allowed with {_describe(env)}"
            env[name] = values[0]
            reason = self.refusal(env)
            if reason is not None:
                return f"at {_describe(env)}: {reason}"
        return f"within {self._maxima_text()}, no set satisfies every requirement"


def _describe(env: Mapping[str, int]) -> str:
    return " ".join(f"{name}={value}" for name, value in env.items())
