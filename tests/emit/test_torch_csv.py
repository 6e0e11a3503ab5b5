"""pipec's torch CSV is PyTorch's own: torch's `_load_csv` accepts it, its lowering and simulator run it, and a real
two-process gloo run under `_PipelineScheduleRuntime` with pipec's schedule gives torch's own results."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # as conftest.py does: run as a script too

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.pipelining import schedules as torch_schedules  # noqa: E402
from torch_reference import HIDDEN, _stage, stage_module  # noqa: E402

import pipec  # noqa: E402
from pipec.emit import dump_torch_csv  # noqa: E402
from pipec.emit.torch_csv import TORCH_RUNTIME_ONLY  # noqa: E402

CASES = [
    ("1f1b", 4, 8, 1),
    ("gpipe", 2, 3, 1),
    ("interleaved_1f1b", 4, 8, 2),
    ("looped_bfs", 2, 4, 2),
    ("interleaved_zb", 3, 6, 2),
    ("zb_h1", 3, 5, 1),
    ("zbv", 4, 8, 2),
    ("dualpipev", 4, 8, 2),
]


def _runtime(program: pipec.Program):
    stages = [_stage(s, 0, program.ranks, program.num_stages) for s in program.stages_of(0)]
    return torch_schedules._PipelineScheduleRuntime(stages, program.microbatches)


@pytest.mark.parametrize(("name", "ranks", "microbatches", "chunks"), CASES)
def test_torch_loads_pipec_csv(name: str, ranks: int, microbatches: int, chunks: int, tmp_path: Path) -> None:
    program = pipec.compile(name, ranks, microbatches, chunks)
    compute_csv = tmp_path / "compute.csv"
    compute_csv.write_text(dump_torch_csv(program, with_comms=False))
    schedule = _runtime(program)
    schedule._load_csv(str(compute_csv), format="compute_only")
    for rank, stream in enumerate(program.compute_streams()):
        assert [str(a) for a in schedule.pipeline_order[rank] if a is not None] == [str(i) for i in stream]
    assert schedule.stage_index_to_group_rank == dict(enumerate(program.stage_to_rank))

    comms_csv = tmp_path / "comms.csv"
    comms_csv.write_text(dump_torch_csv(program, with_comms=True))
    schedule = _runtime(program)
    schedule._load_csv(str(comms_csv), format="compute_comms")
    # pipec's streams as written, plus torch's REDUCE_GRAD/UNSHARD/RESHARD (test_torch_api checks where they go)
    order = {
        rank: [a for a in actions if a.computation_type.name not in TORCH_RUNTIME_ONLY]
        for rank, actions in schedule.pipeline_order_with_comms.items()
    }
    for rank, stream in enumerate(program.streams):
        assert [str(a) for a in order[rank]] == [str(i) for i in stream]
    if not any(isinstance(i, pipec.Overlap) for s in program.streams for i in s):  # torch's simulator has no overlap
        torch_schedules._simulate_comms_compute(order, lambda s: program.stage_to_rank[s], program.num_stages)


def test_pipec_reads_torch_dumped_csv(tmp_path: Path) -> None:
    from torch_reference import torch_schedule

    schedule = torch_schedule("interleaved_1f1b", 4, 8, 2)
    path = tmp_path / "torch.csv"
    schedule._dump_csv(str(path), format="compute_only")
    program = pipec.compile(str(path))
    assert (program.ranks, program.microbatches, program.chunks) == (4, 8, 2)
    assert program.streams == pipec.compile("interleaved_1f1b", 4, 8, 2).streams
    program.check(p2p="tagged")


# ---- a real run: torch's runtime executing pipec's CSV equals torch's own schedule ----------------------------

BATCH = 8


def _worker(rank: int, world: int, port: int, csv_path: str, chunks: int, microbatches: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    try:
        num_stages = world * chunks
        results = {}
        for mode in ("torch", "pipec"):
            stage_ids = [rank + c * world for c in range(chunks)]
            modules = {s: stage_module(s) for s in stage_ids}
            stages = [PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in stage_ids]
            loss_fn = torch.nn.MSELoss()
            if mode == "torch":
                schedule = torch_schedules.ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)
            else:
                schedule = torch_schedules._PipelineScheduleRuntime(stages, microbatches, loss_fn=loss_fn)
                # compute_only: torch's own lowering adds the comms (tests/runtime/test_torch_api.py runs pipec's
                # compute_comms files, REDUCE_GRAD included).
                schedule._load_csv(csv_path, format="compute_only")
            torch.manual_seed(0)
            x, target = torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN)
            losses: list = []
            if rank == 0:
                schedule.step(x, target=target, losses=losses)
            elif rank == world - 1:
                schedule.step(target=target, losses=losses)
            else:
                schedule.step()
            results[mode] = {s: [p.grad.clone() for p in modules[s].parameters()] for s in stage_ids}
        same = all(
            torch.equal(a, b)
            for s in results["torch"]
            for a, b in zip(results["torch"][s], results["pipec"][s], strict=True)
        )
        Path(out, f"rank{rank}").write_text("same" if same else "different")
    finally:
        dist.destroy_process_group()


def test_torch_runtime_runs_pipec_csv_like_its_own_schedule(tmp_path: Path) -> None:
    world, chunks, microbatches = 2, 2, 4
    program = pipec.compile("interleaved_1f1b", world, microbatches, chunks)
    csv_path = tmp_path / "streams.csv"
    csv_path.write_text(dump_torch_csv(program, with_comms=False))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, str(csv_path), chunks, microbatches, str(tmp_path)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(world)] == ["same"] * world


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
