"""The bundled chimera against Chimera's own schedule (Li & Hoefler, SC'21, arXiv 2107.06925; github
Shigangli/Chimera, commit 6b78ac7).

The orders below were taken by running the authors' schedule generator, chimera_pipeline_rank.py's
AutoGeneratePipelineRank(D, 2K, N).get_schedule() (what their pipeline.py _call_chimera_pipeline executes, slot by
slot), and writing each worker's forward and backward passes in order (its gradient-sync slots left out). At D = 4,
N = 4 that is the paper's figure of two bidirectional pipelines with four stages: the down pipeline (stage l on worker
l) runs micro-batches 0 and 1, the up pipeline (stage l on worker 3 - l) runs 2 and 3, each with 1F1B, merged.

In pipec's numbering (docs/design/replicated.md) copy c's stage l is stage c * D + l, so worker r holds stage r of
the down copy and stage 2D - 1 - r of the up copy. Micro-batches are numbered by basic unit: unit u holds
uD .. uD + D - 1, the first D/2 down (each copy runs its micro-batches in order, so any numbering by unit is the
same order). The generator's own labels for N > D are not unique (two units share "0"), and past N = 2D it drops
micro-batches (at D = 2 already), so the N > D reference here is N = 2D, where it equals direct concatenation.
"""

from __future__ import annotations

import pytest

import pipec

AUTHORS_ORDERS = {
    # (P, M, V): per rank, its compute order
    (4, 4, 2): [  # the paper's D = 4 figure
        "0F0 0F1 7F2 7B2 7F3 7B3 0B0 0B1",
        "1F0 6F2 1F1 6F3 6B2 1B0 6B3 1B1",
        "5F2 2F0 5F3 2F1 2B0 5B2 2B1 5B3",
        "4F2 4F3 3F0 3B0 3F1 3B1 4B2 4B3",
    ],
    (4, 8, 2): [  # two basic units, the second starting 2D slots after the first (direct concatenation)
        "0F0 0F1 7F2 7B2 7F3 7B3 0B0 0F4 0B1 0F5 7F6 7B6 7F7 7B7 0B4 0B5",
        "1F0 6F2 1F1 6F3 6B2 1B0 6B3 1B1 1F4 6F6 1F5 6F7 6B6 1B4 6B7 1B5",
        "5F2 2F0 5F3 2F1 2B0 5B2 2B1 5B3 5F6 2F4 5F7 2F5 2B4 5B6 2B5 5B7",
        "4F2 4F3 3F0 3B0 3F1 3B1 4B2 4F6 4B3 4F7 3F4 3B4 3F5 3B5 4B6 4B7",
    ],
    (8, 8, 4): [  # four pipelines (AutoGeneratePipelineRank(8, 4, 8)): pair 1 shifted by 4 workers
        "0F0 0F1 27F6 20F4 27F7 20F5 15F2 15B2 15F3 15B3 20B4 27B6 20B5 27B7 0B0 0B1",
        "1F0 26F6 1F1 26F7 21F4 14F2 21F5 14F3 14B2 21B4 14B3 21B5 26B6 1B0 26B7 1B1",
        "25F6 2F0 25F7 2F1 13F2 22F4 13F3 22F5 22B4 13B2 22B5 13B3 2B0 25B6 2B1 25B7",
        "24F6 24F7 3F0 12F2 3F1 12F3 23F4 23B4 23F5 23B5 12B2 3B0 12B3 3B1 24B6 24B7",
        "16F4 16F5 11F2 4F0 11F3 4F1 31F6 31B6 31F7 31B7 4B0 11B2 4B1 11B3 16B4 16B5",
        "17F4 10F2 17F5 10F3 5F0 30F6 5F1 30F7 30B6 5B0 30B7 5B1 10B2 17B4 10B3 17B5",
        "9F2 18F4 9F3 18F5 29F6 6F0 29F7 6F1 6B0 29B6 6B1 29B7 18B4 9B2 18B5 9B3",
        "8F2 8F3 19F4 28F6 19F5 28F7 7F0 7B0 7F1 7B1 28B6 19B4 28B7 19B5 8B2 8B3",
    ],
}


@pytest.mark.parametrize("case", list(AUTHORS_ORDERS), ids=lambda case: "P{}-M{}-V{}".format(*case))
def test_chimera_is_the_authors_schedule(case: tuple[int, int, int]) -> None:
    ranks, microbatches, chunks = case
    program = pipec.compile("chimera", ranks, microbatches, chunks)
    orders = [" ".join(map(str, stream)) for stream in program.compute_streams()]
    assert orders == AUTHORS_ORDERS[case]
    assert program.pipelines == chunks


def test_each_copy_runs_1f1b_in_a_basic_unit() -> None:
    """The paper's construction, checked without the slots: at M = P each copy, seen alone on each rank, is 1F1B
    over its P/2 micro-batches (warm-up min(P - l - 1, P/2) forwards at its stage l, then F and B alternate)."""
    for ranks in (2, 4, 6, 8, 12):
        program = pipec.compile("chimera", ranks, ranks, 2, comms=False)
        for stream in program.compute_streams():
            for copy in (0, 1):
                mine = [op for op in stream if program.pipeline_of(op.stage) == copy]
                stage = mine[0].stage % ranks
                count = ranks // 2
                warmup = min(ranks - stage - 1, count)
                kinds = "F" * warmup + "FB" * (count - warmup) + "B" * warmup
                assert "".join(op.kind.value for op in mine) == kinds, (ranks, stage, copy)
                assert [op.mb for op in mine if op.kind.value == "F"] == [op.mb for op in mine if op.kind.value == "B"]


def test_chimeras_memory_is_the_papers_range() -> None:
    """The paper gives Chimera (two pipelines) an activation memory between (D/2 + 1) and D micro-batches' worth
    of a stage: the declared bound, which the verifier checks, is P/2 + 1 on the outer ranks up to P in the
    middle."""
    for ranks in (2, 4, 8):
        bound = pipec.compile("chimera", ranks, 2 * ranks, 2, comms=False).memory_bound
        assert bound is not None and (min(bound), max(bound)) == (ranks // 2 + 1, ranks)


def test_chimeras_bubble_is_the_papers_ratio() -> None:
    """The paper's bubble ratio for Chimera, (D - 2) / (2N + D - 2), reproduced by the simulator with forward and
    backward of equal length (the unit slots of its figures and of the authors' generator), basic units directly
    concatenated for N > D."""
    from pipec.sim import parse_costs, simulate

    costs = parse_costs("F=1,B=1,W=1")
    for ranks, microbatches in ((4, 4), (4, 8), (6, 12), (8, 8), (8, 32)):
        result = simulate(pipec.compile("chimera", ranks, microbatches, 2, costs=costs), costs)
        expected = (ranks - 2) / (2 * microbatches + ranks - 2)
        assert result.bubble_fraction == pytest.approx(expected), (ranks, microbatches)
