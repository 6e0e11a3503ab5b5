"""GPT-2 with tied embeddings (or any pipec.hf model) trained with torch's PipelineStages and a pipec schedule.

    torchrun --nproc-per-node 2 examples/torch/hf_train.py 1f1b --microbatches 4
    torchrun --nproc-per-node 2 examples/torch/hf_train.py zbv --microbatches 4 --chunks 2 --architecture llama

Every rank builds the whole model (same seed) and hands torch the stages its placement holds, cut from pipec.hf's
layers; `model=` lets pipec.torch find the tied embedding and sum its gradient across the ranks holding it
(docs/torch.md, "Tied parameters"). tests/runtime/test_hf.py runs `train` against the HF model's own training loop.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

import pipec
import pipec.hf
from pipec.runtime.stages import partition
from pipec.torch import PipelineSchedule

GPT2 = {"n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 32}  # ties its embeddings
LLAMA = {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 64, "tie_word_embeddings": True}  # fmt: skip


def train(
    schedule: str, microbatches: int, chunks: int = 1, architecture: str = "gpt2", **options
) -> tuple[dict, list[str]]:
    """3 SGD steps (lr 0.1); returns the HF model's parameters this rank holds afterwards, by their HF names, and
    the ties the schedule synced."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    program = pipec.compile(schedule, ranks=ranks, microbatches=microbatches, chunks=chunks)
    torch.manual_seed(0)
    options = options or (GPT2 if architecture == "gpt2" else LLAMA)
    work = pipec.hf.from_config(architecture, **options)  # .model: the transformers model
    layers, num_stages = work.layers, program.num_stages  # embedding, blocks, norm + LM head
    sizes = partition(layers, num_stages)  # layers per stage, balanced by parameter count
    starts = [sum(sizes[:s]) for s in range(num_stages + 1)]
    modules = {s: torch.nn.Sequential(*layers[starts[s] : starts[s + 1]]) for s in program.stages_of(rank)}
    stages = [PipelineStage(m, s, num_stages, torch.device("cpu")) for s, m in modules.items()]
    pipe = PipelineSchedule(program, stages, microbatches, loss_fn=pipec.hf.loss_fn, model=work.model)
    params = list(dict.fromkeys(p for m in modules.values() for p in m.parameters()))  # a tied weight once
    optimizer = torch.optim.SGD(params, lr=0.1)
    first, last = 0 in modules, num_stages - 1 in modules
    for ids, target in work.batches:
        optimizer.zero_grad()
        pipe.step(*((ids,) if first else ()), target=target if last else None)
        optimizer.step()
    held = {id(p) for p in params}
    named = work.model.named_parameters(remove_duplicate=False)
    return {n: p.detach().clone() for n, p in named if id(p) in held}, pipe.tied_parameters


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("schedule")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--architecture", default="gpt2", choices=pipec.hf.ARCHITECTURES)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        trained, ties = train(args.schedule, args.microbatches, args.chunks, args.architecture)
        print(f"rank {dist.get_rank()}: 3 steps, {len(trained)} tensors held, ties synced: {ties}")
    finally:
        dist.destroy_process_group()
