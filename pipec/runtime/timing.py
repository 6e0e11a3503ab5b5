"""Where a step's compute times come from: the host clock on the CPU, CUDA events on a GPU.

On the CPU a torch call returns when its work is done, so the host's `perf_counter` around it (the interpreter's
`_mark`) is the compute time: `HostClock` adds nothing to the step. On a GPU a call returns once its kernels are
queued, and the host clock reads the launch, not the work. `CudaClock` records a CUDA event on the compute
stream before and after each compute action (from a pool that grows to the longest step and is then reused: no
allocation per op), ends the step with one synchronize, and then reads every event against an origin event
recorded when the step began. The GPU is idle at that moment (the previous step ended with a synchronize), so
the origin fires at the host time read beside it, and the events' offsets place each action on the host's
timeline: the trace shows when the GPU ran it.

Both give, after the step, `(action, start, duration)` per compute action in host `perf_counter` seconds
(`resolve`), and the optimizer step's seconds (`optimizer_s`: on a GPU, two events of their own around it, so
that it holds the optimizer's kernels and not the end of the step's backlog, which the host waits for in
`finish_step`). The interpreter's own cost stays the host's (the loop's time outside torch's calls) either way.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from pipec.ir import Action

perf = time.perf_counter
Timed = tuple[Action, float, float]  # (action, start, duration), host perf_counter seconds


class Clock(Protocol):
    """A step's timing source. `device` is False when the host's readings are the compute times (then the
    interpreter calls neither `start` nor `stop`)."""

    device: bool

    def begin_step(self) -> None: ...

    def start(self) -> None: ...

    def stop(self, action: Action) -> None: ...

    def begin_optimizer(self) -> None: ...

    def end_optimizer(self) -> None: ...

    def finish_step(self) -> None: ...

    def resolve(self, timed: list[Timed]) -> list[Timed]: ...

    def optimizer_s(self, host_s: float) -> float: ...


class HostClock:
    """The CPU: torch's calls are synchronous, so the host readings `_mark` took are the compute times."""

    device = False

    def begin_step(self) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self, action: Action) -> None:
        pass

    def begin_optimizer(self) -> None:
        pass

    def end_optimizer(self) -> None:
        pass

    def finish_step(self) -> None:
        pass

    def resolve(self, timed: list[Timed]) -> list[Timed]:
        return timed

    def optimizer_s(self, host_s: float) -> float:
        return host_s


class CudaClock:
    """CUDA events around each compute action, resolved after the step's one synchronize."""

    device = True

    def __init__(self, device: torch.device) -> None:
        self.cuda = device
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin_host = 0.0
        self.pool: list = []  # events, reused every step; grows to the longest step's 2 x compute actions
        self.used = 0
        self.actions: list[Action] = []
        self.stream = torch.cuda.current_stream(device)
        self.optimizer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self.optimized = False  # whether this step ran an optimizer step (not forward-only, not skipped)

    def begin_step(self) -> None:
        self.used = 0
        self.actions.clear()
        self.optimized = False
        # The stream, looked up once a step: Event.record() without one builds a Stream object per call, a few
        # microseconds each, twice per action (the interpreter's host cost on a GPU).
        self.stream = torch.cuda.current_stream(self.cuda)
        self.origin_host = perf()
        self.origin.record(self.stream)

    def _next(self):
        if self.used == len(self.pool):
            self.pool.append(torch.cuda.Event(enable_timing=True))
        event = self.pool[self.used]
        self.used += 1
        return event

    def start(self) -> None:
        self._next().record(self.stream)

    def stop(self, action: Action) -> None:
        self._next().record(self.stream)
        self.actions.append(action)

    def begin_optimizer(self) -> None:
        self.optimizer[0].record(self.stream)

    def end_optimizer(self) -> None:
        self.optimizer[1].record(self.stream)
        self.optimized = True

    def finish_step(self) -> None:
        """The step ends when the GPU has done its work: the one synchronize per step."""
        torch.cuda.synchronize(self.cuda)

    def resolve(self, timed: list[Timed]) -> list[Timed]:
        """Each action's GPU start and duration, on the host timeline (after `finish_step`)."""
        origin, base, pool = self.origin, self.origin_host, self.pool
        out = []
        for k, action in enumerate(self.actions):
            start_ms = origin.elapsed_time(pool[2 * k])
            end_ms = origin.elapsed_time(pool[2 * k + 1])
            out.append((action, base + start_ms / 1e3, max(0.0, end_ms - start_ms) / 1e3))
        return out

    def optimizer_s(self, host_s: float) -> float:
        """The GPU's time in the optimizer step (after `finish_step`); 0 when the step ran none."""
        return self.optimizer[0].elapsed_time(self.optimizer[1]) / 1e3 if self.optimized else 0.0


def clock_for(device: torch.device) -> Clock:
    return CudaClock(device) if device.type == "cuda" else HostClock()
