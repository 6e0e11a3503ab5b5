"""The list scheduler (pipec/passes/list_schedule.py, docs/design/cost_aware.md steps 1 and 2): hand rules against
the bundled orders, its errors, determinism, and that what it produces is an ordinary, verified Program."""

from __future__ import annotations

import pytest

import pipec
from pipec import ir
from pipec.errors import PipecInputError
from pipec.ir import Kind, Program
from pipec.passes.list_schedule import Candidate, Rules, list_schedule, schedule_timeline
from pipec.passes.p2p import insert_p2p_ops
from pipec.sim import Costs, simulate
from pipec.verify import memory, verify

# 1F1B as a rule: prefer a backward, forwards limited by the schedule's declared bound min(P - r, M)
ONE_F_ONE_B = Rules((Kind.F, Kind.B), priority=lambda c: (c.kind is Kind.B,))
# ZB-H1 as a rule: I before F, W only when no F/I is ready and fits; forwards limited by the declared min(P, M)
ZB = Rules(
    (Kind.I, Kind.F, Kind.W),
    priority=lambda c: (c.kind is Kind.I, c.kind is Kind.F),
    admit=lambda c: c.kind is not Kind.W or c.idle,
)
COSTS = ("default", "comm", "per-stage")


def _costs(which: str, stages: int) -> Costs:
    """Default costs; uneven ones with messages that hold the sender (overlap 0); per-stage ones, overlapped."""
    if which == "default":
        return Costs()
    if which == "comm":
        return Costs(F=1.0, B=3.0, I=1.5, W=1.5, comm=0.25)
    f, b, w = (tuple(float(x[s % len(x)]) for s in range(stages)) for x in ((1, 2, 1, 3), (2, 2, 4, 2), (1, 0.5)))
    return Costs(F=f, B=b, W=w, comm=0.5, overlap=True)


def _rules(template: Program) -> Rules:
    """Backward first, then forwards of the later chunk; an F[0] keeps a unit free for its micro-batch's next
    chunk (the design's reservation; without it two chunks a rank deadlock at the declared bound)."""
    back = Kind.I if any(a.kind is Kind.I for s in template.streams for a in s) else Kind.B
    bound = template.memory_bound

    def admit(c: Candidate) -> bool:
        if c.kind is Kind.W:
            return c.idle
        return c.kind is not Kind.F or c.chunk == template.chunks - 1 or bound is None or c.after + 1 <= bound[c.rank]

    kinds = (back, Kind.F, Kind.W) if back is Kind.I else (Kind.F, Kind.B)
    return Rules(kinds, priority=lambda c: (c.kind is back, c.kind is Kind.F, c.chunk), admit=admit)


def _placed_and_verified(program: Program, costs: Costs) -> Program:
    placed = insert_p2p_ops(program, costs)
    report = verify(placed, p2p="nccl")
    assert report.ok, report
    return placed


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
def test_the_ir_and_the_verifier_share_one_liveness_rule(fraction: float) -> None:
    assert ir.activation_deltas(fraction) == memory.activation_deltas(fraction)
    assert memory.activation_deltas is ir.activation_deltas
    assert memory.DEFAULT_INPUT_FRACTION == ir.DEFAULT_INPUT_FRACTION == 0.5


@pytest.mark.parametrize(("ranks", "mbs"), [(1, 3), (2, 2), (3, 7), (4, 3), (4, 8), (8, 16)])
def test_prefer_backward_with_forwards_limited_is_1f1b_exactly(ranks: int, mbs: int) -> None:
    bundled = pipec.load("1f1b", ranks, mbs)
    timeline = schedule_timeline(bundled, ONE_F_ONE_B)
    assert timeline.program.streams == bundled.streams
    assert timeline.makespan == simulate(insert_p2p_ops(bundled)).makespan


@pytest.mark.parametrize(("ranks", "mbs"), [(2, 2), (3, 7), (4, 3), (4, 8), (8, 16)])
def test_i_first_w_when_idle_matches_zb_h1s_makespan(ranks: int, mbs: int) -> None:
    """Exact only at P = 2, M = 2: ZB-H1 holds W back on later ranks by a fixed rule, the greedy one runs W in the
    first idle moment; the makespan is the same (verified, within the declared memory)."""
    bundled = pipec.load("zb_h1", ranks, mbs)
    program = list_schedule(bundled, ZB)
    assert (program.streams == bundled.streams) == ((ranks, mbs) == (2, 2))
    ours = simulate(_placed_and_verified(program, Costs())).makespan
    assert ours <= simulate(insert_p2p_ops(bundled)).makespan


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize(
    ("name", "chunks"), [("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2)]
)
def test_every_output_verifies_and_its_timeline_is_the_ideal_one(name: str, chunks: int, costs: str) -> None:
    template = pipec.load(name, 4, 8, chunks)
    model = _costs(costs, template.num_stages)
    timeline = schedule_timeline(template, _rules(template), model)
    placed = _placed_and_verified(timeline.program, model)
    assert verify(placed, p2p="nccl").ok and max(memory.peak_activations(placed)) <= max(template.memory_bound or [])
    # the scheduler's timeline is the ideal model's, except that without overlap a sender also spends the message
    # time posting each send (the p2p replay's rule), which the ideal model does not charge
    if model.overlap or model.message_time == 0:
        assert timeline.makespan == pytest.approx(simulate(placed, model, p2p="ideal").makespan)


@pytest.mark.parametrize("costs", COSTS)
def test_the_live_profile_is_memory_profile(costs: str) -> None:
    template = pipec.load("zb_h1", 4, 8)
    sizes = (2.0, 1.0, 1.0, 0.5)
    timeline = schedule_timeline(template, ZB, _costs(costs, 4), input_fraction=0.3, stage_sizes=sizes)
    for stream, live in zip(timeline.program.streams, timeline.live, strict=True):
        assert list(live) == memory.memory_profile(stream, 0.3, sizes)
    assert verify(timeline.program, input_fraction=0.3, stage_sizes=sizes).ok


def test_a_limit_keeps_the_peak_and_the_rules_see_the_candidate() -> None:
    seen: list[Candidate] = []

    def priority(c: Candidate) -> tuple:
        seen.append(c)
        return (c.kind is Kind.B,)

    template = pipec.load("1f1b", 4, 8)
    program = list_schedule(template, Rules((Kind.F, Kind.B), priority=priority, limit=lambda r: 2))
    assert max(memory.peak_activations(program)) == 2
    assert verify(program, memory_limit=2).ok
    assert all(c.ready <= c.now and c.after == c.live + (1 if c.kind is Kind.F else -1) for c in seen)


def test_the_same_input_gives_the_same_orders() -> None:
    template = pipec.load("zbv", 4, 8)
    runs = [schedule_timeline(template, _rules(template), _costs("per-stage", 8)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_a_memory_deadlock_names_the_rank_the_time_and_the_limit() -> None:
    # two chunks a rank, room for one activation: mb 0's second forward on rank 0 can never fit
    template = pipec.load("interleaved_1f1b", 2, 4, 2)
    with pytest.raises(PipecInputError) as caught:
        list_schedule(template, Rules((Kind.F, Kind.B), priority=lambda c: (c.kind is Kind.B,), limit=lambda r: 1))
    text = str(caught.value)
    assert "cannot finish" in text and "rank 0 at t=" in text and "live 1 of limit 1" in text
    assert "F[1] mb 0 (stage 2) needs 1 more" in text


def test_a_guard_that_never_opens_is_reported() -> None:
    rules = Rules((Kind.I, Kind.F, Kind.W), admit=lambda c: c.kind is not Kind.W)
    with pytest.raises(PipecInputError, match=r"W\[0\] mb 0 \(stage \d\) refused by its guard"):
        list_schedule(pipec.load("zb_h1", 2, 2), rules)


def test_the_step_budget_stops_the_scheduler() -> None:
    with pytest.raises(PipecInputError, match=r"stopped after .* steps"):
        list_schedule(pipec.load("1f1b", 4, 64), ONE_F_ONE_B, max_steps=100)


def test_the_rules_must_take_the_kinds_the_schedule_needs() -> None:
    with pytest.raises(PipecInputError, match="this schedule needs exactly"):
        list_schedule(pipec.load("zb_h1", 2, 2), Rules((Kind.I, Kind.F)))


def test_a_forward_only_schedule() -> None:
    template = pipec.load("forward_only", 3, 5)
    program = list_schedule(template, Rules((Kind.F,)))
    assert program.streams == template.streams
    _placed_and_verified(program, Costs())


def test_stage_sizes_must_match_the_stages() -> None:
    with pytest.raises(PipecInputError, match="3 stage sizes given for 4 stages"):
        list_schedule(pipec.load("1f1b", 4, 4), ONE_F_ONE_B, stage_sizes=(1.0, 1.0, 1.0))
