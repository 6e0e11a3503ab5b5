"""break/continue and named blocks in per-rank programs: the op sequences they produce, the errors they raise
before anything runs, the budgets that still bound them, and a ZB-V under a memory limit written with blocks."""

from __future__ import annotations

import pytest
from paths import TESTS

import pipec
from pipec.emit import dump_text
from pipec.errors import PipecSyntaxError, ScheduleProgramError
from pipec.limits import MAX_NESTING

ZBV_LIMITED = TESTS / "zbv_limited.pipe"


def orders(body: str, ranks: int = 1, microbatches: int = 4, header: str = "") -> list[str]:
    """Each rank's compute order, as `--emit orders` prints it ('0F0 0F1 ...')."""
    text = f"schedule t\n{header}per rank r:\n" + "".join(f"    {line}\n" for line in body.splitlines())
    program = pipec.load(text, ranks, microbatches)
    return [line.split(": ", 1)[1] for line in dump_text(program).splitlines() if line.startswith("rank ")]


def rank_orders(text: str, ranks: int, microbatches: int, **params: int) -> list[str]:
    program = pipec.load(text, ranks, microbatches, **params)
    return [" ".join(str(a) for i in s for a in i.parts) for s in program.compute_streams()]


# ---- break and continue ------------------------------------------------------------------------


def test_break_leaves_a_repeat_at_once() -> None:
    assert orders("repeat M:\n    F\n    if count(F) == 2: break\n    B") == ["0F0 0B0 0F1"]


def test_break_leaves_only_the_innermost_loop() -> None:
    body = "for k in 0 .. 3:\n    repeat 5:\n        F\n        break\n    B"
    assert orders(body, microbatches=3) == ["0F0 0B0 0F1 0B1 0F2 0B2"]


def test_continue_skips_the_rest_of_the_iteration() -> None:
    body = "for k in 0 .. 4:\n    F\n    if k % 2 == 1: continue\n    B"
    assert orders(body) == ["0F0 0B0 0F1 0F2 0B1 0F3"]


def test_break_ends_a_while_that_would_not_end_alone() -> None:
    body = "while 1:\n    F\n    if count(F) >= M: break\nwhile 1:\n    if pending(W) == 0 and count(I) == M: break\n"
    body += "    if count(I) < M: I\n    else: W"
    assert orders(body, microbatches=2) == ["0F0 0F1 0I0 0I1 0W0 0W1"]


def test_continue_in_a_while_retests_its_condition() -> None:
    body = "while count(F) < M:\n    F\n    if count(F) < M: continue\n    B"
    assert orders(body, microbatches=3) == ["0F0 0F1 0F2 0B0"]


def test_a_while_with_break_in_an_if_is_still_bounded() -> None:
    with pytest.raises(ScheduleProgramError, match="the program ran too long"):
        orders("while 1:\n    if count(F) > M: break\n    pass")


def test_continue_forever_is_still_bounded() -> None:
    with pytest.raises(ScheduleProgramError, match="the program ran too long"):
        orders("while 1:\n    continue")


@pytest.mark.parametrize(
    ("body", "where"),
    [("F\nbreak", "2:5"), ("if 1: continue", "1:11"), ("repeat 2: F\nif 1:\n    break", "3:9")],
)
def test_break_and_continue_outside_a_loop_are_refused(body: str, where: str) -> None:
    with pytest.raises(PipecSyntaxError, match="outside a loop") as caught:
        orders(body)
    span = caught.value.span
    assert f"{span.line - 2}:{span.column}" == where  # two header lines before the program


# ---- blocks ------------------------------------------------------------------------------------

ONE_F_ONE_B = """schedule blocks_1f1b
block warmup(n):
    repeat n: F
block steady(n):
    repeat n: B F
per rank r:
    warm = min(P - r, M)
    warmup(warm)
    steady(M - warm)
    repeat warm: B
"""


def test_blocks_give_the_same_orders_as_the_body_they_replace() -> None:
    for ranks, microbatches in ((1, 1), (2, 5), (4, 8), (5, 3)):
        assert pipec.load(ONE_F_ONE_B, ranks, microbatches).streams == pipec.load("1f1b", ranks, microbatches).streams


def test_block_arguments_are_evaluated_at_the_call_and_locals_stay_private() -> None:
    text = """schedule t
block emit_at(m):
    x = m + 1
    F @ x
per rank r:
    x = 5
    emit_at(x * 2)
    F @ x
    emit_at(count(F))
"""
    # the block's x is its own: the caller's x is still 5; count(F) is read at the call (a bare F never ran)
    assert rank_orders(text, 1, 1) == ["0F11 0F5 0F1"]


def test_blocks_see_parameters_lets_and_share_the_ranks_counters() -> None:
    text = """schedule t
params P, M, extra = 1
let total = M + extra
block forwards(k):
    repeat k: F
    if count(F) < total: F
per rank r:
    forwards(r)
    forwards(0)
"""
    assert rank_orders(text, 2, 3, extra=1) == ["0F0 0F1", "1F0 1F1 1F2"]  # total = 4: never reached
    assert rank_orders(text, 2, 3, extra=-1) == ["0F0 0F1", "1F0 1F1"]  # total = 2: rank 1 stops at two


def test_blocks_can_call_blocks_and_contain_loops_that_break() -> None:
    text = """schedule t
block take(n):
    repeat 100:
        if count(F) >= n: break
        F
block both(n):
    take(n)
    repeat n: B
per rank r:
    both(M)
"""
    assert rank_orders(text, 1, 3) == ["0F0 0F1 0F2 0B0 0B1 0B2"]


def test_a_call_chain_that_doubles_is_stopped_by_the_budget() -> None:
    # 40 blocks each calling the one below twice: 2**40 ops with no loop at all, so the calls must count
    lines = ["schedule t", "block b0():", "    F @ 0"]
    for k in range(1, 40):
        lines += [f"block b{k}():", f"    b{k - 1}()", f"    b{k - 1}()"]
    lines += ["per rank r:", "    b39()"]
    with pytest.raises(ScheduleProgramError, match=r"ran too long|steps|more than"):
        pipec.load("\n".join(lines) + "\n", 1, 1)


@pytest.mark.parametrize(
    ("program", "message"),
    [
        ("block warm(n):\n    repeat n: F\nper rank r:\n    wram(1)\n", "unknown block 'wram': did you mean 'warm'?"),
        ("block warm(n):\n    repeat n: F\nper rank r:\n    zzz(1)\n", "unknown block 'zzz'; blocks defined: warm"),
        ("per rank r:\n    warm(1)\n", r"unknown block 'warm'; define it with 'block warm\(\.\.\.\):'"),
        ("block warm(n):\n    repeat n: F\nper rank r:\n    warm()\n", r"block warm\(n\) takes 1 argument, got 0"),
        ("block two(a, b):\n    F\nper rank r:\n    two(1)\n", r"block two\(a, b\) takes 2 arguments, got 1"),
        ("block me(n):\n    me(n)\nper rank r:\n    me(1)\n", r"block 'me' calls itself \(me -> me\)"),
        (
            "block a():\n    b()\nblock b():\n    c()\nblock c():\n    a()\nper rank r:\n    F\n",
            r"block 'a' calls itself \(a -> b -> c -> a\)",
        ),
        ("block w(n):\n    F\nblock w(m):\n    B\nper rank r:\n    w(1)\n", "block 'w' is defined twice"),
        ("block w(n, n):\n    F\nper rank r:\n    w(1, 2)\n", "parameter 'n' is named twice"),
        ("block w():\n    break\nper rank r:\n    repeat 2: w()\n", "'break' outside a loop"),
    ],
)
def test_block_mistakes_are_refused_before_anything_runs(program: str, message: str) -> None:
    with pytest.raises(PipecSyntaxError, match=message) as caught:
        pipec.load("schedule t\n" + program, 1, 1)
    assert caught.value.span is not None and caught.value.span.line > 1


@pytest.mark.parametrize(
    ("program", "message"),
    [
        ("block w(M):\n    F\nper rank r:\n    w(1)\n", "parameter 'M' hides the parameter or let"),
        ("block w():\n    P = 3\nper rank r:\n    w()\n", "P is fixed for the whole schedule"),
        ("block w():\n    F @ r\nper rank r:\n    w()\n", "unknown name 'r' .block w sees the parameters"),
        ("block w():\n    F @ warm\nper rank r:\n    warm = 1\n    w()\n", "unknown name 'warm'"),
    ],
)
def test_block_scope_mistakes_name_the_rule(program: str, message: str) -> None:
    with pytest.raises(pipec.PipecError, match=message):
        pipec.load("schedule t\n" + program, 1, 1)


def test_calls_nested_past_the_limit_are_refused() -> None:
    lines = ["schedule t", "block b0():", "    F"]
    for k in range(1, MAX_NESTING + 2):
        lines += [f"block b{k}():", f"    b{k - 1}()"]
    lines += ["per rank r:", f"    b{MAX_NESTING + 1}()"]
    with pytest.raises(PipecSyntaxError, match=f"more than {MAX_NESTING} levels deep"):
        pipec.load("\n".join(lines) + "\n", 1, 1)


def test_a_block_word_can_still_be_a_variable() -> None:
    assert orders("block = 2\nrepeat block: F", microbatches=2) == ["0F0 0F1"]


# ---- ZB-V under a memory limit, written with blocks ----------------------------------------------


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 2), (3, 7), (4, 8), (4, 13), (6, 12)])
def test_zbv_limited_at_zbv_memory_is_zbv(ranks: int, microbatches: int) -> None:
    mine = pipec.load(str(ZBV_LIMITED), ranks, microbatches, 2, limit=2 * ranks)
    assert mine.streams == pipec.load("zbv", ranks, microbatches, 2).streams


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (3, 7), (4, 8), (5, 16)])
@pytest.mark.parametrize("share", [0, 1, 2])
def test_zbv_limited_verifies_within_its_limit(ranks: int, microbatches: int, share: int) -> None:
    limit = (2, ranks + 1, 2 * ranks - 1)[share]
    program = pipec.compile(str(ZBV_LIMITED), ranks, microbatches, 2, limit=limit)
    report = pipec.check(program)  # raises when invalid: structure, p2p order, deadlock, memory within `limit`
    assert max(report.peak_memory) <= limit
    assert max(report.peak_memory) < 2 * ranks  # and below ZB-V's own


def test_zbv_limited_refuses_a_limit_below_one_micro_batch() -> None:
    with pytest.raises(pipec.PipecError, match="outside its declared range"):
        pipec.compile(str(ZBV_LIMITED), 4, 8, 2, limit=1)
