"""The solve of `pipec tune`'s exact phase that raises a behind shape's bound by refuting a makespan (`gap_first`).

A solve cut off at a makespan that it then proves no order reaches is a refutation, and its cost depends on how
far below the shape's optimum the cutoff lies: well below it is quick, near it slow. So a shape behind tune's best
refutes the gap before anything else (`gap_first`). A refutation's bound holds for every order of the shape, as
any solve's does (pipec.tune.cpsat).

A shape that holds tune's best gets its whole share for its own solve. Keeping a quarter of it for refutations
below the best that solve finds (when it ends unproved) was measured and dropped: at P=8, M=24, X=4, comm=0.5,
V=1 it raised F=I=W=1's bound from 157 to 160 (tune 165.5 both) but lowered W=2F's from 163.5 to 162; at P=4,
M=8, X=2, V=2, I=2F, comm=0.5 the V shape's solve, in 3/4 of its share, stopped at 63 with the bound 58.5 where
the whole share finds and proves 62.5 (the run's bound 62, tune 63: 1.6% became 7.7%); F=2I=2W there went from 64
against 55 to 65.5 against 53.

Without messages no shape refutes a gap first: the ideal model's optimum is what tune must reach (within 1%), and
there a refutation near it was measured slower than the solve below tune's best that finds and proves it (P=4,
M=8, V=2, F=1, I=1.5, W=0.7, one worker, cold: at limit 4 the v shape refutes 27.3 in none of 400 s but finds and
proves 27.85 in 33; at limit 2 the loop shape refutes 35.1 in 24 s and 35.8 in 33). On the V=2 grid at P=4, M=8
without messages (the five mixes and that one, limits 2 and 4) tune then proves 11 of 12 optimal where gap first (2%,
then 1%) proved 9 (not those two, 35.8 and 27.85), and the rest at the same makespans and bounds.

`solve_below(limit, fraction)` is the shape's solve cut off at `limit` in `fraction` of the time its share has
left (search._solve_shape); results are cpsat.SolverResult, the bound of one merged from every solve it took.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from pipec.tune.cpsat import SolverResult

# the gap tune certifies first: a shape behind tune's best proves its bound within it before anything else
CERTIFY_GAP = 0.02
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
    within the gap) it is the solve below the cutoff in the whole share."""
    if math.isinf(cutoff) or own <= cutoff + _EPSILON or known() * (1 + CERTIFY_GAP) >= cutoff:
        return solve_below(cutoff, 1.0)
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


__all__ = ["CERTIFY_GAP", "below", "gap_first"]
