"""The language's rules that the parser and the expansion both apply, with no expansion machinery behind them.

What an overlapped pair may hold (check_pair_kinds, and two different micro-batches where the pair is emitted),
which names a program may not assign (refuse_assignments), the op letters, and the names a `choose` section's
expressions see for each candidate.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipec.errors import PipecInputError
from pipec.frontend import ast
from pipec.ir import Action, Kind

KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}
# The names a choose section's expressions see for each candidate: the fields of the list scheduler's Candidate
# (pipec.passes.list_schedule), in its order, except the rank, which is the section's own variable, and the kind,
# which the take line already fixes. Written out because the front end sits below the passes;
# tests/frontend/test_choose.py fails when a field is added there and not here.
CANDIDATE_NAMES = (
    "chunk", "stage", "mb", "now", "ready", "dur", "live", "after", "idle", "blocked",
    "gap", "inflight", "wpending", "work", "owed", "bound",
)  # fmt: skip


def same_microbatch_pair(a: Action, b: Action) -> str:
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


def refuse_assignments(body: Iterable[ast.Stmt], fixed: set[str]) -> None:
    """Parameters, lets, S and the rank variable are fixed for the whole program: assigning one is an error."""
    for s in body:
        if isinstance(s, ast.Assign) and s.name in fixed:
            raise PipecInputError(f"{s.name} is fixed for the whole schedule and cannot be assigned", s.span)
        if isinstance(s, ast.For) and s.var in fixed:
            raise PipecInputError(f"{s.var} is fixed for the whole schedule and cannot be a loop variable", s.span)
        if isinstance(s, (ast.Repeat, ast.For, ast.While)):
            refuse_assignments(s.body, fixed)
        elif isinstance(s, ast.If):
            for _, branch in s.branches:
                refuse_assignments(branch, fixed)
            refuse_assignments(s.otherwise, fixed)


def assignment_counts(body: Iterable[ast.Stmt]) -> dict[str, int]:
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
