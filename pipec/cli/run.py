"""`pipec run SCHEDULE --ranks P ... --model MODULE:FACTORY`: compile, verify, then train on torch.distributed
(pipec.runtime.start).

Started directly, it spawns P x D local worker processes (D = --dp, default 1; NCCL when CUDA has a GPU per
process, else gloo on the CPU, saying so when CUDA is there). Started by torchrun (RANK and WORLD_SIZE set),
this process is one worker: `torchrun --nproc-per-node 4 -m pipec.run ...`. torch is imported only once the
schedule has been compiled and verified.

Everything that can be checked without a process group is checked before any worker starts, in both cases, and
ends in exit 2 with a message: the numbers (--seed, --timeout, --steps, --dp, --checkpoint-every), the world
size under torchrun (P x D), the outputs (--save, --report, --trace: not an input, not each other, in a
writable directory), the workload and the checkpoints to resume from (see `preflight.validate`).
Exit codes: 0 ok, 1 invalid schedule, 2 bad input, 3 the run failed after its workers started (a rank failed,
a NaN or inf, an output that could not be written), 130/143 interrupted by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import re
import sys
import tempfile

from pipec.cli.common import EXIT_INVALID, EXIT_OK, EXIT_USAGE, params, positive, say_error, schedule_args
from pipec.errors import PipecError, PipecInputError
from pipec.runtime.workload import SEED_MAX

HELP = "train a model with the schedule on torch.distributed"
DESCRIPTION = (
    "Compile and verify the schedule, then train the --model workload with it on torch.distributed: P x D local "
    "worker processes, or one worker of each process torchrun starts. Bad input is refused before any worker "
    "starts."
)
EXAMPLES = """examples:
  pipec run 1f1b -P 4 -M 8 --model examples.workload:mlp --steps 3
  pipec run zbv -P 2 -M 8 -V 2 --dp 2 --model examples.workload:mlp --save weights.pt --report run.json
  pipec run 1f1b -P 2 -M 4 --model my_model.py:build --checkpoint ckpt --checkpoint-every 100
  pipec run 1f1b -P 2 -M 4 --model my_model.py:build --checkpoint ckpt --resume ckpt
  torchrun --nproc-per-node 4 -m pipec.run 1f1b -P 4 -M 8 --model examples.workload:mlp
exit codes: 0 ok, 1 the schedule is invalid, 2 bad input or usage (checked before any worker starts), 3 the run
failed after its workers started, 130/143 interrupted by SIGINT/SIGTERM
"""
TIMEOUT_MIN_S, TIMEOUT_MAX_S = 0.1, 86400.0  # a p2p wait: from a tenth of a second to a day


def seed(text: str) -> int:
    """An argparse type: an integer from 0 to 2**64-1 (what torch.manual_seed accepts)."""
    if not re.fullmatch(r"[0-9]{1,20}", text) or int(text) > SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**64-1 ({SEED_MAX}), got {text!r}")
    return int(text)


def timeout(text: str) -> float:
    """An argparse type: seconds, finite, within [TIMEOUT_MIN_S, TIMEOUT_MAX_S] (nan, inf and 1e30 would be
    accepted by float() and then fail inside every worker)."""
    try:
        value = float(text) if re.fullmatch(r"[0-9.eE+-]{1,32}", text) else math.nan
    except ValueError:
        value = math.nan
    if not TIMEOUT_MIN_S <= value <= TIMEOUT_MAX_S:  # also refuses nan
        raise argparse.ArgumentTypeError(
            f"expected seconds from {TIMEOUT_MIN_S:g} to {TIMEOUT_MAX_S:g} (one day), got {text!r}"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    schedule_args(parser)
    parser.add_argument("--model", required=True, metavar="MODULE:FACTORY", help="the workload (see docs/runtime.md)")
    parser.add_argument(
        "--dp", type=positive, default=1, metavar="D", help="D pipeline replicas, data parallel: P x D processes (1)"
    )
    parser.add_argument("--checkpoint", metavar="DIR", help="write checkpoints into DIR (see --checkpoint-every)")
    parser.add_argument(
        "--checkpoint-every",
        type=positive,
        metavar="K",
        help="a checkpoint every K steps (default: only after the last step)",
    )
    parser.add_argument("--resume", metavar="DIR", help="continue from DIR's last complete checkpoint")
    parser.add_argument("--steps", type=positive, metavar="N", help="training steps (default: one per batch)")
    parser.add_argument("--seed", type=seed, default=0, metavar="S", help="seed for the model and data (default 0)")
    parser.add_argument("--save", metavar="PATH", help="write the trained state_dict of the whole model (rank 0)")
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), help="default: nccl with a GPU per process, else gloo (on the CPU)"
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="compute precision: fp32 (default); bf16 or fp16 run under autocast with float32 weights and send "
        "activations and gradients in that dtype (fp16: static loss scale 1024)",
    )
    parser.add_argument(
        "--partition", default="params", metavar="HOW", help="params (default), profile, or layer counts: 4,4,4,4"
    )
    parser.add_argument("--report", metavar="PATH", help="write step times, losses and per-rank statistics (JSON)")
    parser.add_argument("--trace", metavar="PATH", help="write the measured timeline as a Chrome trace")
    parser.add_argument(
        "--timeout",
        type=timeout,
        default=30.0,
        metavar="SECONDS",
        help=f"a p2p wait gives up after this (30; {TIMEOUT_MIN_S:g} to {TIMEOUT_MAX_S:g})",
    )
    parser.add_argument(
        "--log-every",
        type=positive,
        default=1,
        metavar="K",
        help="print a step line (loss, step time, elapsed time and ETA) every K steps, and for the first and last (1)",
    )
    parser.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="train on when a loss or gradient is NaN or inf (default: stop the run, exit 3)",
    )


def input_files(args: argparse.Namespace) -> list[str | None]:
    """The --model module's own file: pipec.cli checks that no output replaces it, as for the other inputs."""
    from pipec.runtime.workload import module_file

    return [module_file(args.model)]


def run(args: argparse.Namespace) -> int:
    refused = _refusal_file() if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None
    if refused is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and os.path.exists(refused):
        # torchrun restarts on any failure, but bad input fails the same way every time: say so once, fast
        if os.environ.get("LOCAL_RANK", "0") == "0":
            with open(refused, encoding="utf-8") as f:
                restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
                say_error(f"error: not retried (torchrun restart {restart}; the input is as refused): {f.read()}")
        return EXIT_USAGE
    from pipec.runtime import launch

    try:
        with launch.interruptible():  # SIGINT/SIGTERM: stop the workers, say where they were, exit 130/143
            return _run(args)
    except PipecError as e:
        if refused is None or e.exit_code != EXIT_USAGE:
            raise
        with contextlib.suppress(OSError):  # only a shortcut for the restarts: they check again without it
            with open(refused, "w", encoding="utf-8") as f:
                f.write(e.message.splitlines()[0])
        if os.environ.get("LOCAL_RANK", "0") != "0":  # every worker checks the same: one message a node
            return EXIT_USAGE
        raise


def _refusal_file() -> str:
    """Where a torchrun worker leaves the input error it exited with, for the workers of torchrun's next attempt:
    one file per node's agent (the workers' parent, the same across restarts), job id and command line."""
    key = "\0".join([os.environ.get("TORCHELASTIC_RUN_ID", ""), str(os.getppid()), os.getcwd(), *sys.argv])
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"pipec-refused-{digest}.txt")


def _run(args: argparse.Namespace) -> int:
    if args.checkpoint_every is not None and not args.checkpoint:
        raise PipecInputError("--checkpoint-every needs --checkpoint DIR (where to write them)")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not torchrun or os.environ["RANK"] == "0":  # the first line within a second: what the wait is for
        shown = "the schedule text" if "\n" in args.schedule else args.schedule
        print(
            f"pipec run: compiling and verifying {shown}, then checking --model {args.model} (importing torch, "
            "one micro-batch without gradients) before starting the workers",
            flush=True,
        )
    from pipec.compiler import compile_program
    from pipec.verify import verify

    program = compile_program(args.schedule, args.ranks, args.microbatches, args.chunks, params(args))
    # The runtime issues p2p ops in the order the nccl model assumes; refuse what that model cannot prove.
    report = verify(program, p2p="nccl")
    if not report.ok:
        print(report.render(), file=sys.stderr)
        return EXIT_INVALID

    from pipec.runtime.options import Options
    from pipec.runtime.start import start

    options = Options(
        model=args.model,
        steps=args.steps,
        seed=args.seed,
        partition=args.partition,
        save=args.save,
        report=args.report,
        trace=args.trace,
        timeout_s=args.timeout,
        allow_nonfinite=args.allow_nonfinite,
        dp=args.dp,
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        dtype=args.dtype,
        log_every=args.log_every,
        job=os.environ.get("TORCHELASTIC_RUN_ID") if torchrun else None,
    )
    start(program, options, args.backend)
    return EXIT_OK
