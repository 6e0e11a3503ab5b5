"""pipec schedules inside torch.distributed.pipelining: a schedule object for torch's own stages and training loop.

    from pipec.torch import PipelineSchedule
    schedule = PipelineSchedule("my_schedule.pipe", stages, n_microbatches=8, loss_fn=loss_fn)
    schedule.step(x, target=y, losses=losses)      # as with torch's ScheduleInterleaved1F1B & co.

`PipelineSchedule` is a subclass of torch's `_PipelineScheduleRuntime` (the runtime behind torch's multi-stage
schedules and torchtitan's CSV option) whose `pipeline_order_with_comms` is set from pipec's compiled and verified
streams, torch's REDUCE_GRAD/UNSHARD/RESHARD included (`pipec.emit.torch_csv.torch_runtime_streams`, the same
rows `--format torch-csv-comms` writes): what torch runs is exactly what pipec compiled and verified, with torch's
stages, shape inference, p2p and `step`/`eval`. See docs/torch.md.

Tied parameters (one weight in several stages, such as tied input/output embeddings) are one logical parameter:
after each step the ranks holding a copy sum its gradient (`_Ties`), and every parameter is scaled by 1/M once,
however many of this rank's stages use it. A tie pipec.torch cannot see is refused, never trained apart.

This module imports torch; `import pipec` does not import it.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
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
    if program.pipelines > 1:
        raise PipecInputError(
            f"pipec.torch: {program.name} runs {program.pipelines} copies of the model (replicated pipelines); "
            "torch's runtime holds one module per stage index, each stage handing to the next, and cannot sum the "
            "copies' gradients: run it with `pipec run` (docs/runtime.md, \"Replicated pipelines\")"
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

    Tied parameters across stages (docs/torch.md, "Tied parameters"): `model`, the module the stages were cut from
    (built alike on every rank), lets pipec find every parameter that stages on several ranks hold; `tied` declares
    them instead, as groups `{stage index: parameter name in that stage's module}` (the same on every rank). Their
    gradients are summed across the ranks holding them after each step. A stage parameter that another module in
    this process registers too (a tie this rank cannot resolve) is refused unless `model` or `tied` covers it.
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
        model: torch.nn.Module | None = None,
        tied: Sequence[Mapping[int, str]] | None = None,
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
        # torch scales each stage's gradients at its REDUCE_GRAD: a parameter two local stages share (a V placement
        # holds the first and the last stage) would be divided by M twice, and once before the other stage's last
        # backward added to it. pipec scales after the step instead, each parameter once (`_finish_gradients`).
        self._scale_by_microbatches = scale_grads
        self.scale_grads = False
        self._ties = _Ties.find(self._stages, model, tied)

    @property
    def tied_parameters(self) -> list[str]:
        """The ties this schedule syncs (their names), the same list on every rank."""
        return [tie.name for tie in self._ties.ties]

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._step_microbatches(*args, **kwargs)
        if self._has_backward:
            self._finish_gradients()
        return result

    def _finish_gradients(self) -> None:
        """Each parameter's gradient divided by M once (when `scale_grads`), then each tie's copies given the sum
        of their gradients across the ranks holding them: every copy gets the same bits."""
        if self._scale_by_microbatches and self._n_microbatches != 1:
            for p in _unique_parameters(self._stages):
                if p.grad is not None:
                    p.grad.div_(self._n_microbatches)
        self._ties.sync()

    def eval(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """Forward only, as torch's `eval`, but on the streams' forward actions alone. torch's own eval runs the
        training order with the backward actions skipped, which fails where adjacent stages share a rank (a V
        placement: "can't steal_bwd_input") and runs REDUCE_GRAD, dividing the gradients a step() left by M."""
        train_order, self.pipeline_order_with_comms = self.pipeline_order_with_comms, self._eval_order
        try:
            return super().eval(*args, target=target, losses=losses, **kwargs)
        finally:
            self.pipeline_order_with_comms = train_order


def _unique_parameters(stages: Sequence[Any]) -> list[torch.nn.Parameter]:
    """This rank's trainable parameters across its stages, each once (a shared one is one parameter)."""
    return list(dict.fromkeys(p for stage in stages for p in stage.submod.parameters() if p.requires_grad))


@dataclass
class _Tie:
    name: str  # for messages: the model's name of the parameter, or tied[k] with its entries
    copies: list[torch.Tensor]  # this rank's distinct parameter objects (none where the rank holds no copy)
    shape: tuple[int, ...]
    dtype: torch.dtype
    ranks: tuple[int, ...]  # the group ranks holding a copy


@dataclass
class _Ties:
    """The tied parameters of a pipeline, found at construction (the same list, in one order, on every rank), and
    the gradient sum that keeps their copies equal."""

    ties: list[_Tie]
    group: Any  # the stages' process group
    device: torch.device

    @classmethod
    def find(
        cls, stages: Sequence[Any], model: torch.nn.Module | None, tied: Sequence[Mapping[int, str]] | None
    ) -> _Ties:
        if model is not None and tied is not None:
            raise PipecInputError("pipec.torch: give model= (ties found by name) or tied= (ties declared), not both")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise PipecInputError(f"pipec.torch: model= must be the nn.Module the stages were cut from, not {model!r}")
        first = stages[0]
        groups = _tied_groups(tied, first.num_stages)
        # Found here, refused on every rank together after the exchange: one rank raising alone would leave the
        # others waiting in it.
        problem, local, layout, mine = None, {}, None, {}
        try:
            local, layout = _local_ties(stages, model, groups)
            if model is None:
                _refuse_unseen_ties(stages, local)
            mine = {key: _describe_copies(key, entries) for key, entries in local.items()}
        except PipecInputError as e:
            problem = e.message
        gathered: list[Any] = [None] * first.group_size
        dist.all_gather_object(gathered, (layout, mine, problem), group=first.group)
        for rank, (_, _, refused) in enumerate(gathered):
            if refused is not None:
                raise PipecInputError(refused if refused == problem else f"{refused} (on rank {rank})")
        if any(g[0] != layout for g in gathered):
            what = "model= (its parameter names and shapes)" if model is not None else "tied="
            raise PipecInputError(f"pipec.torch: the ranks were given different {what}; give every rank the same")
        ties = []
        for key in sorted({key for _, held, _ in gathered for key in held}):
            holders = [(rank, held[key]) for rank, (_, held, _) in enumerate(gathered) if key in held]
            copies = list({id(p): p for _, p in local.get(key, [])}.values())
            if len(holders) == 1 and holders[0][1][4] < 2:
                continue  # one parameter on one rank: nothing to sync (its stages' uses already add up in it)
            label = key if model is not None else f"{key} ({_entries(groups[_group_index(key)])})"
            _check_alike(label, holders)
            shape, dtype = holders[0][1][0], getattr(torch, holders[0][1][1].removeprefix("torch."))
            ties.append(_Tie(label, copies, shape, dtype, tuple(rank for rank, _ in holders)))
        device = getattr(first, "device", torch.device("cpu"))
        return cls(ties, first.group, device)

    def sync(self) -> None:
        """Every tie's gradient summed over its copies and the ranks holding them (all ranks of the group take part,
        those without a copy with zeros, so that no sub-group is needed), and given to each copy."""
        for tie in self.ties:
            grads = [p.grad for p in tie.copies if p.grad is not None]
            if grads:
                total = grads[0].clone()
                for g in grads[1:]:
                    total += g
            else:
                total = torch.zeros(tie.shape, dtype=tie.dtype, device=self.device)
            if len(tie.ranks) > 1:
                dist.all_reduce(total, group=self.group)
            for p in tie.copies:
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.copy_(total)


def _local_ties(
    stages: Sequence[Any], model: torch.nn.Module | None, groups: list[dict[int, str]]
) -> tuple[dict[str, list[tuple[int, torch.Tensor]]], Any]:
    """This rank's copies of every tie (key -> (stage, parameter)), keyed alike on every rank: by the parameter's
    first name in `model`, or by the position of its group in `tied`; and what every rank must have been given."""
    local: dict[str, list[tuple[int, torch.Tensor]]] = {}
    if model is not None:
        names = {id(p): name for name, p in model.named_parameters()}  # each parameter under its first name
        for stage in stages:
            for p in stage.submod.parameters():
                if not p.requires_grad:
                    continue
                if id(p) not in names:
                    raise PipecInputError(
                        f"pipec.torch: stage {stage.stage_index} has a trainable parameter of shape "
                        f"{tuple(p.shape)} that model= does not hold; pass the module the stages were cut from"
                    )
                local.setdefault(names[id(p)], []).append((stage.stage_index, p))
        return local, [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    for k, group in enumerate(groups):
        for stage in stages:
            if stage.stage_index in group:
                p = _parameter_named(stage, group[stage.stage_index], k)
                local.setdefault(f"tied[{k}]", []).append((stage.stage_index, p))
    return local, [sorted(group.items()) for group in groups]


def _describe_copies(key: str, entries: list[tuple[int, torch.Tensor]]) -> tuple:
    """(shape, dtype, stages, checksum, distinct copies) of this rank's copies of a tie, which must start equal."""
    copies = list({id(p): p for _, p in entries}.values())
    checksums = {_checksum(p) for p in copies}
    if len(checksums) > 1 or len({(tuple(p.shape), p.dtype) for p in copies}) > 1:
        raise PipecInputError(
            f"pipec.torch: the copies of the tie {key} on stages {sorted(s for s, _ in entries)} differ in shape, "
            "dtype or value; tied copies must start equal"
        )
    p = copies[0]
    return tuple(p.shape), str(p.dtype), sorted(s for s, _ in entries), checksums.pop(), len(copies)


def _tied_groups(tied: Sequence[Mapping[int, str]] | None, num_stages: int) -> list[dict[int, str]]:
    if tied is None:
        return []
    if isinstance(tied, Mapping) or isinstance(tied, (str, bytes)):
        tied = [tied]  # type: ignore[list-item]
    groups = []
    for k, group in enumerate(tied):
        example = f"e.g. tied=[{{0: 'embed.weight', {num_stages - 1}: 'head.weight'}}]"
        if not isinstance(group, Mapping) or len(group) < 2:
            raise PipecInputError(
                f"pipec.torch: tied[{k}] is {group!r}; each tie maps two or more stage indices to a parameter name "
                f"in that stage's module ({example})"
            )
        for stage, name in group.items():
            if not isinstance(stage, int) or not 0 <= stage < num_stages or not isinstance(name, str):
                raise PipecInputError(
                    f"pipec.torch: tied[{k}] has the entry {stage!r}: {name!r}; expected a stage index from 0 to "
                    f"{num_stages - 1} and a parameter name ({example})"
                )
        groups.append(dict(group))
    return groups


def _parameter_named(stage: Any, name: str, k: int) -> torch.Tensor:
    params = dict(stage.submod.named_parameters(remove_duplicate=False))
    if name not in params:
        known = ", ".join(list(params)[:8]) + (" ..." if len(params) > 8 else "")
        raise PipecInputError(
            f"pipec.torch: tied[{k}] names {name!r} in stage {stage.stage_index}, whose module has no such parameter "
            f"(it has {known})"
        )
    if not params[name].requires_grad:
        raise PipecInputError(f"pipec.torch: tied[{k}]: {name!r} of stage {stage.stage_index} is not trainable")
    return params[name]


def _group_index(key: str) -> int:
    """k of the key `tied[k]`."""
    return int(key.removeprefix("tied[").removesuffix("]"))


def _entries(group: Mapping[int, str]) -> str:
    return ", ".join(f"stage {s} {n}" for s, n in sorted(group.items()))


def _checksum(p: torch.Tensor) -> tuple[int, int]:
    """Two sums that differ when two copies of a tie start from different values (another seed, a copy made
    elsewhere). Sums of the values' bits as integers: exact and independent of the order of summation, so equal
    copies agree on ranks that reduce with different thread counts."""
    values = p.detach().contiguous().reshape(-1)
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(values.element_size())
    bits = (values.view(width) if width is not None else values.view(torch.uint8)).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return int(bits.sum()), int((bits * weights).sum())  # int64 wraps around alike everywhere


def _check_alike(label: str, holders: list[tuple[int, Any]]) -> None:
    (rank0, (shape0, dtype0, _, sum0, _)), *rest = holders
    for rank, (shape, dtype, _, checksum, _) in rest:
        if (shape, dtype) != (shape0, dtype0):
            raise PipecInputError(
                f"pipec.torch: the tie {label} is {shape0} {dtype0} on rank {rank0} but {shape} {dtype} on rank {rank}"
            )
        if checksum != sum0:
            raise PipecInputError(
                f"pipec.torch: the copies of the tie {label} on ranks {rank0} and {rank} start from different values; "
                "build the model alike on every rank (same seed) so that tied copies start equal"
            )


def _refuse_unseen_ties(stages: Sequence[Any], declared: dict[str, list[tuple[int, torch.Tensor]]]) -> None:
    """Refuse a trainable stage parameter that a module outside this rank's stages registers too: that module may
    be another rank's stage (the tied embedding of a model cut into stages on every rank), whose copy would then
    train apart from this one. Ties declared with `tied=` are covered."""
    inside = {id(m) for stage in stages for m in stage.submod.modules()}
    params = {id(p): (stage.stage_index, p) for stage in stages for p in stage.submod.parameters() if p.requires_grad}
    wanted = set(params) - {id(p) for entries in declared.values() for _, p in entries}
    if not wanted:
        return
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.nn.Module) or id(obj) in inside:  # type(): no lazy module attribute
            continue
        for attr, p in obj._parameters.items():
            if p is not None and id(p) in wanted:
                stage, param = params[id(p)]
                name = next(n for n, q in _stage_parameters(stages, stage) if q is param)
                raise PipecInputError(
                    f"pipec.torch: stage {stage}'s parameter {name} {tuple(param.shape)} is also registered by a "
                    f"{type(obj).__name__} ({attr}) outside this rank's stages: a tied weight whose other copy may "
                    "be trained by another rank. Pass the module the stages were cut from (model=whole_model), or "
                    f"declare the tie (tied=[{{{stage}: {name!r}, OTHER_STAGE: 'its.name'}}]); see docs/torch.md"
                )


def _stage_parameters(stages: Sequence[Any], index: int) -> list[tuple[str, torch.Tensor]]:
    stage = next(s for s in stages if s.stage_index == index)
    return list(stage.submod.named_parameters())


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
