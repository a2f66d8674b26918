#!/usr/bin/env python
"""What rolling back a hybrid target's recurrent state costs: `python scripts/hybrid_rollback_bench.py [--block 16] [--repeats 5]`, run from a checkout.
The code is `dflash_cli.bench.rollback` (its docstring says what it does and how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.rollback import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
