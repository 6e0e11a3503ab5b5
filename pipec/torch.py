"""pipec schedules inside torch.distributed.pipelining: a schedule object for torch's own stages and training loop.

    from pipec.torch import PipelineSchedule
    schedule = PipelineSchedule("my_schedule.pipe", stages, n_microbatches=8, loss_fn=loss_fn)
    schedule.step(x, target=y, losses=losses)      # as with torch's ScheduleInterleaved1F1B & co.

`PipelineSchedule` is a subclass of torch's `_PipelineScheduleRuntime` (the runtime behind torch's multi-stage
schedules and torchtitan's CSV option) whose `pipeline_order_with_comms` is set from pipec's compiled and verified
streams, torch's REDUCE_GRAD/UNSHARD/RESHARD included (`pipec.emit.torch_csv.torch_runtime_streams`, the same
rows `--format torch-csv-comms` writes): what torch runs is exactly what pipec compiled and verified, with torch's
stages, shape inference, p2p and `step`/`eval`. See docs/torch.md.

This module imports torch; `import pipec` does not import it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.pipelining import schedules as torch_schedules

import pipec
from pipec.emit.torch_csv import torch_runtime_streams
from pipec.errors import PipecError, PipecInputError, ScheduleError
from pipec.ir import Kind, Program, parse_instruction
from pipec.passes.p2p import insert_p2p_ops
from pipec.verify import Report, verify

# The p2p execution model a schedule is verified under before torch runs it.
# TORCH RULE: the execution rule of torch's `_PipelineScheduleRuntime` (docs/torch.md, "torch's execution rule"):
# each SEND/RECV action posted on its own, a receive waited for right before its compute, the ops of a rank
# completing in issue order as on one NCCL stream. pipec's own rule ("nccl") batches consecutive send/recv, so a
# stream valid there can deadlock inside torch.
P2P_MODEL = "torch"


def compile_for_torch(
    schedule: str | os.PathLike[str] | Program,
    ranks: int,
    microbatches: int,
    chunks: int,
    params: Mapping[str, int] | None = None,
) -> tuple[Program, Report]:
    """The program `PipelineSchedule` runs: compiled for (P, M, V) (or a given Program, checked against them), with
    send/recv, and verified. Raises PipecInputError for a mismatch, ScheduleError (with the report) when invalid."""
    what = f"P={ranks} ranks, V={chunks} local stages, M={microbatches} micro-batches"
    try:
        if isinstance(schedule, Program):
            program = schedule
            if params:
                raise PipecInputError(f"schedule parameters {sorted(params)} apply when compiling, not to a Program")
            given = {"P": program.ranks, "V": program.chunks, "M": program.microbatches}
            wanted = {"P": ranks, "V": chunks, "M": microbatches}
            wrong = [
                f"{k}={given[k]} (the stages and n_microbatches give {wanted[k]})"
                for k in given
                if given[k] != wanted[k]
            ]
            if wrong:
                raise PipecInputError(f"the Program {program.name!r} was compiled for {', '.join(wrong)}")
        else:
            program = pipec.compile(os.fspath(schedule), ranks, microbatches, chunks, **(params or {}))
    except PipecError as e:
        raise type(e)(f"pipec.torch ({what}): {e.message}", e.span, e.rank) from None
    if program.forward_only:
        raise PipecInputError(
            f"pipec.torch: {program.name} is forward-only; torch's runtime needs every micro-batch's backward. "
            "Build the schedule from a training schedule and call its eval() for inference"
        )
    if not program.has_comms:
        program = insert_p2p_ops(program)
    report = verify(program, p2p=P2P_MODEL)
    if not report.ok:
        raise ScheduleError(f"pipec.torch: {program.name} ({what}) fails verification:\n{report.render()}")
    return program, report


class PipelineSchedule(torch_schedules._PipelineScheduleRuntime):
    """A pipec schedule as a torch.distributed.pipelining schedule, usable wherever `PipelineScheduleMulti` is.

    `schedule`: a bundled name (see `pipec list`), a path to a .pipe or stream file, .pipe source text, or a compiled
    `pipec.Program`. P is the stages' process-group size, V the number of `stages` this rank holds (they must be the
    stages the schedule's placement puts on this rank), M is `n_microbatches`; `**params` are the schedule's named
    parameters. The schedule is compiled and verified here, on every rank, before any message is sent.
    """

    def __init__(
        self,
        schedule: str | os.PathLike[str] | Program,
        stages: Sequence[Any] | Any,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        **params: int,
    ) -> None:
        local = list(stages) if isinstance(stages, Sequence) else [stages]
        ranks, rank = _check_stages(local)
        self.program, self.report = compile_for_torch(schedule, ranks, n_microbatches, len(local), params)
        held = sorted(stage.stage_index for stage in local)
        placed = list(self.program.stages_of(rank))
        if held != placed:
            raise PipecInputError(
                f"pipec.torch: rank {rank} holds stages {held}, but {self.program.name} places stages {placed} on "
                f"rank {rank} (stage -> rank: {list(self.program.stage_to_rank)})"
            )
        # Torch passes only the options a caller set, so that a torch whose constructor lacks one still works.
        options: dict[str, Any] = {"loss_fn": loss_fn}
        for name, value, default in (
            ("args_chunk_spec", args_chunk_spec, None),
            ("kwargs_chunk_spec", kwargs_chunk_spec, None),
            ("output_merge_spec", output_merge_spec, None),
            ("scale_grads", scale_grads, True),
        ):
            if value is not default:
                options[name] = value
        # Ascending stage order: torch initialises the stages (in 2.13 with a vote passed by blocking send/recv
        # from stage to stage) in list order; with a V placement, another order can wait in a cycle.
        super().__init__(sorted(local, key=lambda s: s.stage_index), n_microbatches, **options)
        actions, install = _for_this_torch(torch_runtime_streams(self.program))
        getattr(self, install)(actions, format="compute_comms")  # torch validates it and sets its order from it
        # eval() runs the forwards only; torch would not accept them as a training order, so they bypass `install`
        self._eval_order = _for_this_torch(torch_runtime_streams(_forward_projection(self.program)))[0]
        # torch infers the stage -> rank map from the actions; pipec's placement is the authority, and they agree
        # because every stage's compute is on its rank (the structure check).
        mapping = dict(enumerate(self.program.stage_to_rank))
        self.stage_index_to_group_rank = mapping
        for stage in self._stages:
            stage.stage_index_to_group_rank = mapping

    def eval(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """Forward only, as torch's `eval`, but on the streams' forward actions alone. torch's own eval runs the
        training order with the backward actions skipped, which fails where adjacent stages share a rank (a V
        placement: "can't steal_bwd_input") and runs REDUCE_GRAD, dividing the gradients a step() left by M."""
        train_order, self.pipeline_order_with_comms = self.pipeline_order_with_comms, self._eval_order
        try:
            return super().eval(*args, target=target, losses=losses, **kwargs)
        finally:
            self.pipeline_order_with_comms = train_order


def _forward_projection(program: Program) -> Program:
    """The streams' forwards and their messages, in order (an overlapped pair keeps its forward half). Dropping
    actions from a verified stream adds no wait, so it runs whenever the whole stream does; it is verified anyway."""
    streams = tuple(
        tuple(a for i in stream for a in i.parts if a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F))
        for stream in program.streams
    )
    forward = replace(program, name=f"{program.name} (eval)", streams=streams, forward_only=True, memory_bound=None)
    verify(forward, p2p=P2P_MODEL).raise_if_failed()
    return forward


def _check_stages(stages: list[Any]) -> tuple[int, int]:
    """(P, this rank) from the stages, which must agree with each other and number P * (stages per rank) in all."""
    if not stages:
        raise PipecInputError("pipec.torch: no stages given; pass this rank's PipelineStage objects")
    first = stages[0]
    for stage in stages[1:]:
        if _pipeline_of(stage) != _pipeline_of(first):
            raise PipecInputError(
                f"pipec.torch: stages {first.stage_index} and {stage.stage_index} disagree about the pipeline "
                "(process group or number of stages)"
            )
    indices = [stage.stage_index for stage in stages]
    if len(set(indices)) != len(indices):
        raise PipecInputError(f"pipec.torch: a stage is given twice: {indices}")
    ranks, local = first.group_size, len(stages)
    if first.num_stages != ranks * local:
        raise PipecInputError(
            f"pipec.torch: the stages say the model has {first.num_stages} stages, but rank {first.group_rank} holds "
            f"{local} of them on {ranks} ranks ({ranks} x {local} = {ranks * local}); every rank must hold the same "
            "number of stages"
        )
    return ranks, first.group_rank


def _pipeline_of(stage: Any) -> tuple[int, int, int]:
    return stage.group_size, stage.group_rank, stage.num_stages


def _for_this_torch(rows: Sequence[Sequence[str]]) -> tuple[dict[int, list[Any]], str]:
    """pipec's per-rank actions as this torch's `_Action`s, and the name of the runtime method that installs a
    compute_comms order. The one place where torch versions differ:
    - before 2.6 torch's IR named the input backward `B` and the full one `BW`: refused;
    - torch with `_prepare_schedule_with_comms` (2.13, run): REDUCE_GRAD and OVERLAP_F_B exist; all as written;
    - torch with `_load_actions` instead (an earlier 2.x, read from its source, not run): no REDUCE_GRAD (its
      runtime scales gradients inside each stage's last B or W) and no OVERLAP_F_B (a pair becomes its two halves,
      which is how the newer runtime runs a pair anyway)."""
    types = torch_schedules._ComputationType
    action = torch_schedules._Action
    if action.from_str("0B0").computation_type is not types.FULL_BACKWARD:
        raise PipecInputError(
            f"pipec.torch: torch {torch.__version__} names schedule actions differently (B was the input backward "
            "before 2.6); pipec.torch needs torch 2.6 or later"
        )
    known = set(types.__members__)
    actions: dict[int, list[Any]] = {}
    for rank, row in enumerate(rows):
        out: list[Any] = []
        for cell in row:
            if cell.endswith("REDUCE_GRAD") and "REDUCE_GRAD" not in known:
                continue
            if cell.endswith("OVERLAP_F_B") and "OVERLAP_F_B" not in known:
                out.extend(action.from_str(str(half)) for half in parse_instruction(cell).parts)
                continue
            out.append(action.from_str(cell))
        actions[rank] = out
    runtime = torch_schedules._PipelineScheduleRuntime
    install = "_prepare_schedule_with_comms" if hasattr(runtime, "_prepare_schedule_with_comms") else "_load_actions"
    return actions, install


__all__ = ["P2P_MODEL", "PipelineSchedule", "compile_for_torch"]
