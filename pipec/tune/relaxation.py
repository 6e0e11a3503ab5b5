"""A lower bound for `pipec tune`'s certificate from one rank at a time (`one_rank_bound`), on CP-SAT.

The exact model (pipec/tune/cpsat.py) restricted to one rank: its ops, its posts, their order and its memory as
the full model has them (one at a time, each stage's ops of a kind and its posts in micro-batch order, the
cumulative of its activations), and every other rank a delay of unlimited capacity. What the other ranks
still force is kept as heads and tails:

- between two ops of the rank of one micro-batch, the longest chain of the micro-batch's dependencies from one
  start to the other (`_paths`: durations, and message times where a step crosses ranks);
- another stage's k-th op of a kind starts no earlier than its first can plus k of its durations (its ops of a kind
  run in micro-batch order, one at a time on its rank), so an op of the rank after it starts no earlier than that
  plus the chain between them;
- and after an op of the rank, every later stage's op it leads to runs for each micro-batch from this one on and
  then the chain to its micro-batch's last op: the makespan is at least that.

Every schedule of the full model, restricted to the rank, is a schedule of this one, so its optimum (or the
solver's bound when cut by time) is a lower bound of the full model's makespan, and the largest over ranks is
one. Each rank's model is small (48 ops and their posts at P=4, M=8, V=2) and CP-SAT closes it in seconds where
the full model's LP bound stalls: at P=4, M=8, limit 2, V=2, comm=0.5, F=2I=2W, placement v, 57 against the full
solve's 55 in tune's budget (the posted-sends model's optimum is 64). Against tests/tune/test_tune_exact.py's
brute force (160 settings at P in {2, 3}, M in 2..4) it is never above the least makespan and equal to it in 149.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipec.ir import Program
from pipec.sim.costs import Costs
from pipec.tune.clock import Clock
from pipec.tune.instance import F_INDEX, I_INDEX, MODEL_POSTED, W_INDEX, Instance

Node = tuple[int, int]  # (stage, kind index): one micro-batch's op


def _paths(inst: Instance) -> dict[Node, dict[Node, int]]:
    """For each op of a micro-batch, the longest chain of dependencies from its start to the start of each op that
    depends on it (itself at 0): the producer's duration, and the message time where the step crosses ranks."""
    nodes = [(s, k) for s in range(inst.stages) for k in range(3)]
    consumers: dict[Node, list[Node]] = {n: [] for n in nodes}
    for s, k in nodes:
        for p, pk, _ in inst.inputs(s, k, 0):
            consumers[(p, pk)].append((s, k))
    order: list[Node] = []  # producers before consumers
    seen: set[Node] = set()

    def visit(node: Node) -> None:
        if node not in seen:
            seen.add(node)
            for consumer in consumers[node]:
                visit(consumer)
            order.append(node)

    for node in nodes:
        visit(node)
    order.reverse()
    paths = {}
    for source in nodes:
        far = {source: 0}
        for node in order:
            if node in far:
                for c in consumers[node]:
                    step = inst.dur[node[0]][node[1]] + (inst.delay if inst.where[node[0]] != inst.where[c[0]] else 0)
                    far[c] = max(far.get(c, -1), far[node] + step)
        paths[source] = far
    return paths


def shape_bound(
    template: Program,
    costs: Costs,
    limit: float | None,
    input_fraction: float,
    stage_sizes: Sequence[float] | None,
    seconds: float,
    clock: Clock,
) -> tuple[float, str]:
    """`one_rank_bound` of `template`'s P, M, V and placement (cpsat.solve's arguments), in the costs' units, and
    the model it bounds (instance.MODEL_IDEAL or MODEL_POSTED)."""
    inst = Instance(template, costs, limit, input_fraction, stage_sizes)
    return one_rank_bound(inst, seconds, clock) / inst.scale, inst.model


def one_rank_bound(inst: Instance, seconds: float, clock: Clock) -> int:
    """The largest over ranks of the one-rank model's bound (module docstring), in the model's units, each rank's
    solve given an equal part of what is left of `seconds` of the budget (a solve cut by time gives its bound so
    far)."""
    from ortools.sat.python import cp_model

    paths = _paths(inst)
    first = paths[(0, F_INDEX)]  # the earliest start of each op of micro-batch 0
    to_end = {n: max(far[u] + inst.dur[u[0]][u[1]] for u in far) for n, far in paths.items()}
    # every order's earliest timing ends by it: all ops, each send's post and message, one after the other
    horizon = sum(inst.dur[s][k] + (2 * inst.delay if inst.sends((s, k, 0)) else 0) for s, k in paths) * inst.n_mb
    best, end = 0, clock.after(seconds)
    for rank in range(inst.ranks):
        mine = [n for n in paths if inst.where[n[0]] == rank]
        if not mine:
            continue
        model = cp_model.CpModel()
        makespan = model.new_int_var(0, horizon, "makespan")
        start = _rank_ops(model, inst, paths, mine, first, to_end, makespan, horizon)
        if inst.limit is not None:
            _rank_memory(model, inst, mine, start, horizon)
        model.minimize(makespan)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        share = clock.left(end) / (inst.ranks - rank)  # what a rank leaves passes on to the next
        status, _ = clock.run_solver(solver, model, share, len(mine) * inst.n_mb)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):
            best = max(best, math.ceil(solver.best_objective_bound - 1e-6))
    return best


def _rank_ops(model, inst: Instance, paths, mine: list[Node], first, to_end, makespan, horizon: int) -> dict:
    """The rank's ops and posts, one at a time, with their heads, tails and chains (module docstring)."""
    post = inst.delay if inst.model == MODEL_POSTED else 0
    n_mb, start, busy = inst.n_mb, {}, []
    for node in mine:
        s, k = node
        for m in range(n_mb):
            head = first[node] + m * inst.dur[s][k]
            tail = to_end[node]
            for other, far in paths.items():
                if inst.where[other[0]] != inst.where[s]:
                    if node in far:  # another rank's op this one waits for, its m-th in order
                        head = max(head, first[other] + m * inst.dur[other[0]][other[1]] + far[node])
                    if other in paths[node]:  # and one it leads to, run for micro-batches m onwards
                        own = inst.dur[other[0]][other[1]]
                        tail = max(tail, paths[node][other] + (n_mb - 1 - m) * own + to_end[other])
            at = model.new_int_var(head, horizon, f"s{s},{k},{m}")
            start[(node, m)] = at
            busy.append(model.new_fixed_size_interval_var(at, inst.dur[s][k], f"i{s},{k},{m}"))
            model.add(makespan >= at + tail)
            if m:
                model.add(at >= start[(node, m - 1)] + inst.dur[s][k])
        if post and inst.sends((s, k, 0)):
            previous = None
            for m in range(n_mb):
                posted = model.new_int_var(0, horizon, f"p{s},{k},{m}")
                model.add(posted >= start[(node, m)] + inst.dur[s][k])
                busy.append(model.new_fixed_size_interval_var(posted, post, f"q{s},{k},{m}"))
                model.add(makespan >= posted + post)
                if previous is not None:
                    model.add(posted >= previous + post)
                previous = posted
    model.add_no_overlap(busy)
    for a in mine:
        for b in mine:
            if a != b and b in paths[a]:
                for m in range(n_mb):
                    model.add(start[(b, m)] >= start[(a, m)] + paths[a][b])
    return start


def _rank_memory(model, inst: Instance, mine: list[Node], start: dict, horizon: int) -> None:
    """The rank's activations within the limit, as cpsat's `_memory` counts them: micro-batch m of stage s holds
    what its I frees from F's start to I's start and the rest from F's start to W's start, each at least the chain
    of work between them (`Instance.chain`, as the full model's lifetimes)."""
    intervals, demands = [], []
    for s in sorted({node[0] for node in mine}):
        for k in (I_INDEX, W_INDEX):
            demand = -inst.change[s][k]
            if demand <= 0:
                continue
            for m in range(inst.n_mb):
                lo, hi = start[((s, F_INDEX), m)], start[((s, k), m)]
                length = model.new_int_var(inst.chain(s, k), horizon, f"h{s},{k},{m}")
                intervals.append(model.new_interval_var(lo, length, hi, f"l{s},{k},{m}"))
                demands.append(demand)
    model.add_cumulative(intervals, demands, inst.limit)


__all__ = ["one_rank_bound", "shape_bound"]
