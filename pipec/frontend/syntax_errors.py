"""Syntax errors worded for people: Lark's 'unexpected X; expected Y' turned into a misspelt keyword with the one it
resembles, a word where an op or a statement should be, and positions for errors Lark gives none."""

from __future__ import annotations

import difflib
import re

from lark import Token

from pipec.errors import PipecSyntaxError, Span
from pipec.frontend.grammar import lark_parser

TOKEN_NAMES = {
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
    if name in TOKEN_NAMES:
        return TOKEN_NAMES[name]
    try:
        pattern = lark_parser().get_terminal(name).pattern
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
            pattern = lark_parser().get_terminal(name).pattern
        except KeyError:
            continue
        if pattern.type == "str" and pattern.value.isidentifier():
            words.append(pattern.value)
    return sorted(words)


def explain_unexpected(
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
            return PipecSyntaxError(f"unknown keyword {shorten(word)!r}: did you mean {close[0]!r}?", span)
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
        return PipecSyntaxError(f"unknown statement {shorten(word)!r}: did you mean {close[0]!r}?", span)
    return PipecSyntaxError(f"{_not_an_op(word)}, a statement such as repeat or if, or an assignment '{word} = ...'",
                            span)


_OP_LETTERS = ("F", "B", "I", "W")


def _not_an_op(word: str) -> str:
    shown = shorten(word)
    if word.upper() in _OP_LETTERS:
        return f"{shown!r} is not an op: ops are written in capitals (F, B, I, W)"
    return f"{shown!r} is not an op: expected an op such as F, B, I or W (F[1], B @ m)"


def describe_expected(expected: set[str]) -> str:
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


def shorten(word: str, limit: int = 40) -> str:
    """A token as a message quotes it: a 1 MB name would otherwise fill the terminal."""
    return word if len(word) <= limit else word[: limit - 3] + "..."


def end_position(text: str) -> tuple[int, int]:
    lines = text.rstrip("\n").splitlines() or [""]
    return len(lines), len(lines[-1]) + 1


def dedent_line(text: str) -> int:
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
