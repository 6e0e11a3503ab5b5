"""The bundled DualPipe family against DeepSeek's own implementation (github deepseek-ai/DualPipe, commit 3da1bbe).

tests/reference/deepseek_dualpipev_orders.json.gz holds, for every (P, M) that DualPipeV.step()'s assert allows
(M >= 2P) with P <= 8 and M <= 32, each rank's compute order as pipec's text writes it (an overlapped pair as
`F&B`). It was extracted by running dualpipe/dualpipev.py's own step() (its eight phases, unchanged) on an object
whose communication methods (_recv_*/_send_*, _commit_and_wait_comm) do nothing and whose compute methods record
what they would run: _forward_compute_chunk(phase) -> F, _backward_compute_chunk(phase, enable_zb) -> B, or I with
its W queued FIFO when enable_zb (WeightGradStore's queue), _weight_chunk -> the queued W,
_forward_backward_compute_chunk(p0, p1) -> the pair F & B. Each phase keeps its own micro-batch counter, as the
source's current_f_chunk_id / current_b_chunk_id do; rank r's phase 0 is stage r and phase 1 stage 2P - 1 - r.
"""

from __future__ import annotations

import gzip
import json

from paths import TESTS

import pipec
from pipec.ir import Action, Instruction


def _text(instruction: Instruction) -> str:
    return str(instruction) if type(instruction) is Action else f"{instruction.first}&{instruction.second}"


def test_dualpipev_equals_deepseeks_dualpipev_over_the_grid() -> None:
    with gzip.open(TESTS / "reference" / "deepseek_dualpipev_orders.json.gz", "rt", encoding="utf-8") as file:
        reference: dict[str, list[str]] = json.load(file)
    grid = {(p, m) for p in range(1, 9) for m in range(2 * p, 33)}
    assert {tuple(map(int, key.split(","))) for key in reference} == grid
    for key, orders in reference.items():
        ranks, microbatches = map(int, key.split(","))
        program = pipec.compile("dualpipev", ranks, microbatches, 2, comms=False)
        ours = [" ".join(map(_text, stream)) for stream in program.compute_streams()]
        assert ours == orders, key
