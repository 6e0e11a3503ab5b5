"""The AST-to-closure compiler: a per-rank program becomes Python closures over a RankState, compiled once per rank
and then run.

Names are checked statically. Expressions over values fixed for the whole run (parameters, the rank, single
top-level assignments) fold to constants at compile time instead of being walked for every op. The closures are
the expansion's hot loop (bench/compile.py): each closure binds what it reads to locals, one closure per operator,
and loops that cannot break keep plain bodies without a try.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction

from pipec.errors import PipecSyntaxError, ScheduleProgramError
from pipec.frontend import ast
from pipec.frontend.rules import KINDS, same_microbatch_pair
from pipec.frontend.state import RankState, bounded_exact, too_big
from pipec.ir import Action, Kind, Overlap
from pipec.limits import MAX_VALUE

ExprFn = Callable[[RankState], int]
StmtFn = Callable[[RankState], None]
BlockFn = Callable[[RankState, list[int]], None]  # a compiled block, run with its arguments' values


class _Break(Exception):  # noqa: N818 - a control-flow signal, never an error
    """Raised by `break`, caught by the innermost loop. Only loops whose body can break catch it, so other loops
    keep their plain closures (and their speed)."""


class _Continue(Exception):  # noqa: N818 - a control-flow signal, never an error
    """Raised by `continue`, caught by the innermost loop."""


def _raise_break(st: RankState) -> None:
    raise _Break  # a fresh instance each time: re-raising one instance would grow its traceback


def _raise_continue(st: RankState) -> None:
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


class Compiler:
    """Turns AST nodes into closures over a RankState. Checks names statically."""

    def __init__(
        self,
        known: Iterable[str],
        exact_division: bool = False,
        constants: Mapping[str, int] | None = None,
        chunks: int | None = None,
        record: bool = False,
        blocks: Mapping[str, BlockFn] | None = None,
        scope: str = "",
        routed: bool = False,
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
        # replicated pipelines: counters hand out the micro-batches routed to their chunk's copy (RankState.routed);
        # one pipeline keeps the plain counters, where the k-th F[c] is micro-batch k
        self.routed = routed
        self._folded: dict[int, int | None] = {}
        self._plain: Compiler | None = None  # evaluates foldable expressions, on a state holding the constants
        self._state: RankState | None = None

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
            self._plain = Compiler(self.known, self.exact_division)
            self._state = RankState(vars=self.constants, rank=-1, stages=())
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

            def var(st: RankState) -> int:
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

                def cdiv(st: RankState) -> int:
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
        return lambda st: bounded_exact(fn(st), span)

    def _binop_unchecked(self, e: ast.BinOp) -> ExprFn:
        a, b, op, span = self.expr(e.left), self.expr(e.right), e.op, e.span
        c = self.fold(e.right) if self.constants else None
        if c is not None:  # a constant right operand: no second call, no zero check
            if op == "+":
                return lambda st: a(st) + c
            if op == "-":
                return lambda st: a(st) - c
            if op == "*":

                def times_constant(st: RankState) -> int:
                    value = a(st) * c
                    if -MAX_VALUE <= value <= MAX_VALUE:  # only * can grow a value fast (squaring in a loop)
                        return value
                    raise too_big(value, span)

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

            def times(st: RankState) -> int:
                value = a(st) * b(st)
                if -MAX_VALUE <= value <= MAX_VALUE:
                    return value
                raise too_big(value, span)

            return times
        if op == "/":
            if not self.exact_division:
                raise PipecSyntaxError(
                    "exact division '/' is allowed only in 'memory' and 'expect' lines; use '//' for integer division",
                    span,
                )

            def exact(st: RankState) -> int:
                left, right = a(st), b(st)
                if right == 0:
                    raise ScheduleProgramError("division by zero", span)
                quotient = Fraction(left) / Fraction(right)
                return quotient.numerator if quotient.denominator == 1 else quotient  # type: ignore[return-value]

            return exact
        if op in ("//", "%"):
            floor = op == "//"

            def divide(st: RankState) -> int:
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
    def top_block(self, body: Iterable[ast.Stmt], once: set[str]) -> Callable[[RankState], None]:
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

    def block(self, body: Iterable[ast.Stmt]) -> Callable[[RankState], None]:
        return self._sequence([self.stmt(s) for s in body])

    def _sequence(self, steps: list[Callable[[RankState], None]]) -> Callable[[RankState], None]:
        def run(st: RankState) -> None:
            for step in steps:
                step(st)

        return steps[0] if len(steps) == 1 else run

    def stmt(self, s: ast.Stmt) -> Callable[[RankState], None]:
        if isinstance(s, ast.Emit):
            emitters = [self.pair(item) if isinstance(item, ast.Pair) else self.op(item) for item in s.items]

            def emit_all(st: RankState) -> None:
                for emitter in emitters:
                    emitter(st)

            return emitters[0] if len(emitters) == 1 else emit_all
        if isinstance(s, ast.Assign):
            name, value, span = s.name, self.expr(s.value), s.span

            def assign(st: RankState) -> None:
                result = value(st)
                # bounded here and in `*`: a sum at most doubles a value, so only a value that is stored and
                # added again in a loop (`x = x + x`) could grow without end
                if not -MAX_VALUE <= result <= MAX_VALUE:
                    raise too_big(result, span)
                st.vars[name] = result

            return assign
        if isinstance(s, ast.Pass):
            return lambda st: None
        if isinstance(s, ast.Drain):
            chunk_fn = self.expr(s.op.chunk) if s.op.chunk is not None else None
            span = s.span

            def drain(st: RankState) -> None:
                chunk = st.chunk_index(chunk_fn(st), span) if chunk_fn else None
                while (w := st.pop_weight(chunk)) is not None:
                    st.tick(span)
                    st.out.append(w)

            if self.record:

                def drain_recorded(st: RankState) -> None:
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

            def if_stmt(st: RankState) -> None:
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

            def repeat(st: RankState) -> None:
                for _ in range(count(st)):
                    st.tick(span)
                    body(st)

            def repeat_breakable(st: RankState) -> None:
                for _ in range(count(st)):
                    st.tick(span)
                    if body(st) is False:
                        return

            return repeat_breakable if any(_escapes(s.body)) else repeat
        if isinstance(s, ast.For):
            name, start, stop = s.var, self.expr(s.start), self.expr(s.stop)

            def for_loop(st: RankState) -> None:
                variables = st.vars
                for k in range(start(st), stop(st)):
                    st.tick(span)
                    variables[name] = k
                    body(st)

            def for_breakable(st: RankState) -> None:
                variables = st.vars
                for k in range(start(st), stop(st)):
                    st.tick(span)
                    variables[name] = k
                    if body(st) is False:
                        return

            return for_breakable if any(_escapes(s.body)) else for_loop
        test = self.expr(s.test)

        def while_loop(st: RankState) -> None:
            while test(st):
                st.tick(span)
                body(st)

        def while_breakable(st: RankState) -> None:
            while test(st):
                st.tick(span)
                if body(st) is False:
                    return

        return while_breakable if any(_escapes(s.body)) else while_loop

    def call(self, s: ast.CallBlock) -> StmtFn:
        run, args, span = self.blocks[s.name], [self.expr(a) for a in s.args], s.span

        def call_block(st: RankState) -> None:
            # a tick per call: blocks that call blocks several times could otherwise emit exponentially many ops
            # with no loop, so no tick, to stop them
            st.tick(span)
            values = [a(st) for a in args]
            for value in values:
                if not -MAX_VALUE <= value <= MAX_VALUE:  # an argument is an assignment to the block's parameter
                    raise too_big(value, span)
            run(st, values)

        return call_block

    def action(self, o: ast.OpRef) -> Callable[[RankState], Action | None]:
        """A closure producing the op's Action (None for `W?` with nothing pending), updating counters."""
        kind, span = KINDS[o.kind], o.span
        chunk_fn = self.expr(o.chunk) if o.chunk is not None else None
        at_fn = self.expr(o.at) if o.at is not None else None

        def chunk_of(st: RankState) -> int:
            return st.chunk_index(chunk_fn(st), span) if chunk_fn is not None else 0

        constant_chunk = 0 if o.chunk is None else self.fold(o.chunk)
        if constant_chunk is not None and self.chunks is not None and 0 <= constant_chunk < self.chunks:
            chunk_of = lambda st: constant_chunk  # noqa: E731 - checked once here, not per op

        if kind is Kind.W:
            if_pending, any_chunk = o.if_pending, chunk_fn is None

            def weight(st: RankState) -> Action | None:
                w = st.pop_weight(None if any_chunk else chunk_of(st))
                if w is None and not if_pending:
                    which = "" if any_chunk else f" of chunk {chunk_of(st)}"
                    raise ScheduleProgramError(
                        f"W: no weight gradient{which} is pending (each W needs an earlier I); use W? to skip", span
                    )
                return w

            return weight

        if kind is Kind.F:

            def forward(st: RankState) -> Action:
                c = chunk_of(st)
                if at_fn is not None:
                    return Action(st.stages[c], kind, at_fn(st))
                mb = st.forward_count[c]
                st.forward_count[c] = mb + 1
                return Action(st.stages[c], kind, mb)

            def forward_routed(st: RankState) -> Action:
                c = chunk_of(st)
                if at_fn is not None:
                    return Action(st.stages[c], kind, at_fn(st))
                k = st.forward_count[c]
                st.forward_count[c] = k + 1
                return Action(st.stages[c], kind, st.routed_microbatch(c, k))

            return forward_routed if self.routed else forward

        is_input = kind is Kind.I

        def backward(st: RankState) -> Action:
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

        def backward_routed(st: RankState) -> Action:
            c = chunk_of(st)
            if at_fn is not None:
                action = Action(st.stages[c], kind, at_fn(st))
            else:
                k = st.backward_count[c]
                st.backward_count[c] = k + 1
                action = Action(st.stages[c], kind, st.routed_microbatch(c, k))
            if is_input:
                st.enqueue_weight(c, action)
            return action

        return backward_routed if self.routed else backward

    def op(self, o: ast.OpRef) -> Callable[[RankState], None]:
        make = self.action(o)

        def emit(st: RankState) -> None:
            action = make(st)
            if action is not None:
                st.out.append(action)

        if self.record:
            span = o.span

            def emit_recorded(st: RankState) -> None:
                action = make(st)
                if action is not None:
                    st.out.append(action)
                    st.spans.append(span)

            return emit_recorded
        return emit

    def pair(self, p: ast.Pair) -> Callable[[RankState], None]:
        # the parser let through only one forward with one backward (B, I or W): see check_pair_kinds
        first, second, span, record = self.action(p.first), self.action(p.second), p.span, self.record

        def emit_pair(st: RankState) -> None:
            a, b = first(st), second(st)
            assert a is not None and b is not None  # `W?` is refused in pairs by the parser
            if a.mb == b.mb:  # a backward depends on every forward of its micro-batch: the halves cannot overlap
                raise ScheduleProgramError(same_microbatch_pair(a, b), span)
            st.out.append(Overlap(a, b))
            if record:
                st.spans.append(span)

        return emit_pair


def _catching(body: StmtFn) -> Callable[[RankState], bool | None]:
    """A loop body that stops a `break` (returning False: leave the loop) and a `continue` (returning None: go on
    with the next iteration). try costs nothing in Python 3.11 until something is raised."""

    def run(st: RankState) -> bool | None:
        try:
            body(st)
        except _Break:
            return False
        except _Continue:
            return None
        return None

    return run
