"""An example workload for `pipec run` (copy it and change the model, the data and the optimizer).

    pipec run 1f1b --ranks 4 --microbatches 8 --model examples.workload:transformer_like --steps 5
    pipec run zbv -P 2 -M 8 --model examples.workload:mlp --report run.json --trace run.trace.json
    pipec run zb_h1 -P 4 -M 8 --model examples.workload:causal_transformer --dtype bf16 --steps 5
    torchrun --nproc-per-node 4 -m pipec.run interleaved_1f1b -P 4 -M 8 --model examples.workload:mlp
    pipec run 1f1b -P 2 --dp 2 -M 4 --model examples.workload:mlp --checkpoint ckpt --checkpoint-every 5

The protocol: a function with no arguments returning an object with
- `layers`: an nn.Sequential (or a list of modules); pipec splits it into the schedule's stages, in order;
- `loss_fn(output, target)`: a scalar, the mean over the batch (pipec runs it on the last stage per micro-batch);
- a layer may return a tuple of tensors: the next layer receives them as positional arguments (see
  `causal_transformer`, whose layers pass (hidden, positions)); the loss gets the last layer's output as it is;
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


def heavy_last_transformer() -> SimpleNamespace:
    """`transformer_like` with 10 blocks: `--partition 3,2,2,6` gives stages of 2, 2, 2 and 4 blocks, a last stage
    twice as heavy as the others (docs/tuning.md tunes a schedule for it)."""
    return transformer_like(hidden=128, blocks=10, seq=32, batch=64)


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (RoPE): each pair of channels of x (batch, heads, seq, dim) turned by an angle
    proportional to the token's integer position (positions: (batch, seq))."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions[:, None, :, None].float() * freq  # (batch, 1, seq, half), in float32 under autocast too
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Embed(nn.Module):
    """Token embeddings, and each token's position (an integer tensor the blocks use for RoPE)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape)
        return self.tokens(tokens), positions


class AttentionBlock(nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention with rotary positions, then an MLP.
    Takes and returns (hidden, positions): the positions travel from stage to stage with the activations."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, positions), rotate(k, positions)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, h))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x)))), positions


class Head(nn.Module):
    """The final norm and the logits; the positions are no longer needed."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def causal_transformer(
    hidden: int = 64, heads: int = 4, blocks: int = 8, vocab: int = 100, seq: int = 16, batch: int = 32
) -> SimpleNamespace:
    """A small causal language model whose layers pass (hidden, positions) between them: pipec sends both
    tensors across a stage boundary (the float32 or --dtype activations and the int64 positions) and the
    gradient of the activations only. The task: predict each next token of random sequences."""
    layers = nn.Sequential(
        Embed(vocab, hidden), *[AttentionBlock(hidden, heads) for _ in range(blocks)], Head(hidden, vocab)
    )
    sequences = [torch.randint(0, vocab, (batch, seq + 1)) for _ in range(10)]
    batches = [(s[:, :-1], s[:, 1:]) for s in sequences]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), target.reshape(-1))

    return SimpleNamespace(
        layers=layers, loss_fn=loss_fn, batches=batches, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)
    )
