"""Checks on the AST that the grammar cannot make: what a choose section's expressions may name, one take line per
op, and the calls between blocks (known blocks, the right number of arguments, no recursion, a bounded depth)."""

from __future__ import annotations

import difflib
from typing import Any

from pipec.errors import PipecSyntaxError
from pipec.frontend import ast
from pipec.frontend.rules import CANDIDATE_NAMES
from pipec.frontend.syntax_errors import shorten
from pipec.limits import MAX_NESTING


def refuse_counters(e: ast.Expr) -> None:
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


def check_take_op(op: ast.OpRef, seen: dict[tuple[str, int | None], ast.Take], rule: ast.Take) -> None:
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


def check_choose_names(choose: ast.Choose, params: tuple[ast.Param, ...], header: list[Any]) -> None:
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


def check_calls(schedule: ast.Schedule) -> None:
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
    name = shorten(call.name)
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
