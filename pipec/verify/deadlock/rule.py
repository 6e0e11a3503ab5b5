"""The p2p execution rule the deadlock engines apply, and its models.

The rule (its version 2, shared with the runtime and the simulator, written out in docs/verification.md):
- each rank runs its stream in order; a maximal run of consecutive SEND/RECV instructions is one *batch*, posted
  at once (one ``batch_isend_irecv``) without waiting; a batch holding a send of a value its rank computes only
  later is never posted;
- before a compute runs, the rank waits for the batches holding the receives it consumes (RECV_F(s, m) for
  F(s, m), RECV_B(s, m) for B/I(s, m)); its other inputs are computes of its own rank that must come earlier
  (F(s-1, m), F(s, m), the backward of (s+1, m), I(s, m) for W). At the end of the step it waits for every batch;
- ``nccl``: the k-th send from rank a to rank b meets the k-th receive on b from a; a rank's batches run in
  posting order (a batch starts once posted and once the previous one completed); an op completes once its
  counterpart's batch is running; a batch completes when all of its ops have;
- ``tagged``: sends complete when posted; a RECV completes once the SEND of the same message has been posted;
- ``torch``: torch's ``_PipelineScheduleRuntime`` (docs/torch.md): ``nccl`` with every SEND/RECV instruction a
  batch of its own (torch posts each action by itself), so a compute waits for exactly its receive and, the
  batches of a rank completing in order, for everything the rank posted before it.

Who is whose peer and which send meets which receive by name are the rule's shared pieces in pipec.p2p_rule;
this module holds what the engines add to them: the models, how each cuts a stream into units, and the channels.
"""

from __future__ import annotations

from pipec.gcpause import without_cyclic_gc
from pipec.ir import Program
from pipec.verify.flat import Flat, flatten

MODELS = ("nccl", "tagged", "torch")
# The models under which a rank's batches run in posting order (one NCCL stream) and a channel's k-th send meets
# its k-th receive; `tagged` is the other kind.
IN_ORDER = ("nccl", "torch")


def check_model(model: str) -> None:
    """Refuse a model name the engines do not know (a ValueError: the callers above turn bad input into errors)."""
    if model not in MODELS:
        raise ValueError(f"unknown p2p model {model!r}; expected one of {', '.join(MODELS)}")


def batched(model: str) -> bool:
    """Whether consecutive send/recv instructions form one batch (one unit) under `model`: pipec's runtime posts
    such a run with one batch_isend_irecv; torch's runtime posts every SEND/RECV action on its own."""
    return model != "torch"


def flat_for(program: Program, model: str, flat: Flat | None = None) -> Flat:
    """`flat` when its units are cut as `model` posts them, else the program flattened that way."""
    if flat is not None and flat.batched == batched(model):
        return flat
    with without_cyclic_gc():  # millions of small acyclic tuples: the collector would rescan them
        return flatten(program, batched=batched(model))
