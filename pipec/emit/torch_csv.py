"""PyTorch's schedule CSV (torch.distributed.pipelining `_dump_csv` / `_load_csv`): row r = rank r's actions.

`dump_torch_csv(with_comms=False)` writes the compute actions only (torch's "compute_only" format);
with comms it writes what torch's runtime executes ("compute_comms"): SEND/RECV actions and torch's own
REDUCE_GRAD, UNSHARD and RESHARD (`torch_runtime_streams`). Blank cells are idle steps. Loading accepts both and
drops REDUCE_GRAD/UNSHARD/RESHARD cells (pipec derives them again); a cell that is neither blank nor an action is an
error naming its row and column.
"""

from __future__ import annotations

import csv
import io
import itertools
import re
from collections import Counter
from collections.abc import Mapping

from pipec.emit.streams import parse_word, program_from_streams
from pipec.errors import PipecInputError, PipecSyntaxError, Span
from pipec.ir import Action, Instruction, Kind, Overlap, Program


def dump_torch_csv(program: Program, with_comms: bool) -> str:
    if program.pipelines > 1:  # before the sync groups: the copies are why this program has them
        raise PipecInputError(
            f"a torch CSV cannot carry a schedule of {program.pipelines} pipelines (copies of the model): torch's "
            "runtime (_PipelineScheduleRuntime) holds one module per stage index and has no cross-stage all-reduce "
            "to sum the copies' gradients; write --format text or json, or run it with `pipec run`"
        )
    if program.sync_groups:
        raise PipecInputError(
            "a torch CSV cannot carry this program's sync groups (SYNC, the all-reduce of shared parameters' "
            "gradients between stages): torch's runtime keeps one copy of each stage and has no cross-stage "
            "all-reduce; write --format text or json, or run it with `pipec run`"
        )
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if with_comms:
        rows = torch_runtime_streams(program)
    else:
        rows = tuple(tuple(str(i) for i in stream) for stream in program.compute_streams())
    for row in rows:
        writer.writerow(row)
    return out.getvalue()


# Actions that only torch's runtime has: FSDP's all-gather / free of a stage's parameters, and the end-of-step
# gradient scaling (and data-parallel reduction). pipec derives them from the streams, so reading drops them.
TORCH_RUNTIME_ONLY = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_TORCH_RUNTIME_ONLY_RE = re.compile(r"\d+(?:" + "|".join(TORCH_RUNTIME_ONLY) + ")")
_GRAD_DONE_KINDS = frozenset({Kind.B, Kind.W})  # torch's `_requires_reduce_grad`: the kinds that finish a gradient
_MAX_ACTIVE_STAGES = 3  # torch's `_add_unshard_reshard` default


def torch_runtime_streams(program: Program) -> tuple[tuple[str, ...], ...]:
    """Each rank's stream as torch's `_PipelineScheduleRuntime` must run it, in torch's text form.

    pipec's instructions, send/recv included, in pipec's order, plus what torch's own lowering of a compute-only
    schedule (`_prepare_schedule_with_comms`) adds, at the same place among the compute actions:
    - `sREDUCE_GRAD` after the instruction holding stage s's M-th B or W (`_add_reduce_grad`), past the sends and
      receives that directly follow it: torch's `_add_send_recv` puts a compute's sends right after it, and a run of
      pipec's sends/receives stays whole. Torch's runtime scales the gradients by 1/M there (and reduces them over
      data parallelism); without it they stay M times too large;
    - `sUNSHARD` / `sRESHARD` before a compute instruction, the rolling window of `_add_unshard_reshard` (the next 3
      stages a rank computes are unsharded). Torch's runtime refuses to compute on an FSDP-wrapped stage that was
      not unsharded; on any other stage both are no-ops.
    """
    return tuple(_runtime_row(stream, program.microbatches) for stream in program.streams)


def _runtime_row(stream: tuple[Instruction, ...], microbatches: int) -> tuple[str, ...]:
    compute = [i for i in stream if not _is_comm(i)]
    before, final = _unshard_reshard(compute)
    row: list[str] = []
    finished: Counter[int] = Counter()
    reduce_pending: list[int] = []
    position = 0
    for instruction in stream:
        if not _is_comm(instruction):
            row.extend(f"{s}REDUCE_GRAD" for s in reduce_pending)
            reduce_pending.clear()
            row.extend(before[position])
            position += 1
        row.append(str(instruction))
        for action in instruction.parts:
            if action.kind in _GRAD_DONE_KINDS:
                finished[action.stage] += 1
                if finished[action.stage] == microbatches:
                    reduce_pending.append(action.stage)
    row.extend(f"{s}REDUCE_GRAD" for s in reduce_pending)
    row.extend(final)
    return tuple(row)


def _is_comm(instruction: Instruction) -> bool:
    return isinstance(instruction, Action) and instruction.kind.is_comm


def _unshard_reshard(compute: list[Instruction]) -> tuple[list[list[str]], list[str]]:
    """torch's `_add_unshard_reshard` on one rank's compute instructions: the actions to put before each one, and
    the ones after the last. Ported step for step, sets included, so that the stages come out in torch's order."""
    active: set[int] = set()
    before: list[list[str]] = []
    for index in range(len(compute)):
        upcoming = _next_stages(compute, index, _MAX_ACTIVE_STAGES)
        fetch = [s for s in upcoming if s not in active]
        evict = [s for s in active if s not in upcoming]
        actions = []
        for stage in evict:
            active.remove(stage)
            actions.append(f"{stage}RESHARD")
        for stage in fetch:
            active.add(stage)
            actions.append(f"{stage}UNSHARD")
        before.append(actions)
    return before, [f"{stage}RESHARD" for stage in list(active)]


def _next_stages(compute: list[Instruction], start: int, count: int) -> list[int]:
    """torch's `next_stage_indices`: the next `count` distinct stages from compute[start:] (an overlapped pair adds
    both of its stages before the count is checked)."""
    seen: set[int] = set()
    found: list[int] = []
    for instruction in itertools.islice(compute, start, None):
        if isinstance(instruction, Overlap):
            for action in instruction.parts:
                if action.stage not in seen:
                    seen.add(action.stage)
                    found.append(action.stage)
            if len(found) >= count:
                break
        elif instruction.stage not in seen:
            seen.add(instruction.stage)
            found.append(instruction.stage)
            if len(found) == count:
                break
    return found


def load_torch_csv(text: str, where: str = "<csv>", expected: Mapping[str, int | None] | None = None) -> Program:
    streams: list[list[Instruction]] = []
    cells: list[list[int]] = []  # per row, the cell number of each instruction (blank and torch-only cells skipped)
    lines: list[int] = []  # per row, the line it starts on
    reader = csv.reader(io.StringIO(text), strict=True)  # strict: a stray quote is an error, not a guess
    while True:
        line = reader.line_num + 1
        try:
            row = next(reader, None)
        except csv.Error as e:  # an over-long field, a stray quote or newline: the module says which
            span = Span(where, reader.line_num, 1, reader.line_num, 2, "")
            raise PipecSyntaxError(f"row {len(streams) + 1} (rank {len(streams)}): not CSV: {e}", span) from None
        if row is None:
            break
        row_number = len(streams) + 1
        stream: list[Instruction] = []
        numbers: list[int] = []
        for column, cell in enumerate(row, 1):
            if not cell.strip():
                continue  # an idle step
            if _TORCH_RUNTIME_ONLY_RE.fullmatch(cell.strip()):
                continue  # torch's REDUCE_GRAD/UNSHARD/RESHARD: re-derived from the streams when written again
            try:
                stream.append(parse_word(cell))
            except PipecSyntaxError as e:
                span = Span(where, line, column, line, column + 1, "")
                raise PipecSyntaxError(
                    f"row {row_number} (rank {row_number - 1}), cell {column}: {e.message}", span
                ) from None
            numbers.append(column)
        streams.append(stream)
        cells.append(numbers)
        lines.append(line)
    if not streams:
        raise PipecSyntaxError(f"{where}: the CSV has no rows")

    def error_at(rank: int, index: int, message: str) -> PipecSyntaxError:
        column = cells[rank][index]
        span = Span(where, lines[rank], column, lines[rank], column + 1, "")
        return PipecSyntaxError(f"row {rank + 1} (rank {rank}), cell {column}: {message}", span)

    return program_from_streams(streams, where, "csv", expected or {}, error_at)
