"""`torchrun --nproc-per-node P -m pipec.run SCHEDULE --ranks P ... --model MODULE:FACTORY`.

Each process torchrun starts is one worker of `pipec run` (torch's launcher handles multi-node).
"""

from __future__ import annotations

import sys

from pipec.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
