"""pipec.tune: search for the fastest verified schedule under a memory limit and measured costs (`pipec tune`).

    from pipec.sim.costs import parse_costs
    from pipec.tune import Setting, library_sources, tune, schedule_text

    setting = Setting(ranks=4, microbatches=8, costs=parse_costs("F=1,I=1,W=1"), limit=4, chunks=(1, 2))
    result = tune(setting, library_sources(), time_budget=10)
    print(result.best.makespan, schedule_text(result, "F=1,I=1,W=1"))

Costs and the limit are per rank share of the model (docs/simulator.md, `--per-rank-share`), so candidates of
different V compare. `space` draws the library's candidates, `greedy` list-schedules orders under the costs,
`exact` searches them exactly at small sizes, `cpsat` solves them exactly on CP-SAT, `candidates` judges each
one (verified and simulated) and holds the certificate's rule, `search` ranks and improves them, `output` writes
the winner as a self-contained .pipe file.
"""

from pipec.tune.candidates import Candidate, evaluate
from pipec.tune.output import candidates_json, schedule_text, table_text
from pipec.tune.search import Setting, TuneResult, tune
from pipec.tune.space import library_sources

__all__ = [
    "Candidate",
    "Setting",
    "TuneResult",
    "candidates_json",
    "evaluate",
    "library_sources",
    "schedule_text",
    "table_text",
    "tune",
]
