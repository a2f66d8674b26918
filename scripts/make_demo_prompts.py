#!/usr/bin/env python
"""Write the demo drafter's prompt set: `python scripts/make_demo_prompts.py dflash_cli/assets`, run from a checkout.
The code is `dflash_cli.commands.demo_prompts` (its docstring says what it does and how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.commands.demo_prompts import main

if __name__ == "__main__":
    sys.exit(main())
