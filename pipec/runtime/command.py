"""`pipec run SCHEDULE --ranks P ... --model MODULE:FACTORY`: compile, verify, then train on torch.distributed.

Started directly, it spawns P local worker processes (gloo on CPU, NCCL when CUDA is available). Started by
torchrun (RANK and WORLD_SIZE set), this process is one worker: `torchrun --nproc-per-node 4 -m pipec.run ...`.
torch is imported only once the schedule has been compiled and verified.
"""

from __future__ import annotations

import argparse
import os
import sys

from pipec.errors import PipecInputError

EXIT_OK, EXIT_INVALID = 0, 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="MODULE:FACTORY", help="the workload (see docs/runtime.md)")
    parser.add_argument("--steps", type=int, metavar="N", help="training steps (default: one per batch)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed for the model and data (default 0)")
    parser.add_argument("--save", metavar="PATH", help="write the trained state_dict of the whole model (rank 0)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    parser.add_argument(
        "--partition", default="params", metavar="HOW", help="params (default), profile, or layer counts: 4,4,4,4"
    )
    parser.add_argument("--report", metavar="PATH", help="write step times, losses and per-rank statistics (JSON)")
    parser.add_argument("--trace", metavar="PATH", help="write the measured timeline as a Chrome trace")
    parser.add_argument(
        "--timeout", type=float, default=30.0, metavar="SECONDS", help="a p2p wait gives up after this (30)"
    )


def main(args: argparse.Namespace) -> int:
    import pipec
    from pipec.verify import verify

    params = dict(args.set)
    program = pipec.compile(args.schedule, args.ranks, args.microbatches, args.chunks, **params)
    # The runtime issues p2p ops in the order the nccl model assumes; refuse what that model cannot prove.
    report = verify(program, p2p="nccl")
    if not report.ok:
        print(report.render(), file=sys.stderr)
        return EXIT_INVALID
    if args.steps is not None and args.steps < 1:
        raise PipecInputError(f"--steps must be at least 1, got {args.steps}")
    if args.timeout <= 0:
        raise PipecInputError(f"--timeout must be positive, got {args.timeout}")

    from pipec.runtime import launch
    from pipec.runtime.worker import Options, run_worker, validate

    options = Options(
        model=args.model,
        steps=args.steps,
        seed=args.seed,
        partition=args.partition,
        save=args.save,
        report=args.report,
        trace=args.trace,
        timeout_s=args.timeout,
    )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        launch.join_torchrun(run_worker, (program, options), timeout_s=args.timeout)
        return EXIT_OK
    validate(program, options)  # bad --model, batch or partition: exit 2 here, before any process starts
    import torch

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < program.ranks:
        raise PipecInputError(f"--backend nccl needs {program.ranks} GPUs, found {torch.cuda.device_count()}")
    sys.stdout.flush()
    launch.spawn(run_worker, program.ranks, (program, options), timeout_s=args.timeout, backend=backend)
    return EXIT_OK
