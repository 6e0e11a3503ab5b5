"""Phase 1 of `pipec tune`: the schedules to try, each at every V and parameter set it accepts.

A source is a bundled schedule or a `--from` file. For each V of `--chunks` its declarations accept, its named
parameters run over their declared `in` ranges, enumerated as `pipec test` does (pipec.testing.space.ParamSpace,
so no set is one the schedule refuses); a product larger than MAX_SETS is sampled with the seed. A parameter
named `limit` is a memory limit in the schedule's own stage units (the convention of the cost-aware library
schedules and tests/zbv_limited.pipe): only its values within the limit X * V / C are tried (X is per rank share,
a stage holds C/V of a share, 1/V with one copy of the model), so that the schedule's own memory declaration
keeps it within X. Replicated schedules (C copies, dualpipe and chimera) are drawn like the others.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

from pipec.compiler import parse_schedule
from pipec.errors import PipecError
from pipec.frontend import ast
from pipec.frontend.header import bind_pipelines
from pipec.library import bundled_names
from pipec.testing.space import ParamSpace

MAX_SETS = 24  # parameter sets tried per (schedule, V); a larger product is sampled
LIMIT_PARAM = "limit"


@dataclass(frozen=True)
class Draw:
    """One phase-1 candidate before compiling: a schedule at one V with its named parameters, or why none."""

    name: str  # the bundled name or the --from path, as shown in the table
    source: str  # the SCHEDULE argument for pipec.compiler
    chunks: int
    params: tuple[tuple[str, int], ...]  # named parameters only (P, M, V are the run's)
    choose: bool  # a cost-aware schedule: its order depends on the costs
    problem: str = ""  # non-empty: not compiled, with this reason (verdict error or skipped)
    skipped: bool = False


def library_sources() -> list[tuple[str, str]]:
    """(name, SCHEDULE argument) of every bundled schedule."""
    return [(name, name) for name in bundled_names()]


def draws(
    sources: Sequence[tuple[str, str]],
    ranks: int,
    microbatches: int,
    chunks: Sequence[int],
    limit: float,
    seed: int,
) -> Iterator[Draw]:
    """Every (schedule, V, parameter set) to try, in a fixed order (sources as given, V ascending)."""
    rng = random.Random(seed)
    for name, source in sources:
        try:
            schedule = parse_schedule(source)
        except PipecError as e:
            yield Draw(name, source, 0, (), False, problem=e.message)
            continue
        if schedule.forward_only:
            reason = "forward only (inference): no backward to tune"
            yield Draw(name, source, 0, (), False, problem=reason, skipped=True)
            continue
        yield from _schedule_draws(name, source, schedule, ranks, microbatches, chunks, limit, rng)


def _schedule_draws(
    name: str,
    source: str,
    schedule: ast.Schedule,
    ranks: int,
    microbatches: int,
    chunks: Sequence[int],
    limit: float,
    rng: random.Random,
) -> Iterator[Draw]:
    choose = getattr(schedule, "choose", None) is not None
    fixed = {"P": ranks, "M": microbatches}
    reasons: list[str] = []
    found = False
    try:
        implied = ParamSpace(schedule, maxima=_maxima(ranks, microbatches, chunks), fixed=fixed).implied.get("V")
    except PipecError as e:
        yield Draw(name, source, 0, (), choose, problem=e.message)
        return
    for v in chunks:
        if implied is not None and v not in implied:
            continue  # a schedule that never names a chunk runs V = 1 only (ParamSpace's rule)
        try:
            space = ParamSpace(schedule, maxima=_maxima(ranks, microbatches, chunks), fixed={**fixed, "V": v})
            sets = space.all_params(limit=10_000)
            if not sets:
                reasons.append(f"V={v}: {space.why_empty()}")
                continue
        except PipecError as e:
            reasons.append(f"V={v}: {e.message}")
            continue
        named = [{k: s[k] for k in space.order if k not in ("P", "M", "V")} for s in sets]
        named = _fit_limit(named, schedule, {**fixed, "V": v}, limit)
        if len(named) > MAX_SETS:
            # the largest limits first (they are sorted so), the rest sampled
            named = named[:MAX_SETS] if LIMIT_PARAM in named[0] else rng.sample(named, MAX_SETS)
        for params in sorted(named, key=lambda p: tuple(p.items())):
            found = True
            yield Draw(name, source, v, tuple(params.items()), choose)
    if not found:
        # not broken, only not for these sizes (dualpipev at --chunks 1): skipped, with the first refusal
        reason = reasons[0] if reasons else "no V of --chunks applies"
        yield Draw(name, source, 0, (), choose, problem=reason, skipped=True)


def _maxima(ranks: int, microbatches: int, chunks: Sequence[int]) -> dict[str, int]:
    return {"P": ranks, "M": microbatches, "V": max(chunks)}


def _copies(schedule: ast.Schedule, env: dict[str, int]) -> int:
    """C, the copies of the model the schedule declares at these parameters (1 where the line cannot be read:
    compiling it reports that)."""
    try:
        return bind_pipelines(schedule, dict(env))
    except PipecError:
        return 1


def _fit_limit(
    sets: list[dict[str, int]], schedule: ast.Schedule, sizes: dict[str, int], limit: float
) -> list[dict[str, int]]:
    """A `limit` parameter is a memory limit: only values within the run's limit in stage units (X * V / C for a
    parameter set, a stage holding C/V of a share) are tried (all of them: a list schedule with more room is not
    always faster), or the smallest one when none is."""
    if not sets or LIMIT_PARAM not in sets[0]:
        return sets
    share = Fraction(str(limit)) * sizes["V"]

    def stage_units(params: dict[str, int]) -> Fraction:
        return share / _copies(schedule, {**sizes, **params})

    groups: dict[tuple, list[dict[str, int]]] = {}
    for s in sets:
        groups.setdefault(tuple((k, v) for k, v in s.items() if k != LIMIT_PARAM), []).append(s)
    out = []
    for members in groups.values():
        within = sorted((s for s in members if s[LIMIT_PARAM] <= stage_units(s)), key=lambda s: -s[LIMIT_PARAM])
        out += within or [min(members, key=lambda s: s[LIMIT_PARAM])]
    return out
