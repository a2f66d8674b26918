#!/usr/bin/env python
"""GPU fast-path benchmark: `python scripts/gpu_bench.py [--smoke] [--output FILE]`, run from a checkout.
The benchmark itself is `dflash_cli.bench.gpu` (its docstring says what it measures)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.gpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
