"""What a REPL echoes: a Program is one short line, a stream is its instructions in their text form."""

from __future__ import annotations

import pipec
from pipec.ir import Action, Kind, Overlap, parse_instruction


def test_a_program_prints_as_one_short_line() -> None:
    program = pipec.compile("1f1b", 4, 8)
    assert repr(program) == "<Program 1f1b P=4 M=8 V=1: 4 ranks, 4 stages, 160 instructions with send/recv>"
    assert str(program) == repr(program)
    orders = pipec.load("examples/tutorial/step3_warmup.pipe", 4, 8, extra=2)
    assert repr(orders) == "<Program my_1f1b_warm P=4 M=8 V=1 extra=2: 4 ranks, 4 stages, 64 compute instructions>"
    big = pipec.compile("interleaved_1f1b", 8, 64, 4)
    assert len(repr(big)) < 120  # the generated dataclass repr printed every instruction: megabytes here


def test_a_stream_prints_its_instructions_in_text_form() -> None:
    assert repr(pipec.load("1f1b", 2, 2).streams[1]) == "(1F0, 1B0, 1F1, 1B1)"
    lowered = pipec.compile("1f1b", 4, 8).streams[0]
    assert repr(lowered).startswith("(0F0, 0SEND_F0, 0F1, ") and len(repr(lowered)) < 400  # was ~1,400 characters
    pair = pipec.load("dualpipev", 2, 4).streams[0]
    assert "(0F3;3B1)OVERLAP_F_B" in repr(pair)
    # each instruction's repr reads back as itself
    for instruction in (Action(2, Kind.SEND_B, 7), Overlap(Action(0, Kind.F, 3), Action(3, Kind.B, 1))):
        assert parse_instruction(repr(instruction)) == instruction
