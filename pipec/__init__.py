"""pipec: a compiler for pipeline-parallel training schedules.

import pipec
program = pipec.compile("my_schedule.pipe", ranks=4, microbatches=8)
program.streams[rank]      # that rank's instructions, in order
program.check()            # raises pipec.ScheduleError when the schedule is invalid
"""

from __future__ import annotations

from pipec.errors import PipecError, PipecInputError, PipecSyntaxError, ScheduleError, ScheduleProgramError
from pipec.ir import Action, Instruction, Kind, Overlap, Program, build_graph, parse_instruction

__version__ = "0.1.0"


def compile(
    schedule: str,
    ranks: int | None = None,
    microbatches: int | None = None,
    chunks: int | None = None,
    *,
    comms: bool = True,
    **params: int,
) -> Program:
    """Compile a schedule (bundled name, path, .pipe source text, torch CSV, text or JSON stream file)."""
    from pipec.compiler import compile_program

    return compile_program(schedule, ranks, microbatches, chunks, params, comms=comms)


def load(
    schedule: str, ranks: int | None = None, microbatches: int | None = None, chunks: int | None = None, **params: int
) -> Program:
    """The per-rank compute orders only (no send/recv inserted)."""
    from pipec.compiler import compute_orders

    return compute_orders(schedule, ranks, microbatches, chunks, params)


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
    "compile",
    "load",
    "parse_instruction",
]
