"""Data parallel x pipeline parallel (`pipec run --dp D`): the rank layout, the replica groups, and the averaging
of each stage's gradients over its D replicas.

Layout, pipeline-major: global rank g = replica * P + pipeline rank, so replica r holds global ranks r*P to
r*P + P - 1. A pipeline's ranks are consecutive, so torchrun with `--nproc-per-node` a multiple of P puts each
pipeline on one node: the point-to-point traffic (2 x M messages per stage boundary per step, each on the critical
path) stays on the node's fast links, and only the gradient all-reduce (one bucketed collective per stage per
step, off the p2p path) crosses nodes. Replica-major (g = pipeline rank * D + replica) would do the opposite.

Every replica runs the same verified streams; its p2p peers are the same pipeline ranks offset by replica * P.
After a step's stream has ended (every p2p batch waited for), each stage's gradients are summed over the D
ranks that hold that stage (one process group per pipeline rank: `torch.distributed.new_group`, which every rank
must call for every group, in the same order) and divided by D. Gradients are flattened into buckets of at most
BUCKET_BYTES per stage (one all-reduce per bucket instead of one per tensor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size (bucket_cap_mb=25)


@dataclass(frozen=True)
class Layout:
    """Where each (replica, pipeline rank) lives among the P x D global ranks (pipeline-major)."""

    ranks: int  # P: ranks per pipeline
    replicas: int  # D

    @property
    def world(self) -> int:
        return self.ranks * self.replicas

    def replica(self, rank: int) -> int:
        return rank // self.ranks

    def pipeline_rank(self, rank: int) -> int:
        return rank % self.ranks

    def global_rank(self, replica: int, pipeline_rank: int) -> int:
        return replica * self.ranks + pipeline_rank

    def group_ranks(self, pipeline_rank: int) -> list[int]:
        """The global ranks holding pipeline rank `pipeline_rank`'s stages, one per replica."""
        return [self.global_rank(r, pipeline_rank) for r in range(self.replicas)]


_GROUPS: dict[tuple, list] = {}  # (default group, P, D) -> one process group per pipeline rank


def replica_group(layout: Layout, rank: int, timeout: timedelta):
    """This rank's replica group (the D ranks holding its stages), or None when D = 1. Every rank creates all P
    groups, in pipeline-rank order, the first time a layout is used in a process group (new_group is collective
    over the default group); later runs in the same process group reuse them."""
    if layout.replicas == 1:
        return None
    key = (id(dist.group.WORLD), layout.ranks, layout.replicas)
    if key not in _GROUPS:
        _GROUPS[key] = [dist.new_group(layout.group_ranks(p), timeout=timeout) for p in range(layout.ranks)]
    return _GROUPS[key][layout.pipeline_rank(rank)]


def buckets(grads: list[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Consecutive dense gradients of one device and dtype, at most `limit` bytes each (a larger gradient is a
    bucket of its own). The order is the parameters' order, the same on every replica."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = out[-1] if out else None
        if last is None or (last[0].device, last[0].dtype) != (g.device, g.dtype) or size + nbytes > limit:
            out.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return out


def sum_gradients(params: list, group, events: list | None = None, label: str = "sync") -> float:
    """Replace each parameter's gradient by its sum over `group` (SUM all-reduces, bucketed as `average_gradients`
    buckets): a SYNC of tied parameters (ties.py). A parameter without a gradient on this rank takes part with
    zeros (it gets one: another member's may be non-zero), so every member reduces the same buckets. Returns the
    seconds spent; `events` receives one (name, "sync", start, duration) per all-reduce, for the trace."""
    seconds = 0.0
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    parts = buckets([g for g in grads if not g.is_sparse])
    for index, bucket in enumerate(parts):
        start = time.perf_counter()
        if len(bucket) == 1 and bucket[0].is_contiguous():  # no copy in and out of a flat buffer
            dist.all_reduce(bucket[0], group=group)
        else:
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=group)
            for g, total in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                g.copy_(total)
        elapsed = time.perf_counter() - start
        seconds += elapsed
        if events is not None:
            events.append((f"{label} bucket {index + 1}/{len(parts)}", "sync", start, elapsed))
    for g in grads:
        if g.is_sparse:  # (gloo sums sparse gradients; NCCL has no sparse all-reduce)
            start = time.perf_counter()
            dist.all_reduce(g, group=group)
            elapsed = time.perf_counter() - start
            seconds += elapsed
            if events is not None:
                events.append((f"{label} sparse", "sync", start, elapsed))
    return seconds


def average_gradients(
    stages: dict, group, replicas: int, flag: bool | None, events: list | None = None
) -> tuple[float, bool]:
    """Replace each stage's gradients by their mean over the replica group. Returns (seconds spent in the
    all-reduces, whether another replica found non-finite values).

    `flag` is this rank's own non-finite finding (None: not checked). It rides at the end of the first bucket, so
    a replica whose peer found a NaN or inf skips its optimizer step too, without an extra message. Parameters
    without a gradient are left out on every replica alike (the streams and the model are the same); sparse
    gradients are all-reduced one by one (gloo supports that, NCCL does not). `events` receives one
    (name, "allreduce", start, duration) per all-reduce, for the trace.
    """
    seconds, peer_found = 0.0, False
    pending_flag = flag
    seen: set[int] = set()  # a parameter tied between two stages of this rank is averaged once
    for s in sorted(stages):
        params = stages[s].parameters()
        grads = [p.grad for p in params if p.grad is not None and id(p) not in seen]
        seen.update(map(id, params))
        dense = [g for g in grads if not g.is_sparse]
        parts = buckets(dense)
        for index, bucket in enumerate(parts):
            start = time.perf_counter()
            flat = _flatten_dense_tensors(bucket)
            if pending_flag is not None:
                flag_element = torch.full((1,), float(pending_flag), dtype=flat.dtype, device=flat.device)
                flat = torch.cat([flat, flag_element])
            dist.all_reduce(flat, group=group)
            if pending_flag is not None:
                peer_found = float(flat[-1]) > float(pending_flag)  # someone else's flag was set
                flat = flat[:-1]
                pending_flag = None
            flat.div_(replicas)
            for g, mean in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                g.copy_(mean)
            elapsed = time.perf_counter() - start
            seconds += elapsed
            if events is not None:
                events.append((f"allreduce stage {s} bucket {index + 1}/{len(parts)}", "allreduce", start, elapsed))
        for g in grads:
            if g.is_sparse:
                start = time.perf_counter()
                dist.all_reduce(g, group=group)
                g.div_(replicas)
                elapsed = time.perf_counter() - start
                seconds += elapsed
                if events is not None:
                    events.append((f"allreduce stage {s} sparse", "allreduce", start, elapsed))
    return seconds, peer_found
