"""The simulator against closed-form results, hand-computed timelines and an independent timeline checker."""

# ruff: noqa: N803, N806 - P, M, V are the papers' names

from __future__ import annotations

import json
import math

import pytest

import pipec
from pipec.cli import main
from pipec.errors import PipecError, PipecInputError, ScheduleError
from pipec.ir import Action, Kind, Program, parse_instruction
from pipec.sim import Costs, parse_costs, simulate
from pipec.sim.waits import critical_waits, find_waits
from pipec.verify.memory import peak_activations

UNIT = parse_costs("F=1,I=1,W=1")  # the Zero Bubble paper's T_F = T_B = T_W (its B is our I)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


# ---- closed forms ---------------------------------------------------------------------------------------------
# Each closed form runs under the ideal model (the schedule's compute order with asynchronous messages) and under
# the default nccl model (version 2 of the p2p rule) on the compiled streams. insert_p2p_ops places every message
# at the time a replay of the compute order gives it (pipec/passes/p2p.py); the streams here are compiled for the
# costs they are simulated with, as `pipec simulate --cost` does (compiler.place_p2p: the replay timed with those
# costs, or the default placement where that simulates faster), so nccl reaches the closed forms too (compiled for
# the default costs only, the Zero Bubble table missed them at F=2,I=2,W=1 and F=1.5,I=1,W=0.5 from P = 3 on).


MODELS = ["ideal", "nccl", "torch"]


def _load(name: str, P: int, M: int, V: int, p2p: str, costs: Costs | None = None):
    """The compute orders for ideal, else the streams compiled (send/recv placed) for ``costs``."""
    return pipec.load(name, P, M, V) if p2p == "ideal" else pipec.compile(name, P, M, V, costs=costs)


@pytest.mark.parametrize("p2p", MODELS)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("M_of_P", [0.5, 1, 2, 3.5])
def test_gpipe_and_1f1b_bubble(name, P, M_of_P, p2p):
    M = max(1, int(M_of_P * P))
    costs = parse_costs("F=1.5,B=2.5,W=1")
    result = simulate(_load(name, P, M, 1, p2p), costs, p2p=p2p)
    assert close(result.bubble_fraction, (P - 1) / (M + P - 1))
    assert close(result.makespan, (M + P - 1) * (1.5 + 2.5))
    assert close(result.efficiency, M / (M + P - 1))
    assert all(close(i, (P - 1) * 4.0) for i in result.idle)  # every rank idles (P-1)(F+B)


@pytest.mark.parametrize("p2p", MODELS)
@pytest.mark.parametrize("P", [2, 3, 4, 8])
@pytest.mark.parametrize("V", [2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_1f1b_bubble_per_megatron(P, V, rounds, p2p):
    # Megatron (Narayanan et al. 2021, sec. 2.2.2): bubble time (P-1)(tf+tb)/V against ideal M(tf+tb), so the
    # fraction of the makespan is (P-1)/(V*M + P-1); exact at the default grouping (M a multiple of P).
    M = rounds * P
    result = simulate(_load("interleaved_1f1b", P, M, V, p2p), parse_costs("F=1,B=2"), p2p=p2p)
    assert close(result.bubble_fraction, (P - 1) / (V * M + P - 1))


ZB_COSTS = ["F=1,I=1,W=1", "F=2,I=2,W=1", "F=1,I=2,W=1", "F=1.5,I=1,W=0.5"]


@pytest.mark.parametrize("p2p", MODELS)
@pytest.mark.parametrize("P", [2, 3, 4, 6])
@pytest.mark.parametrize("costs", ZB_COSTS)
def test_zero_bubble_table(P, costs, p2p):
    """Qi et al. 2024, Table 2: bubble size (P-1)(F+B+W) for 1F1B, (P-1)(F+B-W) for ZB-H1, (P-1)(F+B-2W) for ZB-H2
    (their B is our I), peak memory P, P and 2P-1 micro-batches. Their bubble is the idle time of the worst rank
    between its first and last op (steps overlap under their post-validation), here `span_idle`."""
    c = parse_costs(costs)
    for M in (2 * P, 3 * P + 1):
        one = simulate(_load("1f1b", P, M, 1, p2p, c), c, p2p=p2p)
        h1 = simulate(_load("zb_h1", P, M, 1, p2p, c), c, p2p=p2p)
        h2 = simulate(_load("zb_h2", P, M, 1, p2p, c), c, p2p=p2p)
        assert close(max(one.span_idle), (P - 1) * (c.F + c.I + c.W))
        assert close(max(h1.span_idle), (P - 1) * (c.F + c.I - c.W))
        assert close(max(h2.span_idle), (P - 1) * (c.F + c.I - 2 * c.W))
        assert (one.peak_memory[0], h1.peak_memory[0], h2.peak_memory[0]) == (P, P, 2 * P - 1)
        assert max(h2.peak_memory) == 2 * P - 1 and max(h1.peak_memory) == P


@pytest.mark.parametrize("p2p", MODELS)
@pytest.mark.parametrize("P", [2, 3, 4, 6])
def test_zb_h1_is_a_third_of_1f1b(P, p2p):
    M = 3 * P
    one = simulate(_load("1f1b", P, M, 1, p2p), UNIT, p2p=p2p)
    h1 = simulate(_load("zb_h1", P, M, 1, p2p), UNIT, p2p=p2p)
    assert close(h1.idle[0], one.idle[0] / 3)  # (P-1) against 3(P-1)
    assert close(h1.bubble_fraction, (P - 1) / (3 * M + P - 1))


@pytest.mark.parametrize("p2p", MODELS)
@pytest.mark.parametrize("P", [2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, "P"])
def test_zbv_near_zero_bubble(P, extra, p2p):
    M = 2 * P + (P if extra == "P" else extra)
    result = simulate(_load("zbv", P, M, 2, p2p), UNIT, p2p=p2p)
    assert all(close(i, 0.0) for i in result.span_idle)  # no rank ever waits between its first and last op
    # what is left is the start-up skew: rank r starts r forwards late, P-1 units in all, against 2*3*M busy
    assert close(result.bubble_fraction, (P - 1) / (6 * M + P - 1))
    assert max(result.peak_memory) <= 2 * P  # 1F1B's memory (P micro-batches of a 2-chunk rank)


@pytest.mark.parametrize(("name", "V"), [("gpipe", 1), ("forward_only", 1)])
@pytest.mark.parametrize(("P", "M"), [(2, 3), (4, 8), (8, 16)])
def test_nccl_reaches_the_compute_order_where_batches_hold_no_late_receive(name, V, P, M):
    c = parse_costs("F=1.2,B=2.7,W=1")
    program = pipec.compile(name, P, M, V)
    assert close(simulate(program, c).makespan, simulate(program, c, p2p="ideal").makespan)


# ---- the nccl rule (version 2), by hand ------------------------------------------------------------------------


def _program(rows: list[str], P: int = 2, M: int = 2, forward_only: bool = False) -> Program:
    streams = tuple(tuple(parse_instruction(t) for t in row.split()) for row in rows)
    return Program("hand", P, M, 1, tuple(range(P)), streams, has_comms=True, forward_only=forward_only)


HAND = [
    "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
    "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
]


@pytest.mark.parametrize(
    ("costs", "makespan", "finish", "batch", "waited"),
    [
        # free messages: rank 0 posts [0SEND_F1 0RECV_B0] at 2 and it runs at once (its [0SEND_F0] completed at
        # 1); both of its messages complete when rank 1 posts [1SEND_B0 1RECV_F1] at 4; 0B0 waits for it
        ("F=1,B=2", 9.0, (9.0, 7.0), (2.0, 4.0), (3.0, 1.0)),
        # 0.5 per message, 0.5 of sender time per send posted: 0F1 runs 1.5-2.5; the pair completes at 4.5 + 0.5;
        # 1F1 at 5-6, 1B1 6-8, [1SEND_B1] posted at 8 (rank 1 busy until 8.5), 0B1 from 8.5
        ("F=1,B=2,comm=0.5", 10.5, (10.5, 8.5), (2.5, 5.0), (3.5, 1.5)),
        # overlap: posting is free; 0F1 runs 1-2 and the batch starts at 2
        ("F=1,B=2,comm=0.5,overlap=1", 10.5, (10.5, 8.5), (2.0, 5.0), (4.5, 2.5)),
    ],
)
def test_hand_computed_nccl_timeline(costs, makespan, finish, batch, waited):
    result = simulate(_program(HAND), parse_costs(costs), record=True)
    assert result.makespan == makespan and result.finish == finish
    rank0 = result.timeline[0]
    paired = next(op for op in rank0 if op.is_comm and len(op.instruction) == 2)
    assert (paired.start, paired.end) == batch
    assert [str(a) for a in paired.instruction] == ["0SEND_F1", "0RECV_B0"]
    assert result.busy == (6.0, 6.0)
    assert result.comm == waited


def test_sends_do_not_block_the_host(tmp_path):
    """Version 2: rank 0 computes all its forwards back to back although stage 1 (5 per forward) receives late;
    its sends complete when rank 1 posts each receive (1, 6, 11), each batch starting once the previous one has
    completed (one NCCL stream), and the step ends when the last one has."""
    rows = ["0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2", "1RECV_F0 1F0 1RECV_F1 1F1 1RECV_F2 1F2"]
    costs = parse_costs(str(_write(tmp_path, {"F": [1, 5]})))
    result = simulate(_program(rows, M=3, forward_only=True), costs, record=True)
    compute = [(op.start, op.end) for op in result.timeline[0] if not op.is_comm]
    assert compute == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    assert [(op.start, op.end) for op in result.timeline[0] if op.is_comm] == [(1.0, 1.0), (2.0, 6.0), (6.0, 11.0)]
    assert result.finish == (11.0, 16.0) and result.comm == (8.0, 1.0)


def test_batches_of_a_rank_run_in_order_and_are_waited_for_whole():
    """Rank 1 posts [1SEND_F1 1RECV_F2] at 3; its send meets rank 2's receive only at 7 (rank 2 runs 2F0 2-7), so
    the batch completes at 7 and 1F2 waits for it although 1RECV_F2's data was there at 3. Its next batch
    [1SEND_F2], posted at 8, meets rank 2's receive posted at 12."""
    rows = [
        "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_F2 1F2 1SEND_F2",
        "2RECV_F0 2F0 2RECV_F1 2F1 2RECV_F2 2F2",
    ]
    streams = tuple(tuple(map(parse_instruction, r.split())) for r in rows)
    program = Program("hand", 3, 3, 1, (0, 1, 2), streams, has_comms=True, forward_only=True)
    result = simulate(program, Costs(F=(1.0, 1.0, 5.0)), record=True)
    line = [
        (str(op.instruction) if not op.is_comm else " ".join(map(str, op.instruction)), op.start, op.end)
        for op in result.timeline[1]
    ]
    assert line == [
        ("1RECV_F0", 0.0, 1.0),
        ("1F0", 1.0, 2.0),
        ("1SEND_F0 1RECV_F1", 2.0, 2.0),
        ("1F1", 2.0, 3.0),
        ("1SEND_F1 1RECV_F2", 3.0, 7.0),
        ("1F2", 7.0, 8.0),
        ("1SEND_F2", 8.0, 12.0),
    ]
    assert result.finish == (3.0, 12.0, 17.0) and result.makespan == 17.0
    # tagged: sends are buffered, so the batch holding 1RECV_F2 completes at 3 and 1F2 runs at once
    tagged = simulate(program, Costs(F=(1.0, 1.0, 5.0)), p2p="tagged", record=True)
    assert [(op.start, op.end) for op in tagged.timeline[1] if not op.is_comm] == [(1, 2), (2, 3), (3, 4)]


def test_p2p_order_mismatch_is_reported():
    rows = [
        "0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1",  # sends F1 before F0 on the same channel
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    ]
    with pytest.raises(ScheduleError, match=r"p2p order mismatch between rank 0 and rank 1.*1st message.*0SEND_F1"):
        simulate(_program(rows))
    # buffered sends matched by (stage, micro-batch) do not care about the order: rank 1 starts at 2, not 1
    assert simulate(_program(rows), p2p="tagged").makespan == 10.0


def test_deadlock_is_reported():
    rows = [
        "0F0 0RECV_B0 0B0 0SEND_F0",  # waits for a gradient before sending the activation it needs
        "1RECV_F0 1F0 1B0 1SEND_B0",
    ]
    with pytest.raises(
        ScheduleError,
        match=r"(?s)deadlock under the nccl.*rank 0 is stuck at op 2 0B0, waiting for batch \[0RECV_B0\] \(op 1\): "
        r"0RECV_B0 waits for rank 1's 1st send to rank 0.*rank 1 is stuck at op 1 1F0",
    ):
        simulate(_program(rows, M=1))
    with pytest.raises(ScheduleError, match="deadlock under the tagged"):
        simulate(_program(rows, M=1), p2p="tagged")


def test_a_send_nobody_receives_holds_the_end_of_the_step():
    # rank 1 never posts its receive (its first batch sends 1F0's output before computing it), so rank 0, done
    # computing, waits at the end of its step for [0SEND_F0]
    rows = ["0F0 0SEND_F0", "1SEND_F0 1RECV_F0 1F0", "2RECV_F0 2F0"]
    with pytest.raises(
        ScheduleError,
        match=r"(?s)rank 0 is stuck at the end of the step, waiting for batch \[0SEND_F0\] \(op 1\): 0SEND_F0 waits "
        r"for rank 1's 1st receive from rank 0 to run",
    ):
        simulate(_program(rows, P=3, M=1, forward_only=True))


def test_compute_before_its_input_is_an_error():
    rows = ["0F0 0SEND_F0 0B0 0RECV_B0", "1RECV_F0 1F0 1B0 1SEND_B0"]  # 0B0 runs before its receive is posted
    with pytest.raises(ScheduleError, match="0B0 runs before its input gradient from stage 1 is received"):
        simulate(_program(rows, M=1))


# ---- an independent check of every simulated timeline ---------------------------------------------------------


def _check_timeline(result, costs: Costs, p2p: str = "nccl") -> None:
    """Program order, durations, data dependencies (plus message time across ranks), the p2p rule's waits (a compute
    starts after the batch holding its receive has completed; nccl and torch: a rank's batches run one after another
    and a message completes message_time after the later of its two batches started; torch: a batch is one op) and
    the totals."""
    program = result.program
    durations = costs.per_stage(program.num_stages)
    where = program.stage_to_rank
    end_of: dict[tuple[int, str, int], float] = {}
    batch_of: dict[tuple[int, Action], object] = {}
    for rank, line in enumerate(result.timeline):
        clock = comm_clock = 0.0
        for op in line:
            if op.is_comm:
                if p2p in ("nccl", "torch"):
                    assert op.start >= comm_clock - 1e-9, f"rank {rank} runs two batches at once at {op}"
                    comm_clock = op.end
                if p2p == "torch":
                    assert len(op.instruction) == 1, f"rank {rank} posts {op.instruction} together"
                for action in op.instruction:
                    batch_of[(rank, action)] = op
                continue
            assert op.start >= clock - 1e-9, f"rank {rank} runs two things at once at {op}"
            clock = op.end
            expected = sum(durations[a.kind][a.stage] for a in op.instruction.parts)
            assert close(op.end - op.start, expected)
            for stage, kind, mb in op.instruction.parts:
                end_of[(stage, kind.value, mb)] = op.end
    hop = costs.message_time
    for rank, line in enumerate(result.timeline):
        for op in line:
            if op.is_comm:
                continue
            for stage, kind, mb in op.instruction.parts:
                needs = []
                if kind is Kind.F and stage > 0:
                    needs.append((stage - 1, "F", mb))
                if kind in (Kind.B, Kind.I):
                    needs.append((stage, "F", mb))
                    if stage < program.num_stages - 1:
                        later = (stage + 1, "B", mb) if (stage + 1, "B", mb) in end_of else (stage + 1, "I", mb)
                        needs.append(later)
                if kind is Kind.W:
                    needs.append((stage, "I", mb))
                for need in needs:
                    delay = hop if where[need[0]] != rank else 0.0
                    assert end_of[need] + delay <= op.start + 1e-9, f"{op.instruction} starts before {need} arrives"
                    if p2p != "ideal" and where[need[0]] != rank:  # through a receive: its whole batch first
                        recv = Action(stage, Kind.RECV_F if kind is Kind.F else Kind.RECV_B, mb)
                        assert batch_of[(rank, recv)].end <= op.start + 1e-9, f"{op.instruction} before its batch"
    for m in result.messages:
        assert close(m.end - m.start, hop)
        if p2p in ("nccl", "torch"):
            assert close(m.start, max(batch_of[(m.src, m.send)].start, batch_of[(m.dst, m.recv)].start))
    ends = [op.end for line in result.timeline for op in line]
    assert close(result.makespan, max(ends))
    for rank, line in enumerate(result.timeline):
        assert close(result.busy[rank], sum(op.end - op.start for op in line if not op.is_comm))
        assert close(result.finish[rank], max((op.end for op in line), default=0.0))
    assert result.peak_memory == peak_activations(program)


LIBRARY = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("looped_bfs", 2),
    ("interleaved_zb", 2),
    ("zb_h1", 1),
    ("zb_h2", 1),
    ("zbv", 2),
    ("dualpipev", 2),
    ("forward_only", 1),
]


@pytest.mark.parametrize(("name", "V"), LIBRARY)
@pytest.mark.parametrize("costs", ["F=1,B=2,W=1", "F=1.3,B=2.9,W=0.7,latency=0.2,size=4,bandwidth=8,overlap=1"])
@pytest.mark.parametrize("p2p", ["nccl", "tagged", "torch", "ideal"])
def test_library_timelines_are_valid(name, V, costs, p2p):
    c = parse_costs(costs)
    for P, M in ((2, 4), (4, 8)):
        program = pipec.compile(name, P, M, V)
        result = simulate(program, c, record=True, p2p=p2p)
        _check_timeline(result, c, p2p)
        ideal = simulate(program, c, p2p="ideal")
        assert result.makespan >= ideal.makespan - 1e-9  # the ideal model is as-soon-as-possible for that order
        assert close(sum(result.busy), sum(ideal.busy))


@pytest.mark.parametrize(("name", "V"), LIBRARY)
def test_library_completes_under_nccl_with_free_messages(name, V):
    """The verifier proves the library deadlock-free under the nccl rule; the simulation agrees on a small grid,
    never beats the compute order, and ends every rank's step after its last batch has completed."""
    for P in (1, 2, 3, 4):
        for M in sorted({1, P, 2 * P + 1}):
            try:
                program = pipec.compile(name, P, M, V)
            except PipecError:  # parameters the schedule refuses (e.g. M < P for some)
                continue
            result = simulate(program)
            ideal = simulate(program, p2p="ideal")
            assert result.makespan >= ideal.makespan - 1e-9
            assert close(sum(result.busy), sum(ideal.busy))
            assert all(f >= b - 1e-9 for f, b in zip(result.finish, result.busy, strict=True))


# ---- why nccl is slower than the compute order ---------------------------------------------------------------


def test_find_waits_names_the_batch_and_the_peer():
    """The three-rank program above: 1F2 has its data at 3 but waits for its batch [1SEND_F1 1RECV_F2] until 7,
    when rank 2 posts the receive for 1SEND_F1; nothing else waits, and the critical path (rank 2's chain of
    5-unit forwards) holds no wait at all."""
    rows = [
        "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_F2 1F2 1SEND_F2",
        "2RECV_F0 2F0 2RECV_F1 2F1 2RECV_F2 2F2",
    ]
    streams = tuple(tuple(map(parse_instruction, r.split())) for r in rows)
    program = Program("hand", 3, 3, 1, (0, 1, 2), streams, has_comms=True, forward_only=True)
    result = simulate(program, Costs(F=(1.0, 1.0, 5.0)), True)
    waits = find_waits(result)
    assert [(w.kind, w.rank, w.time, w.until) for w in waits] == [("batch", 1, 3.0, 7.0)]
    assert "1F2" in waits[0].text and "[1SEND_F1 1RECV_F2]" in waits[0].text and "1SEND_F1" in waits[0].text
    assert critical_waits(result) == []


def test_critical_waits_on_a_fifo_hand_case(tmp_path):
    """Rank 0 of the two-rank program: [0SEND_F2] is posted at 3 but starts at 6 behind [0SEND_F1], which waits
    for rank 1 to post its receive; rank 1's chain of 5-unit forwards is the critical path, without waits."""
    rows = ["0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2", "1RECV_F0 1F0 1RECV_F1 1F1 1RECV_F2 1F2"]
    costs = parse_costs(str(_write(tmp_path, {"F": [1, 5]})))
    result = simulate(_program(rows, M=3, forward_only=True), costs, record=True)
    assert [(w.kind, w.rank, w.time, w.until) for w in find_waits(result)] == [("fifo", 0, 3.0, 6.0)]
    assert critical_waits(result) == []


def test_critical_waits_follow_the_sender_on_a_tie():
    """Three ranks, F = 1, messages 0.5, overlap: rank 1 posts [1SEND_F0 1RECV_F1] only after 1F0 (at 2.5) while
    0SEND_F1 runs from 2, so 1F1 gets its data at 3 instead of 2.5 (a post wait). Rank 2 posts 2RECV_F1 at 4, the
    moment rank 1 posts 1SEND_F1: a tie, and the walk must follow the sender (rank 2 only sat idle) to find the
    post wait. By hand: nccl makespan 5.5, ideal 5 (2F1 at max(4, 3.5 + 0.5)), the gap is that one wait."""
    rows = [
        "0F0 0SEND_F0 0F1 0SEND_F1",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1",
        "2RECV_F0 2F0 2RECV_F1 2F1",
    ]
    streams = tuple(tuple(map(parse_instruction, r.split())) for r in rows)
    program = Program("hand", 3, 2, 1, (0, 1, 2), streams, has_comms=True, forward_only=True)
    costs = parse_costs("F=1,comm=0.5,overlap=1")
    result = simulate(program, costs, record=True)
    assert close(result.makespan, 5.5) and close(simulate(program, costs, p2p="ideal").makespan, 5.0)
    assert [(w.kind, w.rank, w.time, w.until) for w in critical_waits(result)] == [("post", 1, 2.0, 2.5)]


@pytest.mark.parametrize(("name", "V"), LIBRARY)
def test_critical_waits_account_for_the_gap_to_the_compute_order(name, V):
    """With free messages, the waits on the critical path (batch and fifo) add up to at least what the compiled
    streams lose against the compute order: the rest of the path is compute the ideal model runs too."""
    for P, M in ((2, 5), (3, 7), (4, 8)):
        try:
            program = pipec.compile(name, P, M, V)
        except PipecError:
            continue
        result = simulate(program, record=True)
        gap = result.makespan - simulate(program, p2p="ideal").makespan
        waits = critical_waits(result)
        assert sum(w.until - w.time for w in waits) >= gap - 1e-9
        assert all(w.until > w.time and w.kind in ("batch", "fifo") for w in waits)


# ---- costs and the command ------------------------------------------------------------------------------------


def test_cost_parsing(tmp_path):
    assert (parse_costs(None).F, parse_costs(None).I, parse_costs(None).W) == (1.0, 1.0, 1.0)
    c = parse_costs("F=2,B=5,W=2")
    assert (c.I, c.B) == (3.0, 5.0)
    c = parse_costs("I=3,W=2")
    assert c.B == 5.0
    assert parse_costs("comm=1,latency=0.5,size=100,bandwidth=200").message_time == 2.0
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"F": [1, 2], "B": 4, "W": [1, 3], "scale": [1, 2]}))
    per_stage = parse_costs(str(path)).per_stage(2)
    assert per_stage[Kind.F] == [1.0, 4.0] and per_stage[Kind.I] == [3.0, 2.0] and per_stage[Kind.W] == [1.0, 6.0]
    for bad in ("F=1,X=2", "F=x", "F=-1", "B=1,W=2", "B=3,I=1,W=1", "overlap=2", "F=1,F=2", str(tmp_path / "no.json")):
        with pytest.raises(PipecInputError):
            parse_costs(bad)
    with pytest.raises(PipecInputError, match="3 entries"):
        parse_costs('{"F": [1, 2, 3]}' and str(_write(tmp_path, {"F": [1, 2, 3]}))).per_stage(2)


def test_cost_text_is_a_file_only_when_one_exists(tmp_path, monkeypatch):
    # `F:1` is a slip for F=1, not the name of a missing file; a file that exists is read whatever its name
    with pytest.raises(PipecInputError, match=r"expected NAME=VALUE pairs such as F=1,B=2, got 'F:1'; write F=1"):
        parse_costs("F:1,B:2")
    with pytest.raises(PipecInputError, match=r"--cost 'F': no such cost file; give NAME=VALUE pairs"):
        parse_costs("F")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "F=3").write_text('{"F": 2}')
    (tmp_path / "costs").write_text('{"F": 4}')
    assert parse_costs("F=3").F == 2.0 and parse_costs("costs").F == 4.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("F=1,B=2,W=3", "W = 3 is larger than B = 2, so I = B - W would be -1"),
        ("W=3", "W = 3 is larger than B = 2 (the default), so I = B - W would be -1"),
        ("I=3,B=2", "I = 3 is larger than B = 2, so W = B - I would be -1"),
        ("B=3,I=1,W=1", "B = 3 but I + W = 1 + 1 = 2"),
        ("f=1,b=2", "unknown cost 'f' (names are case-sensitive: did you mean F?)"),
        ("F=1,Q=2,q=3", "unknown cost 'Q';"),  # the first unknown one, and no case hint when none fits
    ],
)
def test_cost_messages_give_the_numbers_and_the_first_unknown_name(spec, message):
    with pytest.raises(PipecInputError) as error:
        parse_costs(spec)
    assert message in str(error.value)
    assert "..." not in str(error.value)  # no unevaluated formula


def test_per_stage_costs_name_the_stage(tmp_path):
    with pytest.raises(PipecInputError, match=r"W = 2 is larger than B = 1 at stage 2, so I = B - W would be -1"):
        parse_costs(str(_write(tmp_path, {"B": [2, 2, 1], "W": [1, 1, 2]})))


def test_time_units_are_singular_for_one():
    from pipec.sim.costs import time_units

    assert (time_units(1), time_units(1.0), time_units(0.5), time_units(2)) == (
        "1 time unit", "1 time unit", "0.5 time units", "2 time units"
    )


def _write(tmp_path, data):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))
    return path


def test_simulate_command_json(capsys):
    assert main(["simulate", "1f1b", "-P", "4", "-M", "8", "--cost", "F=1,B=2", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"makespan", "bubble_fraction", "efficiency", "ranks"} <= set(data)
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    assert all({"rank", "busy", "idle", "peak_memory"} <= set(r) for r in data["ranks"])
    assert [r["peak_memory"] for r in data["ranks"]] == [4, 3, 2, 1]
    assert close(sum(r["idle"] for r in data["ranks"]) / (4 * data["makespan"]), data["bubble_fraction"])


def test_simulate_command_text_and_errors(capsys):
    assert main(["simulate", "gpipe", "-P", "2", "-M", "2", "--p2p", "ideal"]) == 0
    out = capsys.readouterr().out
    assert "makespan 9" in out and "bubble 33.3%" in out
    assert main(["simulate", "gpipe", "-P", "2", "-M", "2", "--cost", "F=1,Q=2"]) == 2
    assert "unknown cost 'Q'" in capsys.readouterr().err


def test_simulate_why_lists_the_critical_waits(capsys):
    assert main(["simulate", "1f1b", "-P", "4", "-M", "8", "--why", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ideal = simulate(pipec.load("1f1b", 4, 8), p2p="ideal").makespan
    waits = data["critical_waits"]
    assert sum(w["until"] - w["time"] for w in waits) >= data["makespan"] - ideal - 1e-9
    assert all({"time", "until", "rank", "kind", "text"} <= set(w) for w in waits)
    assert main(["simulate", "gpipe", "-P", "2", "-M", "2", "--why"]) == 0
    assert "waits on the critical path: none" in capsys.readouterr().out


def test_ideal_model_message_time():
    # with a message costing c, each of the P-1 hops of the first forward and the last backward adds c
    P, M, c = 4, 6, 0.25
    result = simulate(pipec.load("gpipe", P, M), parse_costs(f"F=1,B=2,comm={c}"), p2p="ideal")
    assert close(result.makespan, (M + P - 1) * 3 + 2 * (P - 1) * c)


def test_unused_action_import_keeps_ruff_quiet():
    assert Action(0, Kind.F, 0).stage == 0


def test_memory_costs_reach_the_liveness_function(tmp_path):
    # 1F1B: rank r keeps P - r micro-batches in flight, each the size of its stage's activations
    path = _write(tmp_path, {"activation": [1, 1, 2, 4]})
    result = simulate(pipec.load("1f1b", 4, 8), parse_costs(str(path)), p2p="ideal")
    assert result.peak_memory == (4.0, 3.0, 4.0, 4.0)
    program = pipec.load("zb_h1", 4, 8)
    result = simulate(program, parse_costs("input_fraction=0.8"), p2p="ideal")
    assert result.peak_memory == peak_activations(program, 0.8) != peak_activations(program, 0.5)
    with pytest.raises(PipecInputError, match="3 entries"):
        simulate(program, parse_costs(str(_write(tmp_path, {"activation": [1, 2, 3]}))), p2p="ideal")
