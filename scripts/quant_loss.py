#!/usr/bin/env python
"""The quality cost of bf16 and `--quant int4` / `int8` against float32 on the bench prompts: `python scripts/quant_loss.py [--prompts N] [--tokens N] [--json FILE]`, run from a checkout.
The code is `dflash_cli.bench.quant_loss` (its docstring says what it reports and how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.quant_loss import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
