"""Receive buffers, reused once nothing holds them (the interpreter's `recv_f`/`recv_b` take them, its compute
instructions give them back).

Receive buffers are reused, as torch.distributed.pipelining reuses its own: a received activation goes back to
a free list (`pool`) after the instruction that last needs it (B, or W after I; F when not training), a received
gradient after its B or I, provided nothing else still holds it: no autograd graph, no view or alias (a layer
that passes its input through, a gradient that is the received one), no other reference (`_recycle` checks
the tensor's and its storage's reference counts). Anything still held is left to be freed as before, and the
next receive allocates.
"""

from __future__ import annotations

import sys
from typing import Protocol

import torch

from pipec.runtime.stages import Boundary


class Pools(Protocol):
    """What the buffers live in: the interpreter's Context."""

    pool: dict  # (kind, stage) -> per tensor of the message: (shape, dtype, free buffers)
    received: dict  # (kind, stage, micro-batch) -> the buffers a receive filled, until given back
    device: torch.device


_REUSE = hasattr(torch._C, "_storage_Use_Count") and hasattr(torch.Tensor, "_use_count")  # private: checked


def _storage_refs(tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _buffers(ctx: Pools, key: tuple, boundary: Boundary) -> tuple:
    """Receive buffers for a message across `boundary`, activations (key "F", ...) or their gradients ("B", ...):
    per tensor, a free one from `pool` or a new one."""
    entry = ctx.pool.get(key)
    if entry is None:
        specs = boundary.specs if key[0] == "F" else [boundary.specs[i] for i in boundary.grads]
        entry = ctx.pool[key] = tuple((shape, dtype, []) for shape, dtype in specs)
    if len(entry) == 1:  # one tensor: the common case, without a generator
        shape, dtype, free = entry[0]
        return (free.pop() if free else torch.empty(shape, dtype=dtype, device=ctx.device),)
    device = ctx.device
    return tuple(free.pop() if free else torch.empty(shape, dtype=dtype, device=device) for shape, dtype, free in entry)


def _give_back(ctx: Pools, kind: str, s: int, m: int, later: bool = False) -> None:
    """Return the buffers micro-batch m's RECV_F or RECV_B of stage s received into (if it received: a stage on
    the same rank hands over its own tensors) to the pool, once the caller has dropped its references. With
    `later`, those still held stay listed for another try (I gives back the gradients, W what I's graph kept)."""
    parts = ctx.received.pop((kind, s, m), None)
    if parts is not None and _REUSE:
        held = _recycle(ctx.pool[kind, s], parts)
        if later and held is not None:
            ctx.received[kind, s, m] = held


def _recycle(entry: tuple, parts: tuple) -> tuple | None:
    """Put each tensor of `parts` back on its free list if `parts` alone holds it: no other Python reference (a
    layer keeping its input), no C++ one (an autograd graph saving it, a Work still posted), no other tensor on
    its storage (a view or alias: a layer passing its input through, a gradient equal to the received one). The
    counts are read where the interpreter holds nothing else, so any excess is someone else's; a tensor still
    held is left alone (freed when its holders let go) and the next receive allocates in its place. Returns
    `parts` with None for each tensor taken back, or None if all were (or were None already). The tensors are
    reached through `parts` only: a local name would count as a reference."""
    held = None
    for i in range(len(parts)):
        if parts[i] is None:
            continue
        if _held_elsewhere(parts, i):
            held = held or [None] * len(parts)
            held[i] = parts[i]
        else:
            entry[i][2].append(parts[i])
    return None if held is None else tuple(held)


def _held_elsewhere(parts: tuple, i: int) -> bool:
    # No local names the tensor: it would count as a reference.
    return _python_refs(parts, i) > _OWN_REFS or parts[i]._use_count() > 1 or _storage_refs(parts[i]) > _ALONE


def _python_refs(parts: tuple, i: int) -> int:
    return sys.getrefcount(parts[i])


def _alone() -> int:
    """What `_storage_refs` reads for a tensor that no other tensor shares storage with (the storage object
    the reading makes counts too)."""
    return _storage_refs(torch.empty(1)) if _REUSE else 0


_ALONE = _alone()
# What _python_refs reads for a tensor that its tuple alone holds: calibrated on the same code, since the
# references the interpreter itself adds differ between Python versions.
_OWN_REFS = _python_refs((torch.empty(1),), 0)
