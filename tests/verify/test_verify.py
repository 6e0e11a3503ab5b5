"""Verification passes on the library and on hand-made mistakes: verdicts, explanations, memory bounds, options."""

from __future__ import annotations

import functools
import re

import executor
import pytest
from paths import TESTS
from strategies import naive_lowering

import pipec
from pipec.cli import main
from pipec.compiler import parse_schedule
from pipec.ir import Action, Kind, loop_placement
from pipec.library import bundled_names
from pipec.passes.p2p import insert_p2p_ops
from pipec.sim import simulate
from pipec.verify import run_compute_orders, run_streams, verify
from pipec.verify.deadlock.explain import GRID_MAX_RANKS, MAX_CHAIN
from pipec.verify.memory import peak_activations

CORPUS = TESTS / "bad_schedules"

RANKS = (1, 2, 3, 4, 5)
MICROBATCHES = (1, 2, 3, 4, 5, 6, 8, 12)
CHUNKS = (1, 2, 3)


@functools.cache
def _load(name: str, p: int, m: int, v: int) -> pipec.Program | None:
    try:
        return pipec.load(name, p, m, v)
    except pipec.PipecInputError:
        return None


def _library(ranks=RANKS, microbatches=MICROBATCHES, chunks=CHUNKS):
    """Every bundled schedule at every (P, M, V) its own `require` lines accept."""
    for name in bundled_names():
        for p in ranks:
            for m in microbatches:
                for v in chunks:
                    program = _load(name, p, m, v)
                    if program is not None:
                        yield name, p, m, v, program


def test_library_is_accepted_under_every_model() -> None:
    """nccl, tagged and torch (torch's runtime running pipec's send/recv placement, as pipec.torch does)."""
    seen: dict[str, int] = {}
    for name, p, m, v, program in _library():
        for model in ("nccl", "tagged", "torch"):
            report = verify(program, p2p=model)
            assert report.ok, f"{name} P={p} M={m} V={v} under {model}:\n{report.render()}"
            assert report.peak_memory == peak_activations(program)  # the fused count equals memory_profile's
        seen[name] = seen.get(name, 0) + 1
    assert set(seen) == set(bundled_names())
    # dualpipe takes P even and M even >= 2P: 6 sets of this grid; chimera (P % V == 0, M % P == 0) 8
    few = {"dualpipe": 6, "chimera": 8}
    assert all(count >= few.get(name, 10) for name, count in seen.items()), seen


def test_library_runs_to_the_end_in_the_independent_executor() -> None:
    for name, p, m, v, _ in _library(ranks=(2, 3, 4), microbatches=(1, 3, 4, 8), chunks=(1, 2)):
        program = pipec.compile(name, p, m, v)
        for model in ("nccl", "tagged", "torch"):
            outcome = executor.run(program, model)
            assert outcome.completed and not outcome.mismatches, (name, p, m, v, model, outcome)


def test_placed_streams_are_accepted_and_reach_the_compute_orders_makespan() -> None:
    """insert_p2p_ops times its placement with the default costs: under them (messages free) the simulator's nccl
    run of the compiled streams (rule version 2) loses nothing to send/recv placement: it ends when the compute
    order alone does (the simulator's `ideal` model, which ignores send/recv instructions)."""
    from pipec.sim import simulate

    checked = 0
    for name, p, m, v, compute in _library(microbatches=(1, 2, 3, 4, 8, 12)):
        program = pipec.compile(name, p, m, v)
        for model in ("nccl", "tagged", "torch"):
            report = verify(program, p2p=model)
            assert report.ok, f"{name} P={p} M={m} V={v} under {model}:\n{report.render()}"
        placed, ideal = simulate(program).makespan, simulate(compute, p2p="ideal").makespan
        assert placed == pytest.approx(ideal), (name, p, m, v, placed, ideal)
        checked += 1
    assert checked > 200, checked


# The known peak-memory formulas, written independently of the .pipe files (units: one stage's activations of one
# micro-batch). Interleaved 1F1B: Megatron's warm-up, (P - r - 1) * 2 + (V - 1) * P forwards, plus the one in
# flight, at most every forward (V * M); stated for M a multiple of P as Megatron requires.
FORMULAS = {
    "1f1b": lambda p, m, v, r: min(p - r, m),
    "zb_h1": lambda p, m, v, r: min(p, m),  # the ZB paper: the same peak as 1F1B (rank 0's)
    "zbv": lambda p, m, v, r: 2 * p,  # 1F1B's peak in chunk units
    "gpipe": lambda p, m, v, r: m,
    "looped_bfs": lambda p, m, v, r: v * m,
    "interleaved_1f1b": lambda p, m, v, r: min((p - r - 1) * 2 + (v - 1) * p + 1, v * m) if m % p == 0 else None,
    "interleaved_zb": lambda p, m, v, r: min(v * p, v * m) if m % p == 0 else None,
    "dualpipev": lambda p, m, v, r: 2 * p + (1 if r == p - 1 else 0),
    # DualPipe's README: PP + 1 (a stage is 1/P of the model, our unit), on the two middle ranks; P on the others
    "dualpipe": lambda p, m, v, r: p + (1 if r in (p // 2 - 1, p // 2) else 0),
    # the choose schedules' limits (defaults): the paper's V-Half and V-Min memory, in chunk units, and 1F1B's
    "v_half": lambda p, m, v, r: 2 * ((p + 2) // 2),
    "v_min": lambda p, m, v, r: 2 * ((p + 4) // 3),
    "zbv_mem": lambda p, m, v, r: 2 * p,
    "zb_auto": lambda p, m, v, r: p,
}
# A choose schedule is ordered to keep its limit under the memory model it is compiled with (I frees half, the
# default): with I freeing less the same order holds more, so its bound is checked at that fraction only, and a
# limit is a ceiling the list scheduler may stay under rather than a peak it must reach
CHOSEN = {name for name in bundled_names() if parse_schedule(name).choose is not None}


def test_declared_memory_bounds_are_the_known_formulas_and_hold() -> None:
    checked = 0
    for name, p, m, v, program in _library():
        if program.forward_only:
            continue
        assert program.memory_bound is not None, f"{name} declares no memory bound"
        for fraction in (0.5,) if name in CHOSEN else (0.0, 0.5, 1.0):
            peaks = peak_activations(program, fraction)
            assert all(peak <= bound for peak, bound in zip(peaks, program.memory_bound, strict=True)), (
                name, p, m, v, fraction, peaks, program.memory_bound)
        formula = FORMULAS.get(name)
        expected = [formula(p, m, v, r) for r in range(p)] if formula else [None]
        if None in expected:
            continue
        assert list(program.memory_bound) == expected, (name, p, m, v)
        if name in CHOSEN:
            continue
        # tight: with I freeing nothing, the worst rank reaches its bound
        assert max(peak_activations(program, 0.0)) == max(expected) or (name == "zbv" and m < 2 * p), (name, p, m, v)
        checked += 1
    assert checked >= 100


def _zbv_naive():
    return naive_lowering(pipec.load("zbv", 2, 2, 2))


_LINK = re.compile(r"rank (\d+) at op (\d+) ([^\s,;]+)")
_TARGET = re.compile(r"whose op (\d+) ([^\s,;]+) needs rank (\d+) op (\d+) ([^\s,;]+)")


def test_deadlock_explanation_names_real_ops_and_marks_the_grid() -> None:
    program = _zbv_naive()
    report = verify(program, p2p="nccl")
    deadlock = report.verdict("deadlock")
    assert not deadlock.ok
    text = deadlock.explanation
    links = _LINK.findall(text)
    assert len(links) >= 2
    for rank, index, shown in links:
        assert str(program.streams[int(rank)][int(index)]) == shown
    for line in text.splitlines():
        if " waits for its batch" in line:  # rule version 2: a compute waits for the batch holding its receive
            rank = int(_LINK.search(line)[1])
            target = _TARGET.search(line)
            assert target, line
            assert str(program.streams[rank][int(target[1])]) == target[2]
            assert str(program.streams[int(target[3])][int(target[4])]) == target[5]
            assert "queued behind" in line  # each rank's receive sits behind its own send on its NCCL stream
    assert "cycle" in text
    grid = text[text.index("step ") :].splitlines()
    assert grid[0].split()[1:] == ["rank", "0", "rank", "1"]
    starred = [cell for row in grid[1:-1] for cell in row.split()[1:] if cell.endswith("*")]
    assert {cell[:-1] for cell in starred} >= {shown for _, _, shown in links}
    # the same streams are fine when sends are buffered
    assert verify(program, p2p="tagged").ok
    outcome = executor.run(program, "nccl")
    assert not outcome.completed
    assert executor.run(program, "tagged").completed


def _ring(ranks: int) -> pipec.Program:
    """Two stages per rank (stage s on rank s mod P), each rank running its second stage's forward first: rank r's
    F(P + r) waits for rank r - 1's F(P + r - 1), and rank 0's F(P) for rank P - 1's F(P - 1), which that rank runs
    only after its own F(2P - 1): one cycle of waits through every rank."""
    streams = tuple(
        (Action(ranks + r, Kind.F, 0), Action(r, Kind.F, 0), Action(r, Kind.B, 0), Action(ranks + r, Kind.B, 0))
        for r in range(ranks)
    )
    return pipec.Program("ring", ranks, 1, 2, loop_placement(ranks, 2 * ranks), streams)


@pytest.mark.parametrize("model", ["tagged", "nccl"])  # the compute orders as they are, and lowered to streams
@pytest.mark.parametrize("ranks", [MAX_CHAIN + 2, MAX_CHAIN + 3, 2000])
def test_a_cycle_of_waits_through_many_ranks_is_cut_short(ranks: int, model: str) -> None:
    """The chain of waits shows its first MAX_CHAIN links, counts the rest in one line, then shows the link that
    closes the cycle; the grid keeps to GRID_MAX_RANKS of the chain's ranks. A chain that would hide one link is
    shown whole."""
    deadlock = verify(_ring(ranks), p2p=model).verdict("deadlock")
    assert deadlock is not None and not deadlock.ok
    lines = deadlock.explanation.splitlines()
    head = next(n for n, line in enumerate(lines) if line.startswith("  the waits "))
    assert lines[head].split(" (stuck:")[0].endswith(f"from rank {ranks - 1}")
    end = next(n for n, line in enumerate(lines) if "on this chain already" in line)
    chain = lines[head + 1 : end]
    assert lines[end].startswith(f"    and rank {ranks - 1} is on this chain already: the waits form a cycle")

    def rank_of(line: str) -> int:
        found = re.match(r"    (?:then )?rank (\d+) ", line)
        assert found, line
        return int(found[1])

    hidden = ranks - MAX_CHAIN - 1
    if hidden <= 1:
        assert [rank_of(line) for line in chain] == list(range(ranks - 1, -1, -1))
    else:
        assert len(chain) == MAX_CHAIN + 2
        assert [rank_of(line) for line in chain[:MAX_CHAIN]] == list(range(ranks - 1, ranks - 1 - MAX_CHAIN, -1))
        assert chain[MAX_CHAIN] == f"    ... {hidden} more ranks, each waiting for the next ..."
        assert rank_of(chain[-1]) == 0  # the closing link: rank 0 waits for the rank the chain started at
        assert f"rank {ranks - 1} op" in chain[-1]
    grid = lines[lines.index("", end) + 1 :]
    columns = [int(rank) for rank in re.findall(r"rank (\d+)", grid[0])]
    assert columns == sorted([*range(ranks - GRID_MAX_RANKS + 1, ranks), 0])
    assert len(lines) < 40 and max(map(len, grid)) < 150


def test_each_engine_runs_its_kind_of_program() -> None:
    """run_compute_orders runs compute orders only: given streams with send/recv it says which engine runs them
    (it used to hand them on silently, returning the other engine's kind of run)."""
    orders = _ring(4)
    assert run_compute_orders(orders, "tagged").stuck == [0, 1, 2, 3]
    lowered = insert_p2p_ops(orders)
    with pytest.raises(ValueError, match="run_streams"):
        run_compute_orders(lowered, "nccl")
    assert run_streams(lowered, "nccl").stuck == [0, 1, 2, 3]


def test_order_mismatch_names_the_channel_and_both_ops() -> None:
    # 1F1B (P=2, M=2) whose rank 0 posts micro-batch 1's activation before micro-batch 0's, in one batch
    rows = [
        "0F0,0F1,0SEND_F1,0SEND_F0,0RECV_B0,0B0,0RECV_B1,0B1",
        "1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1",
    ]
    program = pipec.compile(str(CORPUS / "sends_swapped.csv"))
    assert [",".join(map(str, s)) for s in program.streams] == rows
    order = verify(program, p2p="nccl").verdict("p2p order")
    assert not order.ok
    send = program.streams[0].index(Action(0, Kind.SEND_F, 1))
    recv = program.streams[1].index(Action(1, Kind.RECV_F, 0))
    assert (
        f"channel rank 0 -> rank 1: message 1 is sent as rank 0 op {send} 0SEND_F1 but received as rank 1 op {recv} "
        "1RECV_F0, which expects 0SEND_F0" in order.explanation
    )
    assert verify(program, p2p="tagged").ok  # tagged matching does not care about order
    assert executor.run(program, "nccl").mismatches


def test_memory_violation_names_rank_step_and_alive_microbatches() -> None:
    program = pipec.compile("1f1b", 4, 8)
    report = verify(program, memory_limit=3)
    memory = report.verdict("memory")
    assert not memory.ok
    stream = program.streams[0]
    peak_at = stream.index(Action(0, Kind.F, 3))  # rank 0 holds F0..F3 before its first backward
    assert f"rank 0 holds 4 units of activations at op {peak_at} 0F3, over --memory-limit of 3" in memory.explanation
    assert f"first exceeded at op {peak_at} 0F3" in memory.explanation
    assert "alive at the peak: stage 0 mb 0, 1, 2, 3" in memory.explanation
    assert "rank 1" not in memory.explanation  # rank 1 peaks at 3
    assert verify(program, memory_limit=4).ok


def test_memory_model_options_change_the_peaks() -> None:
    program = pipec.load("zb_h1", 4, 8)
    # I frees everything: ZB-H1 keeps 1F1B's per-rank profile, min(P - r, M)
    assert peak_activations(program, 1.0) == (4.0, 3.0, 2.0, 1.0)
    # I frees nothing: every rank holds P micro-batches at its peak (W is deferred r times on rank r)
    assert peak_activations(program, 0.0) == (4.0, 4.0, 4.0, 4.0)
    report = verify(program, input_fraction=1.0, stage_sizes=(2, 1, 1, 1))
    assert report.peak_memory == (8.0, 3.0, 2.0, 1.0)
    assert not report.verdict("memory").ok  # rank 0's stage is twice the declared unit
    with pytest.raises(pipec.PipecInputError, match="3 stage sizes given for 4 stages"):
        verify(program, stage_sizes=(1, 1, 1))
    with pytest.raises(pipec.PipecInputError, match="between 0 and 1"):
        verify(program, input_fraction=1.5)
    with pytest.raises(pipec.PipecInputError, match="unknown p2p model"):
        verify(program, p2p="gloo")


def test_program_check_defaults_to_nccl_and_raises_schedule_error() -> None:
    program = _zbv_naive()
    with pytest.raises(pipec.ScheduleError, match="deadlock under the nccl model"):
        program.check()
    assert program.check(p2p="tagged").ok
    assert pipec.compile("interleaved_1f1b", 4, 8, 2).check().ok


def test_compute_only_program_is_checked_as_lowered_under_nccl() -> None:
    program = pipec.load("interleaved_1f1b", 2, 4, 2)
    report = verify(program)
    assert report.ok and report.program.has_comms
    assert report.program.streams == pipec.compile("interleaved_1f1b", 2, 4, 2).streams
    assert not verify(program, p2p="tagged").program.has_comms


def test_cli_check_exit_codes_and_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "1f1b", "-P", "4", "-M", "8"]) == 0
    out = capsys.readouterr().out
    assert "deadlock   ok  (nccl model)" in out and "p2p order  ok" in out
    assert re.search(r"^\s+0\s+\d+\s+4\s+4$", out, re.M), out  # rank 0: ops, peak 4, bound 4
    assert main(["check", "1f1b", "-P", "4", "-M", "8", "--memory-limit", "2"]) == 1
    assert main(["check", "1f1b", "-P", "4", "-M", "8", "--input-fraction", "2"]) == 2
    assert main(["check", "zb_h1", "-P", "4", "-M", "8", "--input-fraction", "1", "--stage-sizes", "1,1,1,1"]) == 0
    assert main(["check", "no_such_schedule", "-P", "2"]) == 2
    assert main(["compile", "1f1b", "-P", "4", "-M", "8", "--memory-limit", "2"]) == 1
    assert "memory     FAILED" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "p", "m", "v"), [("forward_only", 2, 3, 2), ("1f1b", 3, 4, 1), ("zbv", 2, 4, 2)])
def test_a_missing_message_pair_is_a_structure_error(name: str, p: int, m: int, v: int) -> None:
    program = pipec.compile(name, p, m, v)
    send = next(a for a in program.streams[0] if a.kind is Kind.SEND_F)
    recv = Action(send.stage + 1, Kind.RECV_F, send.mb)
    streams = tuple(tuple(i for i in s if i not in (send, recv)) for s in program.streams)
    broken = program.with_streams(streams, has_comms=True)
    for model in ("nccl", "tagged"):
        structure = verify(broken, p2p=model).verdict("structure")
        assert not structure.ok
        assert f"{send.stage + 1}F{send.mb} needs the activation of {send.stage}F{send.mb}" in structure.explanation


def test_a_rank_can_be_stuck_at_the_end_of_the_step_waiting_for_its_sends(tmp_path) -> None:
    """Rule version 2: rank 2 runs its whole stream (its last send is posted without waiting) but its send never
    completes under nccl, because rank 1 never posts the receive (rank 1's backward comes before that receive).
    Under tagged the send is buffered, so rank 2 finishes there. Checked against the independent executor."""
    rows = [
        "0F0,0SEND_F0,0RECV_B0,0B0",
        "1RECV_F0,1F0,1SEND_F0,1B0,1RECV_B0,1SEND_B0",
        "2RECV_F0,2F0,2B0,2SEND_B0",
    ]
    path = tmp_path / "stuck_at_end.csv"
    path.write_text("\n".join(rows) + "\n")
    program = pipec.compile(str(path))
    report = verify(program, p2p="nccl")
    assert report.verdict("structure").ok and not report.verdict("deadlock").ok
    text = report.verdict("deadlock").explanation
    assert "rank 2 at the end of the step waits for its batch of op 3 (2SEND_B0), whose op 3 2SEND_B0 needs rank 1 " \
           "op 4 1RECV_B0 to be posted" in text, text
    assert "rank 1 at op 3 1B0 waits for its own op 4 1RECV_B0, which comes later in its stream" in text, text
    assert "end*" in text
    outcome = executor.run(program, "nccl")
    assert not outcome.completed and outcome.positions == (3, 3, 4)  # rank 2 got to the end of its stream
    tagged = verify(program, p2p="tagged").verdict("deadlock")
    assert not tagged.ok and "rank 2" not in tagged.explanation.splitlines()[0]  # only ranks 0 and 1 are stuck
    assert not executor.run(program, "tagged").completed


TORCH_DEADLOCK = CORPUS / "torch_send_behind_recv.csv"  # valid under nccl, a deadlock in torch's runtime


def test_a_stream_valid_under_nccl_deadlocks_under_torchs_rule(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 posts 0RECV_B0 then 0SEND_F0: one batch under pipec's rule (both run at once), two posts in torch's
    runtime, where the send waits behind the receive on rank 0's NCCL stream and the receive waits for rank 1's
    backward, which needs that send. Verifier, simulator, executor and CLI agree; the comms CSV export is refused
    whatever --p2p says (the file is for torch's runtime)."""
    program = pipec.compile(str(TORCH_DEADLOCK))
    assert verify(program, p2p="nccl").ok and verify(program, p2p="tagged").ok
    report = verify(program, p2p="torch")
    assert report.verdict("structure").ok and report.verdict("p2p order").ok and not report.ok
    chain = report.verdict("deadlock").explanation
    assert "queued behind an earlier batch of rank 0" in chain and "the waits form a cycle" in chain, chain
    assert executor.run(program, "nccl").completed
    outcome = executor.run(program, "torch")
    assert not outcome.completed and outcome.positions == (3, 1)  # at 0B0 and at 1F0, as the grid marks
    assert simulate(program).makespan > 0
    with pytest.raises(pipec.ScheduleError, match="deadlock under the torch p2p model"):
        simulate(program, p2p="torch")
    with pytest.raises(pipec.ScheduleError, match=r"deadlock: deadlock under the torch model: 2 ranks"):
        program.check(p2p="torch")

    assert main(["check", str(TORCH_DEADLOCK)]) == 0
    assert main(["check", str(TORCH_DEADLOCK), "--p2p", "torch"]) == 1
    assert chain.splitlines()[1] in capsys.readouterr().out
    out = tmp_path / "schedule.csv"
    for p2p in ("nccl", "tagged"):
        assert main(["compile", str(TORCH_DEADLOCK), "--p2p", p2p, "--format", "torch-csv-comms", "-o", str(out)]) == 1
        assert "deadlock   FAILED  (torch model)" in capsys.readouterr().err and not out.exists()
    assert main(["compile", str(TORCH_DEADLOCK), "--format", "torch-csv"]) == 0  # torch lowers that one itself
    assert main(["compile", str(TORCH_DEADLOCK), "--format", "text"]) == 0
    capsys.readouterr()
    assert main(["compile", "zbv", "-P", "2", "-M", "4", "-V", "2", "--format", "torch-csv-comms", "-o", str(out)]) == 0
    assert "REDUCE_GRAD" in out.read_text()


def test_torchs_rule_drops_the_batch_waits_and_keeps_the_fifo(capsys: pytest.CaptureFixture[str]) -> None:
    """Under torch's rule a compute waits for its own receive (and what the rank posted before it), not for the
    receives batched after it: zb_h1 at F=2,I=2,W=1 loses 4 units to such batch waits under nccl (53 against 49,
    docs/simulator.md) and none under torch. Under the default costs the compiled streams reach the compute order's
    makespan under torch too."""
    from pipec.sim.costs import parse_costs

    program = pipec.compile("zb_h1", 4, 8)
    costs = parse_costs("F=2,I=2,W=1")
    ideal = simulate(program, costs, p2p="ideal").makespan
    assert (simulate(program, costs).makespan, simulate(program, costs, p2p="torch").makespan, ideal) == (53, 49, 49)
    for name in bundled_names():
        two = ("zbv", "dualpipev", "interleaved_zb", "v_half", "v_min", "zbv_mem", "dualpipe", "chimera")  # V = 2
        compiled = pipec.compile(name, 4, 8, 2 if name in two else 1)
        assert simulate(compiled, p2p="torch").makespan == simulate(compiled, p2p="ideal").makespan, name
