"""Parse .pipe text into the AST. The only module that imports Lark; Lark's errors become PipecSyntaxError."""

from __future__ import annotations

import difflib
import re
from functools import cache, lru_cache
from importlib import resources
from typing import Any

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError
from lark.indenter import DedentError, Indenter

from pipec.errors import PipecSyntaxError, Span
from pipec.frontend import ast
from pipec.frontend.limits import MAX_LITERAL_DIGITS, MAX_NESTING
from pipec.frontend.rules import CANDIDATE_NAMES, check_pair_kinds
from pipec.gcpause import without_cyclic_gc

# What `expect NAME EXPR` may state; each is checked by pipec.testing against the simulator.
EXPECTATIONS = ("bubble",)


class PipeIndenter(Indenter):
    NL_type = "_NL"
    OPEN_PAREN_types = ("LPAR", "LSQB")
    CLOSE_PAREN_types = ("RPAR", "RSQB")
    INDENT_type = "_INDENT"
    DEDENT_type = "_DEDENT"
    tab_len = 8


@cache
def _lark() -> Lark:
    grammar = resources.files("pipec").joinpath("grammar/pipe.lark").read_text()
    # cache=True keeps the built LALR tables in the temp folder, keyed by the grammar text: start-up drops
    # from ~0.3 s to under 0.1 s, which matters to users who run `pipec compile` in a loop.
    return Lark(
        grammar,
        parser="lalr",
        postlex=PipeIndenter(),
        propagate_positions=True,
        maybe_placeholders=False,
        cache=True,
    )


_TOKEN_NAMES = {
    "_NL": "end of line",
    "_INDENT": "indentation",
    "_DEDENT": "end of block",
    "$END": "end of file",
    "NAME": "a name",
    "SCHEDULE_NAME": "a schedule name",
    "INT": "an integer",
    "STRING": 'a "string"',
    "OPKIND": "an op (F, B, I or W)",
    "ACTION": "an action such as 0F1",
    "COLON": "':'",
    "COMMA": "','",
    "LPAR": "'('",
    "RPAR": "')'",
    "LSQB": "'['",
    "RSQB": "']'",
    "EQUAL": "'='",
}


def _describe_terminal(name: str) -> str:
    if name in _TOKEN_NAMES:
        return _TOKEN_NAMES[name]
    try:
        pattern = _lark().get_terminal(name).pattern
    except KeyError:
        return name.lower()
    return repr(pattern.value) if pattern.type == "str" else name.lower()


# What may start a statement of a per-rank program, besides an op and an assignment: a misspelt one parses as the
# start of an assignment (`reapet warm: F` is NAME NAME ...), so the parser alone would only complain about `warm`.
STATEMENT_KEYWORDS = ("repeat", "for", "while", "if", "elif", "else", "drain", "pass", "break", "continue")
_WORD_BEFORE = re.compile(r"(?:^|[:;])[ \t]*([A-Za-z_][A-Za-z0-9_]*)[ \t]*$")


def _keywords(expected: set[str]) -> list[str]:
    """The keywords (`params`, `rank`, ...) among the terminals the parser expected."""
    words = []
    for name in expected:
        try:
            pattern = _lark().get_terminal(name).pattern
        except KeyError:
            continue
        if pattern.type == "str" and pattern.value.isidentifier():
            words.append(pattern.value)
    return sorted(words)


def _explain_unexpected(
    token: Token, expected: set[str], line: int, column: int, filename: str, text: str
) -> PipecSyntaxError | None:
    """A message for the mistakes that Lark's 'unexpected X; expected Y' describes badly: a misspelt keyword (with
    the keyword it resembles) and a word where an op or a statement should be. None: the generic message will do."""
    word = str(token)
    # a word where keywords or ops could stand: `parms P, M`, `per rnk r:`, `F G` (the lexer may read a word there
    # as a schedule name, which takes the same characters)
    if token.type in ("NAME", "SCHEDULE_NAME") and word.isidentifier():
        close = difflib.get_close_matches(word, _keywords(expected), n=1, cutoff=0.6)
        span = Span(filename, line, column, line, column + len(word), text)
        if close:
            return PipecSyntaxError(f"unknown keyword {_shorten(word)!r}: did you mean {close[0]!r}?", span)
        if "OPKIND" in expected:  # `F G`: after an op, another op could follow
            return PipecSyntaxError(_not_an_op(word), span)
    if "EQUAL" not in expected:
        return None
    # The parser read a word at the start of a statement and so expects `word = ...`: the word is the mistake.
    lines = text.splitlines()
    before = lines[line - 1][: column - 1] if 1 <= line <= len(lines) else ""
    found = _WORD_BEFORE.search(before)
    if found is None:
        return None
    word = found[1]
    span = Span(filename, line, found.start(1) + 1, line, found.end(1) + 1, text)
    close = difflib.get_close_matches(word, STATEMENT_KEYWORDS, n=1, cutoff=0.6)
    if word.upper() in _OP_LETTERS:
        return PipecSyntaxError(_not_an_op(word), span)
    if close:
        return PipecSyntaxError(f"unknown statement {_shorten(word)!r}: did you mean {close[0]!r}?", span)
    return PipecSyntaxError(f"{_not_an_op(word)}, a statement such as repeat or if, or an assignment '{word} = ...'",
                            span)


_OP_LETTERS = ("F", "B", "I", "W")


def _not_an_op(word: str) -> str:
    shown = _shorten(word)
    if word.upper() in _OP_LETTERS:
        return f"{shown!r} is not an op: ops are written in capitals (F, B, I, W)"
    return f"{shown!r} is not an op: expected an op such as F, B, I or W (F[1], B @ m)"


def _describe_expected(expected: set[str]) -> str:
    # Structure first: a missing ':' or ')' is the likeliest mistake, the operators that could continue an
    # expression the least informative.
    first = ("':'", "')'", "']'", "','", "'..'", "end of line")
    names = sorted(
        {_describe_terminal(name) for name in expected},
        key=lambda n: (n not in first, first.index(n) if n in first else 0, n),
    )
    if len(names) > 10:
        names = [*names[:10], "..."]
    return ", ".join(names)


@lru_cache(maxsize=64)
def parse(text: str, filename: str = "<string>") -> ast.Schedule:
    """Parse one .pipe file. Raises PipecSyntaxError with file:line:col on any error.

    Cached by (text, filename): the AST is immutable, and a program that compiles one schedule for many
    (P, M, V), as `pipec test` and the benchmarks do, parses it once."""
    if not text.endswith("\n"):
        text += "\n"
    # Lark builds a token, a tree and a meta object per token and frees none of them in cycles: the cyclic
    # collector would rescan them all, which made parsing a large file superlinear (2-3x slower at 100k lines)
    with without_cyclic_gc():
        tree = _parse_tree(text, filename)
        _check_nesting(tree, filename, text)
        try:
            schedule = _ToAst(filename, text).transform(tree)
        except VisitError as e:
            if isinstance(e.orig_exc, PipecSyntaxError):
                raise e.orig_exc from None
            raise
    _check_calls(schedule)
    return schedule


def _parse_tree(text: str, filename: str) -> Tree:
    try:
        return _lark().parse(text)
    except UnexpectedCharacters as e:
        span = Span(filename, e.line, e.column, e.line, e.column + 1, text)
        raise PipecSyntaxError(f"unexpected character {text[e.pos_in_stream]!r}", span) from None
    except UnexpectedToken as e:
        token = e.token
        line = token.line if token.line is not None else e.line
        column = token.column if token.column is not None else e.column
        if token.type == "$END" or line is None or line < 1:
            line, column = _end_position(text)
        elif token.type == "_INDENT" and token.end_line is not None:
            # The indenter places it on the newline before the line that indents: point at that line.
            line, column = token.end_line, token.end_column
        if token.type in ("_NL", "_INDENT", "_DEDENT", "$END"):
            what = _TOKEN_NAMES[token.type]
        else:
            what = repr(_shorten(str(token)))
        width = max(1, len(str(token))) if token.type not in ("_NL", "_DEDENT", "_INDENT", "$END") else 1
        span = Span(filename, line, column, line, column + width, text)
        if token.type == "_INDENT":  # what could have come instead is no help here
            raise PipecSyntaxError("unexpected indentation: this line is deeper than its block", span) from None
        better = _explain_unexpected(token, set(e.expected), line, column, filename, text)
        if better is not None:
            raise better from None
        raise PipecSyntaxError(f"unexpected {what}; expected {_describe_expected(set(e.expected))}", span) from None
    except UnexpectedEOF as e:
        line, column = _end_position(text)
        span = Span(filename, line, column, line, column + 1, text)
        raise PipecSyntaxError(
            f"unexpected end of file; expected {_describe_expected(set(e.expected))}", span
        ) from None
    except UnexpectedInput as e:  # pragma: no cover - other Lark input errors
        span = Span(filename, e.line, e.column, e.line, e.column + 1, text)
        raise PipecSyntaxError(str(e).splitlines()[0], span) from None
    except DedentError:
        line = _dedent_line(text)
        span = Span(filename, line, 1, line, 2, text)
        raise PipecSyntaxError("inconsistent indentation: this line lines up with no enclosing block", span) from None


# Tree nodes that nest: a block, or an expression operator. The AST builder, the compiler and the per-rank closures
# all recurse once or twice per level, so the depth is bounded here, before any of them runs.
_NESTING_RULES = frozenset(
    {
        "suite", "add", "sub", "mul", "floordiv", "truediv", "mod", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_",
        "neg", "not_", "cond", "call", "count", "pending", "chunk", "at", "pair",
    }
)


def _check_nesting(tree: Tree, filename: str, text: str) -> None:
    """Refuse blocks and expressions nested more than MAX_NESTING deep (an explicit stack: no recursion here)."""
    stack: list[tuple[Tree, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if node.data in _NESTING_RULES:
            depth += 1
            if depth > MAX_NESTING:
                meta = node.meta
                line = getattr(meta, "line", None) or 1
                column = getattr(meta, "column", None) or 1
                span = Span(filename, line, column, line, column + 1, text)
                raise PipecSyntaxError(
                    f"blocks and expressions are nested more than {MAX_NESTING} levels deep here; "
                    f"pipec allows at most {MAX_NESTING}",
                    span,
                )
        stack.extend((child, depth) for child in node.children if isinstance(child, Tree))


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


def _shorten(word: str, limit: int = 40) -> str:
    """A token as a message quotes it: a 1 MB name would otherwise fill the terminal."""
    return word if len(word) <= limit else word[: limit - 3] + "..."


def _end_position(text: str) -> tuple[int, int]:
    lines = text.rstrip("\n").splitlines() or [""]
    return len(lines), len(lines[-1]) + 1


def _dedent_line(text: str) -> int:
    """The first line whose indentation matches no enclosing block (for DedentError, which has no position)."""
    stack = [0]
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip(" \t")
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line.expandtabs(8)) - len(stripped.expandtabs(8))
        if indent > stack[-1]:
            stack.append(indent)
        else:
            while indent < stack[-1]:
                stack.pop()
            if indent != stack[-1]:
                return number
    return 1


def _unquote(token: Token) -> str:
    return str(token)[1:-1]


class _ToAst(Transformer):
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
        def build(self: _ToAst, meta: Any, children: list[Any]) -> ast.BinOp:
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
                _refuse_counters(e)
        return ast.Take(ops, parts.get("priority"), parts.get("guard"), self._span(meta))

    @v_args(meta=True)
    def choose_memory(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        _refuse_counters(children[0])
        return ("memory", children[0], meta)

    @v_args(meta=True)
    def prefer(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        for e in children:
            _refuse_counters(e)
        return ("prefer", tuple(children), meta)

    @v_args(meta=True)
    def choose_decl(self, meta: Any, children: list[Any]) -> tuple[str, Any, Any]:
        rank_var, *rules = children
        found: dict[str, Any] = {}
        takes: list[ast.Take] = []
        seen: dict[tuple[str, int | None], ast.Take] = {}  # (kind, literal chunk or None) -> its take line
        for rule in rules:
            if isinstance(rule, ast.Take):
                for op in rule.ops:
                    _check_take_op(op, seen, rule)
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
                             self._span(meta))
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
            _check_choose_names(choose, params, header)
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
        )


def _refuse_counters(e: ast.Expr) -> None:
    """count() and pending() read a program's counters; a choose section's expressions see the candidate instead."""
    stack = [e]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Count, ast.Pending)):
            raise PipecSyntaxError(
                "count() and pending() are not available in a choose section: its rules see the candidate "
                f"({', '.join(CANDIDATE_NAMES)})",
                node.span,
            )
        if isinstance(node, ast.Call):
            stack.extend(node.args)
        elif isinstance(node, ast.BinOp):
            stack.extend((node.left, node.right))
        elif isinstance(node, ast.Unary):
            stack.append(node.operand)
        elif isinstance(node, ast.Cond):
            stack.extend((node.test, node.then, node.otherwise))


def _check_take_op(op: ast.OpRef, seen: dict[tuple[str, int | None], ast.Take], rule: ast.Take) -> None:
    """One take line per (kind, chunk), as far as the text shows it (a computed chunk is checked when expanded)."""
    chunk = op.chunk.value if isinstance(op.chunk, ast.Int) else None if op.chunk is None else -1
    if chunk == -1:
        return
    clashes = [key for key in seen if key[0] == op.kind and (chunk is None or key[1] is None or key[1] == chunk)]
    if clashes:
        first = seen[clashes[0]].span.line
        what = op.kind if chunk is None else f"{op.kind}[{chunk}]"
        raise PipecSyntaxError(f"{what} is already taken on line {first}: one take line per op and chunk", op.span)
    seen[(op.kind, chunk)] = rule


def _check_choose_names(choose: ast.Choose, params: tuple[ast.Param, ...], header: list[Any]) -> None:
    """A candidate's names would hide a parameter or let of the same name (and the rank variable, a candidate's):
    refused when the file is read rather than silently shadowed."""
    names = set(CANDIDATE_NAMES)
    for item in (*params, *(h for h in header if isinstance(h, ast.Let))):
        if item.name in names:
            raise PipecSyntaxError(
                f"{item.name!r} is a name the choose section gives each candidate; rename the "
                f"{'parameter' if isinstance(item, ast.Param) else 'let'}",
                item.span,
            )
    if choose.rank_var in names:
        raise PipecSyntaxError(f"the rank variable {choose.rank_var!r} is a candidate's name; use another, such as r",
                               choose.span)


# ---- blocks, calls and loops: checks that need the whole file ----------------------------------------------------


def _check_calls(schedule: ast.Schedule) -> None:
    """Refuse, before anything runs: `break`/`continue` outside a loop, a call of an unknown block or with the
    wrong number of arguments, blocks that call themselves (directly or through others: a block is inlined, never
    recursive, so every program stays a bounded tree of statements), and call chains nested deeper than
    MAX_NESTING (each call is a level: the closures that run a call chain recurse like nested blocks do)."""
    blocks = {block.name: block for block in schedule.blocks}
    calls: dict[str, list[tuple[ast.CallBlock, int]]] = {}  # block -> its calls and the nesting at each
    own_depth: dict[str, int] = {}
    bodies: list[tuple[str, tuple[ast.Stmt, ...]]] = [(b.name, b.body) for b in schedule.blocks]
    if schedule.body is not None:
        bodies.append(("", schedule.body))  # "": the per-rank program, which no block can name
    for owner, body in bodies:
        found: list[tuple[ast.CallBlock, int]] = []
        own_depth[owner] = _walk(body, blocks, found, loops=0, depth=1)
        calls[owner] = found
    # depth-first over the call graph: a block on the current path that is called again closes a cycle
    depth: dict[str, int] = {}
    for owner, _ in bodies:
        _call_depth(owner, calls, own_depth, depth, [], blocks)
        if depth[owner] > MAX_NESTING:
            where = blocks[owner].span if owner else schedule.span
            raise PipecSyntaxError(
                f"blocks and the calls between them are nested more than {MAX_NESTING} levels deep here "
                f"({depth[owner]}); pipec allows at most {MAX_NESTING}",
                where,
            )


def _call_depth(
    owner: str,
    calls: dict[str, list[tuple[ast.CallBlock, int]]],
    own_depth: dict[str, int],
    depth: dict[str, int],
    path: list[tuple[str, ast.CallBlock | None]],
    blocks: dict[str, ast.Block],
) -> None:
    """depth[owner]: its statement nesting with every call's callee nested in at the call. Recursive over the call
    graph, whose depth is bounded by the number of blocks on one path, each a level of at most MAX_NESTING."""
    if owner in depth:
        return
    names = [name for name, _ in path]
    if owner in names:  # a cycle: name it from the block that starts it, and point at the call that closes it
        cycle = [*names[names.index(owner):], owner]
        call = path[-1][1]
        assert call is not None
        raise PipecSyntaxError(f"block {owner!r} calls itself ({' -> '.join(cycle)}); blocks cannot be recursive",
                               call.span)
    if len(path) > MAX_NESTING:  # each call is a level: deeper paths are refused below anyway
        call = path[-1][1]
        assert call is not None
        raise PipecSyntaxError(f"blocks call one another more than {MAX_NESTING} levels deep here", call.span)
    deepest = own_depth[owner]
    for call, at in calls[owner]:
        _call_depth(call.name, calls, own_depth, depth, [*path, (owner, call)], blocks)
        deepest = max(deepest, at + depth[call.name])
    depth[owner] = deepest


def _walk(
    body: tuple[ast.Stmt, ...],
    blocks: dict[str, ast.Block],
    found: list[tuple[ast.CallBlock, int]],
    loops: int,
    depth: int,
) -> int:
    """Check one body's break/continue and calls; collect its calls; return its deepest statement nesting.
    Recursive per level of nesting, which the parser has bounded by MAX_NESTING."""
    deepest = depth
    for s in body:
        if isinstance(s, (ast.Break, ast.Continue)) and loops == 0:
            word = "break" if isinstance(s, ast.Break) else "continue"
            raise PipecSyntaxError(f"'{word}' outside a loop: it must stand inside a repeat, for or while "
                                   "of the same program or block", s.span)
        if isinstance(s, ast.CallBlock):
            _check_call(s, blocks)
            found.append((s, depth))
        elif isinstance(s, (ast.Repeat, ast.For, ast.While)):
            deepest = max(deepest, _walk(s.body, blocks, found, loops + 1, depth + 1))
        elif isinstance(s, ast.If):
            for _, branch in s.branches:
                deepest = max(deepest, _walk(branch, blocks, found, loops, depth + 1))
            deepest = max(deepest, _walk(s.otherwise, blocks, found, loops, depth + 1))
    return deepest


def _check_call(call: ast.CallBlock, blocks: dict[str, ast.Block]) -> None:
    block = blocks.get(call.name)
    name = _shorten(call.name)
    if block is None:
        close = difflib.get_close_matches(call.name, list(blocks), n=1, cutoff=0.6)
        if close:
            hint = f": did you mean {close[0]!r}?"
        elif blocks:
            hint = f"; blocks defined: {', '.join(blocks)}"
        else:
            hint = f"; define it with 'block {name}(...):'"
        raise PipecSyntaxError(f"unknown block {name!r}{hint}", call.span)
    if len(call.args) != len(block.params):
        wanted = ", ".join(block.params)
        raise PipecSyntaxError(
            f"block {name}({wanted}) takes {_arguments(len(block.params))}, got {len(call.args)}", call.span
        )


def _arguments(n: int) -> str:
    return "1 argument" if n == 1 else f"{n} arguments"
