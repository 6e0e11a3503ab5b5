"""Bind a schedule's parameters and run its per-rank programs: AST -> per-rank compute orders (a Program).

The per-rank program is compiled once into Python closures and then run once per rank. Each rank has:
- variables (parameters, `let`s, `S`, the rank variable, and its own assignments);
- one micro-batch counter per (F, chunk) and one per (B/I, chunk): a bare op takes the next micro-batch
  from its counter; `@ m` names the micro-batch and leaves the counter alone;
- a queue of deferred weight gradients: every I enqueues its W; `W` emits the oldest pending one,
  `W[c]` the oldest of chunk c, `W?` only if one is pending, `drain W[c]` all of them.
A step budget turns a runaway `while` into an error instead of a hang.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from pipec.errors import PipecInputError, PipecSyntaxError, ScheduleProgramError, Span
from pipec.frontend import ast
from pipec.ir import Action, Instruction, Kind, Overlap, Program, loop_placement, parse_instruction, v_placement

BUILTIN_PARAMS = ("P", "M", "V")
_PARAM_FLAGS = {"P": "--ranks", "M": "--microbatches", "V": "--chunks"}
_KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}


# ---- run-time state of one rank ----------------------------------------------------------------


@dataclass(eq=False)
class _Pending:
    chunk: int
    action: Action
    alive: bool = True


@dataclass(eq=False)
class _RankState:
    vars: dict[str, int]
    rank: int
    stages: tuple[int, ...]  # chunk -> stage on this rank
    budget: int
    out: list[Instruction] = field(default_factory=list)
    forward_count: list[int] = field(default_factory=list)
    backward_count: list[int] = field(default_factory=list)
    weight_count: list[int] = field(default_factory=list)
    queue: deque[_Pending] = field(default_factory=deque)
    chunk_queues: list[deque[_Pending]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.stages)
        self.forward_count = [0] * n
        self.backward_count = [0] * n
        self.weight_count = [0] * n
        self.chunk_queues = [deque() for _ in range(n)]

    def chunk_index(self, chunk: int, span: Span) -> int:
        if not 0 <= chunk < len(self.stages):
            raise ScheduleProgramError(
                f"chunk {chunk} does not exist: this rank holds {len(self.stages)} stage(s) "
                f"{list(self.stages)}, chunks 0..{len(self.stages) - 1}",
                span,
            )
        return chunk

    def tick(self, span: Span) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise ScheduleProgramError("the program ran too long (a loop that never ends?)", span)

    def enqueue_weight(self, chunk: int, action: Action) -> None:
        entry = _Pending(chunk, Action(action.stage, Kind.W, action.mb))
        self.queue.append(entry)
        self.chunk_queues[chunk].append(entry)

    def pop_weight(self, chunk: int | None) -> Action | None:
        source = self.queue if chunk is None else self.chunk_queues[chunk]
        while source and not source[0].alive:
            source.popleft()
        if not source:
            return None
        entry = source.popleft()
        entry.alive = False
        self.weight_count[entry.chunk] += 1
        return entry.action

    def pending_weights(self, chunk: int | None) -> int:
        source = self.queue if chunk is None else self.chunk_queues[chunk]
        return sum(1 for entry in source if entry.alive)


# ---- expressions -------------------------------------------------------------------------------

ExprFn = Callable[[_RankState], int]

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
    ) -> None:
        self.known = set(known)
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
            self._state = _RankState(vars=self.constants, rank=-1, stages=(), budget=1)
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
                raise PipecSyntaxError(f"unknown name {name!r}", span)

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
        a, b, op, span = self.expr(e.left), self.expr(e.right), e.op, e.span
        c = self.fold(e.right) if self.constants else None
        if c is not None:  # a constant right operand: no second call, no zero check
            if op == "+":
                return lambda st: a(st) + c
            if op == "-":
                return lambda st: a(st) - c
            if op == "*":
                return lambda st: a(st) * c
            if op == "//" and c != 0:
                return lambda st: a(st) // c
            if op == "%" and c != 0:
                return lambda st: a(st) % c
        if op == "+":
            return lambda st: a(st) + b(st)
        if op == "-":
            return lambda st: a(st) - b(st)
        if op == "*":
            return lambda st: a(st) * b(st)
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
            name, value = s.name, self.expr(s.value)

            def assign(st: _RankState) -> None:
                st.vars[name] = value(st)

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

            return drain
        if isinstance(s, ast.Repeat):
            count, body, span = self.expr(s.count), self.block(s.body), s.span

            def repeat(st: _RankState) -> None:
                for _ in range(count(st)):
                    st.tick(span)
                    body(st)

            return repeat
        if isinstance(s, ast.For):
            name, start, stop, body, span = s.var, self.expr(s.start), self.expr(s.stop), self.block(s.body), s.span

            def for_loop(st: _RankState) -> None:
                variables = st.vars
                for k in range(start(st), stop(st)):
                    st.tick(span)
                    variables[name] = k
                    body(st)

            return for_loop
        if isinstance(s, ast.While):
            test, body, span = self.expr(s.test), self.block(s.body), s.span

            def while_loop(st: _RankState) -> None:
                while test(st):
                    st.tick(span)
                    body(st)

            return while_loop
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

        return emit

    def pair(self, p: ast.Pair) -> Callable[[_RankState], None]:
        first, second = self.action(p.first), self.action(p.second)

        def emit_pair(st: _RankState) -> None:
            a, b = first(st), second(st)
            assert a is not None and b is not None  # `W?` is refused in pairs by the parser
            st.out.append(Overlap(a, b))

        return emit_pair


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
    st = _RankState(vars=dict(env), rank=-1, stages=(), budget=1)
    return _Compiler(env, exact_division).expr(e)(st)


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


def expand(
    schedule: ast.Schedule,
    ranks: int | None,
    microbatches: int | None = None,
    chunks: int | None = None,
    overrides: Mapping[str, int] | None = None,
    source: str = "",
) -> Program:
    """Bind parameters, check the schedule's requirements and produce each rank's compute order."""
    env = bind_params(schedule, ranks, microbatches, chunks, overrides)
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

    literal = _literal_streams(schedule, env["P"]) if schedule.body is None else None
    if literal is not None and schedule.placement is None:
        placement = _placement_of(literal, placement)
    rank_stages = [tuple(s for s, r in enumerate(placement) if r == rank) for rank in range(env["P"])]
    uneven = [rank for rank, held in enumerate(rank_stages) if len(held) != env["V"]]
    if uneven:
        rank = uneven[0]
        where = schedule.placement.span if schedule.placement is not None else schedule.span
        raise PipecInputError(
            f"the placement gives rank {rank} {len(rank_stages[rank])} stage(s) {list(rank_stages[rank])}; "
            f"each rank must hold V = {env['V']}",
            where,
        )
    streams = literal if literal is not None else _run_programs(schedule, env, rank_stages)
    if schedule.drop_padded:
        streams = [_drop_padded(stream, env["M"]) for stream in streams]
    return Program(
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


def _run_programs(
    schedule: ast.Schedule, env: dict[str, int], rank_stages: list[tuple[int, ...]]
) -> list[list[Instruction]]:
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
    budget = 64 * (3 * env["M"] * env["V"] + env["P"]) + 100_000
    streams = []
    for rank, stages in enumerate(rank_stages):
        # compiled per rank (microseconds) so that the rank and the names derived from it fold to constants
        constants = {name: value for name, value in {**env, schedule.rank_var: rank}.items() if name not in assigned}
        program = _Compiler(known, constants=constants, chunks=len(stages)).top_block(schedule.body, once)
        st = _RankState(vars={**env, schedule.rank_var: rank}, rank=rank, stages=stages, budget=budget)
        try:
            program(st)
        except ScheduleProgramError as e:
            raise ScheduleProgramError(e.message, e.span, rank) from None
        streams.append(st.out)
    return streams


def _placement_of(streams: list[list[Instruction]], default: tuple[int, ...]) -> tuple[int, ...]:
    """A literal schedule without a `placement` line: each stage lives where its actions are (the first rank
    that names it; a stage named on two ranks is left to the structure check to report)."""
    placement = list(default)
    seen: set[int] = set()
    for rank, stream in enumerate(streams):
        for instruction in stream:
            for action in instruction.parts:
                if 0 <= action.stage < len(placement) and action.stage not in seen:
                    seen.add(action.stage)
                    placement[action.stage] = rank
    return tuple(placement)


def _literal_streams(schedule: ast.Schedule, ranks: int) -> list[list[Instruction]]:
    streams: list[list[Instruction]] = [[] for _ in range(ranks)]
    for rank_list in schedule.rank_lists:
        if not 0 <= rank_list.rank < ranks:
            raise PipecInputError(f"'rank {rank_list.rank}:' is outside 0..{ranks - 1} (P = {ranks})", rank_list.span)
        for text, span in rank_list.actions:
            try:
                streams[rank_list.rank].append(parse_instruction(text))
            except PipecSyntaxError as e:
                raise PipecSyntaxError(e.message, span) from None
    return streams


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
