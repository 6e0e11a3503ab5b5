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
- ``FB``: the duration of an overlapped pair (``F[s] & B[t]`` as one instruction, DualPipe's hidden all-to-all),
  a number or, in JSON, one per stage (of the pair's forward half), scaled by ``scale`` like the rest. Without it
  a pair takes the sum of its halves. A pair of a forward and an I or W takes the same share of its halves' sum as
  F & B would (FB / (F + B) of F + I, or of F + W).
- ``sync``: the time of one SYNC (the all-reduce of a sync group's shared gradients, pipec.passes.sync), a number
  or, in JSON, one per stage (a SYNC takes the largest value among its members' stages); default 0. It starts when
  the last member is there (its host at the SYNC and, in order, its earlier batches complete) and ends on every
  member at once; it counts as communication, not compute.
- Memory (for the peak-activation figures, through ``pipec.verify.memory``): ``activation``, the activations of
  one micro-batch on a stage (a number or, in JSON, one per stage; default 1 unit everywhere) and
  ``input_fraction``, the share of them I frees (W frees the rest; default 0.5).
- Every number is finite and 0 or within [MIN_AMOUNT, MAX_AMOUNT] (1e-12 to 1e15): inf, nan, 1e308 or a negative
  value is refused naming its key, in ``--cost K=V`` text and in a JSON file alike (read as UTF-8, size-capped).
- ``--cost`` text names a JSON file when such a file exists or it ends in ``.json``; otherwise text with ``=`` or
  ``:`` is read as NAME=VALUE pairs (``F:1`` is refused with the right syntax, not as a missing file).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pipec.errors import PipecInputError
from pipec.ir import Kind
from pipec.verify.memory import DEFAULT_INPUT_FRACTION, share_of_stage, spread_segments

Value = float | tuple[float, ...]
_COMPUTE = ("F", "B", "I", "W")
_SCALARS = ("comm", "latency", "bandwidth", "size", "overlap", "input_fraction")
_PAIR = "FB"  # the overlapped pair's own duration
_KEYS = (*_COMPUTE, _PAIR, *_SCALARS, "scale", "activation", "sync")


@dataclass(frozen=True)
class Costs:
    """Durations of compute per op kind (a number, or one per stage) and the communication model."""

    F: Value = 1.0
    B: Value = 2.0
    I: Value = 1.0  # noqa: E741 - the op's name
    W: Value = 1.0
    FB: Value | None = None  # an overlapped F & B pair; None: the sum of its halves
    comm: float = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    size: float = 0.0
    overlap: bool = False
    scale: tuple[float, ...] | None = None
    activation: Value | None = None  # activations of one micro-batch on a stage (memory units); None: 1
    input_fraction: float = DEFAULT_INPUT_FRACTION
    sync: Value = 0.0  # one SYNC collective (a number, or one per stage)
    # the keys the user gave (parse_costs), so that a command can say which it filled with defaults; not a cost
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @property
    def defaulted_compute(self) -> tuple[str, ...]:
        """The compute costs the user left to the defaults: F when not given, and the backward split (B, I, W)
        unless two of them were given (the third follows). Empty for costs built in code (no `given`)."""
        if not self.given:
            return ()
        missing = [] if "F" in self.given else ["F"]
        if len(self.given & {"B", "I", "W"}) < 2:
            missing += [k for k in ("B", "I", "W") if k not in self.given]
        return tuple(missing)

    @property
    def message_time(self) -> float:
        """Time one send/recv pair takes once both ends have posted it."""
        transfer = 0.0 if self.size == 0 else self.size / self.bandwidth
        return self.comm + self.latency + transfer

    def per_stage(self, stages: int) -> dict[Kind, list[float]]:
        """Duration of each compute kind at each stage (lists indexed by stage)."""
        if self.scale is not None and len(self.scale) != stages:
            raise PipecInputError(length_mismatch("scale", len(self.scale), stages))
        out = {}
        for name in _COMPUTE:
            value = getattr(self, name)
            if isinstance(value, tuple):
                if len(value) != stages:
                    raise PipecInputError(length_mismatch(name, len(value), stages))
                row = [float(v) for v in value]
            else:
                row = [float(value)] * stages
            if self.scale is not None:
                row = [v * f for v, f in zip(row, self.scale, strict=True)]
            out[Kind(name)] = row
        return out

    def pair_per_stage(self, stages: int) -> list[float] | None:
        """Duration of an overlapped F & B pair by the stage of its forward half (None: the sum of its halves)."""
        if self.FB is None:
            return None
        if isinstance(self.FB, tuple):
            if len(self.FB) != stages:
                raise PipecInputError(f"cost 'FB' has {len(self.FB)} entries, the schedule has {stages} stages")
            row = [float(v) for v in self.FB]
        else:
            row = [float(self.FB)] * stages
        if self.scale is not None:
            if len(self.scale) != stages:
                raise PipecInputError(f"cost 'scale' has {len(self.scale)} entries, the schedule has {stages} stages")
            row = [v * f for v, f in zip(row, self.scale, strict=True)]
        return row

    def sync_per_stage(self, stages: int) -> list[float]:
        """The time of a SYNC named by each stage."""
        if isinstance(self.sync, tuple):
            if len(self.sync) != stages:
                raise PipecInputError(f"cost 'sync' has {len(self.sync)} entries, the schedule has {stages} stages")
            return [float(v) for v in self.sync]
        return [float(self.sync)] * stages

    def describe(self) -> str:
        parts = [f"{k}={_text(getattr(self, k))}" for k in _COMPUTE]
        if self.FB is not None:
            parts.append(f"FB={_text(self.FB)}")
        parts.append(f"comm={self.message_time:g}")
        if self.overlap:
            parts.append("overlap=1")
        if self.scale is not None:
            parts.append("scale=" + _text(self.scale))
        if self.activation is not None:
            parts.append("activation=" + _text(self.activation))
        if self.input_fraction != DEFAULT_INPUT_FRACTION:
            parts.append(f"input_fraction={self.input_fraction:g}")
        if self.sync != 0:  # written only when set: the descriptions of runs without syncs stay as they were
            parts.append("sync=" + _text(self.sync))
        return ",".join(parts)


DEFAULT_COSTS = Costs()


def length_mismatch(name: str, entries: int, stages: int) -> str:
    """The message for a per-stage list of the wrong length. Fewer entries that divide the stages are most often
    a V=1 measurement (a pipec run report, a profile) given to a V-chunk schedule: name the flag that spreads it."""
    text = f"cost {name!r} has {entries} entries, the schedule has {stages} stages"
    if 0 < entries < stages and stages % entries == 0:
        text += (
            f"; a list with one entry per rank (per rank share of the model, as a V=1 run report has) is spread "
            f"over the {stages // entries} chunks of each rank by --per-rank-share"
        )
    return text


def per_rank_share(costs: Costs, ranks: int, chunks: int, pipelines: int = 1) -> Costs:
    """``costs`` given per rank share of the model (``--per-rank-share``) -> the same costs per stage of a P-rank,
    V-chunk schedule of ``pipelines`` = C copies of the model. The one place the units that compare across V (and
    across copies) are turned into stage units, for every command.

    F, B, I, W, FB and ``activation`` describe one segment of P (the model's stages at V=1; a per-stage list has P
    entries). A copy of the model is L = P*V/C stages, so a stage covers C/V of a segment (1/V with one copy;
    DualPipe's and Chimera's V = C = 2 stage is a whole one) and takes C/V of that segment's time and activations
    (pipec.verify.memory.spread_segments). ``scale`` is a factor, so a stage takes its segment's. Messages carry
    the same boundary activations whatever V is, so comm, latency, bandwidth and size stay as given; so do
    ``input_fraction`` (a share, not an amount) and ``sync`` (one all-reduce of a stage's gradients, a time of its
    own, per stage already).
    """
    share = share_of_stage(chunks, pipelines)
    fields: dict[str, object] = {}
    for name in (*_COMPUTE, _PAIR):
        value = getattr(costs, name)
        if value is None:
            continue
        fields[name] = (
            spread_segments(value, ranks, chunks, f"cost {name!r}", pipelines=pipelines)
            if isinstance(value, tuple)
            else value * pipelines / chunks
        )
    if costs.scale is not None:
        fields["scale"] = spread_segments(
            costs.scale, ranks, chunks, "cost 'scale'", divide=False, pipelines=pipelines
        )
    activation = costs.activation
    if isinstance(activation, tuple):
        fields["activation"] = spread_segments(activation, ranks, chunks, "cost 'activation'", pipelines=pipelines)
    elif activation is not None or share != 1:  # None at a whole share a stage is already 1 unit: left as given
        fields["activation"] = (1.0 if activation is None else activation) * pipelines / chunks
    return replace(costs, **fields)  # type: ignore[arg-type]


def time_units(amount: float) -> str:
    """``amount`` with its unit, for printed text: 1 time unit, 0.5 time units."""
    return f"{amount:g} time unit" + ("" if amount == 1 else "s")


# Every number a cost model takes is finite and within [MIN_AMOUNT, MAX_AMOUNT], or 0: sums of up to 10^7 ops stay
# far from overflow, and the pictures' scales (makespan / shortest op, pixels per time unit) stay finite. A value
# outside (inf, nan, 1e308, 5e-324) is a typo or a unit mix-up, refused with its key named.
MIN_AMOUNT = 1e-12
MAX_AMOUNT = 1e15
COST_FILE_BYTES = 16 << 20  # a cost JSON file; per-stage lists of a million stages fit in a few MB
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?")  # ASCII; float() takes '٣', '1_0'


def parse_costs(spec: str | Mapping | None) -> Costs:
    """Costs from ``F=1,B=2,W=1,comm=0`` text, a path to a JSON file, or a mapping of the same keys."""
    if spec is None:
        return DEFAULT_COSTS
    if isinstance(spec, Mapping):
        return _from_mapping(spec, "costs")
    text = spec.strip()
    # A file when one exists (any name) or the name says JSON; else NAME=VALUE text, `F:1` included: a missing
    # file named `F:1,B:2` would only hide the syntax slip behind "cannot read".
    if text.endswith(".json") or os.path.isfile(text):
        return _from_mapping(_read_json(text), text)
    if text and "=" not in text and ":" not in text:
        raise PipecInputError(
            f"--cost {_shown(text)}: no such cost file; give NAME=VALUE pairs such as F=1,B=2 or the path of a "
            "JSON cost file"
        )
    values: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            key, colon, number = item.partition(":")
            hint = f"; write {key.strip()[:40]}={number.strip()[:40]}" if colon else ""
            raise PipecInputError(f"--cost: expected NAME=VALUE pairs such as F=1,B=2, got {item[:40]!r}{hint}")
        if name in values:
            raise PipecInputError(f"--cost: {name[:40]} is given twice")
        value = value.strip()
        if not _DECIMAL.fullmatch(value):
            shown = value if len(value) <= 40 else value[:37] + "..."
            raise PipecInputError(f"--cost: {name[:40]} must be a finite decimal number such as 1.5, got {shown!r}")
        values[name] = float(value)  # checked for range with the JSON file's values, by key
    return _from_mapping(values, "--cost")


def _read_json(path: str) -> dict:
    """A cost file's object: UTF-8 JSON of bounded size and depth, or a PipecInputError naming the file."""
    # a regular file, size-capped, UTF-8 checked (errors name line and column)
    from pipec.library import parse_json, read_text

    data = parse_json(read_text(path, COST_FILE_BYTES), path, "a cost file")
    if not isinstance(data, dict):
        raise PipecInputError(f'{path}: expected a JSON object of costs such as {{"F": 1, "B": 2}}')
    if data.get("format") == "pipec-run-report":  # `pipec run --report`: its measured costs (docs/runtime.md)
        if not isinstance(data.get("costs"), dict):
            raise PipecInputError(f"{path}: this pipec run report holds no measured costs (no step was measured)")
        return data["costs"]
    return data


def _from_mapping(data: Mapping, where: str) -> Costs:
    unknown = next((key for key in data if key not in _KEYS), None)  # the first one given, in the order given
    if unknown is not None:
        shown = repr(unknown) if len(repr(unknown)) <= 40 else repr(unknown)[:37] + "..."
        same = next((k for k in _KEYS if isinstance(unknown, str) and k.lower() == unknown.lower()), None)
        hint = f" (names are case-sensitive: did you mean {same}?)" if same else ""
        raise PipecInputError(f"{where}: unknown cost {shown}{hint}; expected one of {', '.join(_KEYS)}")
    fields: dict[str, object] = {}
    for name in (*_COMPUTE, _PAIR):
        if name in data:
            fields[name] = _value(name, data[name], where)
    for name in _SCALARS:
        if name in data:
            fields[name] = _number(name, data[name], where)
    if "scale" in data:
        scale = _value("scale", data["scale"], where)
        if not isinstance(scale, tuple):
            raise PipecInputError(f"{where}: 'scale' must be a list with one factor per stage")
        fields["scale"] = scale
    if "activation" in data:
        fields["activation"] = _value("activation", data["activation"], where)
    if "sync" in data:
        fields["sync"] = _value("sync", data["sync"], where)
    if fields.get("input_fraction", 0.0) > 1:  # type: ignore[operator]
        raise PipecInputError(f"{where}: input_fraction must be between 0 and 1")
    _derive_backward(fields, where)
    fields["given"] = frozenset(data)
    if fields.get("bandwidth", 1.0) == 0:
        raise PipecInputError(f"{where}: bandwidth must be positive")
    if "overlap" in fields:
        if fields["overlap"] not in (0.0, 1.0):
            raise PipecInputError(f"{where}: overlap must be 0 or 1")
        fields["overlap"] = bool(fields["overlap"])
    return Costs(**fields)  # type: ignore[arg-type]


def _derive_backward(fields: dict[str, object], where: str) -> None:
    """Fill the one of B, I, W that follows from the others (B = I + W); defaults F=1, B=2, W=1. A combination
    that cannot hold is refused with its numbers (and which of them are defaults)."""
    given = {k for k in ("B", "I", "W") if k in fields}
    if given == {"B", "I", "W"}:
        total = _add(fields["I"], fields["W"], "I", "W", where)
        if not _all_close(total, fields["B"]):
            i = _first_stage(total, fields["B"], lambda x, y: not math.isclose(x, y, abs_tol=1e-9))
            at = "" if i is None else f" at stage {i}"
            b, i_, w, sum_ = (_text(_at(x, i)) for x in (fields["B"], fields["I"], fields["W"], total))
            raise PipecInputError(
                f"{where}: B = {b} but I + W = {i_} + {w} = {sum_}{at}: B is the full backward, I and W its two "
                "halves; give two of the three"
            )
        return
    if "I" in given and "B" in given:
        fields["W"] = _sub(fields["B"], fields["I"], "B", "I", where)
        _refuse_negative(fields, "W", "B", "I", given, where)
    elif "I" in given:
        fields["B"] = _add(fields["I"], fields.setdefault("W", DEFAULT_COSTS.W), "I", "W", where)
    else:
        b = fields.setdefault("B", DEFAULT_COSTS.B)
        w = fields.setdefault("W", DEFAULT_COSTS.W)
        fields["I"] = _sub(b, w, "B", "W", where)
        _refuse_negative(fields, "I", "B", "W", given, where)


def _refuse_negative(fields: dict[str, object], derived: str, whole: str, part: str, given: set, where: str) -> None:
    """``derived`` = ``whole`` - ``part`` came out negative somewhere: say where, with the numbers."""
    if min(_as_tuple(fields[derived])) >= 0:
        return
    i = _first_stage(fields[derived], 0.0, lambda x, _: x < 0)
    at = "" if i is None else f" at stage {i}"

    def named(key: str) -> str:
        return f"{key} = {_text(_at(fields[key], i))}" + ("" if key in given else " (the default)")

    raise PipecInputError(
        f"{where}: {named(part)} is larger than {named(whole)}{at}, so {derived} = {whole} - {part} would be "
        f"{_text(_at(fields[derived], i))}; B is the full backward (I + W): give {whole} >= {part}, or give I and W "
        "instead of B"
    )


def _as_tuple(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _at(value: object, i: int | None) -> float:
    """Entry i of a per-stage list, or the number itself."""
    return value[i] if isinstance(value, tuple) and i is not None else value  # type: ignore[return-value]


def _first_stage(a: object, b: object, differs) -> int | None:
    """The first stage where ``differs`` holds when either side is a per-stage list (None: both are numbers)."""
    if not isinstance(a, tuple) and not isinstance(b, tuple):
        return None
    n = len(a) if isinstance(a, tuple) else len(b)  # type: ignore[arg-type]
    return next((i for i in range(n) if differs(_at(a, i), _at(b, i))), None)


def _number(name: str, value: object, where: str) -> float:
    """A finite amount in [MIN_AMOUNT, MAX_AMOUNT] or 0. JSON gives numbers only: a string, a boolean or a list
    in a cost file is a mistake to name, not a value to convert."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise PipecInputError(f"{where}: {name} must be a number, got {shown}")
    if isinstance(value, int) and abs(value) > MAX_AMOUNT:  # float() of a huge int would overflow
        raise PipecInputError(f"{where}: {name} = {value:.3g} is over the limit of {MAX_AMOUNT:g}")
    number = float(value)
    if not math.isfinite(number):
        raise PipecInputError(f"{where}: {name} must be a finite number, got {number}")
    if number < 0:
        raise PipecInputError(f"{where}: {name} must not be negative, got {number:g}")
    if number > MAX_AMOUNT:
        raise PipecInputError(f"{where}: {name} = {number:g} is over the limit of {MAX_AMOUNT:g}")
    if 0 < number < MIN_AMOUNT:
        raise PipecInputError(f"{where}: {name} = {number:g} is below the smallest amount, {MIN_AMOUNT:g} (0 for none)")
    return number


def _value(name: str, value: object, where: str) -> Value:
    if isinstance(value, list | tuple):
        if not value:
            raise PipecInputError(f"{where}: {name} is an empty list")
        return tuple(_number(f"{name}[{i}]", v, where) for i, v in enumerate(value))
    return _number(name, value, where)


def _add(a, b, name_a: str, name_b: str, where: str) -> Value:
    return _zip(a, b, lambda x, y: x + y, name_a, name_b, where)


def _sub(a, b, name_a: str, name_b: str, where: str) -> Value:
    return _zip(a, b, lambda x, y: x - y, name_a, name_b, where)


def _zip(a, b, op, name_a: str, name_b: str, where: str) -> Value:
    if not isinstance(a, tuple) and not isinstance(b, tuple):
        return op(a, b)
    n = len(a) if isinstance(a, tuple) else len(b)
    a = a if isinstance(a, tuple) else (a,) * n
    b = b if isinstance(b, tuple) else (b,) * n
    if len(a) != len(b):
        raise PipecInputError(
            f"{where}: per-stage lists must have the same length: {name_a} has {len(a)} entries, {name_b} {len(b)}"
        )
    return tuple(op(x, y) for x, y in zip(a, b, strict=True))


def _all_close(a, b) -> bool:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-9) for x, y in zip(a, b, strict=True))


def _text(value: Value) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(f"{v:g}" for v in value) + "]"
    return f"{value:g}"


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")
