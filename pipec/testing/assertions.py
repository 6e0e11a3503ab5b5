"""assert_schedule_ok: everything `pipec check` proves, plus the schedule's own `expect` lines, as one assertion."""

from __future__ import annotations

from fractions import Fraction

from pipec.ir import Program

P2P_MODELS = ("nccl", "tagged")
BUBBLE_TOLERANCE = 1e-9


class ScheduleCheckError(AssertionError):
    """A schedule failed a check; the message is the explanation `pipec check` prints."""

    def __init__(self, message: str, params: dict[str, int]) -> None:
        super().__init__(message)
        self.params = params


def describe(params: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def assert_schedule_ok(
    schedule: str | Program,
    ranks: int | None = None,
    microbatches: int | None = None,
    chunks: int | None = None,
    **params: int,
) -> Program:
    """Compile (unless given a Program), verify under both p2p models with the memory bound, and check every
    `expect` figure against the simulator at its default costs. Raises ScheduleCheckError with the
    counterexample text; returns the compiled program."""
    from pipec.compiler import compile_program
    from pipec.verify import verify

    if isinstance(schedule, Program):
        program = schedule
    else:
        program = compile_program(schedule, ranks, microbatches, chunks, params)
    label = f"{program.name} {describe(dict(program.params))}"
    for model in P2P_MODELS:
        report = verify(program, p2p=model)
        if not report.ok:
            message = f"{label}: invalid (pipec check --p2p {model})\n{report.render()}"
            raise ScheduleCheckError(message, program.params)
    if "bubble" in program.expected:
        _check_bubble(program, program.expected["bubble"], label)
    return program


def _check_bubble(program: Program, expected: Fraction, label: str) -> None:
    from pipec.sim import DEFAULT_COSTS, simulate

    result = simulate(program, DEFAULT_COSTS)
    if abs(result.bubble_fraction - float(expected)) > BUBBLE_TOLERANCE:
        raise ScheduleCheckError(
            f"{label}: the simulated bubble fraction is {result.bubble_fraction:.6g} at the default costs "
            f"({DEFAULT_COSTS.describe()}), but the schedule expects {expected} = {float(expected):.6g}",
            program.params,
        )
