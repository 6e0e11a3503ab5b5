"""Bind a schedule's parameters and run its per-rank programs: AST -> per-rank compute orders (a Program).

The steps, each in its own module of pipec.frontend: the parameters (params), the header lines (header), the
per-rank programs compiled into closures and run once per rank (programs, closures, state), or the literal lists
(literal); a `choose` section comes back as its rules (choose), for the driver to list-schedule under its costs.

A Program expanded here carries its provenance (PipeSource): asked through ``Program.op_spans()``, it tells where
each op was written by expanding the schedule again with span recording on. Only a deadlock's explanation asks, so
expansion itself records nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from pipec.errors import PipecError, PipecInputError
from pipec.frontend import ast
from pipec.frontend.choose import ChooseSpec, choose_spec
from pipec.frontend.header import Header, bind_header
from pipec.frontend.literal import literal_placement, literal_streams
from pipec.frontend.padded import drop_padded, drop_padded_spans
from pipec.frontend.params import BUILTIN_PARAMS, bind_params
from pipec.frontend.programs import run_programs
from pipec.frontend.state import Budget
from pipec.ir import Action, Instruction, Program, Spans
from pipec.limits import RANK_STEPS_EXTRA, RANK_STEPS_PER_OP, check_sizes


@dataclass(frozen=True, eq=False)
class PipeSource:
    """Where a program came from: the `.pipe` schedule it was expanded from (ir.Provenance)."""

    schedule: ast.Schedule

    def op_spans(self, program: Program) -> Spans | None:
        """Expands the schedule again with span recording on, for ``program``'s parameters; answers only when that
        reproduces the program's compute orders exactly (a program edited since has no such spans)."""
        named = {name: value for name, value in program.params.items() if name not in BUILTIN_PARAMS}
        try:
            again, spans = _expand(
                self.schedule, program.ranks, program.microbatches, program.chunks, named, program.source, record=True
            )
        except PipecError:  # the parameters no longer fit that schedule: it is not where the program came from
            return None
        if spans is None or isinstance(again, ChooseSpec) or again.streams != program.compute_streams():
            return None
        return spans


def prepare(
    schedule: ast.Schedule,
    ranks: int | None,
    microbatches: int | None = None,
    chunks: int | None = None,
    overrides: Mapping[str, int] | None = None,
    source: str = "",
) -> Program | ChooseSpec:
    """Bind parameters, check the schedule's requirements and produce each rank's compute order; a choose section
    comes back as its rules, for run_choose under the caller's costs."""
    found, _ = _expand(schedule, ranks, microbatches, chunks, overrides, source, record=False)
    return found


def _expand(
    schedule: ast.Schedule,
    ranks: int | None,
    microbatches: int | None,
    chunks: int | None,
    overrides: Mapping[str, int] | None,
    source: str,
    record: bool,
) -> tuple[Program | ChooseSpec, Spans | None]:
    """The program (a per-rank program run, or literal lists), or for a choose section its rules (run_choose runs
    them under the caller's costs) and, when `record`, each instruction's span."""
    budget = Budget(rank_steps=0)  # the clock starts now; rank_steps is set once P, M and V are known
    env = bind_params(schedule, ranks, microbatches, chunks, overrides)
    # before anything is allocated for them (the placement, the per-rank lists): a mutated default such as
    # `V = 2000000` or a flag such as `-M 1000000000000` fails here, in milliseconds, naming the limit
    given = {"P": ranks, "M": microbatches, "V": chunks}
    defaults = frozenset(name for name, value in given.items() if value is None)
    check_sizes(env["P"], env["M"], env["V"], schedule.name, defaults)
    budget.rank_steps = RANK_STEPS_PER_OP * (3 * env["M"] * env["V"] + env["P"]) + RANK_STEPS_EXTRA
    params = dict(env)
    header = bind_header(schedule, env)
    placement = header.placement
    literal, literal_spans = literal_streams(schedule, env["P"]) if schedule.body is None else (None, None)
    if literal is not None and literal_spans is not None:
        placement = literal_placement(schedule, literal, literal_spans, placement, env["V"])
    rank_stages = _rank_stages(schedule, placement, env["P"], env["V"])
    if schedule.choose is not None:
        template = _program(schedule, env, params, header, placement, tuple(() for _ in range(env["P"])), source)
        return choose_spec(schedule, schedule.choose, env, template, rank_stages), None
    if literal is not None and literal_spans is not None:
        streams, spans = literal, literal_spans
    else:
        routed = routed_microbatches(header, env["M"]) if header.pipelines > 1 else None
        streams, spans = run_programs(schedule, env, rank_stages, budget, record, routed)
    if schedule.drop_padded:
        if record:
            spans = [
                drop_padded_spans(stream, rank_spans, env["M"])
                for stream, rank_spans in zip(streams, spans, strict=True)
            ]
        streams = [drop_padded(stream, env["M"]) for stream in streams]
    program = _program(schedule, env, params, header, placement, tuple(tuple(s) for s in streams), source)
    return program, (tuple(tuple(rank_spans) for rank_spans in spans) if record else None)


def _rank_stages(
    schedule: ast.Schedule, placement: tuple[int, ...], ranks: int, chunks: int
) -> list[tuple[int, ...]]:
    """Each rank's stages, in stage order; every rank must hold V of them."""
    by_rank: list[list[int]] = [[] for _ in range(ranks)]  # one pass over the stages, not one per rank
    for stage, rank in enumerate(placement):
        by_rank[rank].append(stage)
    rank_stages = [tuple(stages) for stages in by_rank]
    uneven = [rank for rank, held in enumerate(rank_stages) if len(held) != chunks]
    if uneven:
        rank = uneven[0]
        where = schedule.placement.span if schedule.placement is not None else schedule.span
        raise PipecInputError(
            f"the placement gives rank {rank} {len(rank_stages[rank])} stage(s) {list(rank_stages[rank])}; "
            f"each rank must hold V = {chunks}",
            where,
        )
    return rank_stages


def _program(
    schedule: ast.Schedule,
    env: Mapping[str, int],
    params: dict[str, int],
    header: Header,
    placement: tuple[int, ...],
    streams: tuple[tuple[Instruction, ...], ...],
    source: str,
) -> Program:
    """The Program of these orders (a choose section's template has none yet, and no provenance: its orders are
    the list scheduler's, not lines of the text)."""
    return Program(
        name=schedule.name,
        ranks=env["P"],
        microbatches=env["M"],
        chunks=env["V"],
        stage_to_rank=placement,
        streams=streams,
        # a literal list that places its own send/recv keeps them (pipec tune writes its placement so)
        has_comms=any(type(op) is Action and op.kind.is_comm for stream in streams for op in stream),
        memory_bound=header.memory,
        params=params,
        description=schedule.description,
        source=source,
        forward_only=schedule.forward_only,
        expected={what: Fraction(value) for what, value in header.expected.items()},
        provenance=None if schedule.choose is not None else PipeSource(schedule),
        pipelines=header.pipelines,
        routes=header.routes,
    )


def routed_microbatches(header: Header, microbatches: int) -> tuple[tuple[int, ...], ...]:
    """Per stage, the micro-batches routed to its copy, in order: the k-th `F[c]` of a chunk is the k-th of its
    stage's list."""
    per_copy: list[list[int]] = [[] for _ in range(header.pipelines)]
    for mb, copy in enumerate(header.routes):
        per_copy[copy].append(mb)
    length = header.stages // header.pipelines
    return tuple(tuple(per_copy[stage // length]) for stage in range(header.stages))
