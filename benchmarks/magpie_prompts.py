"""User turns written by the demo target itself, a prompt source for the demo drafter beyond our templates.

Magpie (Xu et al. 2024): an instruct model given its chat template up to the start of a user turn, and nothing
else, writes a user turn of the kind it was tuned on. SmolLM2-135M-Instruct's are everyday requests (advice,
plans, lists, code, explanations) with none of our templates' shapes, which is what the held-out and everyday
prompts are and what the drafter walks worst (benchmarks/results/history.md, "Where held-out tau is lost").
Sampled at temperature 1 (top-p 0.95), one seed a line, through the engine we serve (int4, batched); a line is
kept when its turn ends (the template's end token) within MAX_TURN_TOKENS, has a few words, and is new.

    python -m benchmarks.magpie_prompts OUT_DIR --count N [--answer]

Appends to OUT_DIR/magpie-prompts.jsonl (`{"prompt": ...}` lines, as `dflash train --prompts` reads them), the
seeds going on from the lines' count, so a run stopped at any point resumes. With --answer, the target's greedy
answers to them (128 new tokens) go into OUT_DIR/distill/answers.jsonl: the answer cache `dflash train --output
OUT_DIR` reads, so a later run trains on them without answering them again. Run from a checkout.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

MAX_TURN_TOKENS = 80  # a user turn longer than this is cut off mid-way: dropped
ROUND = 64  # prompts sampled (and answered) per round: a stop loses at most one round


def user_prefix(tokenizer) -> str:
    """The chat template's text up to where a user turn's content starts (its system prompt included)."""
    marker = "\x00TURN\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return text[: text.index(marker)]


def kept_turn(text: str, seen: set[str]) -> str | None:
    """The user turn `text` as a prompt line, or None: too short, a turn that leaks the template, or seen before."""
    turn = text.strip()
    key = re.sub(r"\W+", " ", turn.lower()).strip()
    if len(turn.split()) < 4 or "<|" in turn or key in seen:
        return None
    seen.add(key)
    return turn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, required=True, help="stop when the file holds this many prompts")
    parser.add_argument("--answer", action="store_true", help="also distil the target's answers, round by round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import Progress

    from dflash_cli.loading.session import open_session
    from dflash_cli.protocol.params import SamplingParams
    from dflash_cli.setup.options import RunOptions
    from dflash_cli.setup.planning import PlanOverrides
    from dflash_cli.training.distill import distill
    from dflash_cli.training.prompts import load_prompts

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "magpie-prompts.jsonl"
    lines = [json.loads(line)["prompt"] for line in path.read_text().splitlines()] if path.exists() else []
    seen: set[str] = set()
    for line in lines:
        kept_turn(line, seen)
    console = Console(stderr=True)
    answers = SamplingParams(max_new_tokens=128)
    run = RunOptions(
        recipe_name="demo",
        sampling=answers,
        no_spec=True,
        overrides=PlanOverrides(device="cpu", dtype=None, batch_size=16),
        threads=args.threads,
    )
    session = open_session(run, console, batching=True)
    tokenizer = session.tokenizer
    prefix = tokenizer(user_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    seed = len(lines) * 2  # about half the samples are kept: seeds of a resumed run start past the last one's
    while len(lines) < args.count:
        batch = session.batch(speculative=False)
        rows: dict[object, list[int]] = {}
        for offset in range(ROUND):
            params = SamplingParams(
                max_new_tokens=MAX_TURN_TOKENS, temperature=1.0, top_p=0.95, seed=seed + offset, stop_token_ids=(end,)
            )
            rows[batch.add(prefix, params)] = []
        seed += ROUND
        ended: list[list[int]] = []
        while not batch.idle:
            for row, event in batch.step():
                if isinstance(event, BaseException):
                    raise event
                rows[row] += event.token_ids
                if event.finish_reason == "stop":
                    ended.append(rows[row])
        new = [turn for ids in ended if (turn := kept_turn(tokenizer.decode(ids, skip_special_tokens=True), seen))]
        new = new[: args.count - len(lines)]
        with path.open("a") as out:
            out.writelines(json.dumps({"prompt": turn}) + "\n" for turn in new)
        lines += new
        if args.answer and new:  # (read back as `dflash train --prompts` reads them: the same answer keys)
            with Progress(console=console, transient=True) as progress:
                distill(session, run, load_prompts(path)[-len(new) :], args.out / "distill", progress)
        console.print(f"{len(lines)} prompts ({len(new)} of {ROUND} samples kept this round)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
