"""The run-time state of one rank while its program runs, and the budgets of one expansion.

Each rank has its variables, one micro-batch counter per (F, chunk) and one per (B/I, chunk), and a queue of
deferred weight gradients (every I enqueues its W). Budgets turn a runaway program into an error instead of a hang
(pipec.limits): per rank, loop iterations and ops emitted (a `while` that never ends); for the whole
expansion, steps (loop iterations, ops and program nodes compiled, all ranks together), ops and wall time; and a
bound on the integers a program computes (a value squared in a loop would otherwise grow without end).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction

from pipec.errors import ScheduleProgramError, Span
from pipec.ir import Action, Instruction, Kind
from pipec.limits import MAX_OPS, MAX_SECONDS, MAX_STEPS, MAX_VALUE


@dataclass(eq=False)
class _Pending:
    chunk: int
    action: Action
    alive: bool = True


_CHECK_EVERY = 1024  # steps between looks at the clock and the expansion-wide budgets


@dataclass(eq=False)
class Budget:
    """What the rest of one expansion may spend, all ranks together (the limits are in pipec.limits)."""

    rank_steps: int  # per rank: loop iterations + ops emitted before "a loop that never ends?"
    steps_left: int = MAX_STEPS  # loop iterations + ops emitted + program nodes compiled
    ops_left: int = MAX_OPS
    deadline: float = field(default_factory=lambda: time.monotonic() + MAX_SECONDS)

    def finish_rank(self, st: RankState, span: Span) -> None:
        """Charge what a rank spent. Ops emitted by straight-line code (no loop, so no tick) are counted here."""
        self.steps_left -= st.steps + len(st.out)
        self.ops_left -= len(st.out)
        if self.ops_left < 0:
            raise ScheduleProgramError(_over_ops(), span)
        if self.steps_left < 0:
            raise ScheduleProgramError(_over_steps(), span)

    def charge_compile(self, nodes: int, span: Span) -> None:
        """Compiling a rank's program walks its AST: P ranks of a big program are real work too."""
        self.steps_left -= nodes
        if self.steps_left < 0:
            raise ScheduleProgramError(_over_steps(), span)
        if time.monotonic() > self.deadline:
            raise ScheduleProgramError(_over_time(), span)


def _over_steps() -> str:
    return (
        f"expansion stopped after {MAX_STEPS:,} steps (loop iterations, ops emitted and program nodes compiled, "
        "all ranks together), pipec's limit"
    )


def _over_ops() -> str:
    return f"the program emits more than {MAX_OPS:,} ops (all ranks together), pipec's limit"


def _over_time() -> str:
    return f"expansion stopped after {MAX_SECONDS:g} s, pipec's limit on the time to run the per-rank programs"


@dataclass(eq=False)
class RankState:
    vars: dict[str, int]
    rank: int
    stages: tuple[int, ...]  # chunk -> stage on this rank
    budget: Budget | None = None  # None: header expressions, which run no loops
    out: list[Instruction] = field(default_factory=list)
    forward_count: list[int] = field(default_factory=list)
    backward_count: list[int] = field(default_factory=list)
    weight_count: list[int] = field(default_factory=list)
    queue: deque[_Pending] = field(default_factory=deque)
    chunk_queues: list[deque[_Pending]] = field(default_factory=list)
    pending_total: int = 0  # alive entries of `queue`, so that pending(W) is O(1) and not a scan of the queue
    pending_by_chunk: list[int] = field(default_factory=list)
    steps: int = 0  # loop iterations and drained W's so far; with len(out), what the budgets count
    next_check: int = 0  # steps + len(out) above which checkpoint() looks at the budgets
    spans: list[Span] = field(default_factory=list)  # parallel to `out`, filled only by a recording compile
    # replicated pipelines: per chunk, the micro-batches routed to its stage's copy (empty: one pipeline, where
    # the k-th F[c] is micro-batch k); a counter past its copy's list hands out padded micro-batches M, M+1, ...
    routed: tuple[tuple[int, ...], ...] = ()
    microbatches: int = 0

    def __post_init__(self) -> None:
        n = len(self.stages)
        self.forward_count = [0] * n
        self.backward_count = [0] * n
        self.weight_count = [0] * n
        self.chunk_queues = [deque() for _ in range(n)]
        self.pending_by_chunk = [0] * n
        if self.budget is not None:
            self.next_check = min(_CHECK_EVERY, self.budget.rank_steps, self.budget.steps_left, self.budget.ops_left)

    def chunk_index(self, chunk: int, span: Span) -> int:
        if not 0 <= chunk < len(self.stages):
            raise ScheduleProgramError(
                f"chunk {chunk} does not exist: this rank holds {len(self.stages)} stage(s) "
                f"{list(self.stages)}, chunks 0..{len(self.stages) - 1}",
                span,
            )
        return chunk

    def routed_microbatch(self, chunk: int, k: int) -> int:
        """The k-th micro-batch routed to ``chunk``'s copy (past the last, the padded M + k - routed)."""
        table = self.routed[chunk]
        return table[k] if k < len(table) else self.microbatches + k - len(table)

    def tick(self, span: Span) -> None:
        """One loop iteration. Ops emitted count too: len(out) is read here, so a loop body that emits many ops
        per iteration cannot get past the budgets by more than one iteration's worth."""
        self.steps += 1
        if self.steps + len(self.out) > self.next_check:
            self.checkpoint(span)

    def checkpoint(self, span: Span) -> None:
        budget = self.budget
        assert budget is not None  # header expressions have no loops
        ops = len(self.out)
        used = self.steps + ops
        if used > budget.rank_steps:
            raise ScheduleProgramError("the program ran too long (a loop that never ends?)", span)
        if used > budget.steps_left:
            raise ScheduleProgramError(_over_steps(), span)
        if ops > budget.ops_left:
            raise ScheduleProgramError(_over_ops(), span)
        if time.monotonic() > budget.deadline:
            raise ScheduleProgramError(_over_time(), span)
        self.next_check = min(used + _CHECK_EVERY, budget.rank_steps, budget.steps_left, self.steps + budget.ops_left)

    def enqueue_weight(self, chunk: int, action: Action) -> None:
        entry = _Pending(chunk, Action(action.stage, Kind.W, action.mb))
        self.queue.append(entry)
        self.chunk_queues[chunk].append(entry)
        self.pending_total += 1
        self.pending_by_chunk[chunk] += 1

    def pop_weight(self, chunk: int | None) -> Action | None:
        source = self.queue if chunk is None else self.chunk_queues[chunk]
        while source and not source[0].alive:
            source.popleft()
        if not source:
            return None
        entry = source.popleft()
        entry.alive = False
        self.weight_count[entry.chunk] += 1
        self.pending_total -= 1
        self.pending_by_chunk[entry.chunk] -= 1
        return entry.action

    def pending_weights(self, chunk: int | None) -> int:
        return self.pending_total if chunk is None else self.pending_by_chunk[chunk]


_VALUE_TEXT = f"10**{len(str(MAX_VALUE)) - 1}" if str(MAX_VALUE).strip("0") == "1" else f"{MAX_VALUE:,}"


def too_big(value: int | Fraction, span: Span) -> ScheduleProgramError:
    if isinstance(value, Fraction) and abs(value) <= MAX_VALUE:
        what = f"a fraction whose denominator has {len(str(value.denominator))} digits"
    else:
        digits = len(str(abs(int(value))))
        what = f"{int(value)}" if digits <= 40 else f"a value of {digits} digits"
    return ScheduleProgramError(
        f"{what} is beyond pipec's limit of {_VALUE_TEXT} on the integers a program computes (an overflow?)", span
    )


def bounded_exact(value: int | Fraction, span: Span) -> int | Fraction:
    """A value of a `memory` or `expect` line: fractions keep their numerator and denominator within the limit,
    so that a long chain of divisions cannot build a huge denominator."""
    if type(value) is int:
        if -MAX_VALUE <= value <= MAX_VALUE:
            return value
    elif abs(value.numerator) <= MAX_VALUE and value.denominator <= MAX_VALUE:  # type: ignore[union-attr]
        return value
    raise too_big(value, span)
