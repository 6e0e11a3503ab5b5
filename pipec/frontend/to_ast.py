"""Lark's parse tree to the frozen AST of pipec.frontend.ast, each node with the span of the text it came from, and
the checks that need one declaration at a time (integer literals, pairs, the choose section's names)."""

from __future__ import annotations

from typing import Any

from lark import Token, Transformer, Tree, v_args

from pipec.errors import PipecSyntaxError, Span
from pipec.frontend import ast
from pipec.frontend.checks import check_choose_names, check_take_op, refuse_counters
from pipec.frontend.rules import check_pair_kinds
from pipec.limits import MAX_LITERAL_DIGITS

# What `expect NAME EXPR` may state; each is checked by pipec.testing against the simulator.
EXPECTATIONS = ("bubble",)


def _integer(token: Token, filename: str, text: str) -> int:
    """An integer literal, refused with its span when it has more digits than any schedule needs (a 5,000-digit
    number would also hit Python's limit on converting long strings to int)."""
    digits = str(token).lstrip("0")
    if len(digits) > MAX_LITERAL_DIGITS:
        line, column = token.line or 1, token.column or 1
        span = Span(filename, line, column, line, column + len(token), text)
        raise PipecSyntaxError(
            f"integer literal with {len(digits):,} digits; pipec allows at most {MAX_LITERAL_DIGITS} "
            f"(values below 10**{MAX_LITERAL_DIGITS})",
            span,
        )
    return int(digits or "0")


def _unquote(token: Token) -> str:
    return str(token)[1:-1]


class ToAst(Transformer):
    """Builds frozen AST nodes, giving each the span of the tree or token it came from."""

    def __init__(self, filename: str, text: str) -> None:
        super().__init__()
        self.filename = filename
        self.text = text

    def _span(self, node: Any) -> Span:
        meta = node.meta if isinstance(node, Tree) else node
        line = getattr(meta, "line", None) or 1
        column = getattr(meta, "column", None) or 1
        end_line = getattr(meta, "end_line", None) or line
        end_column = getattr(meta, "end_column", None) or column + 1
        return Span(self.filename, line, column, end_line, end_column, self.text)

    def _error(self, message: str, node: Any) -> PipecSyntaxError:
        return PipecSyntaxError(message, self._span(node))

    # Lark calls each rule's method with (meta, children) thanks to v_args(meta=True).
    def __default__(self, data: str, children: list[Any], meta: Any) -> Any:  # pragma: no cover
        raise NotImplementedError(data)

    # -- expressions
    @v_args(meta=True)
    def int(self, meta: Any, children: list[Token]) -> ast.Int:
        return ast.Int(_integer(children[0], self.filename, self.text), self._span(children[0]))

    @v_args(meta=True)
    def var(self, meta: Any, children: list[Token]) -> ast.Var:
        return ast.Var(str(children[0]), self._span(children[0]))

    @v_args(meta=True)
    def call(self, meta: Any, children: list[Any]) -> ast.Call:
        name, *args = children
        return ast.Call(str(name), tuple(args), self._span(meta))

    def _binop(op: str):  # noqa: N805 - a factory used in the class body
        @v_args(meta=True)
        def build(self: ToAst, meta: Any, children: list[Any]) -> ast.BinOp:
            return ast.BinOp(op, children[0], children[1], self._span(meta))

        return build

    add, sub, mul, floordiv, mod = _binop("+"), _binop("-"), _binop("*"), _binop("//"), _binop("%")
    truediv = _binop("/")
    eq, ne, lt, le, gt, ge = _binop("=="), _binop("!="), _binop("<"), _binop("<="), _binop(">"), _binop(">=")
    and_, or_ = _binop("and"), _binop("or")

    @v_args(meta=True)
    def neg(self, meta: Any, children: list[Any]) -> ast.Unary:
        return ast.Unary("-", children[0], self._span(meta))

    @v_args(meta=True)
    def not_(self, meta: Any, children: list[Any]) -> ast.Unary:
        return ast.Unary("not", children[0], self._span(meta))

    @v_args(meta=True)
    def cond(self, meta: Any, children: list[Any]) -> ast.Cond:
        then, test, otherwise = children
        return ast.Cond(test, then, otherwise, self._span(meta))

    @v_args(meta=True)
    def count(self, meta: Any, children: list[Any]) -> ast.Count:
        op = children[0]
        if op.at is not None or op.if_pending:
            raise self._error("count(...) takes an op and an optional chunk: count(F), count(B[1])", meta)
        return ast.Count(op, self._span(meta))

    @v_args(meta=True)
    def pending(self, meta: Any, children: list[Any]) -> ast.Pending:
        op = children[0]
        if op.kind != "W" or op.if_pending:
            raise self._error("pending(...) counts weight gradients: write pending(W) or pending(W[c])", meta)
        return ast.Pending(op, self._span(meta))

    # -- ops
    def chunk(self, children: list[Any]) -> tuple[str, Any]:
        return ("chunk", children[0])

    def at(self, children: list[Any]) -> tuple[str, Any]:
        return ("at", children[0])

    @v_args(meta=True)
    def op(self, meta: Any, children: list[Any]) -> ast.OpRef:
        return self._op(meta, children, if_pending=False)

    @v_args(meta=True)
    def op_if_pending(self, meta: Any, children: list[Any]) -> ast.OpRef:
        return self._op(meta, children, if_pending=True)

    def _op(self, meta: Any, children: list[Any], if_pending: bool) -> ast.OpRef:
        kind = str(children[0])
        parts = dict(children[1:])
        if if_pending and kind != "W":
            raise self._error(f"'{kind}?' is not an op: only W may be emitted if pending ('W?')", meta)
        if kind == "W" and "at" in parts:
            raise self._error("W takes no explicit micro-batch: it emits the oldest pending weight gradient", meta)
        return ast.OpRef(kind, parts.get("chunk"), parts.get("at"), if_pending, self._span(meta))

    @v_args(meta=True)
    def pair(self, meta: Any, children: list[Any]) -> ast.Pair:
        first, second = children
        for part in (first, second):
            if part.if_pending:
                raise self._error("an overlapped pair must emit both of its ops: 'W?' cannot be one", meta)
        refused = check_pair_kinds(first.kind, second.kind)
        if refused is not None:
            raise self._error(refused, meta)
        return ast.Pair(first, second, self._span(meta))

    # -- statements
    @v_args(meta=True)
    def emit(self, meta: Any, children: list[Any]) -> ast.Emit:
        return ast.Emit(tuple(children), self._span(meta))

    @v_args(meta=True)
    def assign(self, meta: Any, children: list[Any]) -> ast.Assign:
        return ast.Assign(str(children[0]), children[1], self._span(meta))

    @v_args(meta=True)
    def drain(self, meta: Any, children: list[Any]) -> ast.Drain:
        op = children[0]
        if op.kind != "W" or op.if_pending:
            raise self._error("drain takes W or W[c]: it emits every pending weight gradient", meta)
        return ast.Drain(op, self._span(meta))

    @v_args(meta=True)
    def pass_stmt(self, meta: Any, children: list[Any]) -> ast.Pass:
        return ast.Pass(self._span(meta))

    @v_args(meta=True)
    def break_stmt(self, meta: Any, children: list[Any]) -> ast.Break:
        return ast.Break(self._span(meta))

    @v_args(meta=True)
    def continue_stmt(self, meta: Any, children: list[Any]) -> ast.Continue:
        return ast.Continue(self._span(meta))

    @v_args(meta=True)
    def call_stmt(self, meta: Any, children: list[Any]) -> ast.CallBlock:
        name, *args = children
        return ast.CallBlock(str(name), tuple(args), self._span(meta))

    @v_args(meta=True)
    def block_decl(self, meta: Any, children: list[Any]) -> ast.Block:
        name, *params, body = children
        seen: set[str] = set()
        for param in params:
            if str(param) in seen:
                raise self._error(f"block {name}: parameter {str(param)!r} is named twice", param)
            seen.add(str(param))
        return ast.Block(str(name), tuple(str(p) for p in params), body, self._span(name))

    def simple_stmt(self, children: list[Any]) -> list[Any]:
        return children

    def suite(self, children: list[Any]) -> tuple[Any, ...]:
        out: list[Any] = []
        for child in children:
            out.extend(child if isinstance(child, list) else [child])
        return tuple(out)

    @v_args(meta=True)
    def repeat_stmt(self, meta: Any, children: list[Any]) -> ast.Repeat:
        return ast.Repeat(children[0], children[1], self._span(meta))

    @v_args(meta=True)
    def for_stmt(self, meta: Any, children: list[Any]) -> ast.For:
        var, start, stop, body = children
        return ast.For(str(var), start, stop, body, self._span(meta))

    @v_args(meta=True)
    def while_stmt(self, meta: Any, children: list[Any]) -> ast.While:
        return ast.While(children[0], children[1], self._span(meta))

    def elif_clause(self, children: list[Any]) -> tuple[str, Any, Any]:
        return ("elif", children[0], children[1])

    def else_clause(self, children: list[Any]) -> tuple[str, Any]:
        return ("else", children[0])

    @v_args(meta=True)
    def if_stmt(self, meta: Any, children: list[Any]) -> ast.If:
        branches = [(children[0], children[1])]
        otherwise: tuple[Any, ...] = ()
        for clause in children[2:]:
            if clause[0] == "elif":
                branches.append((clause[1], clause[2]))
            else:
                otherwise = clause[1]
        return ast.If(tuple(branches), otherwise, self._span(meta))

    # -- declarations
    def schedule_decl(self, children: list[Token]) -> tuple[str, Token, str]:
        name = children[0]
        description = _unquote(children[1]) if len(children) > 1 else ""
        return ("schedule", name, description)

    @v_args(meta=True)
    def param(self, meta: Any, children: list[Any]) -> ast.Param:
        name, *rest = children
        default = rest[0] if len(rest) in (1, 3) else None
        low, high = rest[-2:] if len(rest) >= 2 else (None, None)
        return ast.Param(str(name), default, low, high, self._span(meta))

    @v_args(meta=True)
    def expect_decl(self, meta: Any, children: list[Any]) -> ast.Expect:
        what = str(children[0])
        if what not in EXPECTATIONS:
            raise self._error(f"unknown expectation {what!r}; pipec knows: {', '.join(EXPECTATIONS)}", children[0])
        return ast.Expect(what, children[1], self._span(meta))

    def params_decl(self, children: list[ast.Param]) -> tuple[str, tuple[ast.Param, ...]]:
        return ("params", tuple(children))

    @v_args(meta=True)
    def let_decl(self, meta: Any, children: list[Any]) -> ast.Let:
        return ast.Let(str(children[0]), children[1], self._span(meta))

    @v_args(meta=True)
    def require_decl(self, meta: Any, children: list[Any]) -> ast.Require:
        return ast.Require(children[0], _unquote(children[1]), self._span(meta))

    @v_args(meta=True)
    def stages_decl(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        return ("stages", children[0], meta)

    @v_args(meta=True)
    def pipelines_decl(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        return ("pipelines", ast.Pipelines(children[0], self._span(meta)), meta)

    @v_args(meta=True)
    def route_decl(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        return ("route", ast.Route(str(children[0]), children[1], self._span(meta)), meta)

    @v_args(meta=True)
    def placement_named(self, meta: Any, children: list[Token]) -> ast.Placement:
        style = str(children[0])
        if style not in ("loop", "v"):
            raise self._error(
                f"unknown placement {style!r}: use loop, v, a list [r0, r1, ...] or a formula 's -> expr'",
                children[0],
            )
        return ast.Placement(style, (), None, self._span(meta))

    @v_args(meta=True)
    def placement_list(self, meta: Any, children: list[Any]) -> ast.Placement:
        return ast.Placement("list", tuple(children), None, self._span(meta))

    @v_args(meta=True)
    def placement_formula(self, meta: Any, children: list[Any]) -> ast.Placement:
        return ast.Placement("formula", (children[1],), str(children[0]), self._span(meta))

    @v_args(meta=True)
    def placement_decl(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        return ("placement", children[0], meta)

    @v_args(meta=True)
    def memory_decl(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        return ("memory", ast.Memory(children[0], None, self._span(meta)), meta)

    @v_args(meta=True)
    def memory_per_rank(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        return ("memory", ast.Memory(children[1], str(children[0]), self._span(meta)), meta)

    @v_args(meta=True)
    def drop_decl(self, meta: Any, children: list[Any]) -> tuple[str, bool, Any]:
        return ("drop", True, meta)

    @v_args(meta=True)
    def forward_decl(self, meta: Any, children: list[Any]) -> tuple[str, bool, Any]:
        return ("forward_only", True, meta)

    @v_args(meta=True)
    def per_rank(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        return ("per_rank", (str(children[0]), children[1]), meta)

    @v_args(meta=True)
    def rank_list(self, meta: Any, children: list[Token]) -> ast.RankList:
        rank, *actions = children
        number = _integer(rank, self.filename, self.text)
        return ast.RankList(number, tuple((str(a), self._span(a)) for a in actions), self._span(meta))

    # -- the choose section
    @v_args(meta=True)
    def take_op(self, meta: Any, children: list[Any]) -> ast.OpRef:
        return self._op(meta, children, if_pending=False)

    def take_priority(self, children: list[Any]) -> tuple[str, Any]:
        return ("priority", children[0])

    def take_guard(self, children: list[Any]) -> tuple[str, Any]:
        return ("guard", children[0])

    @v_args(meta=True)
    def take(self, meta: Any, children: list[Any]) -> ast.Take:
        ops = tuple(c for c in children if isinstance(c, ast.OpRef))
        parts = dict(c for c in children if isinstance(c, tuple))
        for e in (parts.get("priority"), parts.get("guard")):
            if e is not None:
                refuse_counters(e)
        return ast.Take(ops, parts.get("priority"), parts.get("guard"), self._span(meta))

    @v_args(meta=True)
    def choose_memory(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        refuse_counters(children[0])
        return ("memory", children[0], meta)

    @v_args(meta=True)
    def prefer(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        for e in children:
            refuse_counters(e)
        return ("prefer", tuple(children), meta)

    @v_args(meta=True)
    def choose_overlap(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        return ("overlap", True, meta)

    @v_args(meta=True)
    def choose_decl(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        rank_var, *rules = children
        found: dict[str, Any] = {}
        takes: list[ast.Take] = []
        seen: dict[tuple[str, int | None], ast.Take] = {}  # (kind, literal chunk or None) -> its take line
        for rule in rules:
            if isinstance(rule, ast.Take):
                for op in rule.ops:
                    check_take_op(op, seen, rule)
                takes.append(rule)
                continue
            key, value, where = rule
            if key in found:
                raise self._error(f"'{key}' is given twice in the choose section", where)
            found[key] = value
        if not takes:
            raise self._error("the choose section takes nothing: add a line such as 'take F' or 'take I priority 1'",
                              meta)
        # the section's span is its first line (the caret runs to its end), where a whole-section error points
        section = ast.Choose(str(rank_var), found.get("memory"), tuple(takes), found.get("prefer", ()),
                             self._span(meta), found.get("overlap", False))
        return ("choose", section, meta)

    @v_args(meta=True)
    def start(self, meta: Any, children: list[Any]) -> ast.Schedule:
        _, name, description = children[0]
        found: dict[str, Any] = {}
        params: tuple[ast.Param, ...] = ()
        header: list[ast.Let | ast.Require] = []
        rank_lists: list[ast.RankList] = []
        expects: list[ast.Expect] = []
        blocks: dict[str, ast.Block] = {}
        for decl in children[1:]:
            if isinstance(decl, ast.Block):
                if decl.name in blocks:
                    first = blocks[decl.name].span
                    raise PipecSyntaxError(f"block {decl.name!r} is defined twice (first on line {first.line})",
                                           decl.span)
                blocks[decl.name] = decl
            elif isinstance(decl, (ast.Let, ast.Require)):
                header.append(decl)
            elif isinstance(decl, ast.Expect):
                expects.append(decl)
            elif isinstance(decl, ast.RankList):
                rank_lists.append(decl)
            elif decl[0] == "params":
                if params:
                    raise PipecSyntaxError("'params' is declared twice", decl[1][0].span)
                params = decl[1]
            else:
                key, value, where = decl
                if key in found:
                    raise self._error(f"'{key.replace('_', ' ')}' is declared twice", where)
                found[key] = value
        per_rank = found.get("per_rank")
        choose: ast.Choose | None = found.get("choose")
        if per_rank is not None and rank_lists:
            raise self._error("a schedule has either a 'per rank' program or literal 'rank N:' lists, not both", meta)
        if choose is not None and (per_rank is not None or rank_lists):
            raise PipecSyntaxError(
                "a schedule has one of a 'per rank' program, literal 'rank N:' lists or a 'choose' section",
                choose.span,
            )
        if per_rank is None and not rank_lists and choose is None:
            raise self._error(
                "the schedule has no order: add a 'per rank r:' program, 'rank N:' lists or a 'choose per rank r:' "
                "section",
                name,
            )
        if choose is not None:
            check_choose_names(choose, params, header)
        return ast.Schedule(
            name=str(name),
            description=description,
            params=params,
            header=tuple(header),
            stages=found.get("stages"),
            placement=found.get("placement"),
            memory=found.get("memory"),
            drop_padded=found.get("drop", False),
            forward_only=found.get("forward_only", False),
            expects=tuple(expects),
            rank_var=per_rank[0] if per_rank else None,
            body=per_rank[1] if per_rank else None,
            rank_lists=tuple(rank_lists),
            span=self._span(name),
            blocks=tuple(blocks.values()),
            choose=choose,
            pipelines=found.get("pipelines"),
            route=found.get("route"),
        )
