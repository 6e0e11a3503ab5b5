"""The `choose per rank r:` section (docs/language.md, "Cost-aware schedules: choose"; docs/design/cost_aware.md steps
3 and 4): its syntax and AST, its errors with carets, and that the compiler list-schedules it under the costs each
command is given, every result an ordinary verified program."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_capture import run_main
from paths import TESTS

import pipec
from pipec.compiler import compute_orders
from pipec.errors import PipecError
from pipec.frontend import ast
from pipec.frontend.choose import ChooseSpec
from pipec.frontend.expand import prepare
from pipec.frontend.parser import parse
from pipec.frontend.rules import CANDIDATE_NAMES
from pipec.passes.list_schedule import Candidate
from pipec.sim import Costs, simulate
from pipec.sim.costs import per_rank_share
from pipec.verify import verify

HERE = TESTS

# the Zero Bubble greedy rule: I first, F up to the limit, W when memory blocks a forward or nothing else is ready
ZB_GREEDY = """\
schedule zb_greedy "I first, F up to the limit, W when blocked or idle"
params P, M, V = 1 in 1 .. 2, limit = P in 1 .. 2 * P + 1
stages P
memory limit
choose per rank r:
    take I priority 3
    take F priority 2
    take W priority 1 if blocked or idle
"""

# 1F1B as a rule: a backward first, forwards within 1F1B's own bound (tests/passes/test_list_schedule.py's ONE_F_ONE_B)
GREEDY_1F1B = """\
schedule greedy_1f1b "1F1B as a rule"
params P, M
memory per rank r: min(P - r, M)
choose per rank r:
    take F
    take B priority 1
"""

# two chunks in a V: an F[0] keeps a unit free for its micro-batch's F[1] (the design's reservation)
V_GREEDY = """\
schedule v_greedy "a V, greedily"
params P, M, V = 2 in 2 .. 3
placement v
memory 2 * P
choose per rank r:
    take I priority 3 + chunk
    take F[1] priority 2
    take F[0] priority 1 if after + 1 <= 2 * P
    take W if idle or blocked
    prefer -ready
"""


def _write(tmp_path: Path, text: str, name: str = "s.pipe") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_section_parses_into_choose_and_take_nodes() -> None:
    schedule = parse(V_GREEDY, "v.pipe")
    section = schedule.choose
    assert isinstance(section, ast.Choose) and schedule.body is None and not schedule.rank_lists
    assert section.rank_var == "r" and section.memory is None and len(section.prefer) == 1
    kinds = [[(op.kind, op.chunk.value if op.chunk else None) for op in take.ops] for take in section.takes]
    assert kinds == [[("I", None)], [("F", 1)], [("F", 0)], [("W", None)]]
    assert section.takes[0].guard is None and section.takes[3].priority is None
    assert isinstance(section.takes[2].guard, ast.BinOp) and section.takes[2].guard.op == "<="


def test_several_ops_a_memory_line_and_a_conditional_priority_in_parentheses() -> None:
    text = ZB_GREEDY.replace("    take I priority 3\n    take F priority 2\n", "    memory limit - r / 2\n"
                             "    take I, F priority (2 if mb < 3 else 1)\n    prefer -ready, -mb\n")
    section = parse(text).choose
    assert section is not None and isinstance(section.memory, ast.BinOp)
    assert [op.kind for op in section.takes[0].ops] == ["I", "F"] and isinstance(section.takes[0].priority, ast.Cond)
    assert len(section.prefer) == 2


def test_emit_ast_prints_the_section(tmp_path: Path) -> None:
    code, out, err = run_main(["compile", _write(tmp_path, ZB_GREEDY), "--emit", "ast"])
    assert code == 0, err
    assert "  choose:\n    Choose\n      rank_var: 'r'\n" in out
    assert out.count("- Take") == 3 and "guard:\n" in out and "name: 'blocked'" in out


def test_keywords_stay_names_elsewhere() -> None:
    """`limit`, `priority`, `take`, `prefer`, `choose`, `ready` are keywords only inside the section."""
    parse((HERE / "zbv_limited.pipe").read_text(), "zbv_limited.pipe")
    text = ZB_GREEDY.replace("limit = P", "prefer = 1, take = 2, choose = 3, limit = P")
    parse(text.replace("schedule zb_greedy", "schedule choose"))
    program = """schedule names "keywords as variables"
params P, M
per rank r:
    priority = 1; take = 2; prefer = 3; ready = priority + take + prefer
    repeat M: F
    repeat M: B
"""
    assert pipec.load(program, 2, 2).streams[0][0].kind.value == "F"


def test_every_candidate_field_but_rank_and_kind_is_a_name() -> None:
    # in the scheduler's order: the parser lists them in that order when a name is unknown
    assert CANDIDATE_NAMES == tuple(name for name in Candidate._fields if name not in ("rank", "kind"))
    assert {"chunk", "stage", "mb", "now", "ready", "dur", "live", "after", "idle", "blocked"} <= set(CANDIDATE_NAMES)


BAD = [
    # (what is changed, the message, the text the caret underlines)
    ("    take F priority 2\n", "    take F priority 2\n    take F[0]\n", "F[0] is already taken on line 7", "F[0]"),
    ("    take F priority 2\n", "    take F, I\n", "I is already taken on line 6", "I"),
    ("limit = P in", "ready = P in", "'ready' is a name the choose section gives each candidate", "ready = P"),
    ("stages P\n", "stages P\nlet idle = 1\n", "'idle' is a name the choose section gives each candidate", "let"),
    ("    take F priority 2\n", "    take X\n", "'X' is not an op", "X"),
    ("    take F priority 2\n", "    tkae F\n", "unknown keyword 'tkae': did you mean 'take'?", "tkae"),
    ("take F priority 2", "take F prority 2", "did you mean 'priority'?", "prority"),
    ("    take F priority 2\n", "    take F priority\n", "unexpected end of line", ""),
    ("priority 2\n", "priority lateness\n", "unknown name 'lateness'", "lateness"),
    ("priority 2\n", "priority count(F)\n", "count() and pending() are not available in a choose section", "count(F)"),
    ("priority 2\n", "priority 1 / (mb - mb)\n", "division by zero", "1 / (mb - mb)"),
    ("    take F priority 2\n", "    take F[1]\n", "chunk 1 does not exist", "F[1]"),
    ("    take I priority 3\n", "    take B priority 3\n", "the choose section takes B, F, W", "choose per rank r:"),
    ("    take I priority 3\n", "    prefer mb\n    prefer -mb\n    take I\n", "'prefer' is given twice",
     "prefer -mb"),
    ("choose per rank r:", "choose per rank ready:", "the rank variable 'ready' is a candidate's name",
     "choose per rank ready:"),
    ("memory limit\n", "memory limit\nper rank r:\n    F\n", "a schedule has one of", "choose per rank r:"),
    # a limit no forward fits in: the list schedule cannot finish, and says why at the section
    ("    take I priority 3\n", "    memory 0\n    take I priority 3\n", "the list schedule cannot finish",
     "choose per rank r:"),
]


@pytest.mark.parametrize(("old", "new", "message", "underlined"), BAD, ids=[b[2][:30] for b in BAD])
def test_mistakes_are_one_message_at_their_place(
    tmp_path: Path, old: str, new: str, message: str, underlined: str
) -> None:
    assert old in ZB_GREEDY
    path = _write(tmp_path, ZB_GREEDY.replace(old, new, 1), "bad.pipe")
    code, out, err = run_main(["compile", path, "-P", "4", "-M", "8"])
    assert code == 2 and not out
    head, line, caret = err.rstrip("\n").split("\n")[:3]
    assert head.startswith(f"{path}:") and message in head, err
    column = int(head.split(":")[2])
    assert caret.strip().startswith("^") and line[4 + column - 1 :].startswith(underlined), err
    assert "Traceback" not in err


def test_default_costs_reproduce_1f1b_exactly() -> None:
    for ranks, mbs in [(1, 3), (2, 2), (3, 7), (4, 8)]:
        assert pipec.load(GREEDY_1F1B, ranks, mbs).streams == pipec.load("1f1b", ranks, mbs).streams


@pytest.mark.parametrize(("text", "chunks"), [(ZB_GREEDY, 1), (V_GREEDY, 2)])
def test_different_costs_give_different_orders_each_verified(text: str, chunks: int) -> None:
    mixes = [Costs(F=1.0, I=1.0, W=1.0), Costs(F=1.0, I=2.0, W=1.0), Costs(F=1.0, I=1.0, W=2.0)]
    orders = set()
    for costs in mixes:
        program = pipec.compile(text, 4, 8, chunks, costs=costs)
        assert verify(program, p2p="nccl").ok
        orders.add(program.compute_streams())
    assert len(orders) == len(mixes)


def test_without_costs_it_is_the_default_costs() -> None:
    assert pipec.load(ZB_GREEDY, 4, 8).streams == compute_orders(ZB_GREEDY, 4, 8, costs=Costs()).streams
    assert isinstance(prepare(parse(ZB_GREEDY), 4, 8), ChooseSpec)


def test_every_command_with_cost_orders_by_it(tmp_path: Path) -> None:
    """compile, check, simulate (and show, viz, through simulate's path) order with --cost: the makespan simulate
    reports is that of the order compile prints for the same costs."""
    path = _write(tmp_path, ZB_GREEDY)
    slow_i = ["--cost", "F=1,I=3,W=1"]
    code, orders, err = run_main(["compile", path, "-P", "4", "-M", "8", "--emit", "orders", *slow_i])
    assert code == 0, err
    assert orders != run_main(["compile", path, "-P", "4", "-M", "8", "--emit", "orders"])[1]
    code, out, err = run_main(["check", path, "-P", "4", "-M", "8", *slow_i])
    assert code == 0 and "memory     ok" in out, out + err
    literal = "schedule lists\n" + orders
    expected = simulate(pipec.compile(literal, 4, 8, costs=Costs(F=1, I=3, W=1)), Costs(F=1, I=3, W=1))
    code, out, err = run_main(["simulate", path, "-P", "4", "-M", "8", *slow_i, "--format", "json"])
    assert code == 0, err
    assert json.loads(out)["makespan"] == pytest.approx(expected.makespan)
    code, out, err = run_main(["show", path, "-P", "4", "-M", "8", *slow_i])
    assert code == 0 and out, err


def test_per_rank_share_reaches_the_scheduler() -> None:
    """Under --per-rank-share the scheduler sees 1/V of each segment's cost and memory, as the simulator does: with
    a rule that reads no absolute amount, the order is that of the converted costs in stage units; and a limit in
    share units binds as such (1 micro-batch of a rank's share is 2 chunk units at V = 2)."""
    text = V_GREEDY.replace(" if after + 1 <= 2 * P", "").replace("memory 2 * P\n", "")  # no limit, no deadlock
    costs = Costs(F=(1.0, 2.0, 1.0, 3.0), I=1.0, W=(2.0, 1.0, 1.0, 1.0))
    share = compute_orders(text, 4, 8, 2, costs=costs, per_rank_share=True)
    assert share.streams == compute_orders(text, 4, 8, 2, costs=per_rank_share(costs, 4, 2)).streams
    assert share.streams != compute_orders(text, 4, 8, 2).streams
    # the guard keeps half a share unit (one chunk's activations) for the micro-batch's F[1]
    text = V_GREEDY.replace("memory 2 * P\n", "").replace("after + 1 <= 2 * P", "after + 1 / 2 <= cap")
    text = text.replace("take W if idle or blocked", "take W")  # the guard refuses F[0] where it would not block
    text = text.replace("V = 2 in 2 .. 3", "V = 2 in 2 .. 3, cap = 1")
    runs = [compute_orders(text, 4, 8, 2, {"cap": x}, memory_limit=x, per_rank_share=True) for x in (1, 2)]
    peaks = [max(max(_live(s)) for s in run.streams) for run in runs]
    assert peaks[0] <= 2 < peaks[1] <= 4  # in chunk units


def test_per_rank_share_of_copies_is_their_stage_units_at_v_equal_c() -> None:
    """With two copies of the model at V = 2 a stage is a whole share: the converted costs, sizes and declared
    `memory` are the stage-unit ones, so the order is the same with or without the flag (before, compute and
    memory were halved while the messages kept their cost, and the order changed)."""
    text = """\
schedule bidirectional_auto "two copies in opposite directions, ordered by the list scheduler"
params P, M, V = 2
pipelines 2
placement v
memory 6
choose per rank r:
    take B priority 1
    take F
"""
    costs = Costs(F=1.0, B=2.0, W=1.0, comm=1.0)
    share = compute_orders(text, 4, 8, 2, costs=costs, per_rank_share=True)
    assert share.streams == compute_orders(text, 4, 8, 2, costs=costs).streams


def test_a_memory_limit_bounds_the_choice() -> None:
    free = ZB_GREEDY.replace("memory limit\n", "")
    assert max(max(_live(s)) for s in compute_orders(free, 4, 8).streams) > 1.0
    tight = compute_orders(free, 4, 8, memory_limit=1.0)
    assert max(max(_live(s)) for s in tight.streams) <= 1.0


def _live(stream: tuple) -> list[float]:
    from pipec.verify.memory import memory_profile

    return memory_profile(stream)


def test_a_memory_limit_from_the_command_line_binds_the_choice(tmp_path: Path) -> None:
    path = _write(tmp_path, ZB_GREEDY.replace("memory limit\n", ""))
    code, out, err = run_main(["check", path, "-P", "4", "-M", "8", "--memory-limit", "2"])
    assert code == 0 and "memory     ok" in out, out + err
    code, out, err = run_main(["check", path, "-P", "4", "-M", "8", "--memory-limit", "0.5"])
    assert code == 2 and "the list schedule cannot finish" in err and "Traceback" not in err


def test_the_section_limit_and_drop_padded(tmp_path: Path) -> None:
    text = ZB_GREEDY.replace("    take I priority 3\n", "    memory 1 + (r == 0)\n    take I priority 3\n")
    program = pipec.load(text, 4, 8, limit=4)
    peaks = [max(_live(s)) for s in program.streams]
    assert peaks[0] <= 2 and max(peaks[1:]) <= 1 and verify(pipec.compile(text, 4, 8, limit=4)).ok


def test_forward_only_takes_f_alone() -> None:
    text = 'schedule inference "F only"\nparams P, M\nforward only\nchoose per rank r:\n    take F\n'
    program = pipec.compile(text, 3, 4)
    assert verify(program).ok
    with pytest.raises(PipecError, match="a schedule takes F only"):
        pipec.load(text.replace("take F\n", "take F\n    take B\n"), 3, 4)
