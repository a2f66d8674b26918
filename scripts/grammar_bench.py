#!/usr/bin/env python
"""Structured output under speculation: `python scripts/grammar_bench.py [--recipe demo] [--max-tokens 96] [--rounds 1]`, run from a checkout.
The code is `dflash_cli.bench.grammar` (its docstring says what it does and how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.grammar import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
