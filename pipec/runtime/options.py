"""What `pipec run` asks of a run (its flags), handed from the command line to every worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Options:
    model: str
    steps: int | None = None
    seed: int = 0
    partition: str = "params"
    save: str | None = None
    report: str | None = None
    trace: str | None = None
    quiet: bool = False
    timeout_s: float = 30.0  # each p2p batch
    allow_nonfinite: bool = False  # train on through NaN/inf losses and gradients (no check, no cost)
    dp: int = 1  # D: pipeline replicas (data parallel); the world is P x D processes
    checkpoint: str | None = None  # DIR: write checkpoints there
    checkpoint_every: int | None = None  # K: a checkpoint every K steps (and always after the last step)
    resume: str | None = None  # the step directory to resume from (chosen and checked before workers start)
    resume_step: int = 0  # the steps it holds: training continues at this step index
    job: str | None = None  # torchrun's run id (TORCHELASTIC_RUN_ID), recorded in manifests; None otherwise
    dtype: str = "fp32"  # --dtype: fp32, or bf16/fp16 (autocast, boundary tensors in that dtype; docs/runtime.md)
    log_every: int = 1  # --log-every K: a step line every K steps (and for the first and last)
