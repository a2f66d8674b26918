"""`dflash run` on one prompt file at several --batch-size values: aggregate tok/s and per-row latency, side by side.

`time`: the decoding of every request (`generate_s`); `wall`: the whole run after the imports, the model's load
included (`wall_s`). `draft share`: the drafter's part of the decode steps' time (draft / (draft + verify), over every row's steps).

Each round runs every batch size once, in turn, each into a fresh output file (the model loads in every run; the
load is not timed), so a busy machine's noise falls on all sizes alike; ratios are taken within a round. The
prompts are the first N of the demo's held-out prompts, sent as chat messages. Also checks that every request's
text is the same at every batch size (true in float32).

    python -m benchmarks.batch_bench [--recipe demo] [--sizes 1 4 16] [--rounds 2] [--prompts 16] [--max-tokens 128] [-- FLAGS]

FLAGS after `--` go to `dflash run` (e.g. `-- --no-spec`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ASSET = Path(__file__).resolve().parents[1] / "dflash_cli" / "assets" / "demo_prompts_eval.jsonl"


def run(recipe: str, prompts: Path, size: int, max_tokens: int, extra: list[str], out: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "dflash_cli",
        "run",
        recipe,
        str(prompts),
        "-o",
        str(out),
        "--batch-size",
        str(size),
        "--max-tokens",
        str(max_tokens),
        "--json",
        *extra,
    ]
    load_before = os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    summary = json.loads(done.stdout)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    latencies = []  # each row's own time: prefill to its last token (its wait for a free row excluded)
    draft_s = step_s = 0.0  # every row's share of its steps (a row's draft and verify times are its steps')
    for record in records:
        stats, tokens = record["stats"], record["completion_tokens"]
        draft_s += stats["draft_s"]
        step_s += stats["draft_s"] + stats["verify_s"]
        rate = stats["decode_tokens_per_s"]
        latencies.append(stats["ttft_s"] + ((tokens - 1) / rate if tokens > 1 and rate else 0.0))
    return {
        "size": size,
        "tokens": summary["completion_tokens"],
        "seconds": summary["generate_s"],
        "wall": summary["wall_s"],
        "tok_s": summary["tokens_per_s"],
        "tau": summary["tau"],
        "latency_mean": statistics.mean(latencies),
        "latency_max": max(latencies),
        "draft_share": draft_s / step_s if step_s else 0.0,
        "load": (load_before, os.getloadavg()[0]),
        "texts": {record["id"]: record["text"] for record in records},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args, extra = parser.parse_known_args(argv)
    extra = [flag for flag in extra if flag != "--"]
    with tempfile.TemporaryDirectory() as scratch:
        prompts = Path(scratch) / "prompts.jsonl"
        lines = ASSET.read_text().splitlines()[: args.prompts]
        prompts.write_text(
            "".join(
                json.dumps({"id": f"p{i:02d}", "messages": [{"role": "user", "content": json.loads(line)["prompt"]}]})
                + "\n"
                for i, line in enumerate(lines)
            )
        )
        print(
            f"{args.recipe}: {len(lines)} prompts, --max-tokens {args.max_tokens}, {' '.join(extra) or 'default flags'}; "
            f"load average before: {os.getloadavg()}"
        )
        print(
            "| round | batch | tokens | time (s) | tok/s | vs batch "
            + str(args.sizes[0])
            + " | wall (s) | wall vs batch "
            + str(args.sizes[0])
            + " | tau | draft share | row latency mean / max (s) | load (1 min) |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        texts: dict[int, dict[str, str]] = {}
        for round_ in range(1, args.rounds + 1):
            base = wall = None
            for size in args.sizes:
                result = run(
                    args.recipe, prompts, size, args.max_tokens, extra, Path(scratch) / f"out-{round_}-{size}.jsonl"
                )
                base, wall = base or result["tok_s"], wall or result["wall"]
                texts.setdefault(size, result["texts"])
                tau = f"{result['tau']:.2f}" if result["tau"] is not None else "-"
                print(
                    f"| {round_} | {size} | {result['tokens']} | {result['seconds']:.1f} | {result['tok_s']:.1f} | "
                    f"{result['tok_s'] / base:.2f}x | {result['wall']:.1f} | {result['wall'] / wall:.2f}x | {tau} | {result['draft_share']:.0%} | {result['latency_mean']:.1f} / {result['latency_max']:.1f} | "
                    f"{result['load'][0]:.2f} -> {result['load'][1]:.2f} |",
                    flush=True,
                )
        same = all(texts[size] == texts[args.sizes[0]] for size in texts)
        print(f"every request's text is the same at every batch size: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
