"""PyTorch's schedule CSV (torch.distributed.pipelining `_dump_csv` / `_load_csv`): row r = rank r's actions.

`dump_torch_csv(with_comms=False)` writes the compute actions only (torch's "compute_only" format);
with comms it adds SEND/RECV actions ("compute_comms"). Blank cells are idle steps. Loading accepts both;
a cell that is neither blank nor an action is an error naming its row and column.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping

from pipec.emit.streams import program_from_streams
from pipec.errors import PipecSyntaxError, Span
from pipec.ir import Instruction, Program, parse_instruction


def dump_torch_csv(program: Program, with_comms: bool) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    streams = program.streams if with_comms else program.compute_streams()
    for stream in streams:
        writer.writerow([str(i) for i in stream])
    return out.getvalue()


def load_torch_csv(text: str, where: str = "<csv>", expected: Mapping[str, int | None] | None = None) -> Program:
    streams: list[list[Instruction]] = []
    for row_number, row in enumerate(csv.reader(io.StringIO(text)), 1):
        stream: list[Instruction] = []
        for column, cell in enumerate(row, 1):
            if not cell.strip():
                continue  # an idle step
            try:
                stream.append(parse_instruction(cell))
            except PipecSyntaxError as e:
                span = Span(where, row_number, column, row_number, column + 1, "")
                raise PipecSyntaxError(
                    f"row {row_number} (rank {row_number - 1}), cell {column}: {e.message}", span
                ) from None
        streams.append(stream)
    if not streams:
        raise PipecSyntaxError(f"{where}: the CSV has no rows")
    return program_from_streams(streams, where, "csv", expected or {})

