"""Each step's micro-batches on the rank's device: the inputs where the rank runs stage 0, the targets where it
runs the last stage (of a copy, in a replicated program; no other rank reads them, so none other copies them).

On a GPU the copy of a batch is work the plain training loop does too, but it need not be on the step's path:
`prefetch` copies the next step's micro-batches on a side stream while the GPU is still running this step's
queued kernels (the worker calls it after posting the whole step, before its synchronize), and `take` hands them
over, making the compute stream wait for that copy and telling the allocator the tensors are used there. A batch
that was not prefetched (the first step, a batch other than the one announced) is copied on the compute stream
as it is needed. On the CPU, `take` splits the batch and nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipec.runtime import workload


@dataclass
class Feed:
    device: torch.device
    microbatches: int
    replica: int = 0
    replicas: int = 1
    inputs_here: bool = True  # the rank runs stage 0 (a copy's first stage)
    targets_here: bool = True  # the rank runs the last stage (a copy's last)
    stream: object = None  # the side stream of the copies ahead (CUDA only)
    ahead: tuple | None = field(default=None, repr=False)  # (the batch, its inputs, its targets) copied ahead

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)

    def _split(self, batch) -> tuple[list, list]:
        return workload.split(batch, self.microbatches, self.replica, self.replicas)

    def _place(self, inputs: list, targets: list) -> tuple[list, list]:
        """The tensors this rank reads, copied to the device (asynchronously: each copy is ordered on the current
        stream); the others left where they are, unread."""
        device = self.device
        if self.inputs_here:
            inputs = [x.to(device, non_blocking=True) for x in inputs]
        if self.targets_here:
            targets = [y.to(device, non_blocking=True) for y in targets]
        return inputs, targets

    def take(self, batch) -> tuple[list, list]:
        """This step's micro-batches (inputs, targets) of `batch`, ready on the device for the compute stream."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[0] is not batch:
            if self.device.type == "cpu":
                return self._split(batch)
            return self._place(*self._split(batch))
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)  # the compute waits for the copies made ahead
        for tensor in (*ahead[1], *ahead[2]):
            if tensor.device.type == "cuda":  # (what this rank does not read stayed on the CPU)
                tensor.record_stream(current)  # allocated on the side stream, used and freed on this one
        return ahead[1], ahead[2]

    def prefetch(self, batch) -> None:
        """Start copying the next step's `batch` on the side stream (a GPU; nothing on the CPU). A batch that
        cannot be split is left for `take` to report when its step comes."""
        if self.stream is None or batch is None:
            return
        try:
            inputs, targets = self._split(batch)
        except Exception:  # the step that takes this batch raises it, with its message
            return
        with torch.cuda.stream(self.stream):
            self.ahead = (batch, *self._place(inputs, targets))
