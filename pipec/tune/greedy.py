"""Phase 2 of `pipec tune`: orders found by list scheduling under the user's costs and memory limit.

The Zero Bubble paper's greedy heuristic and the squeezed V schedules of Qi et al. decide by simulated time: when
a rank is free it runs the most urgent ready op that fits in memory. pipec.passes.list_schedule runs such rules
over all ranks at once; here a few rule sets are tried for each V of `--chunks` and each placement (loop, v):

- backward (I) first, then forward, later chunks first (a micro-batch near the end of the model frees sooner);
- W, the weight gradient, by one of three policies: `fill` (only when nothing else is ready, or a forward is
  refused by the limit: it frees memory), `gap` (also when idle and the next input is at least W's length away,
  or never coming) and `eager` (before any forward: least memory);
- at V > 1 a forward of chunk c is admitted only if the rank keeps room for that micro-batch's later chunks, so
  that a micro-batch once started can always finish (without it a V fills memory with first chunks and stalls).

With the overlapped pair's own cost (`--cost FB=...`) each rule set also runs with pairs (`list-*-*-pairs`: the
chosen op overlapped with the best ready op of the other side, list_schedule's Rules.overlap).

A rule set that cannot finish (memory too small for it) is an `error` candidate, not a failure of tune.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from pipec.errors import PipecError
from pipec.ir import MEMORY_TOLERANCE, Kind, Program, loop_placement, v_placement
from pipec.passes.list_schedule import NEVER, Candidate, Rules, list_schedule

if TYPE_CHECKING:
    from pipec.tune.setting import Setting

POLICIES = ("fill", "gap", "eager")
_RANK = {Kind.I: 3, Kind.F: 2, Kind.W: 1}


def listed_orders(setting: Setting) -> Iterator[tuple[str, int, Program | str]]:
    """(name, V, compute orders or why the rules could not finish) for each V, placement and W policy."""
    ranks, microbatches = setting.ranks, setting.microbatches
    for v in setting.chunks:
        stages = ranks * v
        placements = (("loop", loop_placement(ranks, stages)),)
        if v > 1:
            placements += (("v", v_placement(ranks, stages)),)
        for placement, where in placements:
            sizes = setting.stage_sizes(v)
            template = Program(
                name="tuned",
                ranks=ranks,
                microbatches=microbatches,
                chunks=v,
                stage_to_rank=where,
                streams=((),) * ranks,
            )
            # with the overlapped pair's own cost (FB), each rule set also runs pairing a forward with a backward
            # of another micro-batch: a pair saves time and its memory is that of its two halves, so the limit
            # decides how many pairs fit (the trade the ranking then weighs)
            overlaps = (False, True) if setting.costs.FB is not None else (False,)
            for policy in POLICIES:
                for overlap in overlaps:
                    name = f"list-{placement}-{policy}" + ("-pairs" if overlap else "")
                    rules = _rules(policy, v, max(sizes), setting.limit, overlap)
                    try:
                        orders = list_schedule(
                            template, rules, setting.stage_costs(v), setting.costs.input_fraction, sizes
                        )
                    except PipecError as e:
                        yield name, v, e.message.splitlines()[0][:200]
                        continue
                    yield name, v, orders


def _rules(policy: str, chunks: int, unit: float, limit: float, overlap: bool = False) -> Rules:
    def admit(c: Candidate) -> bool:
        if c.kind is Kind.F:
            # room for this micro-batch's later chunks on this rank
            return c.after + (chunks - 1 - c.chunk) * unit <= limit + MEMORY_TOLERANCE
        if c.kind is Kind.W:
            if policy == "eager":
                return True
            if c.blocked or (c.idle and (policy == "fill" or c.gap >= c.dur)):
                return True
            return policy == "gap" and c.gap == NEVER
        return True

    def priority(c: Candidate) -> tuple:
        rank = 2.5 if policy == "eager" and c.kind is Kind.W else _RANK[c.kind]  # eager: after I, before F
        return (rank, c.chunk if c.kind is not Kind.W else 0, -c.mb)

    return Rules(
        takes=(Kind.F, Kind.I, Kind.W), priority=priority, admit=admit, limit=lambda rank: limit, overlap=overlap
    )


__all__ = ["POLICIES", "listed_orders"]
