"""The fault table of `pipec run` (issue #12): each fault injected into a real run, and what came of it.

    python bench/faults.py            # about 2-3 minutes on 2 cores; prints a Markdown table
    python bench/faults.py --only nan # the rows whose name contains "nan"

For each fault: the exit code, the seconds to exit (from the start for faults refused up front and for faults
during the run; from the signal for the signal rows), the first line printed on stderr, what was left on disk
(new files in the run's directory and its private TMPDIR, torch's and pipec's caches aside) and what was left in
the process table (descendants of `pipec run` still running 1 s after it exited; for a SIGKILLed parent, how
long its workers took to go). The workloads are tests/support/faulty_workloads.py; each run is 1f1b with P=2, M=4.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests" / "support"
CACHES = (".lark_cache", "torchinductor_")  # pipec's parse-table cache and torch's compile cache: not leaks


@dataclass
class Fault:
    name: str
    args: list[str]  # after `pipec run 1f1b -P 2 -M 4`
    signal: int | None = None  # sent to the parent once the first step is printed
    torchrun: bool = False
    file_limit: int | None = None  # RLIMIT_FSIZE in bytes: a full disk, as far as the writes can tell
    before: dict[str, bytes] = field(default_factory=dict)  # files present before the run (kept ones are fine)


def faults() -> list[Fault]:
    unwritable = "/sys/pipec-report.json" if os.geteuid() == 0 else "locked/r.json"  # root writes anywhere else
    model = ["--model"]
    return [
        Fault("factory raises", [*model, "faulty_workloads:raises"]),
        Fault("layers are a string", [*model, "faulty_workloads:string_layers"]),
        Fault("layers are ints", [*model, "faulty_workloads:int_layers"]),
        Fault("batches: one tensor", [*model, "faulty_workloads:tensor_batches"]),
        Fault("batches: targets not divisible into the micro-batches", [*model, "faulty_workloads:mismatched_batches"]),
        Fault("batches of the wrong width for the model", [*model, "faulty_workloads:wrong_width"]),
        Fault("factory needs arguments", [*model, "faulty_workloads:needs_args"]),
        Fault("--seed 2**70", [*model, "faulty_workloads:good", "--seed", str(2**70)]),
        Fault("--timeout nan", [*model, "faulty_workloads:good", "--timeout", "nan"]),
        Fault("--timeout 1e30", [*model, "faulty_workloads:good", "--timeout", "1e30"]),
        Fault("--save into a missing directory", [*model, "faulty_workloads:good", "--save", "missing/w.pt"]),
        Fault("--report unwritable", [*model, "faulty_workloads:good", "--report", unwritable, "--save", "w.pt"]),
        Fault(
            "disk full writing --save over a good file (file-size limit 4 KB)",
            [*model, "faulty_workloads:wide", "--save", "w.pt", "--report", "r.json"],
            file_limit=4096,
            before={"w.pt": b"previous weights"},
        ),
        Fault("SIGINT to pipec run", [*model, "faulty_workloads:slow", "--save", "w.pt"], signal=signal.SIGINT),
        Fault("SIGTERM to pipec run", [*model, "faulty_workloads:slow", "--save", "w.pt"], signal=signal.SIGTERM),
        Fault("SIGKILL to pipec run", [*model, "faulty_workloads:slow", "--save", "w.pt"], signal=signal.SIGKILL),
        Fault("SIGKILL to one worker", [*model, "faulty_workloads:kills_worker", "--partition", "2,2"]),
        Fault("NaN from a layer", [*model, "faulty_workloads:nan_layers", "--partition", "2,2", "--save", "w.pt"]),
        Fault("inf loss", [*model, "faulty_workloads:inf_loss", "--save", "w.pt"]),
        Fault("NaN gradients, finite loss", [*model, "faulty_workloads:nan_gradient", "--partition", "2,2"]),
        Fault(
            "NaN from a layer, --allow-nonfinite",
            [*model, "faulty_workloads:nan_layers", "--partition", "2,2", "--allow-nonfinite", "--save", "w.pt"],
        ),
        Fault("torchrun: factory raises", [*model, "faulty_workloads:raises"], torchrun=True),
    ]


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc (children first found, then theirs)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            ppid = next((line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "0")
            parents[int(entry.name)] = int(ppid)
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status and "\nState:\tX" not in status


def message(stderr: str) -> str:
    """The line that says what happened: the first `error:` line (not argparse's usage line, not torchrun's
    banner), with the line after it when it ends in a colon (the first rank's report); else the first line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith(("error:", "pipec run: error:")) or (line.startswith("rank ") and i == 0):
            if line.endswith(":") and i + 1 < len(lines):
                line += " " + lines[i + 1]
            return line[:220]
    return lines[0][:220] if lines else "(nothing)"


def measure(fault: Fault) -> tuple[str, ...]:
    with tempfile.TemporaryDirectory(prefix="pipec-faults-") as scratch:
        where = Path(scratch)
        (where / "tmp").mkdir()
        (where / "locked").mkdir(mode=0o555)
        for name, data in fault.before.items():
            (where / name).write_bytes(data)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]), TMPDIR=str(where / "tmp"))
        pipec = [sys.executable, "-m", "pipec", "run"]
        if fault.torchrun:
            pipec = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "pipec.run"]
        command = [*pipec, "1f1b", "-P", "2", "-M", "4", *fault.args]
        limit = fault.file_limit

        def prepare() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        out, err = where / "out.txt", where / "err.txt"
        seen: set[int] = set()
        with out.open("w") as stdout, err.open("w") as stderr:
            start = time.monotonic()
            proc = subprocess.Popen(command, cwd=where, env=env, stdout=stdout, stderr=stderr, preexec_fn=prepare)
        signalled = None
        while proc.poll() is None:
            seen |= descendants(proc.pid)
            if fault.signal is not None and signalled is None and "step   0" in out.read_text():
                time.sleep(0.5)  # well inside training
                seen |= descendants(proc.pid)
                proc.send_signal(fault.signal)
                signalled = time.monotonic()
            if time.monotonic() - start > 300:
                proc.kill()
            time.sleep(0.05)
        ended = time.monotonic()
        seconds = ended - (signalled or start)
        if fault.signal == signal.SIGKILL:
            while any(running(p) for p in seen) and time.monotonic() - ended < 10:
                time.sleep(0.02)
            gone = time.monotonic() - ended
            left = [p for p in seen if running(p)]
            processes = f"workers gone {gone:.2f} s after it" + (f"; still running: {left}" if left else "")
        else:
            time.sleep(1.0)
            left = [p for p in seen if running(p)]
            processes = "nothing" if not left else f"{len(left)} still running: {left}"
            time.sleep(0.5)
        disk = []
        for path in sorted([*where.iterdir(), *(where / "tmp").iterdir()]):
            name = str(path.relative_to(where))
            if name in ("out.txt", "err.txt", "tmp", "locked") or path.name.startswith(CACHES):
                continue
            if name in fault.before:
                kept = path.read_bytes() == fault.before[name]
                disk.append(f"{name} ({'previous file intact' if kept else 'REPLACED'})")
            else:
                disk.append(name + ("/" if path.is_dir() else ""))
        code = proc.returncode
        return (
            fault.name,
            str(code) if code >= 0 else f"{code} ({signal.Signals(-code).name})",
            f"{seconds:.1f}",
            message(err.read_text()),
            ", ".join(disk) or "nothing new",
            processes,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="only the faults whose name contains this text")
    args = parser.parse_args()
    header = ("fault", "exit", "seconds", "what it said (first error line)", "left on disk", "left running")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for fault in faults():
        if args.only.lower() in fault.name.lower():
            row = measure(fault)
            print("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |", flush=True)


if __name__ == "__main__":
    main()
