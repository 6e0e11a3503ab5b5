"""The CP-SAT exact phase of `pipec tune` (pipec/tune/cpsat.py) and its certificate, against a brute force.

The brute force is test_tune_exact.py's: every per-rank order of the ops (within the verifier's memory profile),
every combination simulated by pipec.sim in the ideal and the nccl models. It is independent of the solver: it
neither builds intervals nor reads the solver's bound. What must hold:

- the solver's bound never exceeds the least nccl makespan of any schedule (it is a lower bound for what runs),
  and at comm = 0 a proved optimum equals the brute force's ideal optimum (the model is the ideal model);
- tune's reported bound never exceeds its makespan, and when tune says `proved optimal` no schedule the brute
  force finds is faster;
- its orders are what it claims: within the limit as the verifier counts it, at the makespan it gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import run_main
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_tune_exact import brute_force

from pipec.compiler import compile_program
from pipec.ir import Kind, Program, loop_placement, v_placement
from pipec.sim.costs import parse_costs
from pipec.sim.simulate import simulate
from pipec.tune import Setting, cpsat, library_sources, tune
from pipec.tune.instance import Instance
from pipec.verify.memory import memory_profile

pytestmark = pytest.mark.skipif(cpsat.available() is not None, reason="OR-tools is not installed")


def solve(
    ranks: int,
    microbatches: int,
    cost: str | dict,
    limit: float,
    chunks: int = 1,
    placement: str = "loop",
    cutoff: float | None = None,
):
    stages = ranks * chunks
    where = loop_placement(ranks, stages) if placement == "loop" else v_placement(ranks, stages)
    template = Program("t", ranks, microbatches, chunks, where, ((),) * ranks)
    setting = Setting(ranks, microbatches, parse_costs(cost), limit, (chunks,))
    found = cpsat.solve(
        template,
        setting.stage_costs(chunks),
        limit,
        setting.costs.input_fraction,
        setting.stage_sizes(chunks),
        seconds=20,
        workers=1,
        cutoff=cutoff,
    )
    return found, setting


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ranks=st.integers(2, 3),
    microbatches=st.integers(2, 3),
    f=st.sampled_from([1, 2]),
    i=st.sampled_from([1, 2]),
    w=st.sampled_from([1, 2]),
    comm=st.sampled_from([0, 0, 0.5]),
    limit=st.sampled_from([1, 1.5, 2, 3]),
)
@example(ranks=2, microbatches=3, f=1, i=1, w=1, comm=0.5, limit=1.5)  # a post holds the sender, not the message
@example(ranks=3, microbatches=2, f=1, i=2, w=1, comm=0, limit=1)
def test_the_bound_is_below_every_schedule_and_a_proof_is_the_brute_force_optimum(
    ranks: int, microbatches: int, f: int, i: int, w: int, comm: float, limit: float
) -> None:
    if ranks == 3 and microbatches == 3 and limit >= 2:
        microbatches = 2  # keeps the brute force's product of per-rank orders small
    cost = f"F={f},I={i},W={w},comm={comm}"
    found, _ = solve(ranks, microbatches, cost, limit)
    ideal, nccl = brute_force(ranks, microbatches, cost, limit)
    if ideal is None:  # nothing fits: the solver proves it too
        assert found.infeasible and found.orders is None
        return
    assert found.optimal and found.bound is not None and found.orders is not None
    assert found.bound <= nccl + 1e-9  # a lower bound on what runs
    if comm == 0:
        assert found.bound == pytest.approx(ideal)  # the ideal model, solved exactly
    else:  # posting costs time: between the ideal model and nccl
        assert ideal - 1e-9 <= found.bound
    costs = parse_costs(cost)
    assert all(max(memory_profile(s)) <= limit + 1e-9 for s in found.orders.streams)
    if comm == 0:  # the orders take the makespan claimed in the model solved
        assert simulate(found.orders, costs, p2p="ideal").makespan == pytest.approx(found.makespan)


@pytest.mark.parametrize("cost", ["F=1,I=2,W=1", "F=1,I=1,W=1,comm=0.5"])
def test_a_cutoff_below_the_optimum_proves_a_bound_and_at_it_keeps_the_optimum(cost: str) -> None:
    # tune passes its best makespan as the cutoff: below the optimum the solve finds no order and proves that
    # none is faster than the cutoff plus a unit, a bound the brute force's optimum respects
    ideal, nccl = brute_force(2, 3, cost, 2)
    exact, _ = solve(2, 3, cost, 2)
    assert exact.optimal and exact.makespan is not None and ideal is not None
    assert ideal - 1e-9 <= exact.makespan <= nccl + 1e-9  # the model's optimum lies between the two
    below, _ = solve(2, 3, cost, 2, cutoff=exact.makespan - 0.5)
    assert below.orders is None and below.optimal and not below.infeasible
    assert exact.makespan - 0.5 < below.bound <= exact.makespan <= nccl + 1e-9
    at, _ = solve(2, 3, cost, 2, cutoff=exact.makespan)
    assert at.optimal and at.makespan == exact.makespan


def test_v_placement_and_per_stage_costs_against_the_simulator() -> None:
    # V = 2 in the V shape with a last stage twice as slow: the orders fit and take their makespan (ideal model)
    cost = {"F": [1, 1, 2], "I": [1, 1, 2], "W": [1, 1, 2]}
    found, setting = solve(3, 3, cost, 2, chunks=2, placement="v")
    assert found.optimal and found.orders is not None and found.orders.stage_to_rank == v_placement(3, 6)
    sizes = setting.stage_sizes(2)
    assert all(max(memory_profile(s, 0.5, sizes)) <= 2 + 1e-9 for s in found.orders.streams)
    span = simulate(found.orders, setting.stage_costs(2), p2p="ideal").makespan
    assert span == pytest.approx(found.makespan)
    # a lower bound that any V = 2 library order respects: v_min, verified within 2 units, is no faster
    result = tune(Setting(3, 3, parse_costs(cost), 2, (2,)), [("zbv_mem", "zbv_mem")], time_budget=10)
    assert result.certificate is not None and result.certificate.bound is not None
    assert all(c.makespan >= result.certificate.bound - 1e-9 for c in result.candidates if c.ok)


@pytest.mark.parametrize(("cost", "limit"), [("F=1,I=2,W=1", 2), ("F=1,I=1,W=1,comm=0.5", 1.5)])
def test_tune_reports_a_bound_below_its_makespan_and_a_proof_agrees_with_the_brute_force(
    cost: str, limit: float
) -> None:
    result = tune(Setting(2, 3, parse_costs(cost), limit, (1,)), library_sources(), time_budget=8)
    cert, best = result.certificate, result.best
    assert cert is not None and not cert.skipped and best is not None
    assert cert.bound is not None and cert.bound <= best.makespan + 1e-9
    assert cert.relaxed == ("comm" in cost)
    _, nccl = brute_force(2, 3, cost, limit)
    assert best.makespan >= nccl - 1e-9  # nothing beats the optimum
    if cert.optimal(best.makespan):
        assert best.makespan == pytest.approx(nccl)


def test_the_certificate_in_the_table_the_header_and_json(tmp_path: Path) -> None:
    out = tmp_path / "best.pipe"
    argv = ["tune", "-P", "2", "-M", "3", "--cost", "F=1,I=2,W=1", "--memory-limit", "2", "--chunks", "1"]
    code, text, err = run_main([*argv, "--time-budget", "8", "-o", str(out)], tmp_path)
    assert code == 0, err
    assert "proved optimal: no schedule of V=1" in text
    header = [line for line in out.read_text().splitlines() if line.startswith("#")]
    assert any(line.startswith("# proved optimal") for line in header)
    code, raw, err = run_main([*argv, "--time-budget", "8", "--format", "json"], tmp_path)
    data = json.loads(raw)
    assert code == 0 and data["optimal"] is True and data["lower_bound"] == pytest.approx(data["makespan"])
    assert data["bound"]["solver"] == "cp-sat" and data["bound"]["relaxation"] is False
    (proof,) = data["bound"]["proofs"]
    assert proof["bound"] == data["lower_bound"] and proof["solved"] is True and proof["seconds"] > 0


@pytest.mark.parametrize("overlap", [0, 1])
def test_with_messages_the_bound_says_what_model_it_is_for(tmp_path: Path, overlap: int) -> None:
    # with overlap=0 a send's post holds its host, and the bound's model posts the sends of one batch together as
    # nccl moves them (the posted model alone is beaten by a batch of several: the test below); with overlap=1
    # posting costs nothing. Either way the bound is a relaxation of nccl, and the text says which one.
    cost = f"F=1,I=1,W=1,comm=0.5,overlap={overlap}"
    argv = ["tune", "-P", "2", "-M", "3", "--cost", cost, "--memory-limit", "2", "--chunks", "1"]
    code, text, err = run_main([*argv, "--time-budget", "8"], tmp_path)
    assert code == 0, err
    assert "the bound is for a relaxation of nccl" in text
    assert ("the sends of one batch posted together" in text) is (overlap == 0)


def test_a_batch_of_several_sends_beats_the_posted_model_and_the_bound_holds(tmp_path: Path) -> None:
    # this V=2 looped order (found by a model whose messages leave at their batch's post) posts sends in batches of
    # several, checks within the limit and runs at 34.5 under nccl, below every order of the posted-sends model
    # (35, where each message leaves at its own send's post): the bound comes from the model that posts a batch's
    # sends together, and stays at or below it
    path = Path(__file__).parent / "batched_sends.pipe"
    cost = "F=1,I=1,W=1,comm=0.5"
    code, _, err = run_main(["check", str(path), "--per-rank-share", "--cost", cost, "--memory-limit", "2"], tmp_path)
    assert code == 0, err
    program = compile_program(path.read_text())
    setting = Setting(3, 6, parse_costs(cost), 2, (2,))
    costs = setting.stage_costs(2)
    run = simulate(program, costs, record=True, p2p="nccl")
    assert run.makespan == 34.5
    sends = (Kind.SEND_F, Kind.SEND_B)
    assert any(sum(op.kind in sends for op in t.instruction) > 1 for line in run.timeline for t in line if t.is_comm)
    template = Program("t", 3, 6, 2, program.stage_to_rank, ((),) * 3)
    assert template.stage_to_rank == loop_placement(3, 6)
    found = cpsat.solve(template, costs, setting.limit, costs.input_fraction, setting.stage_sizes(2), 60)
    assert found.makespan == 35  # the posted model's best order
    assert found.bound is not None and found.bound <= run.makespan and not found.optimal
    assert found.bound == 34  # the batched model's optimum: it ends, below nccl's 34.5 by a half unit


def test_without_or_tools_tune_says_what_it_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpsat, "available", lambda: "OR-tools is not installed (as the test pretends)")
    argv = ["tune", "-P", "2", "-M", "2", "--cost", "F=1,I=1,W=1", "--memory-limit", "2", "--chunks", "1"]
    code, raw, err = run_main([*argv, "--time-budget", "4", "--format", "json"], tmp_path)
    data = json.loads(raw)
    assert code == 0, err
    assert data["lower_bound"] is None and data["optimal"] is False and "not installed" in data["bound"]["skipped"]
    assert any(c["name"] == "exact" for c in data["candidates"])  # the branch and bound ran instead


def test_never_worse_than_tune_without_the_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    # tune without the solver runs first inside tune with it: its best order (local moves from a library start)
    # stays a candidate, so the solver's orders add to tune's answer and never displace it. Before, the solver's
    # order took one of the three starts of the local moves here, and the order below was never reached.
    setting = Setting(4, 8, parse_costs("F=1,I=1,W=2,comm=0.5"), 2, (1,))
    with monkeypatch.context() as patched:
        patched.setattr(cpsat, "available", lambda: "off: tune as it runs without OR-tools")
        alone = tune(setting, library_sources(), time_budget=4)
    both = tune(setting, library_sources(), time_budget=4)
    assert alone.best is not None and alone.best.moves > 0 and alone.complete
    assert both.best is not None and both.best.makespan <= alone.best.makespan + 1e-9
    assert both.certificate is not None and both.certificate.bound <= both.best.makespan + 1e-9
    streams = alone.best.program.compute_streams()
    kept = [c for c in both.candidates if c.ok and c.program.compute_streams() == streams]
    assert kept and kept[0].makespan <= alone.best.makespan + 1e-9


def test_a_late_solve_starts_from_the_solvers_own_timing() -> None:
    # the solver may post a send after a later compute (a post holds the host): its orders' earliest timing, posts
    # right after their producer, is then slower than its makespan, and a `late` solve hinted with the orders
    # alone had no solution to start from (at P=4, M=8, X=4, V=2, comm=0.5 every `late` solve found nothing)
    found, setting = solve(2, 3, "F=1,I=2,W=1,comm=0.5", 2, chunks=2, placement="v")
    assert found.orders is not None and found.timing is not None
    costs = setting.stage_costs(2)
    earliest = max(end for _, end in cpsat.model_times(found.orders, costs).values())
    assert earliest > found.makespan + 1e-9  # the premise: the orders alone do not give the solver's timing
    inst = Instance(found.orders, costs, 2, setting.costs.input_fraction, setting.stage_sizes(2))
    starts, _ = cpsat._hinted_times(inst, None, found.timing)
    span = max(at + inst.dur[s][k] for (s, k, _), at in starts.items()) / inst.scale
    assert span == pytest.approx(found.makespan)
    later = cpsat.solve(
        found.orders,
        costs,
        2,
        setting.costs.input_fraction,
        setting.stage_sizes(2),
        0.3,  # seconds: the hint is a solution at once
        found.orders.streams,
        late=found.makespan,
        hint_timing=found.timing,
    )
    assert later.orders is not None and later.makespan <= found.makespan + 1e-9


def test_a_shape_behind_first_proves_the_gap_then_looks_below_tunes_best() -> None:
    # refutation.gap_first: a shape whose own best is slower than tune's best is solved first below tune's best /
    # (1 + CERTIFY_GAP), then, when nothing is found there, below tune's best itself
    from pipec.tune.refutation import CERTIFY_GAP
    from pipec.tune.refutation import gap_first as _gap_first

    optimum, _ = solve(2, 4, "F=1,I=2,W=1", 2)
    assert optimum.optimal and optimum.makespan is not None
    best = optimum.makespan
    asked: list[float] = []
    left = [1.0]

    def solve_below(limit: float, share: float = 1.0) -> cpsat.SolverResult:
        asked.append(limit)
        return solve(2, 4, "F=1,I=2,W=1", 2, cutoff=limit)[0]

    # tune's best is the optimum: nothing below the gap, then the optimum itself, proved
    found = _gap_first(solve_below, lambda: left[0], best, best + 3, lambda: 0.0, 2)
    assert len(asked) == 2 and asked[1] == best and asked[0] < best / (1 + CERTIFY_GAP) <= asked[0] + 0.5
    assert found.optimal and found.makespan == best and found.bound == best
    # no time for the second solve: the gap is proved, the shape is not
    asked.clear()
    left[0] = 0.0
    gap_only = _gap_first(solve_below, lambda: left[0], best, best + 3, lambda: 0.0, 2)
    assert len(asked) == 1 and gap_only.orders is None and not gap_only.optimal
    assert best / (1 + CERTIFY_GAP) <= gap_only.bound <= best
    # tune's best far above the optimum: the first solve finds the optimum and is the result
    asked.clear()
    far = _gap_first(solve_below, lambda: left[0], best * 1.5, best * 2, lambda: 0.0, 2)
    assert len(asked) == 1 and far.optimal and far.makespan == best
    # the shape holds tune's best, or its bound is already within the gap: one solve below tune's best
    for own, known in ((best, 0.0), (best + 3, best / (1 + CERTIFY_GAP) + 0.1)):
        asked.clear()
        alone = _gap_first(solve_below, lambda: left[0], best, own, lambda known=known: known, 2)
        assert asked == [best] and alone.optimal and alone.makespan == best


@pytest.mark.parametrize("comm", [0, 0.5])
def test_only_with_messages_a_shape_behind_refutes_a_gap_first(comm: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # without messages the ideal model's optimum is sought at once (pipec.tune.refutation: measured faster there)
    from pipec.tune import search

    shapes: list[float] = []
    real = search.gap_first

    def counted(*args, **kwargs):
        shapes.append(args[2])  # the cutoff
        return real(*args, **kwargs)

    monkeypatch.setattr(search, "gap_first", counted)
    setting = Setting(2, 4, parse_costs(f"F=1,I=2,W=1,comm={comm}"), 2, (2,))
    result = tune(setting, library_sources(), time_budget=20)
    assert result.certificate is not None and len(result.certificate.proofs) == 2  # both placements solved
    assert (len(shapes) > 0) == (comm > 0)


# tmp_path is only the working folder of run_main: nothing is written there
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(i=st.sampled_from([1, 2]), w=st.sampled_from([1, 2]), limit=st.sampled_from([1, 1.5]))
@example(i=2, w=1, limit=1)
def test_a_shape_that_cannot_win_gets_its_own_optimum_proved_as_the_brute_force_finds_it(
    tmp_path: Path, i: int, w: int, limit: float
) -> None:
    # search._solve_shape: V=1 proved unable to beat V=2's best is then solved for its own best, whose row and
    # summary say it is optimal for V=1; the brute force over every V=1 order is the independent check
    cost = f"F=1,I={i},W={w}"
    argv = ["tune", "-P", "2", "-M", "3", "--cost", cost, "--memory-limit", str(limit), "--chunks", "1,2"]
    code, raw, err = run_main([*argv, "--time-budget", "8", "--format", "json"], tmp_path)
    assert code == 0, err
    data = json.loads(raw)
    _, v1_optimum = brute_force(2, 3, cost, limit)
    assert v1_optimum is not None and data["chunks"] == 2 and data["makespan"] < v1_optimum  # V=2 wins
    (v1,) = [c for c in data["candidates"] if c["name"] == "cpsat" and c["chunks"] == 1]
    assert v1["verdict"] == "ok" and v1["makespan"] == pytest.approx(v1_optimum) == pytest.approx(v1["bound"])
    optima = {(o["chunks"], o["placement"]): o for o in data["bound"]["shape_optima"]}
    assert optima[1, "loop"]["makespan"] == pytest.approx(v1_optimum)
    assert data["candidates"][optima[1, "loop"]["row"] - 1] == v1
    (proof,) = [p for p in data["bound"]["proofs"] if p["chunks"] == 1]
    assert proof["solved"] and proof["bound"] == pytest.approx(v1_optimum)
    code, text, err = run_main([*argv, "--time-budget", "8"], tmp_path)
    assert code == 0 and f"V=1 loop at {v1_optimum:g} (row {optima[1, 'loop']['row']})" in text
    assert "the best of another shape, proved optimal for it: " in text


def test_a_shape_at_v2_keeps_its_one_rank_bound_when_its_solve_gets_no_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # search._solve_shape: at V > 1 the one-rank bound (pipec.tune.relaxation) is computed before the solve; with
    # the solve starved its bound is the cheap one (24.5 loop, 21 v), the one-rank bound is 32 and 28
    from pipec.tune import search

    real = search.cpsat.solve

    def starved(template, costs, limit, input_fraction, sizes, seconds, *args, **kwargs):
        return real(template, costs, limit, input_fraction, sizes, 0.0, *args, **kwargs)

    monkeypatch.setattr(search.cpsat, "solve", starved)
    setting = Setting(2, 4, parse_costs("F=1,I=2,W=1,comm=0.5"), 1, (2,))
    result = tune(setting, library_sources(), time_budget=20)
    assert result.certificate is not None and result.best is not None
    bounds = {proof.placement: proof.bound for proof in result.certificate.proofs}
    assert bounds["loop"] >= 32 - 1e-9 and bounds["v"] >= 28 - 1e-9
    assert result.best.makespan >= 28 - 1e-9
