"""A tiny language model with tied input/output embeddings, as `pipec run --model` workloads: the embedding is
the first layer, the LM head the last, and the head's weight IS the embedding's (one parameter, as GPT-2 ties
them), so under most placements the first and the last stage hold copies of it on different ranks."""

from __future__ import annotations

import torch
from torch import nn
from workloads import Residual

from pipec.runtime.workload import Workload

VOCAB, WIDTH, SEQ, BATCH, STEPS = 16, 8, 6, 8, 3
LR, MOMENTUM = 0.1, 0.9


class Head(nn.Linear):
    """Hidden states (B, T, H) -> logits (B, T, V) through the embedding's weight (set by `tied_lm`)."""

    def __init__(self) -> None:
        super().__init__(WIDTH, VOCAB, bias=False)


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each position predicts the next token (the last position predicts nothing)."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def tied_lm(blocks: int = 6, tied: bool = True) -> Workload:
    """Embedding, `blocks` residual blocks, head (blocks + 2 layers: 8 by default, one per stage of zbv or
    interleaved_1f1b at P=4, V=2), trained with SGD and momentum (an optimizer state that checkpoints carry)."""
    embed = nn.Embedding(VOCAB, WIDTH)
    head = Head()
    if tied:
        head.weight = embed.weight
    layers = nn.Sequential(embed, *[Residual(WIDTH) for _ in range(blocks)], head)
    batches = [(ids, ids) for ids in (torch.randint(VOCAB, (BATCH, SEQ)) for _ in range(STEPS))]
    return Workload(layers, loss_fn, batches, lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM))


def untied_lm() -> Workload:
    """The same model with a head of its own (the step-time baseline of bench/tied.py)."""
    return tied_lm(tied=False)


def reference(steps: int = STEPS, blocks: int = 6) -> dict[str, torch.Tensor]:
    """The plain one-process loop a user would write: each step the whole batch, one backward, one optimizer
    step, built with seed 0 as `pipec run --seed 0` builds the workload. Its state_dict (both tied keys)."""
    torch.manual_seed(0)
    work = tied_lm(blocks)
    params = [p for p in work.layers.parameters() if p.requires_grad]
    optimizer = work.optimizer(params)
    for k in range(steps):
        inputs, targets = work.batches[k % len(work.batches)]
        optimizer.zero_grad()
        loss_fn(work.layers(inputs), targets).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in work.layers.state_dict().items()}
