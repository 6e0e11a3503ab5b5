"""One simulation of a placed program under a p2p model (``run_model``), and the checks around it that decide what
is raised (``checked``): the structure pass's verdict wins over the symptom a run tripped over.

A structurally invalid program (what `pipec check`'s structure pass refuses) is not simulated. The run proves
soundness from its own arrays (``Run.sound``, ``simulate_dataflow``) and the structure pass is asked only when that
proof fails or the run stops at an error, so the check costs no second pass over the streams.
"""

from __future__ import annotations

from collections.abc import Callable

from pipec.errors import ScheduleError
from pipec.gcpause import without_cyclic_gc
from pipec.ir import Program
from pipec.sim.costs import Costs
from pipec.sim.hosts import run_hosts
from pipec.sim.ideal import simulate_dataflow
from pipec.sim.refusals import deadlock_message, structure_verdict
from pipec.sim.result import SimResult
from pipec.sim.state import Run


def run_model(
    program: Program, costs: Costs, record: bool, input_fraction: float | None, p2p: str
) -> tuple[SimResult, bool]:
    """The result of a program with its send/recv placed (any program under ``ideal``), and whether the run proved
    the structure sound (False: ask the structure pass)."""
    if p2p == "ideal":
        return simulate_dataflow(program, costs, record, input_fraction)
    run = Run(program, costs, p2p)
    run_hosts(run, record)
    stuck = [r for r in range(run.P) if not run.done[r]]
    if stuck:
        raise ScheduleError(deadlock_message(run, stuck))
    sound = run.sound()
    return run.result(costs, record, input_fraction), sound


def checked(program: Program, p2p: str, simulation: Callable[[], tuple[SimResult, bool]]) -> SimResult:
    """The result of ``simulation`` (a run of ``program``, placed or not), or ScheduleError with the structure
    verdict on ``program`` when the run failed or could not vouch for the structure and the pass finds a fault."""
    # The run keeps one small record per message until the end; the cyclic garbage collector would rescan them
    # again and again (it halves the speed at 800k instructions) and nothing here forms a cycle.
    try:
        with without_cyclic_gc():
            result, sound = simulation()
    except (ScheduleError, IndexError) as error:
        # What the run tripped over is most often a symptom (`7I0 runs before its forward 7F0` when stage 7 never
        # runs a forward at all): the structure pass names the cause, so its verdict wins when it has one.
        verdict = structure_verdict(program, p2p)
        if verdict:
            raise ScheduleError(verdict) from None
        if isinstance(error, IndexError):  # cannot happen on a sound structure; kept for a clear message
            raise ScheduleError(
                "an instruction names a stage outside the schedule's placement (run `pipec check` for details)"
            ) from None
        raise
    if not sound:  # the run could not vouch for the structure (see Run.sound): the structure pass decides
        verdict = structure_verdict(program, p2p)
        if verdict:
            raise ScheduleError(verdict)
    return result
