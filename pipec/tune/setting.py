"""What `pipec tune` fits schedules to (`Setting`), in a module of its own: the phases (space, greedy, exact,
cpsat, search) all read it, and search imports the phases, so the setting cannot live in search without an
import circle inside pipec/tune."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipec.sim.costs import Costs, per_rank_share
from pipec.verify.memory import share_stage_sizes


@dataclass(frozen=True)
class Setting:
    """What tune fits schedules to: sizes, costs and the memory limit, all per rank share of the model."""

    ranks: int
    microbatches: int
    costs: Costs  # per rank share (F, I, W of one segment of P)
    limit: float  # activation units per rank (micro-batches of one rank's share)
    chunks: tuple[int, ...]

    def stage_costs(self, chunks: int, pipelines: int = 1) -> Costs:
        """The costs in the stage units of a V-chunk schedule of ``pipelines`` copies (a stage: C/V of a share)."""
        return per_rank_share(self.costs, self.ranks, chunks, pipelines)

    def stage_sizes(self, chunks: int, pipelines: int = 1) -> tuple[float, ...]:
        """The verifier's stage sizes for a V-chunk schedule of ``pipelines`` copies."""
        return share_stage_sizes(self.segment_sizes(), self.ranks, chunks, pipelines)

    def segment_sizes(self) -> Sequence[float] | None:
        """Activation units of one micro-batch per segment (None: 1 each), from the costs' `activation`."""
        activation = self.costs.activation
        if activation is None:
            return None
        return activation if isinstance(activation, tuple) else (activation,) * self.ranks


__all__ = ["Setting"]
