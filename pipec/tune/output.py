"""What `pipec tune` prints and writes: the winner as a self-contained .pipe file, the ranked table, JSON.

The file holds literal `rank N:` lists (docs/language.md), an explicit `placement [...]`, a `require` pinning P,
M and V, and `memory` set to the limit in the file's own stage units (the limit X per rank share times V, so that
`pipec check FILE --per-rank-share` reads X again). Its header comment gives the sizes, the costs and the limit
with their units, the makespan, bubble and peak, and the best library candidate it beat. `recheck` reads the
text back and verifies and simulates it again before anything is written.
"""

from __future__ import annotations

import shlex
from fractions import Fraction

from pipec.compiler import compute_orders
from pipec.emit.text import rank_lines
from pipec.errors import PipecError
from pipec.ir import Program
from pipec.passes.sync import copy_orders
from pipec.tune.candidates import OK, Candidate, evaluate, gap_to, proves_optimal
from pipec.tune.instance import MODEL_POSTED
from pipec.tune.search import TuneResult

UNITS = "per-rank-share"


def schedule_text(result: TuneResult, cost_arg: str, output: str = "best.pipe") -> str:
    """The winner as a .pipe file (the result must have a best candidate). `cost_arg` is --cost as given, for
    the `pipec check` line of the header; `output` the file's name there."""
    best, setting = result.best, result.setting
    assert best is not None and best.program is not None and best.makespan is not None
    program = best.program
    p, m, v, copies = program.ranks, program.microbatches, program.chunks, program.pipelines
    stage_limit = Fraction(str(setting.limit)) * v / copies  # a stage holds C/V of a share
    check = ["pipec", "check", output, "--per-rank-share", "--cost", cost_arg, "--memory-limit", f"{setting.limit:g}"]
    if setting.costs.input_fraction != 0.5:
        check += ["--input-fraction", f"{setting.costs.input_fraction:g}"]
    activation = setting.costs.activation
    if activation is not None:  # pipec check reads activation sizes from --stage-sizes, not from --cost
        sizes = activation if isinstance(activation, tuple) else (activation,) * p
        check += ["--stage-sizes", ",".join(f"{x:g}" for x in sizes)]
    lines = [
        f"# pipec tune: P={p} M={m} V={v}, send/recv placed for these costs, verified and simulated (nccl model)",
        f"# costs per rank share of the model (one segment of P; a stage of V chunks takes 1/V, C/V with C "
        f"copies of the model): "
        f"{setting.costs.describe()}",
        f"# memory limit: {setting.limit:g} activation units per rank, in micro-batches of one rank's share "
        f"({_fraction(stage_limit)} in this file's stage units)",
        f"# makespan {best.makespan:g}, bubble {best.bubble:.4f}, peak memory {best.peak:g} per rank share",
        f"# found: {_origin(best)}",
        f"# {_beat(best, result.library_best)}",
        *(f"# {line}" for line in certificate_text(result).splitlines()),
        f"# check: {shlex.join(check)}",
        f'schedule tuned "tuned by pipec tune for P={p}, M={m}, V={v}: makespan {best.makespan:g}"',
        f"params P = {p}, M = {m}, V = {v}",
        f'require P == {p} and M == {m} and V == {v}, "tuned for P = {p}, M = {m}, V = {v}: run pipec tune again '
        'for other sizes"',
        f"stages {p * v}",
        *copy_lines(program),
        "placement [" + ", ".join(str(r) for r in program.stage_to_rank) + "]",
        f"memory {_fraction(stage_limit)}",
        "",
    ]
    # the send/recv are listed when tune placed them itself (pipec.tune.placement; never for copies, whose SYNCs
    # a .pipe cannot list): pipec check and simulate keep a literal list's own placement; otherwise they place
    # them for the costs given, as tune did, with the copies' SYNCs
    orders = program if best.own_placement else copy_orders(program)
    return "\n".join(lines) + rank_lines(orders)


def copy_lines(program: Program) -> list[str]:
    """A replicated program's header lines (docs/language.md "Replicated pipelines"): `pipelines C`, and its
    `route` unless it is the default blocks. The route is written as conditions on m over its runs of one copy,
    nested as a balanced tree (so its depth grows with log2 of the runs, never past the parser's nesting)."""
    copies, mbs = program.pipelines, program.microbatches
    if copies == 1:
        return []
    routes = tuple(program.route_of(mb) for mb in range(mbs))
    lines = [f"pipelines {copies}"]
    if routes != tuple(mb * copies // mbs for mb in range(mbs)):
        runs: list[tuple[int, int]] = []  # (first micro-batch, copy) of each run
        for mb, copy in enumerate(routes):
            if not runs or runs[-1][1] != copy:
                runs.append((mb, copy))
        lines.append(f"route m -> {_route_tree(runs)}")
    return lines


def _route_tree(runs: list[tuple[int, int]]) -> str:
    if len(runs) == 1:
        return str(runs[0][1])
    half = len(runs) // 2
    low, high = _route_tree(runs[:half]), _route_tree(runs[half:])
    return f"({low} if m < {runs[half][0]} else {high})"


def recheck(text: str, result: TuneResult) -> None:
    """Compile the file's text as a user would and judge it as tune did: it must verify and match the winner."""
    best = result.best
    assert best is not None
    try:
        again = evaluate("tuned", (), compute_orders(text), result.setting)
    except PipecError as e:
        raise PipecError(f"pipec tune: its own output does not compile: {e.message}") from None
    if again.verdict != OK or again.makespan is None or abs(again.makespan - (best.makespan or 0)) > 1e-6:
        raise PipecError(
            f"pipec tune: its own output does not check as found ({again.verdict} {again.reason}, makespan "
            f"{again.makespan} against {best.makespan}); this is a bug in pipec"
        )


def table_text(result: TuneResult) -> str:
    """The ranked table: ok candidates by makespan, then peak, then name; then the rest as tried."""
    rows = [("#", "name", "params", "V", "makespan", "bubble", "peak", "verdict")]
    for index, c in enumerate(result.candidates, 1):
        params = " ".join(f"{k}={v}" for k, v in c.params) + (f" +{c.moves} moves" if c.moves else "")
        verdict = c.verdict if c.ok or not c.reason else f"{c.verdict}: {_short(c.reason)}"
        if c.ok and c.bound is not None:
            verdict += f" ({_row_proof(c)})"
        rows.append(
            (
                str(index) if c.ok else "-",
                c.name,
                params.strip() or "-",
                str(c.chunks) if c.chunks else "-",
                _num(c.makespan),
                "-" if c.bubble is None else f"{c.bubble:.4f}",
                _num(c.peak),
                verdict,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "".join(
        "  ".join(
            cell.rjust(w) if i in (0, 3, 4, 5, 6) else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row[:-1], widths, strict=True))
        )
        + "  "
        + row[-1]
        + "\n"
        for row in rows
    )


def summary_text(result: TuneResult, output: str | None) -> str:
    best, s = result.best, result.setting
    assert best is not None
    lines = [
        f"best: {best.label()}{f' +{best.moves} moves' if best.moves else ''}: makespan {best.makespan:g}, "
        f"bubble {best.bubble:.4f}, peak {best.peak:g} of limit {s.limit:g} (units per rank share)",
        _beat(best, result.library_best),
    ]
    copies = 1 if best.program is None else best.program.pipelines
    if copies > 1:  # the memory limit counts activations; the copies' weights are the user's to budget
        lines.append(f"{best.name} holds {copies} copies of the model: {copies}x its weights and their gradients, "
                     "which the activation limit does not count")
    lines.append(certificate_text(result))
    others = _shapes_proved(result)
    if others:
        shown = ", ".join(f"{_shape_of(c)} at {c.makespan:g} (row {row})" for row, c in others)
        lines.append(f"the best of another shape, proved optimal for it: {shown}")
    if not result.complete:
        lines.append("the time budget ended the search early (--time-budget): a longer one may find better")
    if output is not None:
        lines.append(f"wrote {output}")
    return "\n".join(lines) + "\n"


def candidates_json(result: TuneResult, text: str | None) -> dict:
    best, s = result.best, result.setting
    lib = result.library_best
    return {
        "ranks": s.ranks,
        "microbatches": s.microbatches,
        "costs": s.costs.describe(),
        "memory_limit": s.limit,
        "units": UNITS,
        "makespan": None if best is None else best.makespan,
        "bubble_fraction": None if best is None else best.bubble,
        "peak_memory": None if best is None else best.peak,
        "chunks": None if best is None else best.chunks,
        "name": None if best is None else best.name,
        "params": None if best is None else dict(best.params),
        "moves": None if best is None else best.moves,
        "schedule": text,
        "library_best": None
        if lib is None
        else {
            "name": lib.name,
            "params": dict(lib.params),
            "chunks": lib.chunks,
            "makespan": lib.makespan,
            "peak_memory": lib.peak,
        },
        "complete": result.complete,
        **_certificate_json(result),
        "candidates": [_candidate_json(c) for c in result.candidates],
    }


def certificate_text(result: TuneResult) -> str:
    """The lower bound beside the result: proved optimal, within X% of optimal, or why there is no bound."""
    cert, best = result.certificate, result.best
    if cert is None or cert.skipped:
        why = "no solver ran" if cert is None else cert.skipped
        return f"lower bound: none ({why}); the exact phase ran pipec's branch and bound at small sizes only"
    space = _space(result)
    bound = cert.bound
    per = ", ".join(
        f"V={p.chunks} {p.placement} {'-' if p.bound is None else f'{p.bound:g}'}{' proved' if p.solved else ''}"
        for p in cert.proofs
    )
    copies = 1 if best is None or best.program is None else best.program.pipelines
    reached = (
        "this schedule reaches it under nccl: optimal under nccl too"
        if cert.optimal(best.makespan if best is not None else None)
        else "nccl may not reach it"
    )
    if copies > 1:  # a replicated best is outside the bound's space: at or below the bound is no optimality
        reached = "the best runs outside the bound's space"
    relaxed = ""
    if cert.relaxed:
        posts = (
            ", once its send is posted; each send holds its rank for the message time, the sends of one batch "
            "posted together"
            if cert.model == MODEL_POSTED
            else ""
        )
        relaxed = (
            f"\nthe bound is for a relaxation of nccl ({cert.model} model: a message takes its time between producer "
            f"and consumer{posts}; sends and receives batch freely); {reached}"
        )
    if bound is None:
        return f"lower bound: none over {space} (a solve ended before it had one: per shape {per}){relaxed}"
    makespan = None if best is None else best.makespan
    if copies > 1:  # the solver orders one copy of the model: its bound says nothing of C copies
        return (
            f"lower bound {bound:g} over {space} for one copy of the model (CP-SAT; per shape {per}); the best "
            f"runs {copies} copies (a library schedule's order, outside that space){relaxed}"
        )
    if cert.optimal(makespan):
        return f"proved optimal: no schedule of {space} is faster than {bound:g} (CP-SAT; per shape {per}){relaxed}"
    gap = cert.gap(makespan)
    within = f"within {gap:.1%} of optimal" if gap is not None else "not proved optimal"
    return f"{within}: lower bound {bound:g} over {space} (CP-SAT; per shape {per}){relaxed}"


def _space(result: TuneResult) -> str:
    cert = result.certificate
    assert cert is not None
    chunks = ",".join(str(v) for v in result.setting.chunks)
    return f"V={chunks} (placements loop{' and v' if any(p.placement == 'v' for p in cert.proofs) else ''})"


def _placement_of(c: Candidate) -> str:
    """A solver row's placement (cpsat-v: v)."""
    return "v" if c.name.endswith("-v") else "loop"


def _shape_of(c: Candidate) -> str:
    """A solver row's V and placement."""
    return f"V={c.chunks} {_placement_of(c)}"


def _shapes_proved(result: TuneResult) -> list[tuple[int, Candidate]]:
    """The solver rows of shapes other than the best's whose order is proved optimal for their shape (a shape
    that cannot win has its own optimum sought: for a user who keeps that V), with their row numbers."""
    best = result.best
    placed = [] if best is None or best.program is None else [best.program.stage_to_rank]
    found = []
    for row, c in enumerate((c for c in result.candidates if c.ok), start=1):
        assert c.program is not None
        if c.phase == 4 and proves_optimal(c.makespan, c.bound) and c.program.stage_to_rank not in placed:
            placed.append(c.program.stage_to_rank)
            found.append((row, c))
    return found


def _row_proof(c: Candidate) -> str:
    """A solver row's own certificate: for its V and placement."""
    assert c.bound is not None and c.program is not None
    shape = _shape_of(c)
    if proves_optimal(c.makespan, c.bound):
        return f"proved optimal for {shape}"
    gap = gap_to(c.makespan, c.bound)
    return f"within {gap:.1%} of {shape}'s bound {c.bound:g}" if gap is not None else f"bound {c.bound:g}"


def _certificate_json(result: TuneResult) -> dict:
    cert, best = result.certificate, result.best
    makespan = None if best is None else best.makespan
    if cert is None:
        return {"lower_bound": None, "optimal": False, "gap": None, "bound": None}
    bound = cert.bound
    one_copy = best is None or best.program is None or best.program.pipelines == 1  # what the bound is about
    return {
        "lower_bound": None if bound is None or bound == float("inf") else bound,
        "optimal": one_copy and cert.optimal(makespan),
        "gap": cert.gap(makespan) if one_copy else None,
        "bound": {
            "solver": None if cert.skipped else "cp-sat",
            "skipped": cert.skipped or None,
            "model": cert.model,
            "relaxation": cert.relaxed,
            "space": {"chunks": list(result.setting.chunks), "placements": ["loop", "v"]},
            # the best order of another shape, proved optimal for that shape (its row in `candidates`, from 1)
            "shape_optima": [
                {"chunks": c.chunks, "placement": _placement_of(c), "makespan": c.makespan, "row": row}
                for row, c in _shapes_proved(result)
            ],
            "proofs": [
                {
                    "chunks": p.chunks,
                    "placement": p.placement,
                    "bound": None if p.bound == float("inf") else p.bound,
                    "solved": p.solved,
                    "seconds": round(p.seconds, 3),
                }
                for p in cert.proofs
            ],
        },
    }


def _candidate_json(c: Candidate) -> dict:
    return {
        "name": c.name,
        "params": dict(c.params),
        "chunks": c.chunks,
        "moves": c.moves,
        "makespan": c.makespan,
        "bubble_fraction": c.bubble,
        "peak_memory": c.peak,
        "verdict": c.verdict,
        "reason": c.reason,
        "bound": c.bound,
        "own_placement": c.own_placement,  # its send/recv placed by tune from its timing, listed in the file
    }


def _origin(c: Candidate) -> str:
    phase = {1: "a library schedule", 2: "list scheduling under the costs", 3: "local moves", 4: "the exact phase"}
    origin = phase[c.phase]
    moves = f" + {c.moves} local moves" if c.moves else ""
    placed = ", its send/recv as listed below, not placed by pipec" if c.own_placement else ""
    return f"{c.label()}{moves} ({origin}{placed})"


def _beat(best: Candidate, library: Candidate | None) -> str:
    if library is None:
        return "beat: no library schedule fits this limit"
    shown = f"{library.label()}, makespan {library.makespan:g}, peak {library.peak:g}"
    if best.makespan is not None and library.makespan is not None and best.makespan < library.makespan - 1e-9:
        return f"beat: {shown} (the best library candidate)"
    return f"best library candidate: {shown} (not beaten)"


def _fraction(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator} / {x.denominator}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _short(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
