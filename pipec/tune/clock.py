"""How `pipec tune` counts its time budget (`Clock`), one object that the search hands down to every phase.

A wall-clock budget proves less on a loaded machine: the same command on 2 shared cores got half of a core and
left the solver's bound open where an idle run proved the optimum (P=8, M=24, X=4, I=2F, comm=0.5: 214 idle
against 218 loaded). So the budget counts work, not waiting:

- tune's own phases (list scheduling, local moves, send/recv placement, the branch and bound) read `now()`, the
  CPU seconds of this process since the clock started (time.process_time: every thread, the solver's included);
- a CP-SAT solve is limited by the solver's *deterministic* time (`solver_limits`), which counts the same work
  whatever the load, so one worker given the same share gives the same orders and bound idle or loaded;
- a wall-clock safety cap: `now()` is never less than the wall time over WALL_CAP, so a machine so loaded that
  the process gets under 1/WALL_CAP of a core still ends within WALL_CAP times the budget.

With `--workers N` the solver's N threads spend CPU time N times as fast: the budget is the same work, done
sooner in wall time on idle cores.
"""

from __future__ import annotations

import time
from collections.abc import Callable

WALL_CAP = 3.0  # the command ends by this many times its budget in wall time, however loaded the machine
# CP-SAT's deterministic time per CPU second of its solve, on this project's 2-core machine (one worker): measured
# on five models, cold, solved for 2 to 15 s: 0.90 (P=8 M=24 X=4 I=2F), 0.89 (P=8 M=16 X=4 W=2F), 0.86 (P=4 M=8
# X=2 V=2 placement v), 0.55 (P=8 M=24 X=4 I=2F comm=0.5), 0.30 (P=4 M=8 X=4 comm=0.5, proved in 1.8 s); the
# median of the long solves, rounded down: a solve given s seconds of the budget stops at about s CPU seconds on
# the models without posts and runs over by up to a third on those with them (what it overruns, the phases
# after it lose: each takes its share of what is left).
DETERMINISTIC_PER_SECOND = 0.8
SOLVER_FLOOR = 0.05  # the least solver time given, in seconds of the budget (CP-SAT rejects a limit of zero)


class Clock:
    """The budget's clock: `now()` is the seconds of budget spent since the clock was made (module docstring).
    Deadlines are values of `now()`. `cpu` and `wall` are the two time sources (seconds, any origin)."""

    def __init__(
        self, cpu: Callable[[], float] = time.process_time, wall: Callable[[], float] = time.monotonic
    ) -> None:
        self._cpu, self._wall = cpu, wall
        self._cpu_start, self._wall_start = cpu(), wall()

    def now(self) -> float:
        """Seconds of the budget spent: this process's CPU seconds, or the wall seconds over WALL_CAP if more."""
        return max(self._cpu() - self._cpu_start, (self._wall() - self._wall_start) / WALL_CAP)

    def after(self, seconds: float) -> float:
        """The deadline `seconds` of budget from now."""
        return self.now() + seconds

    def left(self, deadline: float) -> float:
        """Seconds of budget left until `deadline` (0 when passed)."""
        return max(0.0, deadline - self.now())

    def passed(self, deadline: float) -> bool:
        return self.now() > deadline


def solver_limits(seconds: float) -> tuple[float, float]:
    """CP-SAT's (max_deterministic_time, max_time_in_seconds) for a solve given `seconds` of the budget: the
    deterministic limit is what binds (the same work idle or loaded); the wall limit is the safety cap."""
    seconds = max(SOLVER_FLOOR, seconds)
    return seconds * DETERMINISTIC_PER_SECOND, seconds * WALL_CAP


def solver_seconds(deterministic_time: float) -> float:
    """A solve's deterministic time in seconds of the budget (about its CPU seconds here; the same idle or loaded)."""
    return deterministic_time / DETERMINISTIC_PER_SECOND


__all__ = ["DETERMINISTIC_PER_SECOND", "WALL_CAP", "Clock", "solver_limits", "solver_seconds"]
