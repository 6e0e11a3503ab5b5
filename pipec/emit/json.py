"""Versioned JSON instruction streams (docs/format.md). `load_json` validates and explains what is wrong."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pipec.emit.streams import program_from_streams
from pipec.errors import PipecSyntaxError
from pipec.ir import Instruction, Program, parse_instruction

FORMAT_NAME = "pipec.streams"
FORMAT_VERSION = 1


def dump_json(program: Program) -> str:
    document = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "schedule": program.name,
        "ranks": program.ranks,
        "microbatches": program.microbatches,
        "chunks": program.chunks,
        "stages": program.num_stages,
        "placement": list(program.stage_to_rank),
        "params": program.params,
        "memory_bound": list(program.memory_bound) if program.memory_bound is not None else None,
        "has_comms": program.has_comms,
        "streams": [[str(i) for i in stream] for stream in program.streams],
    }
    return json.dumps(document, indent=1) + "\n"


def load_json(text: str, where: str = "<json>", expected: Mapping[str, int | None] | None = None) -> Program:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise PipecSyntaxError(f"{where}:{e.lineno}:{e.colno}: not JSON: {e.msg}") from None
    _require(isinstance(doc, dict), where, "the document must be a JSON object")
    _require(doc.get("format") == FORMAT_NAME, where, f"'format' must be {FORMAT_NAME!r}, got {doc.get('format')!r}")
    _require(
        doc.get("version") == FORMAT_VERSION,
        where,
        f"unsupported version {doc.get('version')!r}; this pipec reads version {FORMAT_VERSION}",
    )
    for key in ("ranks", "microbatches", "chunks", "stages"):
        _require(_is_count(doc.get(key)), where, f"'{key}' must be a positive integer, got {doc.get(key)!r}")
    placement = doc.get("placement")
    _require(
        isinstance(placement, list)
        and len(placement) == doc["stages"]
        and all(_is_rank(r, doc["ranks"]) for r in placement),
        where,
        f"'placement' must list a rank in 0..{doc['ranks'] - 1} for each of the {doc['stages']} stages",
    )
    streams_doc = doc.get("streams")
    _require(
        isinstance(streams_doc, list)
        and len(streams_doc) == doc["ranks"]
        and all(isinstance(s, list) for s in streams_doc),
        where,
        f"'streams' must be a list of {doc['ranks']} lists of action strings",
    )
    streams: list[list[Instruction]] = []
    for rank, stream in enumerate(streams_doc):
        parsed = []
        for index, text_action in enumerate(stream):
            _require(isinstance(text_action, str), where, f"streams[{rank}][{index}] must be a string")
            try:
                parsed.append(parse_instruction(text_action))
            except PipecSyntaxError as e:
                raise PipecSyntaxError(f"{where}: streams[{rank}][{index}]: {e.message}") from None
        streams.append(parsed)
    program = program_from_streams(
        streams, where, str(doc.get("schedule", "json")), expected or {}, doc["microbatches"], tuple(placement)
    )
    bound = doc.get("memory_bound")
    _require(
        bound is None or (isinstance(bound, list) and len(bound) == doc["ranks"]),
        where,
        "'memory_bound' must be null or one number per rank",
    )
    params = doc.get("params") if isinstance(doc.get("params"), dict) else program.params
    from dataclasses import replace

    return replace(program, memory_bound=tuple(bound) if bound else None, params=params)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_rank(value: Any, ranks: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < ranks


def _require(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise PipecSyntaxError(f"{where}: invalid pipec stream file: {message}")
