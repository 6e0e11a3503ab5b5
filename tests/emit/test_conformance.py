"""The library schedules' compute orders equal PyTorch 2.13's generators over a grid of (P, M, V)."""

from __future__ import annotations

import pytest
from torch_reference import torch_orders

import pipec

RANKS = (1, 2, 3, 4, 5)
MICROBATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
CHUNKS = {
    "gpipe": (1,),
    "1f1b": (1,),
    "interleaved_1f1b": (1, 2, 3),
    "looped_bfs": (1, 2, 3),
    "interleaved_zb": (1, 2, 3),
    "zbv": (2,),
    "dualpipev": (2,),
}
# zb_h1 is torch's InterleavedZeroBubble with one chunk per rank.
TORCH_NAME = {"zb_h1": "interleaved_zb"}


def _grid():
    for name, chunks in [*CHUNKS.items(), ("zb_h1", (1,))]:
        for ranks in RANKS:
            for microbatches in MICROBATCHES:
                for v in chunks:
                    yield name, ranks, microbatches, v


def _reference(name: str, ranks: int, microbatches: int, chunks: int) -> list[list[str]] | None:
    try:
        return torch_orders(TORCH_NAME.get(name, name), ranks, microbatches, chunks)
    except ValueError:  # torch refuses these parameters (e.g. DualPipeV with M < 2P)
        return None


def _pipec_orders(program: pipec.Program) -> list[list[str]]:
    return [[str(action) for instruction in stream for action in instruction.parts] for stream in program.streams]


@pytest.mark.parametrize("name", [*CHUNKS, "zb_h1"])
def test_compute_orders_equal_torch(name: str) -> None:
    compared = 0
    for schedule, ranks, microbatches, chunks in _grid():
        if schedule != name:
            continue
        reference = _reference(name, ranks, microbatches, chunks)
        if reference is None:
            continue
        program = pipec.load(name, ranks, microbatches, chunks)
        assert _pipec_orders(program) == reference, (name, ranks, microbatches, chunks)
        compared += 1
    assert compared >= 20, f"only {compared} parameter sets compared for {name}"


def test_torch_refusals_are_pipec_refusals_for_dualpipev() -> None:
    with pytest.raises(pipec.PipecInputError, match="M >= 2 \\* P"):
        pipec.load("dualpipev", 4, 6, 2)
