"""What a run of the deadlock engines leaves behind: the units of each stream, where each rank stopped and why.

`ComputeRun` is a run of compute orders (`run_compute_orders`), `StreamRun` a run of streams with send/recv
(`run_streams`); the explanation (pipec.verify.deadlock.explain) and the diagnosis (pipec.verify.diagnose) read
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pipec.verify.flat import Flat

# A wait: (rank q, threshold T, op index j on q, op index i of the waiting op on its own rank). It holds once rank
# q's unit pointer is >= T. T is the unit of op j when we wait for j to be posted, that unit + 1 when we wait for
# j to complete.
Wait = tuple[int, int, int, int]


@dataclass(frozen=True)
class Units:
    """Each rank's stream cut into units: compute instructions and batches of consecutive send/recv ops."""

    starts: tuple[tuple[int, ...], ...]  # op index where each unit starts, plus a sentinel = len(stream)
    unit_of: tuple[list[int], ...]  # op index -> unit index

    def ops(self, rank: int, unit: int) -> range:
        return range(self.starts[rank][unit], self.starts[rank][unit + 1])


def cut_units(flat: Flat) -> Units:
    """The units flatten found (kept as a function: the explanation and the tests use Units)."""
    return Units(flat.starts, flat.unit_of)


@dataclass(frozen=True)
class ComputeRun:
    """A run of compute orders (`run_compute_orders`): where each rank stopped (unit index; == number of units when
    it finished), the wait that holds each stuck rank, and when each unit finished."""

    model: str
    units: Units
    stop: tuple[int, ...]
    blocked: dict[int, Wait]  # stuck rank -> the first wait of its unit that never holds
    finish: tuple[tuple[int, ...], ...]  # step at which each executed unit completed (an ASAP lockstep timing)
    waits: tuple[tuple[tuple[Wait, ...], ...], ...]

    @property
    def stuck(self) -> list[int]:
        return [r for r, u in enumerate(self.stop) if u < len(self.units.starts[r]) - 1]


class Blocked(NamedTuple):
    """Why a rank cannot finish in a run of the streams (`run_streams`).

    ``at``: the op index its host stands at (len(stream) when it reached the end of the step). ``state``:
    ``compute`` (a compute waiting for the batch holding one of its receives), ``local`` (an op waiting for one of
    its own later ops, or for a compute on another rank), ``end`` (the end of the step, waiting for every batch),
    ``sync`` (a SYNC waiting for a member rank of its group: ``peer`` not there yet (``posted``), there but with an
    earlier batch that never completes (``queued``), or issuing no matching SYNC (``none``); or, with ``batch`` set,
    for its own earlier batch, read as for ``compute``).
    ``batch``: the batch waited for (index among the rank's batches), -1 for ``local``; ``behind``: the earlier
    batch of the rank it is queued behind (nccl), or -1. ``op``: the op of the blocking batch that cannot
    complete (or, for ``local``, the op that waits). ``peer``/``peer_op``: what that op waits for (-1: nothing
    that will ever be posted). ``peer_state``: ``posted`` (the peer never posts it), ``queued`` (posted, but the
    peer's earlier batch never completes), ``run`` (a compute of the peer, ``local`` only), ``later`` (its own
    later op), ``none`` (no counterpart in any stream).
    """

    rank: int
    at: int
    state: str
    batch: int
    behind: int
    op: int
    peer: int
    peer_op: int
    peer_state: str


@dataclass(frozen=True)
class StreamRun:
    """A run of the streams (`run_streams`): each rank's host position (unit), completed batches, timing, and why
    each stuck rank is stuck."""

    model: str
    units: Units
    stop: tuple[int, ...]  # host unit per rank (== number of units at the end of the stream)
    batch_units: tuple[tuple[int, ...], ...]  # per rank, the unit of each batch
    complete: tuple[tuple[bool, ...], ...]  # per rank, per batch
    blocked: dict[int, Blocked]
    finish: tuple[tuple[int, ...], ...]  # per rank, the lockstep step at which the host got past each unit

    @property
    def stuck(self) -> list[int]:
        return sorted(self.blocked)
