"""The `choose` section: its take lines, `prefer` keys and guards compiled per rank into rules for the list
scheduler, and the scheduler's orders taken back (`drop padded`, errors reported at the section).

The front end sits below the passes, so it does not call the list scheduler itself: the driver
(pipec.compiler) hands run_choose a ListScheduler with the costs and the memory model bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Protocol

from pipec.errors import PipecInputError, ScheduleProgramError, Span
from pipec.frontend import ast
from pipec.frontend.closures import Compiler, ExprFn
from pipec.frontend.padded import drop_padded
from pipec.frontend.params import evaluate
from pipec.frontend.rules import CANDIDATE_NAMES, KINDS
from pipec.frontend.state import RankState
from pipec.ir import Kind, Program


class Candidate(Protocol):
    """What the rules read of one op a rank may start (pipec.passes.list_schedule.Candidate has it, with the
    fields CANDIDATE_NAMES names)."""

    @property
    def rank(self) -> int: ...

    @property
    def kind(self) -> Kind: ...

    @property
    def chunk(self) -> int: ...


@dataclass(frozen=True)
class ChooseRules:
    """The section's rules, as pipec.passes.list_schedule.Rules takes them: the kinds in take order, a priority
    key (higher first), a guard, and each rank's memory limit (None: the program's declared bound, or none)."""

    takes: tuple[Kind, ...]
    priority: Callable[[Candidate], tuple]
    admit: Callable[[Candidate], bool]
    limit: Callable[[int], float | None] | None = None
    overlap: bool = False  # the section's `overlap` line (Rules.overlap)


ListScheduler = Callable[[Program, ChooseRules], Program]  # the template's orders under the rules


@dataclass(frozen=True)
class ChooseSpec:
    """A choose section bound to P, M, V and its parameters: what the list scheduler needs besides the costs."""

    template: Program  # P, M, V, the placement, the declared memory bound; no streams yet
    rules: ChooseRules  # the kinds in take order and the compiled priority, prefer and guard expressions
    limits: tuple[int | Fraction, ...] | None  # the section's `memory` per rank (declaration units), if given
    drop_padded: bool
    span: Span  # the section, where a schedule that cannot finish is reported


def run_choose(
    spec: ChooseSpec, list_scheduler: ListScheduler, memory_limit: float | None = None, share: bool = False
) -> Program:
    """The compute orders the rules choose, by ``list_scheduler`` (the costs and the verifier's memory model bound
    by the caller, who checks them first: their mistakes are reported as themselves). A rank's limit is the
    section's `memory`, else ``memory_limit`` (as `--memory-limit`, in the verifier's units), else the schedule's
    declared bound. ``share``: the costs, sizes and ``memory_limit`` are per rank share (`--per-rank-share`,
    already converted by the caller), so the section's and the declaration's limits, in stage units, count C/V
    as much (1/V with one copy). What the run raises is the section's doing (it cannot finish, or runs over the
    budget), and is reported at the section."""
    template = spec.template
    scale = Fraction(template.pipelines, template.chunks) if share else Fraction(1)  # a stage: C/V of a share

    def limit(rank: int) -> float | None:
        if spec.limits is not None:
            return float(spec.limits[rank] * scale)
        if memory_limit is not None:
            return memory_limit
        if template.memory_bound is not None:
            return float(Fraction(str(template.memory_bound[rank])) * scale)
        return None

    try:
        program = list_scheduler(template, replace(spec.rules, limit=limit))
    except ScheduleProgramError:
        raise  # a rule failed (a division by zero): its own span says where
    except PipecInputError as e:  # it cannot finish, or over the budget: the section is what to look at
        raise PipecInputError(f"{template.name}: {e.message}", spec.span) from None
    if spec.drop_padded:
        program = replace(
            program, streams=tuple(tuple(drop_padded(list(s), template.microbatches)) for s in program.streams)
        )
    return program


def _exact(value: object) -> int | Fraction:
    """A candidate's field as the expressions see it: exact, booleans 0/1, times and memory as fractions (from the
    float's shortest text, as costs are read, so that a tie is a tie)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, Fraction)):
        return value
    if isinstance(value, float):
        return Fraction(str(value))
    raise AssertionError(f"a candidate field of type {type(value).__name__}")  # pragma: no cover


def choose_spec(
    schedule: ast.Schedule, choose: ast.Choose, env: dict[str, int], template: Program,
    rank_stages: list[tuple[int, ...]],
) -> ChooseSpec:
    """Compile the section per rank (the rank and the parameters fold to constants) into the scheduler's Rules."""
    var = choose.rank_var
    if var in env:
        raise PipecInputError(
            f"the rank variable '{var}' hides the parameter or let of the same name; rename one", choose.span
        )
    known = set(env) | {var} | set(CANDIDATE_NAMES)
    header = {**env}  # the chunk of a take and the `memory` line see no candidate
    tables: list[dict[tuple[Kind, int], tuple[ExprFn, ExprFn | None]]] = []
    prefers: list[list[ExprFn]] = []
    states: list[RankState] = []
    limits: list[int | Fraction] = []
    order: list[Kind] = []
    for rank, stages in enumerate(rank_stages):
        constants = {**env, var: rank}
        compiler = Compiler(known, exact_division=True, constants=constants, chunks=len(stages))
        table: dict[tuple[Kind, int], tuple[ExprFn, ExprFn | None]] = {}
        where: dict[tuple[Kind, int], ast.Take] = {}
        for take in choose.takes:
            priority = compiler.expr(take.priority) if take.priority is not None else (lambda st: 0)
            guard = compiler.expr(take.guard) if take.guard is not None else None
            for op in take.ops:
                kind = KINDS[op.kind]
                if kind not in order:
                    order.append(kind)
                if op.chunk is None:
                    chunk_list: Iterable[int] = range(len(stages))
                else:
                    chunk = _choose_value(op.chunk, {**header, var: rank})
                    if not isinstance(chunk, int) or not 0 <= chunk < len(stages):
                        raise PipecInputError(
                            f"rank {rank}: chunk {chunk} does not exist: each rank holds {len(stages)} stage(s), "
                            f"chunks 0..{len(stages) - 1}",
                            op.span,
                        )
                    chunk_list = (chunk,)
                for chunk in chunk_list:
                    if (kind, chunk) in where:
                        raise PipecInputError(
                            f"rank {rank}: {op.kind}[{chunk}] is already taken on line {where[kind, chunk].span.line}: "
                            "one take line per op and chunk",
                            op.span,
                        )
                    where[kind, chunk] = take
                    table[kind, chunk] = (priority, guard)
        _check_taken(schedule, choose, table, len(stages), rank)
        tables.append(table)
        prefers.append([compiler.expr(e) for e in choose.prefer])
        states.append(RankState(vars=dict(constants), rank=rank, stages=stages))
        if choose.memory is not None:
            limits.append(_choose_value(choose.memory, {**header, var: rank}))

    def bind(c: Candidate) -> RankState:
        st = states[c.rank]
        for name in CANDIDATE_NAMES:
            st.vars[name] = _exact(getattr(c, name))  # type: ignore[assignment]
        return st

    def priority(c: Candidate) -> tuple:
        st = bind(c)
        return (tables[c.rank][c.kind, c.chunk][0](st), *(fn(st) for fn in prefers[c.rank]))

    def admit(c: Candidate) -> bool:
        guard = tables[c.rank][c.kind, c.chunk][1]
        return guard is None or bool(guard(bind(c)))

    rules = ChooseRules(tuple(order), priority=priority, admit=admit, overlap=choose.overlap)
    return ChooseSpec(template, rules, tuple(limits) if choose.memory is not None else None, schedule.drop_padded,
                      choose.span)


def _choose_value(e: ast.Expr, env: Mapping[str, int]) -> int | Fraction:
    """A header-like expression of the section (a take's chunk, the `memory` line): the parameters and the rank."""
    try:
        return evaluate(e, env, exact_division=True)
    except ScheduleProgramError as error:
        raise PipecInputError(error.message, error.span) from None


def _check_taken(
    schedule: ast.Schedule, choose: ast.Choose, table: Mapping[tuple[Kind, int], object], chunks: int, rank: int
) -> None:
    """The kinds a rank takes must finish the schedule (F and B, or F, I and W; F alone for `forward only`), each
    for every chunk: any other set of take lines could never finish, and the scheduler would only say so late."""
    kinds = {kind for kind, _ in table}
    if schedule.forward_only:
        needed = [Kind.F]
    elif Kind.B in kinds and Kind.I not in kinds:
        needed = [Kind.F, Kind.B]
    else:
        needed = [Kind.F, Kind.I, Kind.W]
    if kinds != set(needed):
        taken = ", ".join(k.value for k in sorted(kinds, key=lambda k: k.value))
        wanted = "F only (forward only)" if schedule.forward_only else "F and B, or F, I and W"
        raise PipecInputError(f"the choose section takes {taken}; a schedule takes {wanted}", choose.span)
    for kind in needed:
        for chunk in range(chunks):
            if (kind, chunk) not in table:
                raise PipecInputError(
                    f"rank {rank}: {kind.value}[{chunk}] is never taken: add it to a take line (a take without a "
                    "chunk takes every chunk)",
                    choose.span,
                )
