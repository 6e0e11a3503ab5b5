"""The solves of `pipec tune`'s exact phase that raise a shape's bound by refuting makespans (`gap_first`, `probed`).

A solve cut off at a makespan that it then proves no order reaches is a refutation, and its cost depends on how
far below the shape's optimum the cutoff lies: well below it is quick, near it slow. A minimising solve raises its
own bound far more slowly (measured at P=8, M=24, X=4, F=I=W=1, comm=0.5, V=1, one worker: tune's solve from its
best found 163 and stayed at the bound 157 after 82 s of the budget; cold refutations of 158 and 160 ended in 0.4
and 27 s, and a cold solve cut off at 163 found 162.5). So a shape's share is spent on orders first and on
refutations below its best after (`probed`), and a shape behind tune's best refutes the gap before anything else
(`gap_first`). A refutation's bound holds for every order of the shape, as any solve's does (pipec.tune.cpsat).

`solve_below(limit, fraction)` is the shape's solve cut off at `limit` in `fraction` of the time its share has
left (search._solve_shape); results are cpsat.SolverResult, the bound of one merged from every solve it took.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from pipec.tune.cpsat import SolverResult

# the gap tune certifies first: a shape behind tune's best proves its bound within it before anything else
# (`gap_first`), and a solve that ends unproved refutes below its best by it (`probed`)
CERTIFY_GAP = 0.02
# of a shape's share, kept from its solve for the refutations below the best it found when that solve ends
# unproved (measured at P=8, M=24, comm=0.5, V=1, one worker: at X=4, F=I=W=1 the solve from tune's best reached
# its 163 in under half of its 82 s; at X=4, F=2I=2W it proved 213.5 in 51 s of 78, and with 0.6 of the share it
# did not, nor did a refutation of 213 in 16 s after it)
PROBE_SHARE = 0.25
_EPSILON = 1e-9

SolveBelow = Callable[[float, float], SolverResult]


def below(makespan: float, gap: float, scale: int) -> float:
    """The greatest makespan in the model's unit (1/`scale`) under makespan / (1 + gap)."""
    return (math.ceil(makespan * scale / (1 + gap) - _EPSILON) - 1) / scale


def gap_first(
    solve_below: SolveBelow,
    time_left: Callable[[], float],
    cutoff: float,
    own: float,
    known: Callable[[], float],
    scale: int,
) -> SolverResult:
    """A shape's solve below `cutoff` (tune's best), gap first when the shape is behind (its own best `own` above
    the cutoff, so no hint of it fits) and its bound so far (`known()`, asked only then) more than CERTIFY_GAP
    below: first below the greatest makespan in the model's unit (1/`scale`) under cutoff / (1 + CERTIFY_GAP),
    then, when that finds no order, below the cutoff in the time left (measured at P=4, M=8, X=2, V=2, I=2F,
    comm=0.5, placement loop, one worker: none at or below 61.5 in 3.2 units of deterministic time, none at or
    below 62.5 in 12.8), so a solve that the budget cuts still leaves the run's bound within the gap of tune's
    best. An order found in the first is faster than tune's best by more than the gap, and that solve goes on from
    it as one at the cutoff would. Otherwise (no cutoff, a shape that holds tune's best, or a bound already
    within the gap) the solve below the cutoff is `probed`."""
    if math.isinf(cutoff) or own <= cutoff + _EPSILON or known() * (1 + CERTIFY_GAP) >= cutoff:
        return probed(solve_below, time_left, cutoff, scale)
    first = solve_below(below(cutoff, CERTIFY_GAP, scale), 1.0)
    if first.orders is not None or not first.optimal:
        return first  # an order within the gap, or the time ran out
    gap_proved = replace(first, optimal=False)  # the bound within the gap of tune's best, not the shape's optimum
    if time_left() <= 0:
        return gap_proved
    then = solve_below(cutoff, 1.0)
    took = first.seconds + then.seconds
    if then.orders is None and not then.optimal:  # the time ran out: the bound is the greater
        return replace(gap_proved, bound=max(first.bound, then.bound or 0.0), seconds=took)  # type: ignore[type-var]
    return replace(then, bound=max(first.bound, then.bound), seconds=took)  # type: ignore[type-var]


def probed(solve_below: SolveBelow, time_left: Callable[[], float], cutoff: float, scale: int) -> SolverResult:
    """The shape's solve below `cutoff` in 1 - PROBE_SHARE of its share's time; when it ends with an order it has
    not proved, refutations in the rest: below its best / (1 + CERTIFY_GAP)
    (proved: the bound is within the gap), again from each faster order one finds, then below its best by one
    unit (proved: the best is optimal). One that the time cuts ends them; its bound still counts."""
    found = solve_below(cutoff, 1 - PROBE_SHARE)
    gap = CERTIFY_GAP
    while found.orders is not None and not found.optimal and found.makespan is not None and time_left() > 0:
        bound = found.bound or 0.0
        target = below(found.makespan, gap, scale)
        if target + _EPSILON >= bound:  # else refuted already: the solve's own bound is above it
            probe = solve_below(target, 1.0)
            bound = max(bound, probe.bound or 0.0)
            took = found.seconds + probe.seconds
            if probe.orders is not None:  # faster than the best by more than the gap: refute below it next
                found = replace(probe, bound=bound, seconds=took)
                continue
            found = replace(found, bound=bound, seconds=took)
            if not probe.optimal:
                return found  # the time ran out
        if gap == 0.0 or found.makespan <= bound + _EPSILON:
            return replace(found, bound=found.makespan, optimal=True)
        gap = 0.0
    return found


__all__ = ["CERTIFY_GAP", "PROBE_SHARE", "below", "gap_first", "probed"]
