"""The runtime: run compiled instruction streams on torch.distributed (`pipec run`).

    workload.py     --model MODULE:FACTORY -> layers, loss, batches, optimizer
    stages.py       partition the layers into the S stages (balanced by parameters, by profile, explicit)
    interpreter.py  one rank's stream: a context, a dispatch table keyed by Kind, a short loop
    worker.py       one rank's run: set-up (shapes, agreement), steps, statistics, report, trace
    launch.py       start P worker processes with a watchdog, or join a torchrun launch
    command.py      `pipec run` (imports torch only when it runs)

This package is the only part of pipec that imports torch, and only in the modules that need it.
"""
