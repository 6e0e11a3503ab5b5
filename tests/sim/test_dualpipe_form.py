"""DualPipe's published figures (deepseek-ai/DualPipe README; DeepSeek-V3 report, arXiv 2412.19437, Table 2)
reproduced by the simulator on DeepSeek's own DualPipe orders (tests/reference/deepseek_dualpipe_orders.json.gz,
two copies of the model, docs/design/replicated.md) and on the bundled `dualpipe`, with the SYNCs that sum the
copies in the streams:

- the bubble (PP/2 - 1)(F&B + B - 3W) on P = PP ranks, on the grid of tests/support/pair_grid.py (I = F, W <= F,
  B <= F&B <= F + B, messages free), under nccl and the ideal model; measured as test_pair_cost.py measures
  DualPipeV's: the most any rank idles in the step (makespan - its busy time);
- activations PP + 1: in pipec's unit (one stage's activations of one micro-batch; a DualPipe stage is 1/P of
  the model, the README's unit), P + 1 on the two middle ranks and P on the others, for the verifier's bound and
  the simulator's peak alike, whatever share of a micro-batch's activations I frees, and the bundled schedule's
  declared bound;
- the sync cost key: every rank's two SYNCs (one per stage it holds) come after its last W, so `sync=s` adds 2s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from deepseek_orders import dualpipe_cases, dualpipe_text
from pair_grid import MIXES, max_idle, mix_spec

import pipec
from pipec.sim.costs import parse_costs
from pipec.sim.simulate import simulate

GRID = [(2, 4), (2, 10), (4, 8), (4, 16), (6, 12), (6, 18), (8, 16), (8, 32)]


def _path(ranks: int, microbatches: int, tmp_path: Path) -> Path:
    """DeepSeek's DualPipe order at (P, M) as a text stream file of two copies."""
    path = tmp_path / f"dualpipe_{ranks}_{microbatches}.txt"
    path.write_text(dualpipe_text(next(o for p, m, o in dualpipe_cases() if (p, m) == (ranks, microbatches))))
    return path


def _orders(source: str, ranks: int, microbatches: int, tmp_path: Path) -> pipec.Program:
    """DualPipe's compute orders: DeepSeek's recorded ones, or the bundled schedule's (equal op for op:
    tests/emit/test_deepseek_conformance.py); simulate places the send/recv and the copies' SYNCs."""
    if source == "bundled":
        return pipec.compile("dualpipe", ranks, microbatches, 2, comms=False)
    return pipec.load(str(_path(ranks, microbatches, tmp_path)))


@pytest.mark.parametrize("source", ["deepseek", "bundled"])
@pytest.mark.parametrize("p2p", ["nccl", "ideal"])
@pytest.mark.parametrize(("ranks", "microbatches"), GRID)
def test_dualpipe_bubble_is_the_published_form(
    ranks: int, microbatches: int, p2p: str, source: str, tmp_path: Path
) -> None:
    program = _orders(source, ranks, microbatches, tmp_path)
    for forward, weight, hidden in MIXES:
        spec, backward, pair = mix_spec(forward, weight, hidden)
        published = (ranks // 2 - 1) * (pair + backward - 3 * weight)
        assert max_idle(program, spec, p2p) == pytest.approx(published, abs=1e-9), spec


@pytest.mark.parametrize("source", ["deepseek", "bundled"])
@pytest.mark.parametrize("input_fraction", [0.0, 0.5, 1.0])
def test_dualpipe_holds_pp_plus_one_activations(input_fraction: float, source: str, tmp_path: Path) -> None:
    for ranks, microbatches in GRID:
        program = _orders(source, ranks, microbatches, tmp_path)
        middle = (ranks // 2 - 1, ranks // 2)
        expected = [ranks + 1 if rank in middle else ranks for rank in range(ranks)]
        report = program.check(input_fraction=input_fraction)
        assert report.ok and list(report.peak_memory) == expected, (ranks, microbatches)
        assert list(simulate(program, input_fraction=input_fraction).peak_memory) == expected
        assert max(expected) == ranks + 1  # the README's PP + 1
        if source == "bundled":  # its declared bound is the same, exactly
            assert list(program.memory_bound or ()) == expected


@pytest.mark.parametrize("sync", [0.5, 3.0])
def test_the_sync_key_charges_each_ranks_two_syncs(sync: float, tmp_path: Path) -> None:
    for ranks, microbatches in GRID:
        program = pipec.compile(str(_path(ranks, microbatches, tmp_path)))
        for spec in ("F=1,B=2,W=1,FB=2.5", "F=2,B=3,W=1,FB=4.4"):
            base = simulate(program, parse_costs(spec)).makespan
            charged = simulate(program, parse_costs(f"{spec},sync={sync}")).makespan
            assert charged == pytest.approx(base + 2 * sync), (ranks, microbatches, spec)
