"""The runtime: run compiled instruction streams on torch.distributed (`pipec run`).

    options.py      what `pipec run` asks of a run (its flags), handed to every worker
    preflight.py    the checks before any worker starts: workload, batch split, partition, dry run, checkpoints
    workload.py     --model MODULE:FACTORY -> layers, loss, batches, optimizer
    stages.py       partition the layers into the S stages (balanced by parameters, by profile, explicit)
    interpreter.py  one rank's stream: a context, a dispatch table keyed by Kind, a short loop
    buffers.py      the interpreter's receive buffers, reused once nothing else holds them
    worker.py       one rank's run: set-up, the steps and their all-reduced time and loss, then the report
    runner.py       a rank set up for a program (context, plan, optimizer) and one step of it
    agreement.py    set-up's collectives: one schedule and partition on every rank, the activation shapes
    feed.py         each step's micro-batches on the device (copied ahead on a GPU)
    timing.py       a step's compute times: the host clock, or CUDA events
    replicas.py     --dp: the rank layout (pipeline-major), the replica groups, the gradient all-reduce; SYNC's sum
    ties.py         parameters tied across ranks: found, their sync groups and SYNCs, process groups, stored once
    objects.py      Python objects between ranks (without NumPy)
    checkpoint.py   --checkpoint/--resume: the format, the atomic write, the checks before resuming
    checkpoint_writer.py  a checkpoint during the run: gathered to rank 0, written, every rank told
    costs.py        the measured costs: per (stage, kind), per stage, in the cost-file format
    report.py       after the last step: the report, the lines rank 0 prints, the outputs it writes
    trace.py        the measured timeline: a common time origin, the Chrome trace
    status.py       where a worker is (phase, step, instruction), read by its guard thread and its messages
    launch.py       start P worker processes under a supervisor (signals, a guard per worker), or join torchrun
    start.py        `pipec run`'s start: the checks, then the workers

The command, `pipec run`, is pipec/cli/run.py (it imports this package only when it runs).

This package is the only part of pipec that imports torch, and only in the modules that need it.
"""
