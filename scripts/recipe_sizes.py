#!/usr/bin/env python
"""Sizes for recipes/*.toml from the published architectures: `python scripts/recipe_sizes.py [NAME ...]`, run from a checkout.
The code is `dflash_cli.bench.recipe_sizes` (its docstring says what it does and how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.recipe_sizes import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
