#!/usr/bin/env python
"""A small hybrid target decoded in batches: `python scripts/hybrid_batch_bench.py [--family qwen3_5|bamba] [--rows 1 4]`, run from a checkout.
The code is `dflash_cli.bench.hybrid_batch` (its docstring says what it does and how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.hybrid_batch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
