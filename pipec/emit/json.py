"""Versioned JSON instruction streams (docs/format.md). `load_json` validates and explains what is wrong."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pipec.emit.streams import brief, parse_word, program_from_streams
from pipec.errors import PipecSyntaxError
from pipec.ir import Instruction, Program
from pipec.library import parse_json

FORMAT_NAME = "pipec.streams"
FORMAT_VERSION = 1
_REQUIRED = ("format", "version", "ranks", "microbatches", "chunks", "stages", "placement", "streams")
_OPTIONAL = ("schedule", "params", "memory_bound", "has_comms", "forward_only", "sync_groups", "pipelines", "routes")
_MAX_NAME = 200  # characters of the schedule's name and of a parameter's name
_MAX_INT = 10**18  # a parameter's magnitude, as in .pipe integer literals
_MAX_AMOUNT = 1e15  # a memory bound, in activation units


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
    if program.forward_only:  # written only when set, so that training schedules' files stay as they were
        document["forward_only"] = True
    if program.sync_groups:  # likewise: programs without SYNCs keep their files byte for byte
        document["sync_groups"] = [list(group) for group in program.sync_groups]
    if program.pipelines > 1:  # replicated copies of the model (docs/design/replicated.md); one copy: as before
        document["pipelines"] = program.pipelines
        document["routes"] = [program.route_of(mb) for mb in range(program.microbatches)]
    return json.dumps(document, indent=1) + "\n"


def load_json(text: str, where: str = "<json>", expected: Mapping[str, int | None] | None = None) -> Program:
    doc = parse_json(text, where, "a pipec stream file")
    _require(isinstance(doc, dict), where, "the document must be a JSON object")
    _require(
        doc.get("format") == FORMAT_NAME, where, f"'format' must be {FORMAT_NAME!r}, got {brief(doc.get('format'))}"
    )
    _require(
        _is_int(doc.get("version")) and doc.get("version") == FORMAT_VERSION,
        where,
        f"unsupported version {brief(doc.get('version'))}; this pipec reads version {FORMAT_VERSION}",
    )
    unknown = [key for key in doc if key not in _REQUIRED and key not in _OPTIONAL]
    _require(
        not unknown,
        where,
        f"unknown field {brief(unknown[0]) if unknown else ''}; version 1 has {', '.join(_REQUIRED + _OPTIONAL)}",
    )
    for key in _REQUIRED:
        _require(key in doc, where, f"'{key}' is missing")
    for key in ("ranks", "microbatches", "chunks", "stages"):
        _require(
            _is_int(doc[key]) and doc[key] >= 1, where, f"'{key}' must be a positive integer, got {brief(doc[key])}"
        )
    ranks, stages = doc["ranks"], doc["stages"]
    _require(
        stages == ranks * doc["chunks"],
        where,
        f"'stages' must be 'ranks' x 'chunks' = {ranks * doc['chunks']}, got {stages}",
    )
    placement = doc["placement"]
    _require(
        isinstance(placement, list) and len(placement) == stages,
        where,
        f"'placement' must be a list of {stages} ranks (one per stage), got {brief(placement)}",
    )
    for stage, rank in enumerate(placement):
        if not (_is_int(rank) and 0 <= rank < ranks):
            _require(False, where, f"placement[{stage}] must be a rank in 0..{ranks - 1}, got {brief(rank)}")
    streams_doc = doc["streams"]
    _require(
        isinstance(streams_doc, list) and len(streams_doc) == ranks,
        where,
        f"'streams' must be a list of {ranks} lists of action strings, got {brief(streams_doc)}",
    )
    streams: list[list[Instruction]] = []
    for rank, stream in enumerate(streams_doc):
        _require(
            isinstance(stream, list), where, f"streams[{rank}] must be a list of action strings, got {brief(stream)}"
        )
        parsed = []
        for index, text_action in enumerate(stream):
            try:
                if not isinstance(text_action, str):
                    raise PipecSyntaxError(f'must be a string such as "0F1", got {brief(text_action)}')
                parsed.append(parse_word(text_action))
            except PipecSyntaxError as e:
                raise PipecSyntaxError(f"{where}: streams[{rank}][{index}]: {e.message}") from None
        streams.append(parsed)
    name = doc.get("schedule", "json")
    _require(
        isinstance(name, str) and 0 < len(name) <= _MAX_NAME and name.isprintable(),
        where,
        f"'schedule' must be a name of 1 to {_MAX_NAME} printable characters, got {brief(name)}",
    )

    def error_at(rank: int, index: int, message: str) -> PipecSyntaxError:
        return PipecSyntaxError(f"{where}: streams[{rank}][{index}]: {message}")

    groups = doc.get("sync_groups", [])
    _require(
        isinstance(groups, list)
        and all(isinstance(g, list) and all(_is_int(s) for s in g) for g in groups),
        where,
        f"'sync_groups' must be a list of lists of stage numbers, got {brief(groups)}",
    )
    pipelines, routes = _copies(doc, where)
    program = program_from_streams(
        streams, where, name, expected or {}, error_at, doc["microbatches"], tuple(placement), groups, pipelines, routes
    )
    return replace(
        program,
        memory_bound=_memory_bound(doc.get("memory_bound"), ranks, where),
        params=_params(doc.get("params", program.params), doc, where),
        has_comms=_has_comms(doc.get("has_comms", program.has_comms), program, where),
        forward_only=_flag(doc, "forward_only", where),
    )


def _copies(doc: dict, where: str) -> tuple[int, list[int] | None]:
    """'pipelines' (default 1) and 'routes' (one copy per micro-batch; absent: read from the ops)."""
    pipelines = doc.get("pipelines", 1)
    _require(
        _is_int(pipelines) and 1 <= pipelines <= doc["stages"],
        where,
        f"'pipelines' must be a positive integer of at most 'stages' ({doc['stages']}), got {brief(pipelines)}",
    )
    _require(
        doc["stages"] % pipelines == 0,
        where,
        f"'stages' ({doc['stages']}) must split into 'pipelines' ({pipelines}) copies of equal length",
    )
    routes = doc.get("routes")
    if routes is None:
        return pipelines, None
    _require(
        isinstance(routes, list) and len(routes) == doc["microbatches"],
        where,
        f"'routes' must be a list of {doc['microbatches']} copies (one per micro-batch), got {brief(routes)}",
    )
    for mb, copy in enumerate(routes):
        _require(
            _is_int(copy) and 0 <= copy < pipelines,
            where,
            f"routes[{mb}] must be a copy in 0..{pipelines - 1}, got {brief(copy)}",
        )
    _require(pipelines > 1 or not any(routes), where, "'routes' names copies, but 'pipelines' is 1")
    return pipelines, routes


def _memory_bound(bound: Any, ranks: int, where: str) -> tuple[float, ...] | None:
    if bound is None:
        return None
    _require(
        isinstance(bound, list) and len(bound) == ranks,
        where,
        f"'memory_bound' must be null or a list of {ranks} numbers (one per rank), got {brief(bound)}",
    )
    for rank, value in enumerate(bound):
        _require(
            _is_number(value) and 0 <= value <= _MAX_AMOUNT,
            where,
            f"memory_bound[{rank}] must be a finite number in 0..{_MAX_AMOUNT:g}, got {brief(value)}",
        )
    return tuple(bound)


def _params(params: Any, doc: dict, where: str) -> dict[str, int]:
    _require(isinstance(params, dict), where, f"'params' must be an object of integers, got {brief(params)}")
    for key, value in params.items():
        _require(
            0 < len(key) <= _MAX_NAME and key.isprintable(),
            where,
            f"a name in 'params' must have 1 to {_MAX_NAME} printable characters, got {brief(key)}",
        )
        _require(
            _is_int(value) and abs(value) <= _MAX_INT,
            where,
            f"params[{brief(key)}] must be an integer, got {brief(value)}",
        )
    for key, field in (("P", "ranks"), ("M", "microbatches"), ("V", "chunks")):
        _require(
            params.get(key, doc[field]) == doc[field],
            where,
            f"params[{key!r}] is {params.get(key)} but '{field}' is {doc[field]}",
        )
    return dict(params)


def _has_comms(value: Any, program: Program, where: str) -> bool:
    _require(isinstance(value, bool), where, f"'has_comms' must be true or false, got {brief(value)}")
    if value == program.has_comms:
        return value
    if not value:
        rank, index, action = next(
            (r, k, i) for r, s in enumerate(program.streams) for k, i in enumerate(s) for a in i.parts if a.kind.is_comm
        )
        what = "a SYNC (placed only with the send/recv)" if action.kind.is_collective else "a send/recv"
        raise PipecSyntaxError(f"{where}: streams[{rank}][{index}]: {action} is {what}, but 'has_comms' is false")
    placement = program.stage_to_rank
    if any(placement[s] != placement[s + 1] for s in range(len(placement) - 1)):
        _require(False, where, "'has_comms' is true, but the streams have no send/recv instructions between ranks")
    return program.has_comms  # one rank, or all stages together: there is nothing to send


def _flag(doc: dict, key: str, where: str) -> bool:
    value = doc.get(key, False)
    _require(isinstance(value, bool), where, f"'{key}' must be true or false, got {brief(value)}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 2**63) or (
        isinstance(value, float) and math.isfinite(value)
    )


def _require(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise PipecSyntaxError(f"{where}: invalid pipec stream file: {message}")
