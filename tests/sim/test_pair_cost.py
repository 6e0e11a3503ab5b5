"""The overlapped pair's own cost (`--cost FB=...`, issue #22 item 3): parsed and checked like the other compute
keys, applied by one rule (pipec.p2p_rule.pair_duration) in the simulator's models and the p2p placement, and
reproducing DualPipeV's published bubble (P-1)(F&B+B-3W) (DeepSeek-V3 report, Table 2; DualPipe README) on the
grid docs/simulator.md names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pair_grid import MIXES, max_idle, mix_spec

import pipec
from pipec.errors import PipecInputError
from pipec.ir import Action, Kind
from pipec.p2p_rule import pair_duration
from pipec.sim.costs import DEFAULT_COSTS, parse_costs, per_rank_share
from pipec.sim.simulate import simulate


def test_fb_is_read_shown_and_checked_like_the_compute_keys() -> None:
    costs = parse_costs("F=1,B=2,W=1,FB=2.5")
    assert costs.FB == 2.5
    assert "FB=2.5" in costs.describe()
    assert DEFAULT_COSTS.pair_per_stage(4) is None and "FB" not in DEFAULT_COSTS.describe()
    listed = parse_costs({"FB": [2, 3], "scale": [1, 2]})
    assert listed.pair_per_stage(2) == [2.0, 6.0]  # scale multiplies the pair as all of a stage's compute
    with pytest.raises(PipecInputError, match="'FB' has 2 entries, the schedule has 3 stages"):
        listed.pair_per_stage(3)
    for bad, message in (("FB=-1", "FB must not be negative"), ("fb=2", "did you mean FB")):
        with pytest.raises(PipecInputError, match=message):
            parse_costs(bad)
    # per rank share: FB describes a segment of P like F and B, so a stage of V chunks takes 1/V of it
    assert per_rank_share(parse_costs("FB=3"), 2, 2).FB == 1.5


def test_pair_duration_is_fb_for_f_and_b_and_the_same_share_for_f_and_i() -> None:
    table = parse_costs("F=1,B=3,W=1").per_stage(2)  # I = 2
    pair = [2.0, 2.0]  # F & B at stage 0 takes 2 of its 4
    f0, b1, i1, w1 = Action(0, Kind.F, 1), Action(1, Kind.B, 0), Action(1, Kind.I, 0), Action(1, Kind.W, 0)
    assert pair_duration((f0, b1), 4.0, table, pair) == 2.0
    assert pair_duration((b1, f0), 4.0, table, pair) == 2.0  # either half first
    assert pair_duration((f0, i1), 3.0, table, pair) == 1.5  # half of F + I, as F & B gets half of F + B
    assert pair_duration((f0, w1), 2.0, table, pair) == 1.0
    assert pair_duration((f0, b1), 4.0, table, None) == 4.0  # no FB: the sum of the halves


@pytest.mark.parametrize("p2p", ["nccl", "ideal"])
@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (3, 7), (4, 8), (4, 16), (6, 18), (8, 16)])
def test_dualpipev_bubble_is_the_published_form(ranks: int, microbatches: int, p2p: str) -> None:
    program = pipec.compile("dualpipev", ranks, microbatches, 2, comms=False)
    for forward, weight, hidden in MIXES:
        spec, backward, pair = mix_spec(forward, weight, hidden)
        published = (ranks - 1) * (pair + backward - 3 * weight)
        assert max_idle(program, spec, p2p) == pytest.approx(published, abs=1e-9), spec


def test_without_fb_a_pair_costs_its_halves_and_fb_shortens_the_step() -> None:
    program = pipec.compile("dualpipev", 4, 8, 2, comms=False)
    serial = simulate(program, parse_costs("F=1,B=2,W=1"))
    same = simulate(program, parse_costs("F=1,B=2,W=1,FB=3"))
    faster = simulate(program, parse_costs("F=1,B=2,W=1,FB=2"))
    assert same.makespan == serial.makespan
    pairs = sum(1 for stream in program.compute_streams() for ins in stream if type(ins) is not Action)
    assert pairs > 0 and sum(serial.busy) - sum(faster.busy) == pytest.approx(pairs * 1.0)
    assert faster.makespan < serial.makespan


@pytest.mark.parametrize("command", ["simulate", "show", "check", "viz"])
def test_every_command_taking_costs_takes_fb(command: str, tmp_path: Path) -> None:
    def run(spec: str) -> tuple[subprocess.CompletedProcess, str]:
        picture = tmp_path / f"{len(spec)}.svg"
        shape = {"simulate": ["--format", "json"], "viz": ["-o", str(picture)]}.get(command, [])
        args = [sys.executable, "-m", "pipec", command, "dualpipev", "-P", "2", "-M", "4", "--cost", spec, *shape]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        return done, picture.read_text() if command == "viz" and done.returncode == 0 else done.stdout

    done, output = run("F=1,B=2,W=1,FB=2")
    assert done.returncode == 0, done.stderr
    serial, serial_output = run("F=1,B=2,W=1")
    assert serial.returncode == 0, serial.stderr
    program = pipec.compile("dualpipev", 2, 4, 2, comms=False)
    paired, alone = (simulate(program, parse_costs(spec)).makespan for spec in ("F=1,B=2,W=1,FB=2", "F=1,B=2,W=1"))
    assert paired < alone
    if command == "simulate":
        assert (json.loads(output)["makespan"], json.loads(serial_output)["makespan"]) == (paired, alone)
    elif command in ("show", "viz"):  # the timeline drawn is the one simulated with the pair's cost
        assert f"makespan {paired:g}" in output and f"makespan {alone:g}" in serial_output
