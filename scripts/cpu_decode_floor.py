#!/usr/bin/env python
"""The engine's target steps against the memory-bandwidth floor on this CPU: `python scripts/cpu_decode_floor.py [--compile] [--compare-layout] [--json FILE]`, run from a checkout.
The code is `dflash_cli.bench.floor` (its docstring says what it does and how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.floor import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
