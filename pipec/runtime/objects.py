"""Python objects between ranks without NumPy.

torch's `all_gather_object`/`broadcast_object_list` turn the received bytes back into objects through NumPy
(`Numpy is not available` on a torch install without it), so the runtime pickles into uint8 tensors itself.
Used only at set-up, for checkpoints and after the last step (agreement, shapes, report, trace, weights), never
per message.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


def group_device(group=None) -> torch.device:
    """Where a process group's tensors live: this process's GPU under NCCL (CUDA tensors only), else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj))
    return torch.frombuffer(data, dtype=torch.uint8).to(device) if data else torch.zeros(0, dtype=torch.uint8)


def _decode(tensor: torch.Tensor, size: int) -> Any:
    return pickle.loads(bytes(tensor[:size].cpu().tolist()))


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    device, world = group_device(), dist.get_world_size()
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


def gather_objects(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank `dst` only (None elsewhere): a checkpoint's parts go to the
    rank that writes them, without every rank receiving every part as `all_gather_objects` would."""
    device, world, rank = group_device(), dist.get_world_size(), dist.get_rank()
    payload = _encode(obj, device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)  # every rank pads to the longest: gather needs tensors of one size
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    parts = [torch.zeros_like(padded) for _ in range(world)] if rank == dst else None
    dist.gather(padded, parts, dst=dst)
    if parts is None:
        return None
    return [_decode(part, int(s.item())) for part, s in zip(parts, sizes, strict=True)]


def broadcast_object(obj: Any, src: int, group=None) -> Any:
    """`obj` from rank `src` (a global rank), on every rank of `group` (default: all); other ranks' `obj` is
    ignored."""
    device = group_device(group)
    payload = _encode(obj, device) if dist.get_rank() == src else torch.zeros(0, dtype=torch.uint8, device=device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buffer = payload if dist.get_rank() == src else torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    return _decode(buffer, int(size.item()))
