"""Back ends: a Program as JSON, text or torch CSV, and the loaders that read those formats back."""

from __future__ import annotations

from pipec.emit.json import dump_json, load_json
from pipec.emit.text import dump_text, load_text
from pipec.emit.torch_csv import dump_torch_csv, load_torch_csv

FORMATS = ("json", "text", "torch-csv", "torch-csv-comms")


def emit(program, fmt: str) -> str:
    if fmt == "json":
        return dump_json(program)
    if fmt == "text":
        return dump_text(program)
    if fmt == "torch-csv":
        return dump_torch_csv(program, with_comms=False)
    if fmt == "torch-csv-comms":
        return dump_torch_csv(program, with_comms=True)
    raise ValueError(fmt)


__all__ = ["FORMATS", "dump_json", "dump_text", "dump_torch_csv", "emit", "load_json", "load_text", "load_torch_csv"]
