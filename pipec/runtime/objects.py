"""Python objects between ranks without NumPy.

torch's `all_gather_object`/`broadcast_object_list` turn the received bytes back into objects through NumPy
(`Numpy is not available` on a torch install without it), so the runtime pickles into uint8 tensors itself.
Used only at set-up and after the last step (agreement, shapes, report, trace, weights), never per message.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj))
    return torch.frombuffer(data, dtype=torch.uint8).to(device) if data else torch.zeros(0, dtype=torch.uint8)


def _decode(tensor: torch.Tensor, size: int) -> Any:
    return pickle.loads(bytes(tensor[:size].cpu().tolist()))


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    device, world = _device(), dist.get_world_size()
    payload = _encode(obj, device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return [_decode(part, int(s.item())) for part, s in zip(parts, sizes, strict=True)]


def broadcast_object(obj: Any, src: int) -> Any:
    """`obj` from rank `src`, on every rank (other ranks' `obj` is ignored)."""
    device = _device()
    payload = _encode(obj, device) if dist.get_rank() == src else torch.zeros(0, dtype=torch.uint8, device=device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    buffer = payload if dist.get_rank() == src else torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src)
    return _decode(buffer, int(size.item()))
