#!/usr/bin/env python
"""The few-row products of a decode step on this CPU, kernel against kernel: `python scripts/cpu_products.py [--rows 1 2 4 16]`, run from a checkout.
The code is `dflash_cli.bench.products` (its docstring says what is timed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.products import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
