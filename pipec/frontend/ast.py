"""The syntax tree of a .pipe file: small frozen dataclasses, each with the span it came from."""

from __future__ import annotations

from dataclasses import dataclass

from pipec.errors import Span

# ---- expressions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Int:
    value: int
    span: Span


@dataclass(frozen=True, slots=True)
class Var:
    name: str
    span: Span


@dataclass(frozen=True, slots=True)
class Call:
    func: str
    args: tuple[Expr, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class BinOp:
    op: str  # one of + - * // % == != < <= > >= and or
    left: Expr
    right: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Unary:
    op: str  # "-" or "not"
    operand: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Cond:
    test: Expr
    then: Expr
    otherwise: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class OpRef:
    """An op as written: `F`, `B[1]`, `I[c] @ m`, `W?`, `W[0]`."""

    kind: str  # F, B, I or W
    chunk: Expr | None
    at: Expr | None  # explicit micro-batch
    if_pending: bool  # `W?`: emit only when a weight gradient is pending
    span: Span


@dataclass(frozen=True, slots=True)
class Count:
    """`count(F[c])`: how many micro-batches that op's counter has handed out on this rank."""

    op: OpRef
    span: Span


@dataclass(frozen=True, slots=True)
class Pending:
    """`pending(W)` / `pending(W[c])`: weight gradients queued by I and not yet emitted."""

    op: OpRef
    span: Span


Expr = Int | Var | Call | BinOp | Unary | Cond | Count | Pending

# ---- statements of a per-rank program ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pair:
    """`F[0] & B[1]`: two ops overlapped in one instruction (DualPipe)."""

    first: OpRef
    second: OpRef
    span: Span


@dataclass(frozen=True, slots=True)
class Emit:
    items: tuple[OpRef | Pair, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Assign:
    name: str
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Drain:
    op: OpRef
    span: Span


@dataclass(frozen=True, slots=True)
class Pass:
    span: Span


@dataclass(frozen=True, slots=True)
class Repeat:
    count: Expr
    body: tuple[Stmt, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class For:
    var: str
    start: Expr
    stop: Expr
    body: tuple[Stmt, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class While:
    test: Expr
    body: tuple[Stmt, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class If:
    branches: tuple[tuple[Expr, tuple[Stmt, ...]], ...]
    otherwise: tuple[Stmt, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Break:
    """`break`: leaves the innermost loop (the parser refuses it outside one)."""

    span: Span


@dataclass(frozen=True, slots=True)
class Continue:
    """`continue`: ends this iteration of the innermost loop."""

    span: Span


@dataclass(frozen=True, slots=True)
class CallBlock:
    """`warmup(P - r - 1)`: runs a named block with these arguments, evaluated at the call."""

    name: str
    args: tuple[Expr, ...]
    span: Span


Stmt = Emit | Assign | Drain | Pass | Repeat | For | While | If | Break | Continue | CallBlock

# ---- declarations ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    default: Expr | None
    low: Expr | None  # `P in low .. high`: the valid values, half-open like `for`
    high: Expr | None
    span: Span


@dataclass(frozen=True, slots=True)
class Expect:
    """`expect bubble EXPR`: a figure the simulator must reproduce (exact division `/` allowed)."""

    what: str
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Let:
    name: str
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Require:
    test: Expr
    message: str
    span: Span


@dataclass(frozen=True, slots=True)
class Placement:
    """`placement loop`, `placement v`, `placement [0, 1, 1, 0]` or `placement s -> expr`."""

    style: str  # "loop", "v", "list" or "formula"
    items: tuple[Expr, ...]  # the list, or the one formula
    var: str | None  # the stage variable of a formula
    span: Span


@dataclass(frozen=True, slots=True)
class Pipelines:
    """`pipelines EXPR`: C copies of the model over the same ranks (docs/language.md, "Replicated pipelines")."""

    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Route:
    """`route m -> EXPR`: the copy (0 .. C-1) micro-batch m goes through."""

    var: str
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Memory:
    """`memory EXPR` or `memory per rank r: EXPR`: the activation-memory bound each rank must keep."""

    value: Expr
    rank_var: str | None
    span: Span


@dataclass(frozen=True, slots=True)
class RankList:
    """`rank 0: 0F0 0F1 0B0`: a literal order for one rank (hand-made schedules)."""

    rank: int
    actions: tuple[tuple[str, Span], ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Block:
    """`block warmup(n): ...`: statements a program can call by name. Its variables are its own (private)."""

    name: str
    params: tuple[str, ...]
    body: tuple[Stmt, ...]
    span: Span  # the name, where a message about the block points


@dataclass(frozen=True, slots=True)
class Take:
    """`take I[0], W priority 3 if idle`: ops a free rank may start, how urgently, and when it may."""

    ops: tuple[OpRef, ...]  # each kind with an optional chunk (none: every chunk of the rank)
    priority: Expr | None  # None: 0
    guard: Expr | None  # None: always admitted
    span: Span


@dataclass(frozen=True, slots=True)
class Choose:
    """`choose per rank r:`: the rules a list scheduler applies under the compile-time costs."""

    rank_var: str
    memory: Expr | None  # the rank's limit, in the units of the `memory` declaration; None: that declaration
    takes: tuple[Take, ...]
    prefer: tuple[Expr, ...]  # tie-breaks after the priority, higher first
    span: Span
    overlap: bool = False  # `overlap`: pair the chosen op with a ready op of the other side (costs with FB)


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    description: str
    params: tuple[Param, ...]
    header: tuple[Let | Require, ...]  # in source order: a require may use the lets above it
    stages: Expr | None
    placement: Placement | None
    memory: Memory | None
    drop_padded: bool
    forward_only: bool  # inference: no backward ops at all
    expects: tuple[Expect, ...]
    rank_var: str | None
    body: tuple[Stmt, ...] | None
    rank_lists: tuple[RankList, ...]
    span: Span
    blocks: tuple[Block, ...] = ()  # in source order; calls are checked by the parser (names, arity, no cycles)
    choose: Choose | None = None  # a cost-aware schedule: rules instead of a program or lists
    pipelines: Pipelines | None = None  # None: one pipeline (C = 1)
    route: Route | None = None  # None: equal contiguous blocks, m * C // M
