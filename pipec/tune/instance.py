"""The numbers of one scheduling problem for the exact phase (`Instance`): durations, message time, memory
deltas and limit in integer units, the data dependencies, and the bounds and timings that need no solver. The
CP-SAT model (pipec/tune/cpsat.py) is built over it; an instance knows no solver.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from pipec.errors import PipecInputError
from pipec.ir import MEMORY_TOLERANCE, Action, Kind, Program, activation_deltas
from pipec.sim.costs import Costs

KINDS = (Kind.F, Kind.I, Kind.W)
F_INDEX, I_INDEX, W_INDEX = 0, 1, 2  # each kind's place in KINDS (and in per-kind rows: durations, memory)
MODEL_IDEAL = "ideal"  # messages take message_time between producer and consumer, nothing else
MODEL_POSTED = "posted sends"  # and the sender's rank spends message_time posting each send (overlap=0)


def exact_times(costs: Costs, stages: int, kinds: Sequence[Kind]) -> tuple[int, dict[Kind, list[Fraction]], Fraction]:
    """The costs as exact fractions: (the integer time units per cost unit, which make every duration of `kinds` and
    the message time an integer, each kind's per-stage durations, the message time). A model in integer time then
    rounds nothing."""
    table = costs.per_stage(stages)
    exact = {kind: [Fraction(str(x)) for x in table[kind]] for kind in kinds}
    message = Fraction(str(costs.message_time))
    scale = math.lcm(message.denominator, *(d.denominator for row in exact.values() for d in row))
    return scale, exact, message


class Instance:
    """The numbers of one problem in integer units: durations, message time, memory deltas and limit."""

    def __init__(
        self,
        template: Program,
        costs: Costs,
        limit: float | None,
        input_fraction: float,
        stage_sizes: Sequence[float] | None,
    ) -> None:
        if template.pipelines != 1:  # its chains (chain, chain_to) and counters run every micro-batch down one chain
            raise PipecInputError("the CP-SAT model orders one pipeline; it has no routes for replicated copies")
        self.template = template
        self.ranks, self.n_mb = template.ranks, template.microbatches
        self.where = template.stage_to_rank
        self.stages = template.num_stages
        self.scale, exact, message = exact_times(costs, self.stages, KINDS)
        self.dur = [[int(exact[k][s] * self.scale) for k in KINDS] for s in range(self.stages)]
        self.delay = int(message * self.scale)
        self.model = MODEL_POSTED if self.delay > 0 and not costs.overlap else MODEL_IDEAL
        sizes = [Fraction(1)] * self.stages if stage_sizes is None else [Fraction(str(x)) for x in stage_sizes]
        deltas = activation_deltas(input_fraction)
        change = [[Fraction(str(deltas[k])) * sizes[s] for k in KINDS] for s in range(self.stages)]
        self.limit: int | None = None
        bound = None if limit is None else Fraction(str(limit)) + Fraction(str(MEMORY_TOLERANCE))
        self.memory_scale = math.lcm(*(c.denominator for row in change for c in row), 1)
        if bound is not None:
            self.memory_scale = math.lcm(self.memory_scale, Fraction(str(limit)).denominator)
            self.limit = math.floor(bound * self.memory_scale)
        self.change = [[int(c * self.memory_scale) for c in row] for row in change]

    def chain(self, s: int, k: int) -> int:
        """The least time from the start of F(s, m) to the start of its I (k = I) or W (k = W): the forward
        through the later stages, the input gradients back, and the messages between ranks on the way (a post
        holds its sender, not the message: the consumer may start message_time after the producer ends)."""
        t = self.dur[s][F_INDEX]
        for t_stage in range(s + 1, self.stages):  # forwards onwards
            t += (self.delay if self.where[t_stage] != self.where[t_stage - 1] else 0) + self.dur[t_stage][F_INDEX]
        for t_stage in range(self.stages - 2, s - 1, -1):  # input gradients back to stage s (its own I excluded)
            cross = self.where[t_stage] != self.where[t_stage + 1]
            t += self.dur[t_stage + 1][I_INDEX] + (self.delay if cross else 0)
        return t + (self.dur[s][I_INDEX] if k == W_INDEX else 0)

    def chain_to(self, s: int) -> int:
        """The earliest start of F(s, m): the forwards of the stages before it and their messages."""
        t = 0
        for t_stage in range(1, s + 1):
            cross = self.where[t_stage] != self.where[t_stage - 1]
            t += self.dur[t_stage - 1][F_INDEX] + (self.delay if cross else 0)
        return t

    def rank_bound(self) -> int:
        """The largest over ranks of its first forward's earliest start plus all its work (and posts)."""
        post = self.delay if self.model == MODEL_POSTED else 0
        best = 0
        for rank in range(self.ranks):
            mine = [op for op in self.ops() if self.where[op[0]] == rank]
            if mine:
                head = min(self.chain_to(s) for s, _, _ in mine)
                work = sum(self.dur[s][k] + (post if self.sends((s, k, m)) else 0) for s, k, m in mine)
                best = max(best, head + work)
        return best

    def memory_bound(self) -> int:
        """The largest over ranks of what the memory limit alone implies (0 without a limit): each activation of
        micro-batch m lives from its forward to its free for at least the chain of work between them
        (`chain`), the rank holds at most the limit at a time, so its memory-time, M x the sum over its stages
        of size x chain, fits under limit x the time from its first forward's earliest start to the end less its
        last W (Little's law; the model's area cut, `_memory`, without solving)."""
        if self.limit is None or self.limit <= 0:
            return 0
        best = 0
        for rank in range(self.ranks):
            mine = [s for s in range(self.stages) if self.where[s] == rank]
            area = sum(
                -self.change[s][k] * self.chain(s, k) * self.n_mb
                for s in mine
                for k in (I_INDEX, W_INDEX)
                if self.change[s][k] < 0
            )
            first = min(self.chain_to(s) for s in mine)
            last = min(self.dur[s][W_INDEX] for s in mine)
            best = max(best, first + last + math.ceil(area / self.limit))
        return best

    def idle_bound(self) -> int:
        """The largest over ranks holding one stage s of its first forward's earliest start, all its work, and the
        idle time the limit forces at the two ends of its order (0 without a limit):

        - before the rank's first I it can run forwards only (a W follows its I), at most c = limit // size of
          them (nothing is freed yet), and that I starts at least `chain(s, I)` after its own forward: so from
          its first forward's earliest start it idles `chain(s, I)` less c forwards (and their posts);
        - while the last forward's micro-batch goes down the pipeline and back (`chain(s, I)` less the forward
          itself) the rank runs only the I and W of other micro-batches not yet begun and posts; after that
          forward it holds M x size less what the a I and b W run before it freed, within the limit, so at most
          (M - 1 - a) I, (M - 1 - b) W and their posts (with those of the forwards whose I has not run, and of
          the I's before, which may be posted late) fill it, the most over every such (a, b), b <= a.

        The two windows are disjoint when M > c (the last forward waits for a free, after the first I), else the
        larger counts. A solver's LP sees neither at loose memory, where the per-rank bound is all it has
        (measured at P=8, M=24, limit 8, F=1, I=1.5, W=0.7: the solver's bound stayed at 87.3, rank 0's idle
        at the start; this bound is 89.4, which tune reaches)."""
        if self.limit is None:
            return 0
        post = self.delay if self.model == MODEL_POSTED else 0
        n, best = self.n_mb, 0
        for rank in range(self.ranks):
            mine = [s for s in range(self.stages) if self.where[s] == rank]
            if len(mine) != 1 or self.change[mine[0]][F_INDEX] <= 0:
                continue  # several stages interleave their ends; a stage of no size is not held back
            s = mine[0]
            forward, backward, weight = self.dur[s]
            size, free_i, free_w = self.change[s][F_INDEX], -self.change[s][I_INDEX], -self.change[s][W_INDEX]
            post_f = post if self.sends((s, F_INDEX, 0)) else 0
            post_i = post if self.sends((s, I_INDEX, 0)) else 0
            trip, fits = self.chain(s, I_INDEX), self.limit // size
            start_idle = max(0, trip - min(n, fits) * (forward + post_f))
            filled = []
            for a in range(n):  # a I's run before the last forward; the fewest W's that leave room for it
                over = n * size - free_i * a - self.limit
                b = 0 if over <= 0 else math.ceil(over / free_w) if free_w > 0 else a + 1
                if b <= a:
                    filled.append((n - 1 - a) * backward + (n - a) * post_f + (n - 1) * post_i + (n - 1 - b) * weight)
            end_idle = max(0, trip - forward - max(filled)) if filled else 0
            idle = start_idle + end_idle if n > fits else max(start_idle, end_idle)
            work = n * (forward + post_f + backward + post_i + weight)
            best = max(best, self.chain_to(s) + work + idle)
        return best

    def bounds(self) -> tuple[int, int]:
        """(the larger of the per-rank and the memory bound, which a solver's model holds its makespan to; the cheap
        bound, that or the idle one, where a solve may stop)."""
        floor = max(self.rank_bound(), self.memory_bound())
        return floor, max(floor, self.idle_bound())

    def cheap_bound(self) -> int:
        """A lower bound without solving: the per-rank one, the memory one or the idle one, the largest."""
        return self.bounds()[1]

    def ops(self) -> list[tuple[int, int, int]]:
        return [(s, k, m) for s in range(self.stages) for k in range(3) for m in range(self.n_mb)]

    def inputs(self, s: int, k: int, m: int) -> list[tuple[int, int, int]]:
        """The ops whose output this one consumes (its data dependencies)."""
        if k == F_INDEX:
            return [(s - 1, F_INDEX, m)] if s > 0 else []
        if k == I_INDEX:
            return [(s, F_INDEX, m)] + ([(s + 1, I_INDEX, m)] if s < self.stages - 1 else [])
        return [(s, I_INDEX, m)]

    def crosses(self, producer: tuple[int, int, int], consumer: tuple[int, int, int]) -> bool:
        return self.where[producer[0]] != self.where[consumer[0]]

    def sends(self, op: tuple[int, int, int]) -> bool:
        """Whether the op's output goes to another rank (an F to the next stage, an I to the previous one)."""
        s, k, _ = op
        target = s + 1 if k == F_INDEX else s - 1 if k == I_INDEX else -1
        return 0 <= target < self.stages and self.where[target] != self.where[s]

    def earliest(self, streams: Sequence[Sequence[Action]]) -> dict[tuple[int, int, int], int] | None:
        """Each op's start when every rank runs its order as early as the model allows (posts right after their
        producer), or None when the order cannot run (a rank waits for an op placed later on another)."""
        index = {kind: i for i, kind in enumerate(KINDS)}
        orders = [[(a.stage, index[a.kind], a.mb) for a in stream if a.kind in index] for stream in streams]
        if sum(map(len, orders)) != self.stages * 3 * self.n_mb:
            return None
        post = self.delay if self.model == MODEL_POSTED else 0
        start: dict[tuple[int, int, int], int] = {}
        end: dict[tuple[int, int, int], int] = {}
        pos, free = [0] * self.ranks, [0] * self.ranks
        moved = True
        while moved:
            moved = False
            for rank, order in enumerate(orders):
                while pos[rank] < len(order):
                    op = order[pos[rank]]
                    at = free[rank]
                    for p in self.inputs(*op):
                        if p not in end:
                            break
                        at = max(at, end[p] + (self.delay if self.crosses(p, op) else 0))
                    else:
                        start[op] = at
                        end[op] = at + self.dur[op[0]][op[1]]
                        free[rank] = end[op] + (post if self.sends(op) else 0)
                        pos[rank] += 1
                        moved = True
                        continue
                    break
        return start if len(start) == len(end) == self.stages * 3 * self.n_mb else None


__all__ = ["KINDS", "MODEL_IDEAL", "MODEL_POSTED", "Instance", "exact_times"]
