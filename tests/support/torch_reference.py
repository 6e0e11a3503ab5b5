"""PyTorch's own schedule orders, built in-process: the conformance reference for the library schedules.

torch's multi-stage schedule classes compute `pipeline_order` in their constructors from stage objects that
only need `group_size`, `group_rank` and `num_stages`, so a stand-in stage object is enough (no process
group). GPipe and 1F1B are single-stage classes whose `_get_pipeline_order` is not what they execute (1F1B's
numbers the last rank's forwards 1..M), so their reference is the order their `_step_microbatches` runs,
written out here from that method's loops.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.ERROR)

MULTI_STAGE = {
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


HIDDEN = 8  # the width of `stage_module`'s layers


def stage_module(stage: int, layers: int = 2) -> torch.nn.Module:
    """Stage `stage` of a small Linear+Tanh model for real runs, the same on every rank (seeded by its number)."""
    torch.manual_seed(1000 + stage)
    modules: list[torch.nn.Module] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()]
    return torch.nn.Sequential(*modules)


def _stage(index: int, rank: int, ranks: int, num_stages: int) -> SimpleNamespace:
    return SimpleNamespace(
        stage_index=index,
        group_rank=rank,
        group_size=ranks,
        num_stages=num_stages,
        submod=SimpleNamespace(),
        is_first=index == 0,
        is_last=index == num_stages - 1,
        stage_index_to_group_rank={},
    )


def torch_schedule(name: str, ranks: int, microbatches: int, chunks: int):
    """Construct torch's schedule object for rank 0 (every rank computes the whole pipeline_order)."""
    class_name, style = MULTI_STAGE[name]
    num_stages = ranks * chunks
    stage_ids = generate_rank_to_stage_mapping(ranks, num_stages, style=style)[0]
    stages = [_stage(s, 0, ranks, num_stages) for s in stage_ids]
    return getattr(torch_schedules, class_name)(stages, microbatches)


def _flatten(actions) -> list[str]:
    out = []
    for action in actions:
        if action is None:
            continue
        if action.sub_actions is not None:
            out.extend(str(sub) for sub in action.sub_actions)
        else:
            out.append(str(action))
    return out


def torch_orders(name: str, ranks: int, microbatches: int, chunks: int) -> list[list[str]]:
    """Per-rank compute actions as torch's strings (`0F1`); an overlapped pair counts as its two actions."""
    if name == "gpipe":
        return [
            [f"{r}F{m}" for m in range(microbatches)] + [f"{r}B{m}" for m in range(microbatches)] for r in range(ranks)
        ]
    if name == "1f1b":
        return [_one_f_one_b(r, ranks, microbatches) for r in range(ranks)]
    schedule = torch_schedule(name, ranks, microbatches, chunks)
    return [_flatten(schedule.pipeline_order[r]) for r in range(ranks)]


def _one_f_one_b(rank: int, ranks: int, microbatches: int) -> list[str]:
    """The order Schedule1F1B._step_microbatches executes on stage `rank`."""
    warmup = min(microbatches, ranks - rank)
    out = [f"{rank}F{m}" for m in range(warmup)]
    forward, backward = warmup, 0
    while True:
        out.append(f"{rank}B{backward}")
        backward += 1
        if forward == microbatches:
            break
        out.append(f"{rank}F{forward}")
        forward += 1
    out.extend(f"{rank}B{m}" for m in range(backward, microbatches))
    return out


# What torch's `_simulate_comms_compute` models; its own lowering also adds UNSHARD/RESHARD/REDUCE_GRAD actions,
# on which the simulator raises.
_TORCH_SIMULATED = {
    "FORWARD",
    "FULL_BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
}


def torch_simulation(name: str, ranks: int, microbatches: int, chunks: int):
    """A no-argument function running torch's `_simulate_comms_compute` on its own lowered schedule (the
    benchmarks' reference): returns the number of steps, or "failed: ..." when torch's simulator stalls."""
    schedule = torch_schedule(name, ranks, microbatches, chunks)
    order = {
        rank: [a for a in actions if a is not None and a.computation_type.name in _TORCH_SIMULATED]
        for rank, actions in schedule.pipeline_order_with_comms.items()
    }
    mapping, num_stages = schedule.stage_index_to_group_rank, schedule._num_stages

    def run() -> int | str:
        try:
            return len(torch_schedules._simulate_comms_compute(order, lambda s: mapping[s], num_stages)[0])
        except Exception as e:  # torch's simulator raises (after printing) when it stalls
            return f"failed: {type(e).__name__}"

    return run
