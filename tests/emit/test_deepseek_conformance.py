"""The bundled DualPipe family against DeepSeek's own implementation (github deepseek-ai/DualPipe, commit 3da1bbe).

tests/reference/deepseek_dualpipev_orders.json.gz holds, for every (P, M) that DualPipeV.step()'s assert allows
(M >= 2P) with P <= 8 and M <= 32, each rank's compute order as pipec's text writes it (an overlapped pair as
`F&B`). It was extracted by running dualpipe/dualpipev.py's own step() (its eight phases, unchanged) on an object
whose communication methods (_recv_*/_send_*, _commit_and_wait_comm) do nothing and whose compute methods record
what they would run: _forward_compute_chunk(phase) -> F, _backward_compute_chunk(phase, enable_zb) -> B, or I with
its W queued FIFO when enable_zb (WeightGradStore's queue), _weight_chunk -> the queued W,
_forward_backward_compute_chunk(p0, p1) -> the pair F & B. Each phase keeps its own micro-batch counter, as the
source's current_f_chunk_id / current_b_chunk_id do; rank r's phase 0 is stage r and phase 1 stage 2P - 1 - r.

tests/reference/deepseek_dualpipe_orders.json.gz holds the same for dualpipe/dualpipe.py (DualPipe, two copies of
the model in opposite directions) for every (P, M) its asserts allow (P even, M even, M >= 2P) up to P = 8, M = 32,
extracted the same way (its phase argument XOR is_in_second_half, as its compute methods do: phase 0 is the
downward copy), written in the stage numbering docs/design/replicated.md gives replicated pipelines: copy c's stage
l is stage c * P + l, copy 0 runs micro-batches 0 .. M/2 - 1 down from rank 0, copy 1 runs M/2 .. M - 1 up from
rank P - 1 (its stage l on rank P - 1 - l).
"""

from __future__ import annotations

import gzip
import json
import re

from cli_capture import run_main
from deepseek_orders import reference as recorded_orders
from paths import TESTS

import pipec
from pipec.ir import Action, Instruction


def _text(instruction: Instruction) -> str:
    return str(instruction) if type(instruction) is Action else f"{instruction.first}&{instruction.second}"


def test_dualpipev_equals_deepseeks_dualpipev_over_the_grid() -> None:
    reference = recorded_orders("dualpipev")
    grid = {(p, m) for p in range(1, 9) for m in range(2 * p, 33)}
    assert {tuple(map(int, key.split(","))) for key in reference} == grid
    for key, orders in reference.items():
        ranks, microbatches = map(int, key.split(","))
        program = pipec.compile("dualpipev", ranks, microbatches, 2, comms=False)
        ours = [" ".join(map(_text, stream)) for stream in program.compute_streams()]
        assert ours == orders, key


_COMPUTE = re.compile(r"[0-9]+[FBIW][0-9]+")
_PAIR = re.compile(r"\(([0-9]+[FBIW][0-9]+);([0-9]+[FBIW][0-9]+)\)OVERLAP_F_B")


def _compute_order(line: str) -> str:
    """A rank's line of `pipec compile --format text` as its compute order (send, recv and sync left out), an
    overlapped pair written `F&B` as in the reference."""
    ops = []
    for token in line.split(":", 1)[1].split():
        if pair := _PAIR.fullmatch(token):
            ops.append(f"{pair[1]}&{pair[2]}")
        elif _COMPUTE.fullmatch(token):
            ops.append(token)
    return " ".join(ops)


def test_dualpipe_compiles_to_deepseeks_dualpipe_over_the_grid() -> None:
    """The bundled dualpipe, as `pipec compile dualpipe -P P -M M --format text` prints it, is op for op the order
    DeepSeek's dualpipe.py step() runs, for every (P, M) its asserts allow up to P = 8, M = 32 (48 cases); and a
    (P, M) they refuse is refused with the schedule's reason."""
    reference = recorded_orders("dualpipe")
    assert len(reference) == 48
    for key, orders in reference.items():
        ranks, microbatches = key.split(",")
        code, out, err = run_main(["compile", "dualpipe", "-P", ranks, "-M", microbatches, "--format", "text"])
        assert code == 0, (key, err)
        lines = [line for line in out.splitlines() if line.startswith("rank ")]
        assert [_compute_order(line) for line in lines] == orders, key
    for ranks, microbatches, why in (("3", "6", "even number of ranks"), ("4", "7", "even M"), ("4", "6", "even M")):
        code, _, err = run_main(["compile", "dualpipe", "-P", ranks, "-M", microbatches])
        assert code == 2 and why in err, (ranks, microbatches, err)


def _unfolded(action: Action, rank: int, ranks: int, microbatches: int) -> str:
    """dualpipev's action at (P/2, M/2) as the DualPipe action of ``rank`` it stands for (see below)."""
    half = ranks // 2
    copy = int(action.stage >= half) ^ int(rank >= half)
    stage = copy * ranks + (rank if copy == 0 else ranks - 1 - rank)
    return f"{stage}{action.kind.value}{action.mb + copy * (microbatches // 2)}"


def test_deepseeks_dualpipe_is_the_bundled_dualpipev_folded_over_two_copies() -> None:
    """DualPipe at (P, M), rank r, is dualpipev at (P/2, M/2), rank h = min(r, P-1-r): its chunk 0 (the V's way
    down) is the copy that enters at rank r's own end (copy 0 for r < P/2, copy 1 after), its chunk 1 the other
    copy, and copy 1's micro-batches are M/2 on. So a `dualpipe.pipe` is dualpipev's program run at the half rank
    with the chunks swapped on the second half (docs/design/replicated.md)."""
    reference = recorded_orders("dualpipe")
    grid = {(p, m) for p in range(2, 9, 2) for m in range(2 * p, 33, 2)}
    assert {tuple(map(int, key.split(","))) for key in reference} == grid
    for key, orders in reference.items():
        ranks, microbatches = map(int, key.split(","))
        folded = pipec.compile("dualpipev", ranks // 2, microbatches // 2, 2, comms=False).compute_streams()
        for rank, order in enumerate(orders):
            ours = [
                "&".join(_unfolded(part, rank, ranks, microbatches) for part in instruction.parts)
                for instruction in folded[min(rank, ranks - 1 - rank)]
            ]
            assert " ".join(ours) == order, (key, rank)


def test_deepseeks_own_p2p_placement_verifies_and_runs_as_fast_as_pipecs() -> None:
    """tests/reference/deepseek_dualpipev_streams.json.gz: dualpipev.py step() with its p2p ops recorded as well
    (its _recv_*/_send_* skip conditions kept, each _commit_and_wait_comm a batch, ops in the order the source
    appends them), as text streams, for P in 1..8 and M in {2P, 2P+1, 32}. pipec's verifier, an independent
    reading of the same rule, proves DeepSeek's own placement deadlock-free under nccl, its compute orders are the
    bundled dualpipev's, and at the default costs it runs in the same simulated time as pipec's placement (which
    differs: pipec posts each send with the batch after its producer, DeepSeek posts some a compute later)."""
    from pipec.emit import load_text
    from pipec.sim.simulate import simulate

    reference = _reference_streams()
    assert len(reference) == 24
    for key, text in reference.items():
        ranks, microbatches = map(int, key.split(","))
        theirs = load_text(text, f"deepseek {key}")
        ours = pipec.compile("dualpipev", ranks, microbatches, 2)
        assert theirs.compute_streams() == ours.compute_streams(), key
        assert theirs.streams != ours.streams or ranks == 1, key  # the placements differ
        pipec.check(theirs, p2p="nccl")
        assert simulate(theirs).makespan == simulate(ours).makespan, key


def _reference_streams() -> dict[str, str]:
    with gzip.open(TESTS / "reference" / "deepseek_dualpipev_streams.json.gz", "rt", encoding="utf-8") as file:
        return json.load(file)
