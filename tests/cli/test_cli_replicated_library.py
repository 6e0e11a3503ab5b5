"""The replicated library schedules from the command line: `pipec check` proves them, the memory line is
DualPipe's published P + 1 activations and is reached, and a torch CSV is refused saying why."""

from __future__ import annotations

import re

from cli_capture import run_main

import pipec
from pipec.verify.memory import peak_activations


def _bounds_and_peaks(out: str) -> list[tuple[int, int]]:
    """(peak, bound) per rank from `pipec check`'s table."""
    rows = re.findall(r"^\s+\d+\s+\d+\s+(\d+)\s+(\d+)\s*$", out, flags=re.MULTILINE)
    return [(int(peak), int(bound)) for peak, bound in rows]


def test_pipec_check_proves_both_and_dualpipe_holds_p_plus_one() -> None:
    for argv in (["dualpipe", "-P", "4", "-M", "8"], ["chimera", "-P", "4", "-M", "8"],
                 ["chimera", "-P", "8", "-M", "16", "-V", "4"]):
        code, out, err = run_main(["check", *argv])
        assert code == 0, (argv, out, err)
        for line in ("structure  ok", "p2p order  ok", "deadlock   ok  (nccl model)", "memory     ok"):
            assert line in out, (argv, out)
        rows = _bounds_and_peaks(out)
        assert rows and all(peak == bound for peak, bound in rows), (argv, rows)  # each bound is reached
    for ranks in (2, 4, 6, 8):
        program = pipec.compile("dualpipe", ranks, 2 * ranks, 2)
        assert program.memory_bound is not None and max(program.memory_bound) == ranks + 1  # the README's P + 1
        assert max(peak_activations(program)) == ranks + 1


def test_a_torch_csv_of_a_replicated_schedule_is_refused_with_the_reason() -> None:
    code, out, err = run_main(["compile", "dualpipe", "-P", "4", "-M", "8", "--format", "torch-csv"])
    assert code == 2 and not out
    assert "one module per stage index" in err and "Traceback" not in err
