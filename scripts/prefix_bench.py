#!/usr/bin/env python
"""Prefix reuse, time to first token with and without: `python scripts/prefix_bench.py [chat|serve|both] [--recipe demo] [--turns 10] [--requests 8] [-- FLAGS]`, run from a checkout.
The code is `dflash_cli.bench.prefix` (its docstring says what it does and how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.prefix import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
