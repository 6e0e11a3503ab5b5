"""Parameters shared across ranks (`pipec run`): one logical parameter held by several stages on several ranks.
Two cases, one mechanism:
- tied parameters: layers of the unsplit model that hold one parameter, such as a language model's input
  embedding and its LM head;
- the copies of a replicated program (DualPipe, Chimera: docs/design/replicated.md): copy c's stage c * L + l
  holds logical stage l's layers, so each parameter of stage l is held by the stages l, L + l, ...
Each rank holding it has its own copy (the model is built alike on every rank, so the copies start equal); the
ranks sum the copies' gradients with a SYNC instruction in their streams (pipec.passes.sync.insert_syncs places
it, the verifier proves it deadlock-free with the step's p2p, the interpreter runs it as one bucketed
all-reduce), so every copy takes the same optimizer step and stays bitwise equal to the others, as one process
would train the one parameter. The groups are per parameter: the stages holding one logical parameter are one
group, so a tied weight of a replicated model is one group over all its stages ((0, L-1, L, 2L-1)) and the rest
of stage l's parameters another ((l, L+l)), and no parameter is summed twice.

- `find_ties`: every trainable parameter that several layers of the unsplit model, or several copies, hold;
- `sync_groups`: the stage sets (sync groups) of the ties whose stages run on more than one rank (several copies:
  `pipec.passes.sync.program_groups` of them, the compiler's definition);
- `with_syncs`: the program with its SYNCs for the model's ties under a partition (checked: exit 1 if the verifier
  refuses it, exit 2 if a program already syncs other groups);
- `process_groups`: one process group per sync group per replica (every rank creates every one, in one order);
- `group_parameters`: this rank's copies of each sync group's parameters, in one order on every member;
- `aliases` / `share_tied`: a state_dict's tied entries (each layer's key) as one tensor, stored once;
- `one_model`: the ranks' parts of a state_dict as one model, copies checked equal and stored once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from pipec.errors import PipecInputError, ScheduleError
from pipec.ir import Program
from pipec.passes import sync as sync_pass  # (called through the module: a test replaces insert_syncs there)


@dataclass(frozen=True)
class Tie:
    """One trainable parameter held by several layers or copies: its names in the unsplit model (`{layer}.{name}`,
    the first one canonical: checkpoints key its optimizer state by it) and the stages holding it (sorted; over
    every copy of a replicated program)."""

    names: tuple[str, ...]
    stages: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.names[0]


def stage_of_layers(sizes: Sequence[int]) -> list[int]:
    return [stage for stage, size in enumerate(sizes) for _ in range(size)]


def find_ties(layers, sizes: Sequence[int], pipelines: int = 1) -> list[Tie]:
    """The trainable parameters held by two or more layers, or by the stages of `pipelines` copies of the model
    partitioned by `sizes` (its L stages), in the order of their first layer (the same on every rank: the model
    is built alike everywhere)."""
    stage_of = stage_of_layers(sizes)
    length = len(sizes)
    names: dict[int, list[str]] = {}  # id(parameter) -> its names, in layer order
    held: dict[int, set[int]] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if p.requires_grad:
                names.setdefault(id(p), []).append(f"{i}.{name}")
                held.setdefault(id(p), set()).update(c * length + stage_of[i] for c in range(pipelines))
    return [
        Tie(tuple(found), tuple(sorted(held[key])))
        for key, found in names.items()
        if len(found) > 1 or len(held[key]) > 1
    ]


def sync_groups(ties: Sequence[Tie], stage_to_rank: Sequence[int], pipelines: int = 1) -> tuple[tuple[int, ...], ...]:
    """The program's sync groups for the model's shared parameters, sorted. One pipeline: the distinct stage sets
    of the ties that span two or more ranks (a tie whose stages all run on one rank is one parameter object there
    and needs no sync). Several: `pipec.passes.sync.program_groups` of the ties' stage sets in one copy (each
    lifted to every copy, and every stage's copies a group), the groups the compiler gives a replicated program
    when the model ties nothing; a group on one rank gets no SYNC (insert_syncs)."""
    if pipelines == 1:
        spanning = {tie.stages for tie in ties if len({stage_to_rank[s] for s in tie.stages}) > 1}
        return tuple(sorted(spanning))
    length = len(stage_to_rank) // pipelines
    in_one_copy = {tuple(s for s in tie.stages if s < length) for tie in ties if len(tie.names) > 1}
    tied = sorted(group for group in in_one_copy if len(group) > 1)
    return sync_pass.program_groups(len(stage_to_rank), pipelines, tied)


def with_syncs(program: Program, layers, sizes: Sequence[int], spec: str | None = None) -> Program:
    """`program` with the SYNCs that the model's shared parameters need under the partition `sizes` (itself when
    none do, or when it trains nothing), verified as the runtime runs it (the nccl p2p model). A program that
    already holds SYNCs (a stream file) must sync exactly these groups, unless they are the copies' groups the
    compiler gives a replicated program (`program_groups` without ties): the model's ties refine those into its
    per-parameter groups."""
    if program.forward_only:  # inference steps nothing: every copy of a shared weight stays the same
        return program
    groups = sync_groups(find_ties(layers, sizes, program.pipelines), program.stage_to_rank, program.pipelines)
    if program.sync_groups == groups:
        return program
    copies = sync_pass.program_groups(program.num_stages, program.pipelines)
    compiled = program.pipelines > 1 and program.sync_groups == copies
    if program.sync_groups and not compiled:
        where = f"--model {spec}: " if spec else ""
        raise PipecInputError(
            f"{where}the schedule syncs the stage groups {list(program.sync_groups)}, but the model's shared "
            f"parameters under the partition {','.join(map(str, sizes))} need {list(groups) or 'none'}"
        )
    from pipec.verify import verify

    synced = sync_pass.insert_syncs(program, groups)  # (it drops the SYNCs the program held)
    report = verify(synced, p2p="nccl")
    if not report.ok:  # a compiler bug rather than the user's: never run a program the verifier refuses
        what = f"{program.name} with the syncs of its shared parameters {list(groups)}"
        raise ScheduleError(f"{what}:\n{report.render()}")
    return synced


def describe_ties(ties: Sequence[Tie], program: Program) -> list[str]:
    """One line per tie that is synced across ranks, and per sync group of a replicated program's copies, for
    the run's start-up lines."""
    out = []
    for tie in ties:
        ranks = sorted({program.stage_to_rank[s] for s in tie.stages})
        if len(ranks) > 1 and len(tie.names) > 1:
            stages = ", ".join(map(str, tie.stages))
            out.append(
                f"tied: {' = '.join(tie.names)} (stages {stages} on ranks {', '.join(map(str, ranks))}): "
                "one parameter, its gradient summed by SYNC"
            )
    for stages in program.sync_groups if program.pipelines > 1 else ():
        copied = sum(1 for tie in ties if tie.stages == stages and len(tie.names) == 1)
        ranks = sync_pass.member_ranks(stages, program.stage_to_rank)
        if copied and ranks:
            out.append(
                f"copies: stages {', '.join(map(str, stages))} on ranks {', '.join(map(str, ranks))}: one stage's "
                f"{copied} parameter tensor{'s' if copied > 1 else ''}, their gradients summed by SYNC"
            )
    return out


def group_parameters(ties: Sequence[Tie], groups: Sequence[tuple[int, ...]], layers) -> dict[int, list]:
    """Per sync group (its index), the parameters of the ties it syncs, in tie order (the same on every member),
    as `layers` (this rank's model) holds them."""
    out: dict[int, list] = {}
    for g, stages in enumerate(groups):
        params = []
        for tie in ties:
            if tie.stages == stages:
                layer, _, name = tie.name.partition(".")
                params.append(layers[int(layer)].get_parameter(name))
        out[g] = params
    return out


_GROUPS: dict[tuple, list] = {}  # (default group, P, D, groups' ranks) -> per replica, per sync group: its group


def process_groups(program: Program, replicas: int, rank: int, timeout: timedelta) -> dict[int, object]:
    """This rank's process group of each sync group it is a member of (keyed by the group's index). Every rank
    creates every group of every replica, replica by replica and group by group (new_group is collective over
    the default group); later runs in the same process group with the same groups reuse them."""
    import torch.distributed as dist

    ranks = program.ranks
    # a group on one rank (a replicated program's copies of a stage placed together) issues no SYNC: no group
    members = [sync_pass.member_ranks(stages, program.stage_to_rank) for stages in program.sync_groups]
    if not any(members):
        return {}
    key = (id(dist.group.WORLD), ranks, replicas, tuple(members))
    if key not in _GROUPS:
        _GROUPS[key] = [
            [dist.new_group([replica * ranks + r for r in group], timeout=timeout) if group else None
             for group in members]
            for replica in range(replicas)
        ]  # fmt: skip
    replica, prank = divmod(rank, ranks)
    return {g: _GROUPS[key][replica][g] for g, group in enumerate(members) if prank in group}


def aliases(ties: Sequence[Tie]) -> dict[str, str]:
    """Each tied parameter's later names -> its first (canonical) name."""
    return {alias: tie.name for tie in ties for alias in tie.names[1:]}


def share_tied(state: dict, ties: Sequence[Tie]) -> dict:
    """`state` (a whole model's state_dict gathered from the ranks) with each tie's later keys holding the very
    tensor of its first key: torch.save then stores the parameter once, and load_state_dict still finds every
    key. The copies must be bitwise equal (the syncs keep them so); a difference is a bug, never hidden."""
    out = dict(state)
    for alias, name in aliases(ties).items():
        if alias in out and name in out:
            _check_equal(out[name], out[alias], f"the tied copies {name} and {alias}")
            out[alias] = out[name]
    return out


def _check_equal(a, b, what: str) -> None:
    """Two copies of one weight must be bitwise equal (NaN equal to NaN: --allow-nonfinite); else RuntimeError."""
    import torch

    if not torch.equal(a, b) and not bool(((a == b) | (a.isnan() & b.isnan())).all()):
        worst = (a.float() - b.float()).abs().max().item()
        raise RuntimeError(f"{what} differ (by up to {worst:g}): not saved")


def one_model(parts: Sequence[tuple[dict, list[dict]]], ties: Sequence[Tie]) -> dict:
    """One model's state_dict from the ranks' parts, each (its entries of copy 0's stages, the entries of each of
    its stages of the other copies; `Runner.model_part`): copy 0's entries in the unsplit model's layer order (a
    rank's stages need not be consecutive: a V placement), each other copy's entry checked bitwise equal to copy
    0's (the SYNCs keep them so; a difference is a bug, never hidden), and a tied parameter stored once
    (`share_tied`)."""
    model: dict = {}
    for mine, _ in parts:
        model.update(mine)
    for _, copies in parts:
        for state in copies:
            for key, value in state.items():
                _check_equal(model[key], value, f"the copies of {key}")
    model = dict(sorted(model.items(), key=lambda item: int(item[0].partition(".")[0])))
    return share_tied(model, ties)
