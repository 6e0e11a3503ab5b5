"""An example workload for `pipec run` (copy it and change the model, the data and the optimizer).

    pipec run 1f1b --ranks 4 --microbatches 8 --model examples.workload:transformer_like --steps 5
    pipec run zbv -P 2 -M 8 --model examples.workload:mlp --report run.json --trace run.trace.json
    torchrun --nproc-per-node 4 -m pipec.run interleaved_1f1b -P 4 -M 8 --model examples.workload:mlp
    pipec run 1f1b -P 2 --dp 2 -M 4 --model examples.workload:mlp --checkpoint ckpt --checkpoint-every 5

The protocol: a function with no arguments returning an object with
- `layers`: an nn.Sequential (or a list of modules); pipec splits it into the schedule's stages, in order;
- `loss_fn(output, target)`: a scalar, the mean over the batch (pipec runs it on the last stage per micro-batch);
- `batches`: a list of full (input, target) batches, one per step; each is split along dim 0 into M micro-batches
  (the batch size must be divisible by M);
- optionally `optimizer(params)`: an optimizer over the given parameters (default SGD, lr 0.1).
Every rank calls the function after `torch.manual_seed(--seed)`, so every rank builds the same initial model and
data: create parameters and random data inside the function, not at import time.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


def mlp(hidden: int = 64, blocks: int = 16, batch: int = 64, steps: int = 10) -> SimpleNamespace:
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    batches = [(torch.randn(batch, hidden), torch.randn(batch, hidden)) for _ in range(steps)]
    return SimpleNamespace(layers=nn.Sequential(*layers), loss_fn=nn.functional.mse_loss, batches=batches)


class Block(nn.Module):
    """A pre-norm residual MLP block, as in a transformer without attention."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def transformer_like(hidden: int = 64, blocks: int = 8, vocab: int = 100, seq: int = 16, batch: int = 32):
    blocks_ = [Block(hidden) for _ in range(blocks)]
    layers = nn.Sequential(nn.Embedding(vocab, hidden), *blocks_, nn.LayerNorm(hidden), nn.Linear(hidden, vocab))
    batches = [(torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))) for _ in range(10)]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    return SimpleNamespace(
        layers=layers, loss_fn=loss_fn, batches=batches, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)
    )
