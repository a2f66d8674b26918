#!/usr/bin/env python
"""`dflash run` at several --batch-size values: `python scripts/batch_bench.py [--recipe demo] [--sizes 1 4 16] [--rounds 2] [-- FLAGS]`, run from a checkout.
The code is `dflash_cli.bench.batching` (its docstring says what it does and how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.batching import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
