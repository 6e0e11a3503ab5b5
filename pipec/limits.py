"""Every bound pipec puts on its input, in one place (documented in docs/language.md, "Limits").

A hostile or mistyped input (a mutated number, a runaway loop, a FIFO given as a file) must end in a clear error
naming the limit, within seconds and a bounded amount of memory, never in a hang, a traceback or an exhausted
machine. The values sit far above real use: the largest benchmark, interleaved 1F1B at P = 32, M = 1024, V = 4,
has 262,144 compute ops; real pipelines have at most a few thousand ranks and about 100k ops per rank. Checking a
program costs about 1.5 KB of memory and 10 us per compute op, so MAX_OPS is what bounds a `pipec check` (at most
~15 GB and a few minutes at the very limit).
"""

from __future__ import annotations

from pipec.errors import PipecInputError

MiB = 1 << 20

# ---- input files (pipec.library) ----
MAX_SOURCE_BYTES = 1 * MiB  # a .pipe file or source text; Lark needs ~250 bytes of memory per byte of source
MAX_STREAM_BYTES = 64 * MiB  # a torch CSV, text or JSON stream file (~10M actions)

# ---- .pipe text (pipec.frontend.parser, to_ast, checks) ----
MAX_LITERAL_DIGITS = 18  # an integer literal, and each number in an action such as 0F1: below 10**18
MAX_NESTING = 100  # blocks and expression operators nested in one another (recursion in the compiler)

# ---- sizes (pipec.frontend.expand, pipec.compiler): checked before anything is allocated ----
MAX_RANKS = 65_536  # P
MAX_MICROBATCHES = 1_000_000  # M
MAX_CHUNKS = 1_024  # V
MAX_STAGES = 1_048_576  # P * V
MAX_OPS = 10_000_000  # compute ops: 3 * P * M * V (F, I and W of every stage and micro-batch), and as emitted

# ---- running per-rank programs (pipec.frontend.expand, state) ----
MAX_VALUE = 10**18  # the magnitude of a value a program computes (products, assignments, fractions' terms)
MAX_STEPS = 50_000_000  # loop iterations + ops emitted + program nodes compiled, all ranks together
MAX_SECONDS = 60.0  # wall time of one expansion
# The per-rank budget (a loop that never ends): 64 * (3 * M * V + P) + 100_000 loop iterations and ops.
RANK_STEPS_PER_OP = 64
RANK_STEPS_EXTRA = 100_000

# ---- `pipec test` (pipec.cli.test) ----
TEST_MAX_RANKS = 512  # --max-ranks
TEST_MAX_MICROBATCHES = 4_096  # --max-microbatches
TEST_MAX_CHUNKS = 64  # --max-chunks
TEST_MAX_SIZE = 262_144  # --max-ranks * --max-microbatches * --max-chunks: at most ~800k compute ops a set
TEST_MAX_EXAMPLES = 100_000  # --examples
TEST_MAX_SPACE_STEPS = 1_000_000  # constraint evaluations while enumerating a schedule's valid parameter sets


def amount(n: int | float) -> str:
    """1234567 -> '1,234,567': limits and sizes in messages are read at a glance."""
    return f"{n:,}"


def check_sizes(
    ranks: int, microbatches: int, chunks: int, where: str = "", defaults: frozenset[str] = frozenset()
) -> None:
    """Refuse P, M, V (and the op count they imply) beyond the limits, before anything is allocated for them.
    `defaults`: the names whose value came from the schedule's declared default rather than a flag."""
    prefix = f"{where}: " if where else ""
    for name, flag, value, limit in (
        ("P", "--ranks", ranks, MAX_RANKS),
        ("M", "--microbatches", microbatches, MAX_MICROBATCHES),
        ("V", "--chunks", chunks, MAX_CHUNKS),
    ):
        if value > limit:
            source = "the schedule's default" if name in defaults else flag
            raise PipecInputError(
                f"{prefix}{name} = {amount(value)} ({source}) is over pipec's limit of {amount(limit)}"
            )
    if ranks * chunks > MAX_STAGES:
        raise PipecInputError(
            f"{prefix}P * V = {amount(ranks * chunks)} stages is over pipec's limit of {amount(MAX_STAGES)}"
        )
    ops = 3 * ranks * microbatches * chunks
    if ops > MAX_OPS:
        raise PipecInputError(
            f"{prefix}P = {amount(ranks)}, M = {amount(microbatches)}, V = {amount(chunks)} imply "
            f"3 * P * M * V = {amount(ops)} ops, over pipec's limit of {amount(MAX_OPS)}"
        )
