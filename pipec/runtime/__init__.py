"""The runtime: run compiled instruction streams on torch.distributed (`pipec run`).

    workload.py     --model MODULE:FACTORY -> layers, loss, batches, optimizer
    stages.py       partition the layers into the S stages (balanced by parameters, by profile, explicit)
    interpreter.py  one rank's stream: a context, a dispatch table keyed by Kind, a short loop
    worker.py       one rank's run: set-up (shapes, agreement), steps, statistics, checkpoints, report, trace
    replicas.py     --dp: the rank layout (pipeline-major), the replica groups, the gradient all-reduce
    checkpoint.py   --checkpoint/--resume: the format, the atomic write, the checks before resuming
    launch.py       start P worker processes under a supervisor (signals, a guard per worker), or join torchrun
    command.py      `pipec run` (imports torch only when it runs)

This package is the only part of pipec that imports torch, and only in the modules that need it.
"""
