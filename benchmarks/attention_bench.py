"""Plain decoding of the demo with the default attention (batch-invariant: dflash's fused kernel where the process
has it, engine.kernels.layers) against `--attention sdpa` (PyTorch's fused kernel, whose rounding follows the step's shape),
alternating, one `dflash chat` process per run; decode tok/s as chat's `--stats` line gives it.

    python -m benchmarks.attention_bench [--rounds 4] [--max-tokens 128] [-- FLAGS]

FLAGS after `--` go to every `dflash chat` (e.g. `-- --threads 1`, or `-- --compile off` for the eager path: a first
start before its stored step is built). Each round runs both, the first of the pair alternating, so a busy machine's
noise falls on both alike; the ratio is of the medians. Also says whether both gave the same text.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

PROMPT = "Write a short story about a robot who learns to paint."
ATTENTIONS = ("eager", "sdpa")  # the CPU plan's default (batch-invariant) and PyTorch's SDPA


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    args, extra = parser.parse_known_args(argv)
    extra = [flag for flag in extra if flag != "--"]
    rates: dict[str, list[float]] = {attention: [] for attention in ATTENTIONS}
    texts: dict[str, str] = {}
    print(f"{args.recipe}, plain decoding, {args.max_tokens} tokens, {' '.join(extra) or 'default flags'}")
    for round_ in range(1, args.rounds + 1):
        for attention in ATTENTIONS if round_ % 2 else ATTENTIONS[::-1]:
            command = [sys.executable, "-m", "dflash_cli", "chat", args.recipe, "--no-spec", "--attention", attention,
                       "--prompt", PROMPT, "--max-tokens", str(args.max_tokens), "--stats", "--no-history", *extra]  # fmt: skip
            load = os.getloadavg()[0]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            found = re.search(r"(\d+) tokens, ([\d.]+) tok/s", done.stdout + done.stderr)
            if done.returncode != 0 or found is None:
                raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
            rates[attention].append(float(found.group(2)))
            texts.setdefault(attention, done.stdout)
            print(f"round {round_}: {attention:5s} {float(found.group(2)):7.1f} tok/s (load {load:.2f})", flush=True)
    default, sdpa = (statistics.median(rates[attention]) for attention in ATTENTIONS)
    print(f"default (invariant) median {default:.1f} tok/s, sdpa median {sdpa:.1f} tok/s: {default / sdpa:.2f}x")
    print(f"the same text with both: {'yes' if texts['eager'] == texts['sdpa'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
