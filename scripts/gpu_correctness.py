#!/usr/bin/env python
"""Correctness on a device (golden sets; greedy identity in bf16 and NF4): `python scripts/gpu_correctness.py [--device cpu] [--precisions float32,bfloat16,nf4] [--output FILE]`, run from a checkout.
The code is `dflash_cli.bench.correctness` (its docstring says what it does and how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.correctness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
