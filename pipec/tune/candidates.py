"""The candidates of `pipec tune` and how each is judged (`evaluate`: send/recv placed for the costs, the full
verifier, the simulator under nccl), and the certificate beside the result (`Proof` per V and placement,
`Certificate` over them, `proves_optimal` and `gap_to`: one rule for every bound), apart from the search that
makes them (pipec.tune.search)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pipec.compiler import place_p2p
from pipec.errors import PipecError
from pipec.ir import Program
from pipec.passes.sync import copy_orders
from pipec.sim.simulate import simulate
from pipec.tune.clock import EVALUATE_SECONDS_PER_OP, Clock, simulation_seconds
from pipec.tune.setting import Setting
from pipec.verify import verify

OK, OVER, INVALID, ERROR, SKIPPED = "ok", "over-memory", "invalid", "error", "skipped"
_EPSILON = 1e-9  # a makespan gain below it is no gain


@dataclass(frozen=True)
class Candidate:
    name: str
    params: tuple[tuple[str, int], ...]
    chunks: int
    makespan: float | None
    bubble: float | None
    peak: float | None  # the largest per-rank peak, in share units
    verdict: str
    reason: str = ""
    program: Program | None = None  # with send/recv, when evaluated
    moves: int = 0  # local moves applied (phase 3)
    phase: int = 1
    bound: float | None = None  # phase 4 with the solver: its lower bound for this V and placement
    own_placement: bool = False  # its send/recv are pipec.tune.placement's, not place_p2p's: the file must list them

    @property
    def ok(self) -> bool:
        return self.verdict == OK

    def key(self) -> tuple:
        return (self.makespan, self.peak, self.name, self.params, self.chunks, self.moves)

    def label(self) -> str:
        params = " ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.name}{' ' + params if params else ''} V={self.chunks}"


@dataclass(frozen=True)
class Proof:
    """What the solver proved for one V and placement."""

    chunks: int
    placement: str  # loop or v
    bound: float | None  # a lower bound on the nccl makespan of every schedule of this V and placement
    solved: bool  # the solver ended: the bound is the optimum of its model
    seconds: float = 0.0  # the solve's time, in seconds of the budget (pipec.tune.clock; to the proof, when solved)


@dataclass(frozen=True)
class Certificate:
    """The lower bound beside tune's result: over every schedule of the V of --chunks, placed loop or v."""

    proofs: tuple[Proof, ...]
    model: str  # the solver's model (cpsat.MODEL_IDEAL or MODEL_POSTED)
    # messages cost time: the model lets sends and receives batch freely (a relaxation of nccl; with posting
    # costs the bound's model also posts the sends of one batch together, as nccl moves them)
    relaxed: bool
    skipped: str = ""  # why no solver ran (then proofs is empty)

    @property
    def bound(self) -> float | None:
        """The least of the per-(V, placement) bounds: no schedule of the space is faster (None: one is missing)."""
        if not self.proofs or any(p.bound is None for p in self.proofs):
            return None
        return min(p.bound for p in self.proofs)  # type: ignore[type-var]

    def optimal(self, makespan: float | None) -> bool:
        return proves_optimal(makespan, self.bound)

    def gap(self, makespan: float | None) -> float | None:
        """(makespan - bound) / bound: how far from optimal at most."""
        return gap_to(makespan, self.bound)


def proves_optimal(makespan: float | None, bound: float | None) -> bool:
    """Whether a lower bound certifies a makespan optimal (to the gain tune ignores)."""
    return bound is not None and makespan is not None and makespan <= bound + _EPSILON


def gap_to(makespan: float | None, bound: float | None) -> float | None:
    """(makespan - bound) / bound, how far from optimal at most; None when the bound says nothing."""
    if bound is None or makespan is None or bound <= 0 or math.isinf(bound):
        return None
    return max(0.0, (makespan - bound) / bound)


def evaluate(
    name: str,
    params: tuple[tuple[str, int], ...],
    orders: Program,
    setting: Setting,
    placed: Program | None = None,
    clock: Clock | None = None,
    **extra,
) -> Candidate:
    """Place, verify and simulate one compute order (module docstring). `placed`: the order with its send/recv
    already placed (pipec.tune.placement), to judge instead of place_p2p's; an `orders` with send/recv (a file
    tune wrote with its placement) is judged as placed too. `clock`: the budget's, charged for the work."""
    if orders.has_comms:  # the file's own placement: what wins is written with it (output.schedule_text)
        placed, orders = orders, copy_orders(orders)
        extra.setdefault("own_placement", True)
    v = orders.chunks
    base = Candidate(name, params, v, None, None, None, ERROR, **extra)
    if orders.ranks != setting.ranks or orders.microbatches != setting.microbatches:
        return replace(base, reason=f"compiled for P={orders.ranks} M={orders.microbatches}, not the run's")
    if orders.num_stages != orders.ranks * v:
        return replace(base, reason=f"{orders.num_stages} stages, not P*V = {orders.ranks * v}")
    if clock is not None:
        clock.charge(simulation_seconds(EVALUATE_SECONDS_PER_OP, orders))
    try:
        costs = setting.stage_costs(v, orders.pipelines)
        sizes = setting.stage_sizes(v, orders.pipelines)
        program = place_p2p(orders, costs) if placed is None else placed
        report = verify(program, "nccl", setting.limit, setting.costs.input_fraction, sizes)
    except PipecError as e:
        return replace(base, reason=e.message.splitlines()[0])
    peak = max(report.peak_memory, default=0.0)
    failed = [verdict for verdict in report.verdicts if not verdict.ok]
    if any(verdict.name != "memory" for verdict in failed):
        first = failed[0]
        line = (first.explanation or first.note).strip().splitlines()
        return replace(base, peak=peak, verdict=INVALID, reason=f"{first.name}: {line[0] if line else 'failed'}")
    try:
        sim = simulate(program, costs, p2p="nccl")
    except PipecError as e:
        return replace(base, peak=peak, verdict=INVALID, reason=e.message.splitlines()[0])
    verdict = OVER if failed else OK
    reason = f"peak {peak:g} > limit {setting.limit:g}" if failed else ""
    return replace(
        base,
        makespan=sim.makespan,
        bubble=sim.bubble_fraction,
        peak=peak,
        verdict=verdict,
        reason=reason,
        program=program,
    )


__all__ = [
    "ERROR",
    "INVALID",
    "OK",
    "OVER",
    "SKIPPED",
    "Candidate",
    "Certificate",
    "Proof",
    "evaluate",
    "gap_to",
    "proves_optimal",
]
