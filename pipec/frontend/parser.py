"""Parse .pipe text into the AST: Lark's tree (pipec.frontend.grammar) built into AST nodes
(pipec.frontend.to_ast), then the whole-file checks (pipec.frontend.checks). Lark is imported by these modules of
pipec.frontend only; its errors become PipecSyntaxError (worded in pipec.frontend.syntax_errors)."""

from __future__ import annotations

from functools import lru_cache

from lark import Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError
from lark.indenter import DedentError

from pipec.errors import PipecSyntaxError, Span
from pipec.frontend import ast
from pipec.frontend.checks import check_calls
from pipec.frontend.grammar import lark_parser
from pipec.frontend.syntax_errors import (
    TOKEN_NAMES,
    dedent_line,
    describe_expected,
    end_position,
    explain_unexpected,
    shorten,
)
from pipec.frontend.to_ast import ToAst
from pipec.gcpause import without_cyclic_gc
from pipec.limits import MAX_NESTING


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
            schedule = ToAst(filename, text).transform(tree)
        except VisitError as e:
            if isinstance(e.orig_exc, PipecSyntaxError):
                raise e.orig_exc from None
            raise
    check_calls(schedule)
    return schedule


def _parse_tree(text: str, filename: str) -> Tree:
    try:
        return lark_parser().parse(text)
    except UnexpectedCharacters as e:
        span = Span(filename, e.line, e.column, e.line, e.column + 1, text)
        raise PipecSyntaxError(f"unexpected character {text[e.pos_in_stream]!r}", span) from None
    except UnexpectedToken as e:
        token = e.token
        line = token.line if token.line is not None else e.line
        column = token.column if token.column is not None else e.column
        if token.type == "$END" or line is None or line < 1:
            line, column = end_position(text)
        elif token.type == "_INDENT" and token.end_line is not None:
            # The indenter places it on the newline before the line that indents: point at that line.
            line, column = token.end_line, token.end_column
        if token.type in ("_NL", "_INDENT", "_DEDENT", "$END"):
            what = TOKEN_NAMES[token.type]
        else:
            what = repr(shorten(str(token)))
        width = max(1, len(str(token))) if token.type not in ("_NL", "_DEDENT", "_INDENT", "$END") else 1
        span = Span(filename, line, column, line, column + width, text)
        if token.type == "_INDENT":  # what could have come instead is no help here
            raise PipecSyntaxError("unexpected indentation: this line is deeper than its block", span) from None
        better = explain_unexpected(token, set(e.expected), line, column, filename, text)
        if better is not None:
            raise better from None
        raise PipecSyntaxError(f"unexpected {what}; expected {describe_expected(set(e.expected))}", span) from None
    except UnexpectedEOF as e:
        line, column = end_position(text)
        span = Span(filename, line, column, line, column + 1, text)
        raise PipecSyntaxError(
            f"unexpected end of file; expected {describe_expected(set(e.expected))}", span
        ) from None
    except UnexpectedInput as e:  # pragma: no cover - other Lark input errors
        span = Span(filename, e.line, e.column, e.line, e.column + 1, text)
        raise PipecSyntaxError(str(e).splitlines()[0], span) from None
    except DedentError:
        line = dedent_line(text)
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
