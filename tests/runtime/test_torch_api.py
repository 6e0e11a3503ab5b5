"""pipec schedules inside torch.distributed.pipelining.

torch's own `_PipelineScheduleRuntime` and `PipelineStage`s run every library schedule (and a schedule torch lacks,
written in .pipe) on real 2- and 4-process gloo groups, two ways: `pipec.torch.PipelineSchedule`, and the
`--format torch-csv-comms` file loaded with torch's `_load_csv(format="compute_comms")`. Both give the gradients,
losses and eval outputs of training the unsplit model on the whole batch. One spawned group per world size runs
every case in sequence (starting processes that import torch is what costs).
"""

from __future__ import annotations

import functools
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # as conftest.py does: run as a script too

import pytest

torch = pytest.importorskip("torch")

from paths import ROOT  # noqa: E402
from torch.distributed.pipelining import schedules as torch_schedules  # noqa: E402
from torch_reference import HIDDEN, _stage, stage_module  # noqa: E402

import pipec  # noqa: E402
from pipec.emit import dump_torch_csv, emit, load_torch_csv  # noqa: E402
from pipec.emit.torch_csv import TORCH_RUNTIME_ONLY, torch_runtime_streams  # noqa: E402
from pipec.runtime import launch  # noqa: E402
from pipec.torch import PipelineSchedule, compile_for_torch  # noqa: E402

# A schedule torch lacks (1F1B on a V placement), and a training loop in torch's style that takes any schedule.
V_1F1B = str(ROOT / "examples" / "torch" / "v_1f1b.pipe")
TRAIN_EXAMPLE = ROOT / "examples" / "torch" / "train.py"
EXAMPLE_RUNS = {2: (V_1F1B, 4, 2), 4: ("zb_h2", 8, 1)}  # world -> (schedule, M, V)

# name -> (V, M on 2 ranks, M on 4 ranks): every library schedule that trains (forward_only has no backward, which
# torch's runtime requires of every micro-batch).
CASES: dict[str, tuple[int, int, int]] = {
    "1f1b": (1, 4, 8),
    "gpipe": (1, 4, 4),
    "interleaved_1f1b": (2, 4, 8),
    "looped_bfs": (2, 4, 4),
    "interleaved_zb": (2, 4, 8),
    "zb_h1": (1, 4, 8),
    "zb_h2": (1, 4, 8),
    "zbv": (2, 4, 8),
    "dualpipev": (2, 4, 8),
    "zb_auto": (1, 4, 8),  # the cost-aware ones, ordered under the default costs
    "v_half": (2, 4, 8),
    "v_min": (2, 4, 8),
    "zbv_mem": (2, 4, 8),
    "v_1f1b": (2, 4, 8),
}
BATCH = 16  # divisible by every M above
MODES = ("pipec.torch", "comms csv")
TOLERANCE = 1e-5


def _schedule(name: str) -> str:
    return V_1F1B if name == "v_1f1b" else name


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, HIDDEN, generator=generator), torch.randn(BATCH, HIDDEN, generator=generator)


# ---- without processes -------------------------------------------------------------------------------------------


def _torchs_lowering(program: pipec.Program) -> Any:
    """torch's runtime (built in-process from stand-in stages) after lowering the program's compute orders itself."""
    stages = [_stage(s, 0, program.ranks, program.num_stages) for s in program.stages_of(0)]
    runtime = torch_schedules._PipelineScheduleRuntime(stages, program.microbatches)
    runtime._prepare_schedule_with_comms(
        {r: [torch_schedules._Action.from_str(str(i)) for i in s] for r, s in enumerate(program.compute_streams())}
    )
    return runtime


def test_import_pipec_does_not_import_torch() -> None:
    code = "import sys, pipec, pipec.emit, pipec.verify; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize(
    ("name", "ranks", "microbatches", "chunks"),
    [("gpipe", 2, 3, 1), ("interleaved_1f1b", 2, 4, 4), ("zb_h2", 4, 8, 1), ("zbv", 4, 8, 2), ("dualpipev", 4, 8, 2)],
)
def test_comms_csv_adds_what_torchs_lowering_adds(name: str, ranks: int, microbatches: int, chunks: int) -> None:
    """Among the compute actions, REDUCE_GRAD, UNSHARD and RESHARD sit exactly where torch's own lowering of the
    compute-only schedule puts them (V = 4 exercises UNSHARD/RESHARD's rolling window of 3 stages)."""
    program = pipec.compile(name, ranks, microbatches, chunks)
    runtime = _torchs_lowering(program)
    comms = {"SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    ours = torch_runtime_streams(program)
    for rank in range(ranks):
        torchs = [str(a) for a in runtime.pipeline_order_with_comms[rank] if a.computation_type.name not in comms]
        assert [cell for cell in ours[rank] if not cell.rstrip("0123456789").endswith(tuple(comms))] == torchs
        assert sum(cell.endswith("REDUCE_GRAD") for cell in ours[rank]) == len(program.stages_of(rank))


def test_comms_csv_reads_back_and_reads_torchs_own(tmp_path: Path) -> None:
    program = pipec.compile("zbv", 2, 4, 2)
    text = emit(program, "torch-csv-comms")
    assert text == dump_torch_csv(program, with_comms=True) and "REDUCE_GRAD" in text
    assert load_torch_csv(text).streams == program.streams
    assert emit(load_torch_csv(text), "torch-csv-comms") == text
    # torch's own compute_comms dump (its lowering: REDUCE_GRAD, UNSHARD, RESHARD and its own send/recv places)
    runtime = _torchs_lowering(program)
    path = tmp_path / "torch_comms.csv"
    runtime._dump_csv(str(path), format="compute_comms")
    assert any(kind in path.read_text() for kind in TORCH_RUNTIME_ONLY)
    loaded = pipec.compile(str(path))
    assert loaded.has_comms and loaded.compute_streams() == program.compute_streams()


def test_compile_for_torch_refuses_before_any_process(tmp_path: Path) -> None:
    with pytest.raises(pipec.PipecInputError, match=r"compiled for M=4 \(the stages and n_microbatches give 8\)"):
        compile_for_torch(pipec.compile("1f1b", 2, 4), 2, 8, 1)
    with pytest.raises(pipec.PipecInputError, match=r"P=2 ranks, V=2 local stages.*V = 1"):
        compile_for_torch("1f1b", 2, 4, 2)
    with pytest.raises(pipec.PipecInputError, match="forward-only"):
        compile_for_torch("forward_only", 2, 4, 1)
    # complete and valid under the tagged model; deadlocks under pipec's nccl rule (rank 0's RECV_B0 batch is
    # posted before, and blocks, its SEND_F0)
    path = tmp_path / "stalls.txt"
    path.write_text("rank 0: 0RECV_B0 0F0 0SEND_F0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n")
    with pytest.raises(pipec.ScheduleError, match=r"(?s)fails verification.*deadlock +FAILED.*1SEND_B0"):
        compile_for_torch(str(path), 2, 1, 1)
    program, report = compile_for_torch("zb_h2", 2, 4, 1)
    assert report.ok and program.has_comms and (program.ranks, program.microbatches) == (2, 4)
    assert report.p2p == "torch"


def test_a_schedule_that_deadlocks_inside_torch_is_refused_at_construction() -> None:
    """Valid under pipec's nccl rule, a deadlock under torch's runtime rule (rank 0's send to rank 1 posted behind
    its receive from rank 1, tests/bad_schedules/torch_send_behind_recv.csv): `PipelineSchedule` refuses it while
    compiling, before torch's runtime object exists and with no process group at all (the stages are stand-ins
    with the attributes it reads), on either rank."""
    path = ROOT / "tests" / "bad_schedules" / "torch_send_behind_recv.csv"
    assert pipec.compile(str(path)).check(p2p="nccl").ok
    for rank in (0, 1):
        with pytest.raises(pipec.ScheduleError) as refused:
            PipelineSchedule(str(path), [_stage(rank, rank, 2, 2)], 1, loss_fn=torch.nn.functional.mse_loss)
        message = str(refused.value)
        assert "pipec.torch: csv (P=2 ranks, V=1 local stages, M=1 micro-batches) fails verification" in message
        assert "deadlock   FAILED  (torch model)" in message, message
        assert "whose op 0 1RECV_F0 needs rank 0 op 2 0SEND_F0, posted but queued behind an earlier batch" in message


# ---- real gloo groups --------------------------------------------------------------------------------------------


def _reference(num_stages: int) -> tuple[dict[int, list[torch.Tensor]], torch.Tensor, float]:
    """Unsplit training on the whole batch: per-stage parameter gradients, the output, the loss."""
    modules = [stage_module(s) for s in range(num_stages)]
    x, y = _batch()
    out = torch.nn.Sequential(*modules)(x)
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    grads = {s: [p.grad.clone() for p in m.parameters()] for s, m in enumerate(modules)}
    return grads, out.detach(), loss.item()


def _run_one(schedule: Any, num_stages: int, local: dict[int, torch.nn.Module], evaluate: bool) -> dict[str, float]:
    """One training step (and one eval) through `schedule`; the worst differences from the unsplit reference."""
    grads, output, loss = _reference(num_stages)
    x, y = _batch()
    first, last = 0 in local, num_stages - 1 in local
    args = (x,) if first else ()
    losses: list[torch.Tensor] | None = [] if last else None
    schedule.step(*args, target=y if last else None, losses=losses)
    got = {s: [p.grad.clone() for p in local[s].parameters()] for s in local}
    result = {"grad": _worst(got, grads)}
    if last:
        result["loss"] = abs(sum(v.item() for v in losses) / len(losses) - loss)
    if evaluate:
        evaluated = schedule.eval(*args, target=y if last else None)
        if last:
            result["eval"] = (evaluated - output).abs().max().item()
        result["grad after eval"] = _worst({s: list(local[s].parameters()) for s in local}, got, grad=True)
    return result


def _worst(got: dict[int, list[torch.Tensor]], expected: dict[int, list[torch.Tensor]], grad: bool = False) -> float:
    pairs = [(g.grad if grad else g, e) for s in got for g, e in zip(got[s], expected[s], strict=True)]
    return max((g - e).abs().max().item() for g, e in pairs)


def _stages(program: pipec.Program, rank: int) -> tuple[list[Any], dict[int, torch.nn.Module]]:
    from torch.distributed.pipelining import PipelineStage

    local = {s: stage_module(s) for s in program.stages_of(rank)}
    return [PipelineStage(m, s, program.num_stages, torch.device("cpu")) for s, m in local.items()], local


def _error(make: Any) -> str:
    try:
        make()
    except pipec.PipecError as e:
        return f"{type(e).__name__}: {e.message}"
    return "no error"


def _constructor_errors(rank: int) -> dict[str, str]:
    """Mismatches between the stages and the schedule, refused by the constructor before torch is involved."""
    from torch.distributed.pipelining import PipelineStage

    def stages(indices: list[int], num_stages: int) -> list[Any]:
        return [PipelineStage(stage_module(s), s, num_stages, torch.device("cpu")) for s in indices]

    v_shape = [rank, 3 - rank]  # the V placement's stages on 2 ranks; interleaved_1f1b loops: rank, rank + 2
    return {
        "placement": _error(lambda: PipelineSchedule("interleaved_1f1b", stages(v_shape, 4), 4)),
        "stage count": _error(lambda: PipelineSchedule("1f1b", stages([rank], 3), 4)),
        "microbatches": _error(lambda: PipelineSchedule(pipec.compile("1f1b", 2, 4), stages([rank], 2), 8)),
        "chunks": _error(lambda: PipelineSchedule("zbv", stages([rank], 2), 4)),
    }


def _worker(world: int, folder: str) -> dict:
    """Every case on this rank of one spawned gloo group; returns the differences per (schedule, mode)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    results: dict = {}
    for name, (chunks, m2, m4) in CASES.items():
        microbatches = m2 if world == 2 else m4
        program = pipec.compile(_schedule(name), world, microbatches, chunks)
        for mode in MODES:
            stages, local = _stages(program, rank)
            loss_fn = torch.nn.functional.mse_loss
            if mode == "pipec.torch":
                schedule = PipelineSchedule(_schedule(name), stages, microbatches, loss_fn=loss_fn)
                assert schedule.stage_index_to_group_rank == dict(enumerate(program.stage_to_rank))
            else:
                schedule = torch_schedules._PipelineScheduleRuntime(stages, microbatches, loss_fn=loss_fn)
                schedule._load_csv(str(Path(folder, f"{name}.csv")), format="compute_comms")
            # torch's own eval cannot run V placements' training orders (see PipelineSchedule.eval): pipec.torch's only
            results[(name, mode)] = _run_one(schedule, program.num_stages, local, evaluate=mode == "pipec.torch")
    if world == 2:
        results["errors"] = _constructor_errors(rank)
    results["example losses"] = runpy.run_path(str(TRAIN_EXAMPLE))["train"](*EXAMPLE_RUNS[world])
    return results


@functools.cache
def _group(world: int) -> list[dict]:
    """One spawned group of `world` ranks running every case (cached: two tests read the 2-rank group)."""
    with tempfile.TemporaryDirectory() as folder:
        for name, (chunks, m2, m4) in CASES.items():
            program = pipec.compile(_schedule(name), world, m2 if world == 2 else m4, chunks)
            Path(folder, f"{name}.csv").write_text(emit(program, "torch-csv-comms"))  # what `--format` writes
        return launch.spawn(_worker, world, (world, folder), timeout_s=60)


@pytest.mark.parametrize("world", [2, 4])
def test_torch_runs_pipec_schedules_like_unsplit_training(world: int) -> None:
    per_rank = _group(world)
    worst: dict[tuple[str, str], dict[str, float]] = {}
    for result in per_rank:
        for key, diffs in result.items():
            if key not in ("errors", "example losses"):
                for what, value in diffs.items():
                    worst.setdefault(key, {})[what] = max(value, worst.get(key, {}).get(what, 0.0))
    assert sorted(worst) == sorted((name, mode) for name in CASES for mode in MODES)
    print(f"\nworld {world}: worst |difference| from unsplit training")
    for key, diffs in sorted(worst.items()):
        print(f"  {key[0]:<17} {key[1]:<12} " + "  ".join(f"{k} {v:.1e}" for k, v in sorted(diffs.items())))
    shown = {"pipec.torch": {"grad", "loss", "eval", "grad after eval"}, "comms csv": {"grad", "loss"}}
    bad = {
        key: diffs for key, diffs in worst.items() if max(diffs.values()) >= TOLERANCE or set(diffs) != shown[key[1]]
    }
    assert not bad, bad


def test_constructor_names_the_mismatch() -> None:
    errors = _group(2)[1]["errors"]
    assert errors["placement"].startswith("PipecInputError: pipec.torch: rank 1 holds stages [1, 2], but")
    assert "places stages [1, 3] on rank 1" in errors["placement"]
    assert "the stages say the model has 3 stages, but rank 1 holds 1 of them on 2 ranks" in errors["stage count"]
    assert "compiled for M=4 (the stages and n_microbatches give 8)" in errors["microbatches"]
    assert "P=2 ranks, V=1 local stages, M=4 micro-batches" in errors["chunks"] and "V = 2" in errors["chunks"]


@pytest.mark.parametrize("world", [2, 4])
def test_example_training_loop_trains_like_the_unsplit_model(world: int) -> None:
    """examples/torch/train.py (pipec.torch in a torchtitan-style loop: 3 steps of SGD) against the same 3 steps of
    ordinary training of the whole model."""
    example = runpy.run_path(str(TRAIN_EXAMPLE))
    model = torch.nn.Sequential(*example["whole_model"]())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for x, y in example["batches"](3):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    got = [r["example losses"] for r in _group(world) if r["example losses"]]
    assert len(got) == 1 and got[0] == pytest.approx(expected, abs=TOLERANCE), (got, expected)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
