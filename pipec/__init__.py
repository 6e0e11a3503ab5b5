"""pipec: a compiler for pipeline-parallel training schedules.

import pipec
program = pipec.compile("my_schedule.pipe", ranks=4, microbatches=8)
program.streams[rank]      # that rank's instructions, in order; they print in text form: (0F0, 0SEND_F0, ...)
program.check()            # raises pipec.ScheduleError when the schedule is invalid (also pipec.check(program))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipec.errors import PipecError, PipecInputError, PipecSyntaxError, ScheduleError, ScheduleProgramError
from pipec.ir import Action, Instruction, Kind, Overlap, Program, build_graph, parse_instruction

if TYPE_CHECKING:
    from pipec.sim.costs import Costs
    from pipec.verify import Report

__version__ = "0.1.0"


def compile(
    schedule: str,
    ranks: int | None = None,
    microbatches: int | None = None,
    chunks: int | None = None,
    *,
    comms: bool = True,
    costs: Costs | str | None = None,
    **params: int,
) -> Program:
    """Compile a schedule (bundled name, path, .pipe source text, torch CSV, text or JSON stream file).

    ``costs`` (a Costs, or ``--cost`` text such as ``"F=1,B=2,W=1,comm=0.5"`` or a JSON file's path) time where
    the send/recv go, so that the streams run well under those costs; None (the default) places them for the
    default costs.
    """
    from pipec.compiler import compile_program

    if costs is not None:  # the cost model is loaded only when costs are given (`import pipec` stays light)
        from pipec.sim.costs import parse_costs

        if isinstance(costs, str):
            costs = parse_costs(costs)
    return compile_program(schedule, ranks, microbatches, chunks, params, comms=comms, costs=costs)


def load(
    schedule: str, ranks: int | None = None, microbatches: int | None = None, chunks: int | None = None, **params: int
) -> Program:
    """The per-rank compute orders only (no send/recv inserted)."""
    from pipec.compiler import compute_orders

    return compute_orders(schedule, ranks, microbatches, chunks, params)


def check(
    program: Program,
    p2p: str = "nccl",
    memory_limit: float | None = None,
    input_fraction: float | None = None,
    stage_sizes: Sequence[float] | None = None,
) -> Report:
    """Run every verification pass; raises ScheduleError when the schedule is invalid, else returns the Report.

    ``input_fraction`` (the share of activations I frees, default 0.5) and ``stage_sizes`` (activations per
    stage, default 1 each) are the memory model, as for ``pipec.verify.verify``. Also ``program.check(...)``.
    """
    # imported here: `import pipec` (and `pipec compile`) must not pay for the verifier until it is used
    from pipec.verify import verify
    from pipec.verify.memory import DEFAULT_INPUT_FRACTION

    if input_fraction is None:
        input_fraction = DEFAULT_INPUT_FRACTION
    report = verify(program, p2p=p2p, memory_limit=memory_limit, input_fraction=input_fraction, stage_sizes=stage_sizes)
    report.raise_if_failed()
    return report


# `program.check()` is pipec.check. It is attached here, in the package that sits above every layer, because the
# verifier imports the IR: a method defined in pipec/ir.py would need the IR to import the verifier (a cycle).
# Importing any pipec module runs this file first, so every Program has the method.
Program.check = check  # type: ignore[method-assign]  # declared in pipec/ir.py for type checkers only

__all__ = [
    "Action",
    "Instruction",
    "Kind",
    "Overlap",
    "PipecError",
    "PipecInputError",
    "PipecSyntaxError",
    "Program",
    "ScheduleError",
    "ScheduleProgramError",
    "build_graph",
    "check",
    "compile",
    "load",
    "parse_instruction",
]
