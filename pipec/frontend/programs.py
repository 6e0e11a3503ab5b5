"""Running the per-rank programs: each rank's program compiled into closures (the rank and the names derived from
it fold to constants), the blocks compiled once for all ranks, and each rank's compute order collected under the
expansion's budgets."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass

from pipec.errors import PipecInputError, ScheduleProgramError, Span
from pipec.frontend import ast
from pipec.frontend.closures import BlockFn, Compiler, StmtFn
from pipec.frontend.rules import assignment_counts, refuse_assignments
from pipec.frontend.state import Budget, RankState
from pipec.ir import Instruction


def run_programs(
    schedule: ast.Schedule,
    env: dict[str, int],
    rank_stages: list[tuple[int, ...]],
    budget: Budget,
    record: bool = False,
    routed: tuple[tuple[int, ...], ...] | None = None,
) -> tuple[list[list[Instruction]], list[list[Span]]]:
    """Each rank's compute order and, when `record`, the span that emitted each of its instructions. ``routed``
    (replicated pipelines): per stage, the micro-batches its counters hand out in order."""
    assert schedule.body is not None and schedule.rank_var is not None
    if schedule.rank_var in env:
        raise PipecInputError(
            f"the rank variable '{schedule.rank_var}' hides the parameter or let of the same name; rename one",
            schedule.span,
        )
    refuse_assignments(schedule.body, set(env) | {schedule.rank_var})
    assigned = assignment_counts(schedule.body)
    known = set(env) | {schedule.rank_var} | set(assigned)
    once = {name for name, count in assigned.items() if count == 1 and name not in env and name != schedule.rank_var}
    nodes = _count_nodes(schedule.body)
    # blocks see no rank (only what is passed to them), and every rank holds V chunks: compiled once for all ranks
    blocks = _compile_blocks(schedule, env, env["V"], budget, record, routed is not None)
    streams: list[list[Instruction]] = []
    spans: list[list[Span]] = []
    for rank, stages in enumerate(rank_stages):
        try:
            budget.charge_compile(nodes, schedule.span)
            # compiled per rank (microseconds) so that the rank and the names derived from it fold to constants
            constants = {
                name: value for name, value in {**env, schedule.rank_var: rank}.items() if name not in assigned
            }
            compiler = Compiler(
                known, constants=constants, chunks=len(stages), record=record, blocks=blocks, routed=routed is not None
            )
            program = compiler.top_block(schedule.body, once)
            st = RankState(vars={**env, schedule.rank_var: rank}, rank=rank, stages=stages, budget=budget)
            if routed is not None:
                st.routed = tuple(routed[stage] for stage in stages)
                st.microbatches = env["M"]
            program(st)
            budget.finish_rank(st, schedule.span)
        except ScheduleProgramError as e:
            raise ScheduleProgramError(e.message, e.span, rank) from None
        streams.append(st.out)
        spans.append(st.spans)
    return streams, spans


def _compile_blocks(
    schedule: ast.Schedule, env: dict[str, int], chunks: int, budget: Budget, record: bool, routed: bool
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
        refuse_assignments(block.body, fixed)
        assigned = assignment_counts(block.body)
        once = {name for name, count in assigned.items() if count == 1 and name not in block.params}
        scope = (
            f" (block {block.name} sees the parameters, lets, S and its own parameters and variables; "
            "pass anything else as an argument)"
        )
        compiler = Compiler(
            fixed | set(block.params) | set(assigned),
            constants=env,
            chunks=chunks,
            record=record,
            blocks=compiled,
            scope=scope,
            routed=routed,
        )
        compiled[block.name] = _frame(compiler.top_block(block.body, once), block.params, env)
    return compiled


def _frame(body: StmtFn, params: tuple[str, ...], env: Mapping[str, int]) -> BlockFn:
    base = dict(env)

    def run(st: RankState, values: list[int]) -> None:
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
