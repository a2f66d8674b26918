#!/usr/bin/env python
"""dflash and llama.cpp side by side on this CPU, on the demo model: `python scripts/vs_llamacpp.py [--rounds N] [--threads N] [--json FILE]`, run from a checkout.
The code is `dflash_cli.bench.vs_llamacpp` (its docstring says how llama.cpp is built and what is measured)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.vs_llamacpp import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
