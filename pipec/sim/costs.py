"""The cost model: how long each compute op and each message takes.

Durations are in arbitrary time units (seconds if you measured seconds). Defaults: F=1, B=2, W=1, so I = B - W = 1
(the Zero Bubble paper's T_F = T_B = T_W with its B being our I), and free communication (comm=0).

- ``F``, ``B``, ``I``, ``W``: compute durations. ``B`` is the full backward (I and W at once). Give ``B`` and
  ``W`` (then I = B - W) or ``I`` and ``W`` (then B = I + W); giving all three requires B = I + W.
  Each is a number (uniform) or, in a JSON file, a list with one number per stage (per (stage, op) costs).
- ``scale``: JSON only, one factor per stage multiplying all its compute (per-stage costs, e.g. a heavier last
  stage with the loss).
- ``comm``: fixed time per message; ``latency`` and ``bandwidth`` (bytes per time unit) with ``size`` (bytes of one
  activation or gradient message): a message takes comm + latency + size / bandwidth.
- ``overlap``: 0 (default) or 1. Under the p2p rule (version 2) a rank posts a batch without waiting and its
  transfers run on the communication stream while it computes. With 1 posting takes no rank time; with 0 the
  sender's rank also spends ``message_time`` per send it posts (the copy competes with compute for the device).
  Receivers wait for their data either way.
- An overlapped pair (F & B as one instruction, DualPipe) takes the sum of its halves.
- Memory (for the peak-activation figures, through ``pipec.verify.memory``): ``activation``, the activations of
  one micro-batch on a stage (a number or, in JSON, one per stage; default 1 unit everywhere) and
  ``input_fraction``, the share of them I frees (W frees the rest; default 0.5).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipec.errors import PipecInputError
from pipec.ir import Kind
from pipec.verify.memory import DEFAULT_INPUT_FRACTION

Value = float | tuple[float, ...]
_COMPUTE = ("F", "B", "I", "W")
_SCALARS = ("comm", "latency", "bandwidth", "size", "overlap", "input_fraction")
_KEYS = (*_COMPUTE, *_SCALARS, "scale", "activation")


@dataclass(frozen=True)
class Costs:
    """Durations of compute per op kind (a number, or one per stage) and the communication model."""

    F: Value = 1.0
    B: Value = 2.0
    I: Value = 1.0  # noqa: E741 - the op's name
    W: Value = 1.0
    comm: float = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    size: float = 0.0
    overlap: bool = False
    scale: tuple[float, ...] | None = None
    activation: Value | None = None  # activations of one micro-batch on a stage (memory units); None: 1
    input_fraction: float = DEFAULT_INPUT_FRACTION

    @property
    def message_time(self) -> float:
        """Time one send/recv pair takes once both ends have posted it."""
        transfer = 0.0 if self.size == 0 else self.size / self.bandwidth
        return self.comm + self.latency + transfer

    def per_stage(self, stages: int) -> dict[Kind, list[float]]:
        """Duration of each compute kind at each stage (lists indexed by stage)."""
        if self.scale is not None and len(self.scale) != stages:
            raise PipecInputError(f"cost 'scale' has {len(self.scale)} entries, the schedule has {stages} stages")
        out = {}
        for name in _COMPUTE:
            value = getattr(self, name)
            if isinstance(value, tuple):
                if len(value) != stages:
                    raise PipecInputError(f"cost {name!r} has {len(value)} entries, the schedule has {stages} stages")
                row = [float(v) for v in value]
            else:
                row = [float(value)] * stages
            if self.scale is not None:
                row = [v * f for v, f in zip(row, self.scale, strict=True)]
            out[Kind(name)] = row
        return out

    def describe(self) -> str:
        parts = [f"{k}={_text(getattr(self, k))}" for k in _COMPUTE]
        parts.append(f"comm={self.message_time:g}")
        if self.overlap:
            parts.append("overlap=1")
        if self.scale is not None:
            parts.append("scale=" + _text(self.scale))
        if self.activation is not None:
            parts.append("activation=" + _text(self.activation))
        if self.input_fraction != DEFAULT_INPUT_FRACTION:
            parts.append(f"input_fraction={self.input_fraction:g}")
        return ",".join(parts)


DEFAULT_COSTS = Costs()


def parse_costs(spec: str | Mapping | None) -> Costs:
    """Costs from ``F=1,B=2,W=1,comm=0`` text, a path to a JSON file, or a mapping of the same keys."""
    if spec is None:
        return DEFAULT_COSTS
    if isinstance(spec, Mapping):
        return _from_mapping(spec, "costs")
    text = spec.strip()
    if text.endswith(".json") or (text and "=" not in text):
        path = Path(text)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise PipecInputError(f"cannot read cost file {text}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise PipecInputError(f"{text}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
        if not isinstance(data, dict):
            raise PipecInputError(f'{text}: expected a JSON object of costs such as {{"F": 1, "B": 2}}')
        return _from_mapping(data, text)
    values: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise PipecInputError(f"--cost: expected NAME=VALUE, got {item!r}")
        if name in values:
            raise PipecInputError(f"--cost: {name} is given twice")
        values[name] = _number(name, value.strip(), "--cost")
    return _from_mapping(values, "--cost")


def _from_mapping(data: Mapping, where: str) -> Costs:
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise PipecInputError(f"{where}: unknown cost {unknown[0]!r}; expected one of {', '.join(_KEYS)}")
    fields: dict[str, object] = {}
    for name in _COMPUTE:
        if name in data:
            fields[name] = _value(name, data[name], where)
    for name in _SCALARS:
        if name in data:
            fields[name] = _number(name, data[name], where)
    if "scale" in data:
        scale = _value("scale", data["scale"], where)
        fields["scale"] = scale if isinstance(scale, tuple) else None
        if not isinstance(scale, tuple):
            raise PipecInputError(f"{where}: 'scale' must be a list with one factor per stage")
    if "activation" in data:
        fields["activation"] = _value("activation", data["activation"], where)
    if fields.get("input_fraction", 0.0) > 1:
        raise PipecInputError(f"{where}: input_fraction must be between 0 and 1")
    _derive_backward(fields, where)
    if fields.get("bandwidth", 1.0) == 0:
        raise PipecInputError(f"{where}: bandwidth must be positive")
    if "overlap" in fields:
        if fields["overlap"] not in (0.0, 1.0):
            raise PipecInputError(f"{where}: overlap must be 0 or 1")
        fields["overlap"] = bool(fields["overlap"])
    return Costs(**fields)  # type: ignore[arg-type]


def _derive_backward(fields: dict[str, object], where: str) -> None:
    """Fill the one of B, I, W that follows from the others (B = I + W); defaults F=1, B=2, W=1."""
    given = {k for k in ("B", "I", "W") if k in fields}
    if given == {"B", "I", "W"}:
        if not _all_close(_add(fields["I"], fields["W"]), fields["B"]):
            raise PipecInputError(f"{where}: B must equal I + W (B is the full backward)")
        return
    if "I" in given and "B" in given:
        fields["W"] = _sub(fields["B"], fields["I"])
    elif "I" in given:
        fields["B"] = _add(fields["I"], fields.setdefault("W", DEFAULT_COSTS.W))
    else:
        b = fields.setdefault("B", DEFAULT_COSTS.B)
        w = fields.setdefault("W", DEFAULT_COSTS.W)
        fields["I"] = _sub(b, w)
    for name in ("I", "W"):
        value = fields[name]
        if min(value if isinstance(value, tuple) else (value,)) < 0:  # type: ignore[arg-type]
            raise PipecInputError(f"{where}: {name} = B - ... comes out negative; give B >= W (B is I + W)")


def _number(name: str, value: object, where: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise PipecInputError(f"{where}: {name} must be a number, got {value!r}") from None
    if math.isnan(number) or number < 0:
        raise PipecInputError(f"{where}: {name} must be a non-negative number, got {value!r}")
    return number


def _value(name: str, value: object, where: str) -> Value:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not value:
            raise PipecInputError(f"{where}: {name} is an empty list")
        return tuple(_number(name, v, where) for v in value)
    return _number(name, value, where)


def _add(a, b) -> Value:
    return _zip(a, b, lambda x, y: x + y)


def _sub(a, b) -> Value:
    return _zip(a, b, lambda x, y: x - y)


def _zip(a, b, op) -> Value:
    if not isinstance(a, tuple) and not isinstance(b, tuple):
        return op(a, b)
    n = len(a) if isinstance(a, tuple) else len(b)
    a = a if isinstance(a, tuple) else (a,) * n
    b = b if isinstance(b, tuple) else (b,) * n
    if len(a) != len(b):
        raise PipecInputError("per-stage cost lists have different lengths")
    return tuple(op(x, y) for x, y in zip(a, b, strict=True))


def _all_close(a, b) -> bool:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-9) for x, y in zip(a, b, strict=True))


def _text(value: Value) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(f"{v:g}" for v in value) + "]"
    return f"{value:g}"
