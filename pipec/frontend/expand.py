"""Bind a schedule's parameters and run its per-rank programs: AST -> per-rank compute orders (a Program).

The per-rank program is compiled once into Python closures and then run once per rank. Each rank has:
- variables (parameters, `let`s, `S`, the rank variable, and its own assignments);
- one micro-batch counter per (F, chunk) and one per (B/I, chunk): a bare op takes the next micro-batch
  from its counter; `@ m` names the micro-batch and leaves the counter alone;
- a queue of deferred weight gradients: every I enqueues its W; `W` emits the oldest pending one,
  `W[c]` the oldest of chunk c, `W?` only if one is pending, `drain W[c]` all of them.
Budgets turn a runaway program into an error instead of a hang (pipec.frontend.limits): per rank, loop
iterations and ops emitted (a `while` that never ends); for the whole expansion, steps (loop iterations, ops and
program nodes compiled, all ranks together), ops and wall time; and a bound on the integers a program computes
(a value squared in a loop would otherwise grow without end).
An overlapped pair is one forward and one backward of two different micro-batches (check_pair_kinds, and the
micro-batches where the pair is emitted). `op_spans` tells where each op of an expanded program was written, by
expanding it again with span recording on: only a deadlock's explanation asks, so expansion itself records nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from fractions import Fraction

from pipec.errors import PipecError, PipecInputError, PipecSyntaxError, ScheduleProgramError, Span
from pipec.frontend import ast
from pipec.frontend.limits import (
    MAX_OPS,
    MAX_SECONDS,
    MAX_STEPS,
    MAX_VALUE,
    RANK_STEPS_EXTRA,
    RANK_STEPS_PER_OP,
    check_sizes,
)
from pipec.ir import (
    DEFAULT_INPUT_FRACTION,
    Action,
    Instruction,
    Kind,
    Overlap,
    Program,
    loop_placement,
    parse_instruction,
    v_placement,
)
from pipec.passes.list_schedule import Candidate, Durations, Rules, list_schedule

BUILTIN_PARAMS = ("P", "M", "V")
# The names a choose section's expressions see for each candidate: every field of the list scheduler's Candidate
# (so a field added there is in the language at once), except the rank, which is the section's own variable, and
# the kind, which the take line already fixes.
CANDIDATE_NAMES = tuple(name for name in Candidate._fields if name not in ("rank", "kind"))
_PARAM_FLAGS = {"P": "--ranks", "M": "--microbatches", "V": "--chunks"}
_KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}


# ---- run-time state of one rank ----------------------------------------------------------------


@dataclass(eq=False)
class _Pending:
    chunk: int
    action: Action
    alive: bool = True


_CHECK_EVERY = 1024  # steps between looks at the clock and the expansion-wide budgets


@dataclass(eq=False)
class _Budget:
    """What the rest of one expansion may spend, all ranks together (the limits are in pipec.frontend.limits)."""

    rank_steps: int  # per rank: loop iterations + ops emitted before "a loop that never ends?"
    steps_left: int = MAX_STEPS  # loop iterations + ops emitted + program nodes compiled
    ops_left: int = MAX_OPS
    deadline: float = field(default_factory=lambda: time.monotonic() + MAX_SECONDS)

    def finish_rank(self, st: _RankState, span: Span) -> None:
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
class _RankState:
    vars: dict[str, int]
    rank: int
    stages: tuple[int, ...]  # chunk -> stage on this rank
    budget: _Budget | None = None  # None: header expressions, which run no loops
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


def _too_big(value: int | Fraction, span: Span) -> ScheduleProgramError:
    if isinstance(value, Fraction) and abs(value) <= MAX_VALUE:
        what = f"a fraction whose denominator has {len(str(value.denominator))} digits"
    else:
        digits = len(str(abs(int(value))))
        what = f"{int(value)}" if digits <= 40 else f"a value of {digits} digits"
    return ScheduleProgramError(
        f"{what} is beyond pipec's limit of {_VALUE_TEXT} on the integers a program computes (an overflow?)", span
    )


def _bounded_exact(value: int | Fraction, span: Span) -> int | Fraction:
    """A value of a `memory` or `expect` line: fractions keep their numerator and denominator within the limit,
    so that a long chain of divisions cannot build a huge denominator."""
    if type(value) is int:
        if -MAX_VALUE <= value <= MAX_VALUE:
            return value
    elif abs(value.numerator) <= MAX_VALUE and value.denominator <= MAX_VALUE:  # type: ignore[union-attr]
        return value
    raise _too_big(value, span)


# ---- expressions -------------------------------------------------------------------------------

ExprFn = Callable[[_RankState], int]
StmtFn = Callable[[_RankState], None]
BlockFn = Callable[[_RankState, list[int]], None]  # a compiled block, run with its arguments' values


class _Break(Exception):  # noqa: N818 - a control-flow signal, never an error
    """Raised by `break`, caught by the innermost loop. Only loops whose body can break catch it, so other loops
    keep their plain closures (and their speed)."""


class _Continue(Exception):  # noqa: N818 - a control-flow signal, never an error
    """Raised by `continue`, caught by the innermost loop."""


def _raise_break(st: _RankState) -> None:
    raise _Break  # a fresh instance each time: re-raising one instance would grow its traceback


def _raise_continue(st: _RankState) -> None:
    raise _Continue


def _escapes(body: Iterable[ast.Stmt]) -> tuple[bool, bool]:
    """Whether this loop body can break / continue its loop: a break or continue in it or in its ifs, not in a
    nested loop (which catches its own) and not in a called block (the parser keeps those inside the block)."""
    can_break = can_continue = False
    for s in body:
        if isinstance(s, ast.Break):
            can_break = True
        elif isinstance(s, ast.Continue):
            can_continue = True
        elif isinstance(s, ast.If):
            for branch in (*(b for _, b in s.branches), s.otherwise):
                b, c = _escapes(branch)
                can_break, can_continue = can_break or b, can_continue or c
    return can_break, can_continue

_FUNCTIONS: dict[str, tuple[int, int, Callable[..., int]]] = {
    # name: (min args, max args, implementation)
    "min": (1, 99, min),
    "max": (1, 99, max),
    "abs": (1, 1, abs),
    "cdiv": (2, 2, lambda a, b: -(-a // b)),
}


class _Compiler:
    """Turns AST nodes into closures over a _RankState. Checks names statically."""

    def __init__(
        self,
        known: Iterable[str],
        exact_division: bool = False,
        constants: Mapping[str, int] | None = None,
        chunks: int | None = None,
        record: bool = False,
        blocks: Mapping[str, BlockFn] | None = None,
        scope: str = "",
    ) -> None:
        self.known = set(known)
        self.blocks = blocks or {}  # compiled blocks by name; the parser checked every call's name and arity
        self.scope = scope  # said after "unknown name": what a block can see
        # record: every emitted op also appends the span of the text that emitted it to the rank's `spans`. Only
        # a deadlock's explanation asks for it (op_spans), so the ordinary closures stay as lean as before.
        self.record = record
        self.exact_division = exact_division  # `/` is legal in `memory` and `expect` lines only
        # names whose value is fixed for the whole run (parameters, the rank, single top-level assignments):
        # expressions over them are folded at compile time instead of walked for every op
        self.constants = dict(constants or {})
        self.chunks = chunks  # this rank's stage count, when compiling for one rank
        self._folded: dict[int, int | None] = {}
        self._plain: _Compiler | None = None  # evaluates foldable expressions, on a state holding the constants
        self._state: _RankState | None = None

    def fold(self, e: ast.Expr) -> int | None:
        """The value of an expression of literals and constants; None when it needs run-time state or fails."""
        key = id(e)  # AST nodes outlive the compiler; each is compiled once, so its answer never changes
        if key not in self._folded:
            self._folded[key] = self._fold(e)
        return self._folded[key]

    def _fold(self, e: ast.Expr) -> int | None:
        if isinstance(e, ast.Int):
            return e.value
        if isinstance(e, ast.Var):
            return self.constants.get(e.name)
        if isinstance(e, ast.Call):
            children: tuple[ast.Expr, ...] = e.args
        elif isinstance(e, ast.BinOp):
            children = (e.left, e.right)
        elif isinstance(e, ast.Unary):
            children = (e.operand,)
        elif isinstance(e, ast.Cond):
            children = (e.test, e.then, e.otherwise)
        else:
            return None  # count(), pending(): run-time state
        if any(self.fold(child) is None for child in children):
            return None
        if self._plain is None:
            self._plain = _Compiler(self.known, self.exact_division)
            self._state = _RankState(vars=self.constants, rank=-1, stages=())
        try:
            value = self._plain.expr(e)(self._state)
        except ScheduleProgramError:
            return None  # e.g. a division by zero: keep it a run-time error, raised only if reached
        return value if isinstance(value, int) else None

    def expr(self, e: ast.Expr) -> ExprFn:
        if self.constants and not isinstance(e, ast.Int):
            folded = self.fold(e)
            if folded is not None:
                return lambda st: folded
        if isinstance(e, ast.Int):
            value = e.value
            return lambda st: value
        if isinstance(e, ast.Var):
            name, span = e.name, e.span
            if name not in self.known:
                raise PipecSyntaxError(f"unknown name {name!r}{self.scope}", span)

            def var(st: _RankState) -> int:
                try:
                    return st.vars[name]
                except KeyError:
                    raise ScheduleProgramError(f"{name!r} is used before it is assigned", span) from None

            return var
        if isinstance(e, ast.Call):
            if e.func not in _FUNCTIONS:
                raise PipecSyntaxError(f"unknown function {e.func!r}; known: {', '.join(_FUNCTIONS)}", e.span)
            low, high, fn = _FUNCTIONS[e.func]
            if not low <= len(e.args) <= high:
                raise PipecSyntaxError(f"{e.func}() takes {low}..{high} arguments, got {len(e.args)}", e.span)
            args = [self.expr(a) for a in e.args]
            span = e.span
            if e.func == "cdiv":
                a, b = args

                def cdiv(st: _RankState) -> int:
                    divisor = b(st)
                    if divisor == 0:
                        raise ScheduleProgramError("division by zero", span)
                    return -(-a(st) // divisor)

                return cdiv
            if len(args) == 1:
                (only,) = args
                return lambda st: fn(only(st)) if e.func == "abs" else only(st)
            return lambda st: fn([a(st) for a in args])
        if isinstance(e, ast.BinOp):
            return self._binop(e)
        if isinstance(e, ast.Unary):
            operand = self.expr(e.operand)
            if e.op == "-":
                return lambda st: -operand(st)
            return lambda st: int(not operand(st))
        if isinstance(e, ast.Cond):
            test, then, otherwise = self.expr(e.test), self.expr(e.then), self.expr(e.otherwise)
            return lambda st: then(st) if test(st) else otherwise(st)
        if isinstance(e, ast.Count):
            return self._count(e)
        if isinstance(e, ast.Pending):
            chunk_fn = self.expr(e.op.chunk) if e.op.chunk is not None else None
            span = e.span
            if chunk_fn is None:
                return lambda st: st.pending_weights(None)
            return lambda st: st.pending_weights(st.chunk_index(chunk_fn(st), span))
        raise AssertionError(f"unhandled expression {e!r}")  # pragma: no cover

    def _binop(self, e: ast.BinOp) -> ExprFn:
        fn = self._binop_unchecked(e)
        if not self.exact_division:
            return fn
        span = e.span  # `memory` and `expect` lines run a few times only: every result is checked
        return lambda st: _bounded_exact(fn(st), span)

    def _binop_unchecked(self, e: ast.BinOp) -> ExprFn:
        a, b, op, span = self.expr(e.left), self.expr(e.right), e.op, e.span
        c = self.fold(e.right) if self.constants else None
        if c is not None:  # a constant right operand: no second call, no zero check
            if op == "+":
                return lambda st: a(st) + c
            if op == "-":
                return lambda st: a(st) - c
            if op == "*":

                def times_constant(st: _RankState) -> int:
                    value = a(st) * c
                    if -MAX_VALUE <= value <= MAX_VALUE:  # only * can grow a value fast (squaring in a loop)
                        return value
                    raise _too_big(value, span)

                return times_constant
            if op == "//" and c != 0:
                return lambda st: a(st) // c
            if op == "%" and c != 0:
                return lambda st: a(st) % c
        if op == "+":
            return lambda st: a(st) + b(st)
        if op == "-":
            return lambda st: a(st) - b(st)
        if op == "*":

            def times(st: _RankState) -> int:
                value = a(st) * b(st)
                if -MAX_VALUE <= value <= MAX_VALUE:
                    return value
                raise _too_big(value, span)

            return times
        if op == "/":
            if not self.exact_division:
                raise PipecSyntaxError(
                    "exact division '/' is allowed only in 'memory' and 'expect' lines; use '//' for integer division",
                    span,
                )

            def exact(st: _RankState) -> int:
                left, right = a(st), b(st)
                if right == 0:
                    raise ScheduleProgramError("division by zero", span)
                quotient = Fraction(left) / Fraction(right)
                return quotient.numerator if quotient.denominator == 1 else quotient  # type: ignore[return-value]

            return exact
        if op in ("//", "%"):
            floor = op == "//"

            def divide(st: _RankState) -> int:
                left, right = a(st), b(st)
                if right == 0:
                    raise ScheduleProgramError("division by zero", span)
                return left // right if floor else left % right

            return divide
        if op == "and":
            return lambda st: int(bool(a(st)) and bool(b(st)))
        if op == "or":
            return lambda st: int(bool(a(st)) or bool(b(st)))
        # one closure per operator: while-loop tests run once per op, a shared compare() call costs a third
        if op == "==":
            return lambda st: 1 if a(st) == b(st) else 0
        if op == "!=":
            return lambda st: 1 if a(st) != b(st) else 0
        if op == "<":
            return lambda st: 1 if a(st) < b(st) else 0
        if op == "<=":
            return lambda st: 1 if a(st) <= b(st) else 0
        if op == ">":
            return lambda st: 1 if a(st) > b(st) else 0
        return lambda st: 1 if a(st) >= b(st) else 0

    def _count(self, e: ast.Count) -> ExprFn:
        chunk_fn = self.expr(e.op.chunk) if e.op.chunk is not None else (lambda st: 0)
        span = e.span
        c = 0 if e.op.chunk is None else self.fold(e.op.chunk)
        if c is not None and self.chunks is not None and 0 <= c < self.chunks:  # a chunk checked once, here
            if e.op.kind == "F":
                return lambda st: st.forward_count[c]
            if e.op.kind != "W":
                return lambda st: st.backward_count[c]
            if e.op.chunk is not None:
                return lambda st: st.weight_count[c]
        if e.op.kind == "F":
            return lambda st: st.forward_count[st.chunk_index(chunk_fn(st), span)]
        if e.op.kind == "W":
            if e.op.chunk is None:
                return lambda st: sum(st.weight_count)
            return lambda st: st.weight_count[st.chunk_index(chunk_fn(st), span)]
        return lambda st: st.backward_count[st.chunk_index(chunk_fn(st), span)]

    # -- statements
    def top_block(self, body: Iterable[ast.Stmt], once: set[str]) -> Callable[[_RankState], None]:
        """The per-rank program. A name assigned once, at top level, to a foldable value is a constant
        from that statement on (uses before it still fail at run time, as they should)."""
        steps = []
        for s in body:
            steps.append(self.stmt(s))
            if isinstance(s, ast.Assign) and s.name in once:
                value = self.fold(s.value)
                if value is not None:
                    self.constants[s.name] = value
        return self._sequence(steps)

    def block(self, body: Iterable[ast.Stmt]) -> Callable[[_RankState], None]:
        return self._sequence([self.stmt(s) for s in body])

    def _sequence(self, steps: list[Callable[[_RankState], None]]) -> Callable[[_RankState], None]:
        def run(st: _RankState) -> None:
            for step in steps:
                step(st)

        return steps[0] if len(steps) == 1 else run

    def stmt(self, s: ast.Stmt) -> Callable[[_RankState], None]:
        if isinstance(s, ast.Emit):
            emitters = [self.pair(item) if isinstance(item, ast.Pair) else self.op(item) for item in s.items]

            def emit_all(st: _RankState) -> None:
                for emitter in emitters:
                    emitter(st)

            return emitters[0] if len(emitters) == 1 else emit_all
        if isinstance(s, ast.Assign):
            name, value, span = s.name, self.expr(s.value), s.span

            def assign(st: _RankState) -> None:
                result = value(st)
                # bounded here and in `*`: a sum at most doubles a value, so only a value that is stored and
                # added again in a loop (`x = x + x`) could grow without end
                if not -MAX_VALUE <= result <= MAX_VALUE:
                    raise _too_big(result, span)
                st.vars[name] = result

            return assign
        if isinstance(s, ast.Pass):
            return lambda st: None
        if isinstance(s, ast.Drain):
            chunk_fn = self.expr(s.op.chunk) if s.op.chunk is not None else None
            span = s.span

            def drain(st: _RankState) -> None:
                chunk = st.chunk_index(chunk_fn(st), span) if chunk_fn else None
                while (w := st.pop_weight(chunk)) is not None:
                    st.tick(span)
                    st.out.append(w)

            if self.record:

                def drain_recorded(st: _RankState) -> None:
                    before = len(st.out)
                    drain(st)
                    st.spans.extend([span] * (len(st.out) - before))

                return drain_recorded
            return drain
        if isinstance(s, (ast.Repeat, ast.For, ast.While)):
            return self.loop(s)
        if isinstance(s, ast.Break):
            return _raise_break
        if isinstance(s, ast.Continue):
            return _raise_continue
        if isinstance(s, ast.CallBlock):
            return self.call(s)
        if isinstance(s, ast.If):
            branches = [(self.expr(test), self.block(body)) for test, body in s.branches]
            otherwise = self.block(s.otherwise) if s.otherwise else None

            def if_stmt(st: _RankState) -> None:
                for test, body in branches:
                    if test(st):
                        body(st)
                        return
                if otherwise is not None:
                    otherwise(st)

            return if_stmt
        raise AssertionError(f"unhandled statement {s!r}")  # pragma: no cover

    def loop(self, s: ast.Repeat | ast.For | ast.While) -> StmtFn:
        body, span = self.block(s.body), s.span
        if any(_escapes(s.body)):
            body = _catching(body)  # the body returns False on break; every tick is still taken, so budgets hold
        if isinstance(s, ast.Repeat):
            count = self.expr(s.count)

            def repeat(st: _RankState) -> None:
                for _ in range(count(st)):
                    st.tick(span)
                    body(st)

            def repeat_breakable(st: _RankState) -> None:
                for _ in range(count(st)):
                    st.tick(span)
                    if body(st) is False:
                        return

            return repeat_breakable if any(_escapes(s.body)) else repeat
        if isinstance(s, ast.For):
            name, start, stop = s.var, self.expr(s.start), self.expr(s.stop)

            def for_loop(st: _RankState) -> None:
                variables = st.vars
                for k in range(start(st), stop(st)):
                    st.tick(span)
                    variables[name] = k
                    body(st)

            def for_breakable(st: _RankState) -> None:
                variables = st.vars
                for k in range(start(st), stop(st)):
                    st.tick(span)
                    variables[name] = k
                    if body(st) is False:
                        return

            return for_breakable if any(_escapes(s.body)) else for_loop
        test = self.expr(s.test)

        def while_loop(st: _RankState) -> None:
            while test(st):
                st.tick(span)
                body(st)

        def while_breakable(st: _RankState) -> None:
            while test(st):
                st.tick(span)
                if body(st) is False:
                    return

        return while_breakable if any(_escapes(s.body)) else while_loop

    def call(self, s: ast.CallBlock) -> StmtFn:
        run, args, span = self.blocks[s.name], [self.expr(a) for a in s.args], s.span

        def call_block(st: _RankState) -> None:
            # a tick per call: blocks that call blocks several times could otherwise emit exponentially many ops
            # with no loop, so no tick, to stop them
            st.tick(span)
            values = [a(st) for a in args]
            for value in values:
                if not -MAX_VALUE <= value <= MAX_VALUE:  # an argument is an assignment to the block's parameter
                    raise _too_big(value, span)
            run(st, values)

        return call_block

    def action(self, o: ast.OpRef) -> Callable[[_RankState], Action | None]:
        """A closure producing the op's Action (None for `W?` with nothing pending), updating counters."""
        kind, span = _KINDS[o.kind], o.span
        chunk_fn = self.expr(o.chunk) if o.chunk is not None else None
        at_fn = self.expr(o.at) if o.at is not None else None

        def chunk_of(st: _RankState) -> int:
            return st.chunk_index(chunk_fn(st), span) if chunk_fn is not None else 0

        constant_chunk = 0 if o.chunk is None else self.fold(o.chunk)
        if constant_chunk is not None and self.chunks is not None and 0 <= constant_chunk < self.chunks:
            chunk_of = lambda st: constant_chunk  # noqa: E731 - checked once here, not per op

        if kind is Kind.W:
            if_pending, any_chunk = o.if_pending, chunk_fn is None

            def weight(st: _RankState) -> Action | None:
                w = st.pop_weight(None if any_chunk else chunk_of(st))
                if w is None and not if_pending:
                    which = "" if any_chunk else f" of chunk {chunk_of(st)}"
                    raise ScheduleProgramError(
                        f"W: no weight gradient{which} is pending (each W needs an earlier I); use W? to skip", span
                    )
                return w

            return weight

        if kind is Kind.F:

            def forward(st: _RankState) -> Action:
                c = chunk_of(st)
                if at_fn is not None:
                    return Action(st.stages[c], kind, at_fn(st))
                mb = st.forward_count[c]
                st.forward_count[c] = mb + 1
                return Action(st.stages[c], kind, mb)

            return forward

        is_input = kind is Kind.I

        def backward(st: _RankState) -> Action:
            c = chunk_of(st)
            if at_fn is not None:
                action = Action(st.stages[c], kind, at_fn(st))
            else:
                mb = st.backward_count[c]
                st.backward_count[c] = mb + 1
                action = Action(st.stages[c], kind, mb)
            if is_input:
                st.enqueue_weight(c, action)
            return action

        return backward

    def op(self, o: ast.OpRef) -> Callable[[_RankState], None]:
        make = self.action(o)

        def emit(st: _RankState) -> None:
            action = make(st)
            if action is not None:
                st.out.append(action)

        if self.record:
            span = o.span

            def emit_recorded(st: _RankState) -> None:
                action = make(st)
                if action is not None:
                    st.out.append(action)
                    st.spans.append(span)

            return emit_recorded
        return emit

    def pair(self, p: ast.Pair) -> Callable[[_RankState], None]:
        # the parser let through only one forward with one backward (B, I or W): see check_pair_kinds
        first, second, span, record = self.action(p.first), self.action(p.second), p.span, self.record

        def emit_pair(st: _RankState) -> None:
            a, b = first(st), second(st)
            assert a is not None and b is not None  # `W?` is refused in pairs by the parser
            if a.mb == b.mb:  # a backward depends on every forward of its micro-batch: the halves cannot overlap
                raise ScheduleProgramError(_same_microbatch_pair(a, b), span)
            st.out.append(Overlap(a, b))
            if record:
                st.spans.append(span)

        return emit_pair


def _catching(body: StmtFn) -> Callable[[_RankState], bool | None]:
    """A loop body that stops a `break` (returning False: leave the loop) and a `continue` (returning None: go on
    with the next iteration). try costs nothing in Python 3.11 until something is raised."""

    def run(st: _RankState) -> bool | None:
        try:
            body(st)
        except _Break:
            return False
        except _Continue:
            return None
        return None

    return run


def _same_microbatch_pair(a: Action, b: Action) -> str:
    return (
        f"the overlapped pair {a}&{b} runs two ops of micro-batch {a.mb}; the backward of a micro-batch needs its "
        "forwards, so a pair must take two different micro-batches"
    )


PAIR_RULE = "an overlapped pair runs one forward (F) with one backward (B, I or W) of another micro-batch"


def check_pair_kinds(first: str, second: str) -> str | None:
    """Why two op kinds cannot form an overlapped pair, or None when they can. Shared by the parser (`F & B`)
    and literal lists (`0F1&1B0`): torch's OVERLAP_F_B, the runtime and the simulator run a pair as a forward
    overlapped with a backward; two forwards or two backwards have nothing to hide behind each other."""
    if (first == "F") != (second == "F"):
        return None
    return f"{PAIR_RULE}; {first} & {second} is {'two forwards' if first == 'F' else 'two backward ops'}"


def _refuse_assignments(body: Iterable[ast.Stmt], fixed: set[str]) -> None:
    """Parameters, lets, S and the rank variable are fixed for the whole program: assigning one is an error."""
    for s in body:
        if isinstance(s, ast.Assign) and s.name in fixed:
            raise PipecInputError(f"{s.name} is fixed for the whole schedule and cannot be assigned", s.span)
        if isinstance(s, ast.For) and s.var in fixed:
            raise PipecInputError(f"{s.var} is fixed for the whole schedule and cannot be a loop variable", s.span)
        if isinstance(s, (ast.Repeat, ast.For, ast.While)):
            _refuse_assignments(s.body, fixed)
        elif isinstance(s, ast.If):
            for _, branch in s.branches:
                _refuse_assignments(branch, fixed)
            _refuse_assignments(s.otherwise, fixed)


def _assignment_counts(body: Iterable[ast.Stmt]) -> dict[str, int]:
    """How many statements assign each name (a loop variable counts as many)."""
    counts: dict[str, int] = {}

    def visit(stmts: Iterable[ast.Stmt]) -> None:
        for s in stmts:
            if isinstance(s, ast.Assign):
                counts[s.name] = counts.get(s.name, 0) + 1
            elif isinstance(s, ast.For):
                counts[s.var] = counts.get(s.var, 0) + 2  # a loop variable changes: never a constant
                visit(s.body)
            elif isinstance(s, (ast.Repeat, ast.While)):
                visit(s.body)
            elif isinstance(s, ast.If):
                for _, branch in s.branches:
                    visit(branch)
                visit(s.otherwise)

    visit(body)
    return counts


def _evaluate(e: ast.Expr, env: Mapping[str, int], exact_division: bool = False) -> int:
    """Evaluate a header expression (no counters: count()/pending() belong to per-rank programs)."""
    if isinstance(e, (ast.Count, ast.Pending)):
        raise PipecSyntaxError("count() and pending() only make sense inside a per-rank program", e.span)
    st = _RankState(vars=dict(env), rank=-1, stages=())
    return _Compiler(env, exact_division).expr(e)(st)


def evaluate(e: ast.Expr, env: Mapping[str, int]) -> int:
    """The value of a declaration's expression (a default, a range bound, a `let`, a `require` test, `stages`, a
    placement entry) for these parameters, as `expand` computes it. Raises ScheduleProgramError when it has none
    (a division by zero) and PipecSyntaxError for count()/pending(). Public for tools that reason about a
    schedule's parameters without expanding it (pipec.testing's parameter spaces)."""
    return _evaluate(e, env)


def param_range(param: ast.Param, env: Mapping[str, int]) -> range | None:
    """The declared valid values of a parameter (`P in 1 .. 9`), given the parameters before it."""
    if param.low is None or param.high is None:
        return None
    try:
        return range(_evaluate(param.low, env), _evaluate(param.high, env))
    except ScheduleProgramError as e:
        raise PipecInputError(e.message, e.span) from None


# ---- binding parameters ------------------------------------------------------------------------


def bind_params(
    schedule: ast.Schedule,
    ranks: int | None,
    microbatches: int | None = None,
    chunks: int | None = None,
    overrides: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """P, M, V and the schedule's named parameters, from the caller's values and the declared defaults."""
    given = {"P": ranks, "M": microbatches, "V": chunks}
    declared = {p.name: p for p in schedule.params}
    overrides = dict(overrides or {})
    for name in overrides:
        if name in BUILTIN_PARAMS:
            raise PipecInputError(f"set {name} with {_PARAM_FLAGS[name]}, not --set")
        if name not in declared:
            known = [p for p in declared if p not in BUILTIN_PARAMS]
            raise PipecInputError(
                f"schedule {schedule.name!r} has no parameter {name!r}"
                + (f"; its parameters: {', '.join(known)}" if known else "; it takes only P, M and V")
            )
    env: dict[str, int] = {}
    order = list(BUILTIN_PARAMS) + [name for name in declared if name not in BUILTIN_PARAMS]
    for name in order:
        value = given.get(name) if name in BUILTIN_PARAMS else overrides.get(name)
        if value is None and name in declared and declared[name].default is not None:
            try:
                value = _evaluate(declared[name].default, env)
            except ScheduleProgramError as e:
                raise PipecInputError(e.message, e.span) from None
        if value is None and name == "V":
            value = 1
        if value is None:
            how = _PARAM_FLAGS.get(name, f"--set {name}=VALUE")
            raise PipecInputError(f"schedule {schedule.name!r} needs parameter {name} ({how})")
        if not isinstance(value, int) or isinstance(value, bool):
            raise PipecInputError(f"parameter {name} must be an integer, got {value!r}")
        if name in BUILTIN_PARAMS and value < 1:
            raise PipecInputError(f"{name} must be at least 1 ({_PARAM_FLAGS[name]}), got {value}")
        valid = param_range(declared[name], env) if name in declared else None
        if valid is not None and value not in valid:
            raise PipecInputError(
                f"{schedule.name}: {name} = {value} is outside its declared range {valid.start} .. {valid.stop} "
                "(half-open)",
                declared[name].span,
            )
        env[name] = value
    return env


# ---- from AST to Program -----------------------------------------------------------------------


def _placement(schedule: ast.Schedule, env: Mapping[str, int], stages: int) -> tuple[int, ...]:
    ranks = env["P"]
    p = schedule.placement
    if p is None or p.style == "loop":
        return loop_placement(ranks, stages)
    if p.style == "v":
        return v_placement(ranks, stages)
    if p.style == "list":
        mapping = tuple(_evaluate(item, env) for item in p.items)
        if len(mapping) != stages:
            raise PipecInputError(
                f"the placement lists {len(mapping)} stage(s) but the schedule has {stages} (stages = {stages})",
                p.span,
            )
    else:
        assert p.var is not None
        mapping = tuple(_evaluate(p.items[0], {**env, p.var: s}) for s in range(stages))
    for stage, rank in enumerate(mapping):
        if not 0 <= rank < ranks:
            raise PipecInputError(f"the placement puts stage {stage} on rank {rank}, outside 0..{ranks - 1}", p.span)
    return mapping


def _memory_bound(schedule: ast.Schedule, env: Mapping[str, int]) -> tuple[int, ...] | None:
    memory = schedule.memory
    if memory is None:
        return None
    if memory.rank_var is None:
        return (_number(_evaluate(memory.value, env, exact_division=True)),) * env["P"]
    return tuple(
        _number(_evaluate(memory.value, {**env, memory.rank_var: r}, exact_division=True)) for r in range(env["P"])
    )


def _number(value: int | Fraction) -> int | float:
    return value if isinstance(value, int) else float(value)


# The schedules expanded lately, by (source, name): a deadlock's explanation names the `.pipe` line that emitted
# each op it speaks of, and finds them by expanding the schedule again with span recording on (op_spans). Keeping
# the AST here (parse() caches it anyway) costs nothing on the way to a valid program.
_EXPANDED: OrderedDict[tuple[str, str], ast.Schedule] = OrderedDict()
_EXPANDED_KEPT = 16

Spans = tuple[tuple[Span, ...], ...]  # per rank, the span of the text that emitted each instruction of its order


def expand(
    schedule: ast.Schedule,
    ranks: int | None,
    microbatches: int | None = None,
    chunks: int | None = None,
    overrides: Mapping[str, int] | None = None,
    source: str = "",
) -> Program:
    """Bind parameters, check the schedule's requirements and produce each rank's compute order."""
    found = prepare(schedule, ranks, microbatches, chunks, overrides, source)
    return run_choose(found) if isinstance(found, ChooseSpec) else found


def op_spans(program: Program) -> Spans | None:
    """Where each compute instruction of `program` was written: per rank, one span per instruction of its compute
    order (send/recv left out), or None when the program did not come from a `.pipe` expanded lately.

    Expands the schedule again with span recording on (only explanations ask, so the ordinary expansion records
    nothing) and answers only when that reproduces the program's compute orders exactly."""
    schedule = _EXPANDED.get((program.source, program.name))
    if schedule is None:
        return None
    named = {name: value for name, value in program.params.items() if name not in BUILTIN_PARAMS}
    try:
        again, spans = _expand(
            schedule, program.ranks, program.microbatches, program.chunks, named, program.source, record=True
        )
    except PipecError:  # the parameters no longer fit that schedule: it is not where the program came from
        return None
    if spans is None or isinstance(again, ChooseSpec) or again.streams != program.compute_streams():
        return None
    return spans


def _expand(
    schedule: ast.Schedule,
    ranks: int | None,
    microbatches: int | None,
    chunks: int | None,
    overrides: Mapping[str, int] | None,
    source: str,
    record: bool,
) -> tuple[Program | ChooseSpec, Spans | None]:
    """The program (a per-rank program run, or literal lists), or for a choose section its rules (run_choose runs
    them under the caller's costs) and, when `record`, each instruction's span."""
    budget = _Budget(rank_steps=0)  # the clock starts now; rank_steps is set once P, M and V are known
    env = bind_params(schedule, ranks, microbatches, chunks, overrides)
    # before anything is allocated for them (the placement, the per-rank lists): a mutated default such as
    # `V = 2000000` or a flag such as `-M 1000000000000` fails here, in milliseconds, naming the limit
    given = {"P": ranks, "M": microbatches, "V": chunks}
    defaults = frozenset(name for name, value in given.items() if value is None)
    check_sizes(env["P"], env["M"], env["V"], schedule.name, defaults)
    budget.rank_steps = RANK_STEPS_PER_OP * (3 * env["M"] * env["V"] + env["P"]) + RANK_STEPS_EXTRA
    params = dict(env)
    try:
        for item in schedule.header:
            if isinstance(item, ast.Let):
                if item.name in env or item.name in ("S", schedule.rank_var):
                    message = f"'let {item.name}' would rebind {item.name}, which is already defined"
                    raise PipecInputError(message, item.span)
                env[item.name] = _evaluate(item.value, env)
            elif not _evaluate(item.test, env):
                raise PipecInputError(f"{schedule.name}: {item.message}", item.span)
        stages = _evaluate(schedule.stages, env) if schedule.stages is not None else env["P"] * env["V"]
        if stages != env["P"] * env["V"]:
            raise PipecInputError(
                f"the schedule declares {stages} stages, but P * V = {env['P']} * {env['V']} = "
                f"{env['P'] * env['V']}: each of the P ranks holds V stages",
                schedule.stages.span if schedule.stages is not None else schedule.span,
            )
        env["S"] = stages
        placement = _placement(schedule, env, stages)
        memory = _memory_bound(schedule, env)
        expected = {e.what: _evaluate(e.value, env, exact_division=True) for e in schedule.expects}
    except ScheduleProgramError as e:  # a header expression divided by zero
        raise PipecInputError(e.message, e.span) from None

    literal, literal_spans = _literal_streams(schedule, env["P"]) if schedule.body is None else (None, None)
    if literal is not None and literal_spans is not None:
        placement = _literal_placement(schedule, literal, literal_spans, placement, env["V"])
    by_rank: list[list[int]] = [[] for _ in range(env["P"])]  # one pass over the stages, not one per rank
    for stage, rank in enumerate(placement):
        by_rank[rank].append(stage)
    rank_stages = [tuple(stages) for stages in by_rank]
    uneven = [rank for rank, held in enumerate(rank_stages) if len(held) != env["V"]]
    if uneven:
        rank = uneven[0]
        where = schedule.placement.span if schedule.placement is not None else schedule.span
        raise PipecInputError(
            f"the placement gives rank {rank} {len(rank_stages[rank])} stage(s) {list(rank_stages[rank])}; "
            f"each rank must hold V = {env['V']}",
            where,
        )
    if schedule.choose is not None:
        template = Program(
            name=schedule.name,
            ranks=env["P"],
            microbatches=env["M"],
            chunks=env["V"],
            stage_to_rank=placement,
            streams=tuple(() for _ in range(env["P"])),
            memory_bound=memory,
            params=params,
            description=schedule.description,
            source=source,
            forward_only=schedule.forward_only,
            expected={what: Fraction(value) for what, value in expected.items()},
        )
        return _choose_spec(schedule, schedule.choose, env, template, rank_stages), None
    if literal is not None:
        streams, spans = literal, literal_spans
    else:
        streams, spans = _run_programs(schedule, env, rank_stages, budget, record)
    if schedule.drop_padded:
        if record:
            spans = [
                _drop_padded_spans(stream, rank_spans, env["M"])
                for stream, rank_spans in zip(streams, spans, strict=True)
            ]
        streams = [_drop_padded(stream, env["M"]) for stream in streams]
    program = Program(
        name=schedule.name,
        ranks=env["P"],
        microbatches=env["M"],
        chunks=env["V"],
        stage_to_rank=placement,
        streams=tuple(tuple(s) for s in streams),
        memory_bound=memory,
        params=params,
        description=schedule.description,
        source=source,
        forward_only=schedule.forward_only,
        expected={what: Fraction(value) for what, value in expected.items()},
    )
    return program, (tuple(tuple(rank_spans) for rank_spans in spans) if record else None)


def prepare(
    schedule: ast.Schedule,
    ranks: int | None,
    microbatches: int | None = None,
    chunks: int | None = None,
    overrides: Mapping[str, int] | None = None,
    source: str = "",
) -> Program | ChooseSpec:
    """expand, except that a choose section comes back as its rules, for run_choose under the caller's costs."""
    found, _ = _expand(schedule, ranks, microbatches, chunks, overrides, source, record=False)
    key = (source, schedule.name)
    _EXPANDED[key] = schedule
    _EXPANDED.move_to_end(key)
    while len(_EXPANDED) > _EXPANDED_KEPT:
        _EXPANDED.popitem(last=False)
    return found


# ---- the choose section --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChooseSpec:
    """A choose section bound to P, M, V and its parameters: what the list scheduler needs besides the costs."""

    template: Program  # P, M, V, the placement, the declared memory bound; no streams yet
    rules: Rules  # the kinds in take order and the compiled priority, prefer and guard expressions
    limits: tuple[int | Fraction, ...] | None  # the section's `memory` per rank (declaration units), if given
    drop_padded: bool
    span: Span  # the section, where a schedule that cannot finish is reported


def run_choose(
    spec: ChooseSpec,
    costs: Durations | None = None,
    input_fraction: float = DEFAULT_INPUT_FRACTION,
    stage_sizes: tuple[float, ...] | None = None,
    memory_limit: float | None = None,
    share: bool = False,
) -> Program:
    """The compute orders the rules choose under ``costs`` (None: the defaults), with the verifier's memory model
    (``input_fraction``, ``stage_sizes``). A rank's limit is the section's `memory`, else ``memory_limit`` (as
    `--memory-limit`, in the verifier's units), else the schedule's declared bound. ``share``: the costs, sizes and
    ``memory_limit`` are per rank share (`--per-rank-share`, already converted by the caller), so the section's and
    the declaration's limits, in stage units, count 1/V as much."""
    template = spec.template
    scale = Fraction(1, template.chunks) if share else Fraction(1)

    def limit(rank: int) -> float | None:
        if spec.limits is not None:
            return float(spec.limits[rank] * scale)
        if memory_limit is not None:
            return memory_limit
        if template.memory_bound is not None:
            return float(Fraction(str(template.memory_bound[rank])) * scale)
        return None

    # mistakes in the costs or sizes are reported as themselves, before the run; what the run raises is the
    # section's doing (it cannot finish, or runs over the budget), and is reported at the section
    if costs is not None:
        costs.per_stage(template.num_stages)
    if stage_sizes is not None and len(stage_sizes) != template.num_stages:
        raise PipecInputError(f"{len(stage_sizes)} stage sizes given for {template.num_stages} stages")
    try:
        program = list_schedule(template, replace(spec.rules, limit=limit), costs, input_fraction, stage_sizes)
    except ScheduleProgramError:
        raise  # a rule failed (a division by zero): its own span says where
    except PipecInputError as e:  # it cannot finish, or over the budget: the section is what to look at
        raise PipecInputError(f"{template.name}: {e.message}", spec.span) from None
    if spec.drop_padded:
        program = replace(
            program, streams=tuple(tuple(_drop_padded(list(s), template.microbatches)) for s in program.streams)
        )
    return program


def _exact(value: object) -> int | Fraction:
    """A candidate's field as the expressions see it: exact, booleans 0/1, times and memory as fractions (from the
    float's shortest text, as costs are read, so that a tie is a tie)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, Fraction)):
        return value
    if isinstance(value, float):
        return Fraction(str(value))
    raise AssertionError(f"a candidate field of type {type(value).__name__}")  # pragma: no cover


def _choose_spec(
    schedule: ast.Schedule, choose: ast.Choose, env: dict[str, int], template: Program,
    rank_stages: list[tuple[int, ...]],
) -> ChooseSpec:
    """Compile the section per rank (the rank and the parameters fold to constants) into the scheduler's Rules."""
    var = choose.rank_var
    if var in env:
        raise PipecInputError(
            f"the rank variable '{var}' hides the parameter or let of the same name; rename one", choose.span
        )
    known = set(env) | {var} | set(CANDIDATE_NAMES)
    header = {**env}  # the chunk of a take and the `memory` line see no candidate
    tables: list[dict[tuple[Kind, int], tuple[ExprFn, ExprFn | None]]] = []
    prefers: list[list[ExprFn]] = []
    states: list[_RankState] = []
    limits: list[int | Fraction] = []
    order: list[Kind] = []
    for rank, stages in enumerate(rank_stages):
        constants = {**env, var: rank}
        compiler = _Compiler(known, exact_division=True, constants=constants, chunks=len(stages))
        table: dict[tuple[Kind, int], tuple[ExprFn, ExprFn | None]] = {}
        where: dict[tuple[Kind, int], ast.Take] = {}
        for take in choose.takes:
            priority = compiler.expr(take.priority) if take.priority is not None else (lambda st: 0)
            guard = compiler.expr(take.guard) if take.guard is not None else None
            for op in take.ops:
                kind = _KINDS[op.kind]
                if kind not in order:
                    order.append(kind)
                if op.chunk is None:
                    chunk_list: Iterable[int] = range(len(stages))
                else:
                    chunk = _choose_value(op.chunk, {**header, var: rank})
                    if not isinstance(chunk, int) or not 0 <= chunk < len(stages):
                        raise PipecInputError(
                            f"rank {rank}: chunk {chunk} does not exist: each rank holds {len(stages)} stage(s), "
                            f"chunks 0..{len(stages) - 1}",
                            op.span,
                        )
                    chunk_list = (chunk,)
                for chunk in chunk_list:
                    if (kind, chunk) in where:
                        raise PipecInputError(
                            f"rank {rank}: {op.kind}[{chunk}] is already taken on line {where[kind, chunk].span.line}: "
                            "one take line per op and chunk",
                            op.span,
                        )
                    where[kind, chunk] = take
                    table[kind, chunk] = (priority, guard)
        _check_taken(schedule, choose, table, len(stages), rank)
        tables.append(table)
        prefers.append([compiler.expr(e) for e in choose.prefer])
        states.append(_RankState(vars=dict(constants), rank=rank, stages=stages))
        if choose.memory is not None:
            limits.append(_choose_value(choose.memory, {**header, var: rank}))

    def bind(c: Candidate) -> _RankState:
        st = states[c.rank]
        for name in CANDIDATE_NAMES:
            st.vars[name] = _exact(getattr(c, name))  # type: ignore[assignment]
        return st

    def priority(c: Candidate) -> tuple:
        st = bind(c)
        return (tables[c.rank][c.kind, c.chunk][0](st), *(fn(st) for fn in prefers[c.rank]))

    def admit(c: Candidate) -> bool:
        guard = tables[c.rank][c.kind, c.chunk][1]
        return guard is None or bool(guard(bind(c)))

    rules = Rules(tuple(order), priority=priority, admit=admit)
    return ChooseSpec(template, rules, tuple(limits) if choose.memory is not None else None, schedule.drop_padded,
                      choose.span)


def _choose_value(e: ast.Expr, env: Mapping[str, int]) -> int | Fraction:
    """A header-like expression of the section (a take's chunk, the `memory` line): the parameters and the rank."""
    try:
        return _evaluate(e, env, exact_division=True)
    except ScheduleProgramError as error:
        raise PipecInputError(error.message, error.span) from None


def _check_taken(
    schedule: ast.Schedule, choose: ast.Choose, table: Mapping[tuple[Kind, int], object], chunks: int, rank: int
) -> None:
    """The kinds a rank takes must finish the schedule (F and B, or F, I and W; F alone for `forward only`), each
    for every chunk: any other set of take lines could never finish, and the scheduler would only say so late."""
    kinds = {kind for kind, _ in table}
    if schedule.forward_only:
        needed = [Kind.F]
    elif Kind.B in kinds and Kind.I not in kinds:
        needed = [Kind.F, Kind.B]
    else:
        needed = [Kind.F, Kind.I, Kind.W]
    if kinds != set(needed):
        taken = ", ".join(k.value for k in sorted(kinds, key=lambda k: k.value))
        wanted = "F only (forward only)" if schedule.forward_only else "F and B, or F, I and W"
        raise PipecInputError(f"the choose section takes {taken}; a schedule takes {wanted}", choose.span)
    for kind in needed:
        for chunk in range(chunks):
            if (kind, chunk) not in table:
                raise PipecInputError(
                    f"rank {rank}: {kind.value}[{chunk}] is never taken: add it to a take line (a take without a "
                    "chunk takes every chunk)",
                    choose.span,
                )


def _run_programs(
    schedule: ast.Schedule,
    env: dict[str, int],
    rank_stages: list[tuple[int, ...]],
    budget: _Budget,
    record: bool = False,
) -> tuple[list[list[Instruction]], list[list[Span]]]:
    """Each rank's compute order and, when `record`, the span that emitted each of its instructions."""
    assert schedule.body is not None and schedule.rank_var is not None
    if schedule.rank_var in env:
        raise PipecInputError(
            f"the rank variable '{schedule.rank_var}' hides the parameter or let of the same name; rename one",
            schedule.span,
        )
    _refuse_assignments(schedule.body, set(env) | {schedule.rank_var})
    assigned = _assignment_counts(schedule.body)
    known = set(env) | {schedule.rank_var} | set(assigned)
    once = {name for name, count in assigned.items() if count == 1 and name not in env and name != schedule.rank_var}
    nodes = _count_nodes(schedule.body)
    # blocks see no rank (only what is passed to them), and every rank holds V chunks: compiled once for all ranks
    blocks = _compile_blocks(schedule, env, env["V"], budget, record)
    streams: list[list[Instruction]] = []
    spans: list[list[Span]] = []
    for rank, stages in enumerate(rank_stages):
        try:
            budget.charge_compile(nodes, schedule.span)
            # compiled per rank (microseconds) so that the rank and the names derived from it fold to constants
            constants = {
                name: value for name, value in {**env, schedule.rank_var: rank}.items() if name not in assigned
            }
            compiler = _Compiler(known, constants=constants, chunks=len(stages), record=record, blocks=blocks)
            program = compiler.top_block(schedule.body, once)
            st = _RankState(vars={**env, schedule.rank_var: rank}, rank=rank, stages=stages, budget=budget)
            program(st)
            budget.finish_rank(st, schedule.span)
        except ScheduleProgramError as e:
            raise ScheduleProgramError(e.message, e.span, rank) from None
        streams.append(st.out)
        spans.append(st.spans)
    return streams, spans


def _compile_blocks(
    schedule: ast.Schedule, env: dict[str, int], chunks: int, budget: _Budget, record: bool
) -> dict[str, BlockFn]:
    """Each block as a closure that runs its body in a fresh frame: the parameters, lets and S, its own parameters
    bound to the arguments. Its assignments stay in that frame (block variables are private to one call), while
    the counters and the weight-gradient queue are the rank's, shared with the caller. Callees are compiled
    before their callers, so a call finds its block compiled (the parser refused cycles)."""
    by_name = {block.name: block for block in schedule.blocks}
    order: list[ast.Block] = []
    seen: set[str] = set()

    def visit(block: ast.Block) -> None:  # post-order over the call graph; its depth is bounded by the parser
        if block.name in seen:
            return
        seen.add(block.name)
        for callee in _calls(block.body):
            visit(by_name[callee])
        order.append(block)

    for block in schedule.blocks:
        visit(block)
    fixed = set(env)
    compiled: dict[str, BlockFn] = {}
    for block in order:
        budget.charge_compile(_count_nodes(block.body), block.span)
        for param in block.params:
            if param in fixed:
                raise PipecInputError(
                    f"block {block.name}: parameter {param!r} hides the parameter or let of the same name; rename it",
                    block.span,
                )
        _refuse_assignments(block.body, fixed)
        assigned = _assignment_counts(block.body)
        once = {name for name, count in assigned.items() if count == 1 and name not in block.params}
        scope = (
            f" (block {block.name} sees the parameters, lets, S and its own parameters and variables; "
            "pass anything else as an argument)"
        )
        compiler = _Compiler(
            fixed | set(block.params) | set(assigned),
            constants=env,
            chunks=chunks,
            record=record,
            blocks=compiled,
            scope=scope,
        )
        compiled[block.name] = _frame(compiler.top_block(block.body, once), block.params, env)
    return compiled


def _frame(body: StmtFn, params: tuple[str, ...], env: Mapping[str, int]) -> BlockFn:
    base = dict(env)

    def run(st: _RankState, values: list[int]) -> None:
        saved = st.vars
        frame = base.copy()
        frame.update(zip(params, values, strict=True))  # the parser checked the arity
        st.vars = frame
        body(st)
        # not restored when the body raises: an error ends the rank's run, and break/continue cannot leave a block
        st.vars = saved

    return run


def _calls(body: Iterable[ast.Stmt]) -> list[str]:
    """The blocks a body calls, in order (its loops and ifs included)."""
    names: list[str] = []
    for s in body:
        if isinstance(s, ast.CallBlock):
            names.append(s.name)
        elif isinstance(s, (ast.Repeat, ast.For, ast.While)):
            names += _calls(s.body)
        elif isinstance(s, ast.If):
            for _, branch in s.branches:
                names += _calls(branch)
            names += _calls(s.otherwise)
    return names


def _count_nodes(body: Iterable[ast.Stmt]) -> int:
    """The number of AST nodes in a per-rank program (an explicit stack rather than recursion)."""
    count = 0
    stack: list[object] = [tuple(body)]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(node)
        elif is_dataclass(node) and not isinstance(node, Span):
            count += 1
            stack.extend(getattr(node, f.name) for f in fields(node))
    return count


def _literal_placement(
    schedule: ast.Schedule,
    streams: list[list[Instruction]],
    spans: list[list[Span]],
    given: tuple[int, ...],
    chunks: int,
) -> tuple[int, ...]:
    """The placement of a literal schedule, every listed op checked against it with a caret under the op.

    Without a `placement` line each stage lives on the rank that lists most of its ops (the first such rank on a
    tie), so that one op typed on the wrong rank is the one pointed at. A stage outside 0..S-1, an op on a rank
    that does not hold its stage, or a rank listing more stages than V is a mistake in the text: exit 2, at the op.
    """
    stages = len(given)
    counts: dict[int, dict[int, int]] = {}  # stage -> rank -> ops listed
    for rank, stream in enumerate(streams):
        for index, instruction in enumerate(stream):
            for action in instruction.parts:
                if not 0 <= action.stage < stages:
                    raise PipecInputError(
                        f"rank {rank} lists {action}, an op of stage {action.stage}, but the schedule has stages "
                        f"0..{stages - 1} (S = P * V = {len(streams)} * {chunks})",
                        spans[rank][index],
                    )
                by_rank = counts.setdefault(action.stage, {})
                by_rank[rank] = by_rank.get(rank, 0) + 1
    placement = list(given)
    if schedule.placement is None:
        for stage, by_rank in counts.items():
            placement[stage] = max(by_rank, key=lambda r: (by_rank[r], -r))
    for rank, stream in enumerate(streams):
        for index, instruction in enumerate(stream):
            for action in instruction.parts:
                home = placement[action.stage]
                if home == rank:
                    continue
                if schedule.placement is not None:
                    why = f"but the placement puts stage {action.stage} on rank {home}"
                else:
                    listed = _ops_text(counts[action.stage][home])
                    why = f"which rank {home} runs (it lists {listed} of stage {action.stage})"
                raise PipecInputError(
                    f"rank {rank} lists {action}, an op of stage {action.stage}, {why}; each stage lives on one rank",
                    spans[rank][index],
                )
    if schedule.placement is None:  # a rank listing more stages than it holds: point at its least listed one
        for rank, stream in enumerate(streams):
            mine = sorted(stage for stage, home in enumerate(placement) if home == rank and stage in counts)
            if len(mine) <= chunks:
                continue
            extra = min(mine, key=lambda stage: (counts[stage][rank], -stage))
            index = next(i for i, ins in enumerate(stream) if any(a.stage == extra for a in ins.parts))
            raise PipecInputError(
                f"rank {rank} lists ops of {len(mine)} stages ({', '.join(map(str, mine))}), but each rank holds "
                f"V = {chunks}; {stream[index]} is an op of stage {extra}",
                spans[rank][index],
            )
    return tuple(placement)


def _ops_text(n: int) -> str:
    return f"{n} op" if n == 1 else f"{n} ops"


def _literal_streams(schedule: ast.Schedule, ranks: int) -> tuple[list[list[Instruction]], list[list[Span]]]:
    """Each rank's literal order and the span of each action as written (what errors and explanations point at)."""
    streams: list[list[Instruction]] = [[] for _ in range(ranks)]
    spans: list[list[Span]] = [[] for _ in range(ranks)]
    for rank_list in schedule.rank_lists:
        if not 0 <= rank_list.rank < ranks:
            raise PipecInputError(f"'rank {rank_list.rank}:' is outside 0..{ranks - 1} (P = {ranks})", rank_list.span)
        for text, span in rank_list.actions:
            try:
                instruction = parse_instruction(text)
            except PipecSyntaxError as e:
                raise PipecSyntaxError(e.message, span) from None
            if type(instruction) is Overlap:
                first, second = instruction
                refused = check_pair_kinds(first.kind.value, second.kind.value)
                if refused is None and first.mb == second.mb:
                    refused = _same_microbatch_pair(first, second)
                if refused is not None:
                    raise PipecSyntaxError(refused, span)
            streams[rank_list.rank].append(instruction)
            spans[rank_list.rank].append(span)
    return streams, spans


def _drop_padded_spans(stream: list[Instruction], spans: list[Span], microbatches: int) -> list[Span]:
    """The spans of the instructions _drop_padded keeps (a pair keeps its span when one half is kept)."""
    kept = zip(stream, spans, strict=True)
    return [span for instruction, span in kept if any(a.mb < microbatches for a in instruction.parts)]


def _drop_padded(stream: list[Instruction], microbatches: int) -> list[Instruction]:
    out: list[Instruction] = []
    for instruction in stream:
        if type(instruction) is Action:  # the common case, without building a list
            if instruction.mb < microbatches:
                out.append(instruction)
            continue
        kept = [a for a in instruction.parts if a.mb < microbatches]
        if len(kept) == 2:
            out.append(instruction)
        elif kept:
            out.append(kept[0])
    return out
