"""Literal schedules: per-rank lists of ops as written (`rank 0: 0F0 0F1 ...`), each op's span kept for errors and
explanations, and the placement they imply, every op checked against it."""

from __future__ import annotations

from pipec.errors import PipecInputError, PipecSyntaxError, Span
from pipec.frontend import ast
from pipec.frontend.rules import check_pair_kinds, same_microbatch_pair
from pipec.ir import Instruction, Overlap, parse_instruction


def literal_placement(
    schedule: ast.Schedule,
    streams: list[list[Instruction]],
    spans: list[list[Span]],
    given: tuple[int, ...],
    chunks: int,
) -> tuple[int, ...]:
    """The placement of a literal schedule, every listed op checked against it with a caret under the op.

    Without a `placement` line each stage lives on the rank that lists most of its ops (the first such rank on a
    tie), so that one op typed on the wrong rank is the one pointed at. A stage outside 0..S-1, an op on a rank
    that does not hold its stage, or a rank listing more stages than V is a mistake in the text: exit 2, at the op.
    """
    stages = len(given)
    counts: dict[int, dict[int, int]] = {}  # stage -> rank -> ops listed
    for rank, stream in enumerate(streams):
        for index, instruction in enumerate(stream):
            for action in instruction.parts:
                if not 0 <= action.stage < stages:
                    raise PipecInputError(
                        f"rank {rank} lists {action}, an op of stage {action.stage}, but the schedule has stages "
                        f"0..{stages - 1} (S = P * V = {len(streams)} * {chunks})",
                        spans[rank][index],
                    )
                by_rank = counts.setdefault(action.stage, {})
                by_rank[rank] = by_rank.get(rank, 0) + 1
    placement = list(given)
    if schedule.placement is None:
        for stage, by_rank in counts.items():
            placement[stage] = max(by_rank, key=lambda r: (by_rank[r], -r))
    for rank, stream in enumerate(streams):
        for index, instruction in enumerate(stream):
            for action in instruction.parts:
                home = placement[action.stage]
                if home == rank:
                    continue
                if schedule.placement is not None:
                    why = f"but the placement puts stage {action.stage} on rank {home}"
                else:
                    listed = _ops_text(counts[action.stage][home])
                    why = f"which rank {home} runs (it lists {listed} of stage {action.stage})"
                raise PipecInputError(
                    f"rank {rank} lists {action}, an op of stage {action.stage}, {why}; each stage lives on one rank",
                    spans[rank][index],
                )
    if schedule.placement is None:  # a rank listing more stages than it holds: point at its least listed one
        for rank, stream in enumerate(streams):
            mine = sorted(stage for stage, home in enumerate(placement) if home == rank and stage in counts)
            if len(mine) <= chunks:
                continue
            extra = min(mine, key=lambda stage: (counts[stage][rank], -stage))
            index = next(i for i, ins in enumerate(stream) if any(a.stage == extra for a in ins.parts))
            raise PipecInputError(
                f"rank {rank} lists ops of {len(mine)} stages ({', '.join(map(str, mine))}), but each rank holds "
                f"V = {chunks}; {stream[index]} is an op of stage {extra}",
                spans[rank][index],
            )
    return tuple(placement)


def _ops_text(n: int) -> str:
    return f"{n} op" if n == 1 else f"{n} ops"


def literal_streams(schedule: ast.Schedule, ranks: int) -> tuple[list[list[Instruction]], list[list[Span]]]:
    """Each rank's literal order and the span of each action as written (what errors and explanations point at)."""
    streams: list[list[Instruction]] = [[] for _ in range(ranks)]
    spans: list[list[Span]] = [[] for _ in range(ranks)]
    for rank_list in schedule.rank_lists:
        if not 0 <= rank_list.rank < ranks:
            raise PipecInputError(f"'rank {rank_list.rank}:' is outside 0..{ranks - 1} (P = {ranks})", rank_list.span)
        for text, span in rank_list.actions:
            try:
                instruction = parse_instruction(text)
            except PipecSyntaxError as e:
                raise PipecSyntaxError(e.message, span) from None
            if type(instruction) is Overlap:
                first, second = instruction
                refused = check_pair_kinds(first.kind.value, second.kind.value)
                if refused is None and first.mb == second.mb:
                    refused = same_microbatch_pair(first, second)
                if refused is not None:
                    raise PipecSyntaxError(refused, span)
            streams[rank_list.rank].append(instruction)
            spans[rank_list.rank].append(span)
    return streams, spans
