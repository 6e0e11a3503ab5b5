"""How `pipec tune` counts its time budget (`Clock`), one object that the search hands down to every phase.

A wall-clock budget proves less on a loaded machine: the same command on 2 shared cores got a fraction of a core
and left the solver's bound open where an idle run proved the optimum (P=8, M=24, X=4, I=2F, comm=0.5: 214 idle
against 218 loaded). CPU time does not fix it either: on this project's 2-core machine with a busy loop on each
core, the same Python work took 28% more CPU seconds (3.38 against 2.64 s) and the same CP-SAT work 60% more
(11.3 against 7.1 s), so a phase cut by CPU time still stops at another point when loaded. So the budget counts
*work*, in seconds that it takes on this machine when idle:

- tune's own phases charge the clock for what they do (`charge`), by the size of what they run: a list schedule,
  a candidate judged (verified and simulated), a local move scored, a send/recv placement scored, a model built,
  a batch of branch-and-bound nodes, each at its cost per op measured here (the constants below);
- a CP-SAT solve is limited by the solver's *deterministic* time (`Clock.solver_limits`), which counts the same work
  whatever the load, and charges that (`solver_seconds`);
- so one worker given the same command makes the same decisions idle or loaded, and returns the same table;
- two safety caps, where the estimate and the machine disagree: `now()` is never less than the process's CPU time
  over CPU_CAP nor the wall time over WALL_CAP, so the command ends within CPU_CAP times its budget in CPU time
  (what the charges leave out: compiling fixed library schedules, Python's own overhead) and WALL_CAP times in
  wall time (a machine that gives the process under 1/WALL_CAP of a core). A cap that binds is the one case
  where load changes the result.

With `--workers N` the solver's deterministic time is the same work spread over N threads (faster in wall time on
idle cores; not deterministic).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pipec.ir import Program

# tune's budget when none is given, in seconds of work: 60 until issue #23's sixth round; with the work clock a
# 60 s run gave the solver too little to close the bounds with messages (P=8, M=24, X=4, I=2F, comm=0.5: 215.5
# within 4.1% of 207 at 60 s, 213.5 proved optimal at 120 s, 72 s of CPU; P=4, M=8, X=2, V=2, F=2I=2W: 44.5
# within 20% of 37 at 60, proved optimal at 120); a search whose phases all end (every shape proved) ends sooner
DEFAULT_BUDGET = 120.0
WALL_CAP = 3.0  # the command ends by this many times its budget in wall time, however loaded the machine
CPU_CAP = 2.0  # and by this many times in CPU time, however far the charges are from what the work cost
# Costs per compute op (3·P·M·V of them) of what tune's phases charge, measured on this project's 2-core machine
# idle (time.process_time over repeated runs of library and list-scheduled orders at P=4 M=8 V=2, P=8 M=24 V=1
# and V=2, P=16 M=64 V=2; the range is over those sizes):
LIST_SECONDS_PER_OP = 100e-6  # one list-scheduled order (phase 2, or a library `choose` schedule): 49 to 105 us
# a simulation's cost per op grows with the program (8 us an op at 576 and 1152 ops, 18 at 6144, for a local
# move's score): these three are at small sizes, times 1 + ops / GROWTH_OPS (`simulation_seconds`)
EVALUATE_SECONDS_PER_OP = 18e-6  # one candidate placed, verified and simulated (candidates.evaluate): 13 to 38 us
SCORE_SECONDS_PER_OP = 8e-6  # one local move scored (search._quick_score: placed and simulated): 8 to 18 us
PLACEMENT_SECONDS_PER_OP = 4.5e-6  # one send/recv placement scored (placement.nccl_score): 4.4 to 7.3 us
GROWTH_OPS = 5000
BUILD_SECONDS_PER_OP = 80e-6  # building one CP-SAT model (cpsat.solve before the solver runs): 53 to 83 us
# and CP-SAT's loading and presolve of it, which its deterministic time hardly counts (0.02 units for 12.6 to 14.1
# CPU seconds at P=16 M=64 V=2, 6144 ops; about 1.8 s at P=8 M=24 V=4, 2304 ops): about quadratic in the ops
LOAD_SECONDS_PER_SQUARED_OP = 3e-7
NODE_SECONDS = 20e-6  # one node of the branch and bound (exact.py), its leaves' simulations spread over them
# CP-SAT's deterministic time per CPU second of its solve, here, one worker. The solves that run to their limit
# (where the rate decides what a budget buys) do 1.0 to 1.45 units a CPU second, measured idle on tune's own
# solves (issue #23's thirteenth round): 1.40-1.43 (P=4 M=8 X=2 V=2 W=2F comm=0.5, placement v), 1.18 (P=8 M=24
# X=4 F=I=W=1 comm=0.5), 1.02 (P=8 M=24 X=4 I=2F comm=0.5), 0.99-1.18 (P=8 M=24 X=4 I=2F V=2); cold solves 0.82
# to 1.28. Short solves do fewer (0.2 to 0.7: presolve and probing count little deterministic time), so a run of
# many of them takes a little longer than its budget (the P=8 M=24 I=2F line over V=1, 2, 4: 131 s of
# wall for 120). At 0.6 (the rate of short warm-started solves, the earlier value) a run of long solves stopped at
# 40% to 80% of its budget: 47 s of wall for 120 at the P=4 V=2 case above, 78 to 96 s at P=8 M=24.
DETERMINISTIC_PER_SECOND = 1.2
# The send/recv placement solves (pipec/tune/placement.py) do far fewer: 0.21 a CPU second (15 solves, 72.8 s of
# CPU, at P=4 M=8 X=2 V=2 I=2F comm=0.5); they keep the earlier 0.6, so that they search as far as before (at 1.2
# they charged a sixth of their CPU and that run took 160 s of wall for 120; at 0.21 they would search a third as
# far). Their charge under-counts their CPU about threefold, as it did before.
PLACEMENT_DETERMINISTIC_PER_SECOND = 0.6
SOLVER_FLOOR = 0.05  # the least solver time given, in seconds of the budget (CP-SAT rejects a limit of zero)


def model_seconds(ops: int) -> float:
    """What building a CP-SAT model of `ops` ops and CP-SAT's loading it cost, in seconds of the budget."""
    return BUILD_SECONDS_PER_OP * ops + LOAD_SECONDS_PER_SQUARED_OP * ops * ops


def simulation_seconds(seconds_per_op: float, program: Program) -> float:
    """What one of the simulations above (its cost per op at small sizes) costs on `program`."""
    ops = compute_ops(program)
    return seconds_per_op * ops * (1 + ops / GROWTH_OPS)


def compute_ops(program: Program) -> int:
    """The F, I and W of a program's micro-batches through its stages (what the costs per op above count)."""
    return 3 * program.microbatches * program.stages_per_pipeline


class Clock:
    """The budget's clock: `now()` is the seconds of budget spent since the clock was made (module docstring).
    Deadlines are values of `now()`. `cpu_cap`, `wall_cap`: the caps (math.inf: none, the work alone counts);
    `cpu` and `wall`: their time sources (seconds, any origin)."""

    def __init__(
        self,
        cpu_cap: float = CPU_CAP,
        wall_cap: float = WALL_CAP,
        cpu: Callable[[], float] = time.process_time,
        wall: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cpu_cap, self.wall_cap = cpu_cap, wall_cap
        self._cpu, self._wall = cpu, wall
        self._cpu_start, self._wall_start = cpu(), wall()
        self._work = 0.0

    def charge(self, seconds: float) -> None:
        """Count `seconds` of work done (a cost per op above times the ops, or a solve's `solver_seconds`)."""
        self._work += seconds

    def now(self) -> float:
        """Seconds of the budget spent: the work charged, or the CPU time over CPU_CAP or the wall time over
        WALL_CAP when either is more (the caps)."""
        return max(
            self._work,
            (self._cpu() - self._cpu_start) / self.cpu_cap,
            (self._wall() - self._wall_start) / self.wall_cap,
        )

    def after(self, seconds: float) -> float:
        """The deadline `seconds` of budget from now."""
        return self.now() + seconds

    def left(self, deadline: float) -> float:
        """Seconds of budget left until `deadline` (0 when passed)."""
        return max(0.0, deadline - self.now())

    def share(self, deadline: float, count: int) -> float:
        """The deadline of an equal share, for each of `count` steps, of the budget left until `deadline` (a step
        that ends early leaves its rest to the next)."""
        return self.after(self.left(deadline) / count)

    def passed(self, deadline: float) -> bool:
        return self.now() > deadline

    def solver_limits(self, seconds: float, rate: float = DETERMINISTIC_PER_SECOND) -> tuple[float, float]:
        """CP-SAT's (max_deterministic_time, max_time_in_seconds) for a solve given `seconds` of the budget, at
        `rate` deterministic units a second: the deterministic limit is what binds (the same work idle or loaded);
        the wall limit is the wall cap's."""
        seconds = max(SOLVER_FLOOR, seconds)
        return seconds * rate, seconds * self.wall_cap

    def run_solver(
        self, solver, model, seconds: float, ops: int, callback=None, rate: float = DETERMINISTIC_PER_SECOND
    ) -> tuple[object, float]:
        """Run a CP-SAT `solver` on `model` of `ops` ops within `seconds` of the budget, charged for building and
        loading it by its size (`model_seconds`), then the limits of `solver_limits` and the solve's charge. With
        less time than the loading takes, the solver gets its least limits and stops while loading (measured at
        P=16 M=64 V=2: 0.07 s of CPU), so only the build is charged. Returns the solver's status and the seconds of
        budget the model took, built and solved (deterministic). `callback`: CP-SAT's, told of each solution. `rate`:
        the solve's deterministic units a second of the budget (PLACEMENT_DETERMINISTIC_PER_SECOND for placements)."""
        built = model_seconds(ops)
        left = seconds - built
        if left < 0:
            built, left = BUILD_SECONDS_PER_OP * ops, 0.0
        self.charge(built)
        deterministic, wall = self.solver_limits(left, rate)
        solver.parameters.max_deterministic_time = deterministic
        solver.parameters.max_time_in_seconds = wall
        status = solver.solve(model, callback)
        solved_in = solver_seconds(solver.response_proto.deterministic_time, rate)
        self.charge(solved_in)
        return status, built + solved_in


def solver_seconds(deterministic_time: float, rate: float = DETERMINISTIC_PER_SECOND) -> float:
    """A solve's deterministic time in seconds of the budget at `rate` units a second (about its CPU seconds here;
    the same idle or loaded)."""
    return deterministic_time / rate


__all__ = [
    "BUILD_SECONDS_PER_OP",
    "CPU_CAP",
    "DEFAULT_BUDGET",
    "DETERMINISTIC_PER_SECOND",
    "EVALUATE_SECONDS_PER_OP",
    "GROWTH_OPS",
    "LIST_SECONDS_PER_OP",
    "LOAD_SECONDS_PER_SQUARED_OP",
    "NODE_SECONDS",
    "PLACEMENT_DETERMINISTIC_PER_SECOND",
    "PLACEMENT_SECONDS_PER_OP",
    "SCORE_SECONDS_PER_OP",
    "WALL_CAP",
    "Clock",
    "compute_ops",
    "model_seconds",
    "simulation_seconds",
    "solver_seconds",
]
