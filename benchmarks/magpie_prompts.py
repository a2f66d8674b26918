"""User turns written by the demo target itself, a prompt source for the demo drafter beyond our templates.

Magpie (Xu et al. 2024): an instruct model given its chat template up to the start of a user turn, and nothing
else, writes a user turn of the kind it was tuned on. SmolLM2-135M-Instruct's are everyday requests (advice,
plans, lists, code, explanations) with none of our templates' shapes, which is what the held-out and everyday
prompts are and what the drafter walks worst (benchmarks/results/history.md, "Where held-out tau is lost").
Sampled at temperature 1 (top-p 0.95), one seed a line, through the engine we serve (int4, batched); a line is
kept when its turn ends (the template's end token) within MAX_TURN_TOKENS, has a few words, and is new.

    python -m benchmarks.magpie_prompts OUT_DIR --count N [--answer] [--target demo]

Appends to OUT_DIR/magpie-prompts.jsonl (`{"prompt": ...}` lines, as `dflash train --prompts` reads them), the next
seed in OUT_DIR/magpie-prompts.seed, so a run stopped at any point resumes; no line repeats another or a held-out
prompt (dflash_cli/assets/demo_prompts_eval.jsonl). With --answer, the target's greedy answers to them (128 new
tokens) go into OUT_DIR/distill/answers.jsonl, the answer cache `dflash train --output OUT_DIR` reads (from the
session it answers with), so a later run trains on them without answering them again. Run from a checkout.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

MAX_TURN_TOKENS = 80  # a user turn longer than this is cut off mid-way: dropped
ROUND = 64  # prompts sampled (and answered) per round: a stop loses at most one round
BARREN_ROUNDS = 5  # rounds in a row that keep nothing: the target does not end its turns, stop
HELD_OUT = Path(__file__).resolve().parents[1] / "dflash_cli" / "assets" / "demo_prompts_eval.jsonl"


def template_ends(tokenizer) -> tuple[str, int]:
    """The chat template's text up to where a user turn's content starts (its system prompt included), and the
    token that ends a user turn (ChatML's <|im_end|>)."""
    marker = "\x00TURN\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    before, after = text.split(marker)
    return before, tokenizer(after, add_special_tokens=False)["input_ids"][0]


def words(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def kept_turn(text: str, seen: set[str]) -> str | None:
    """The user turn `text` as a prompt line, or None: too short to be a request, or seen before."""
    turn, key = text.strip(), words(text)
    if len(turn.split()) < 4 or key in seen:
        return None
    seen.add(key)
    return turn


def turn_text(tokenizer, ids: list[int], end: int) -> str | None:
    """The text of a sampled turn that ended with `end` and holds no other special token (a turn that leaks the
    template, or another turn's start), else None."""
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    if not ids or ids[-1] != end or set(ids[:-1]) & (special | set(tokenizer.all_special_ids)):
        return None
    return tokenizer.decode(ids[:-1])


def read_lines(path: Path) -> list[str]:
    """The prompts written so far; a last line cut short by a kill is dropped (and the file mended)."""
    if not path.exists():
        return []
    lines, whole = [], []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line)["prompt"])
            whole.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    path.write_text("".join(line + "\n" for line in whole))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, required=True, help="stop when the file holds this many prompts")
    parser.add_argument("--answer", action="store_true", help="also distil the target's answers, round by round")
    parser.add_argument("--target", default="demo", help="a recipe or model directory (default: demo)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import Progress

    from dflash_cli.protocol.params import SamplingParams
    from dflash_cli.training.distill import distill
    from dflash_cli.training.loop import answering_session
    from dflash_cli.training.options import TrainOptions
    from dflash_cli.training.prompts import load_prompts

    args.out.mkdir(parents=True, exist_ok=True)
    path, seeds = args.out / "magpie-prompts.jsonl", args.out / "magpie-prompts.seed"
    lines = read_lines(path)
    seen = {words(json.loads(line)["prompt"]) for line in HELD_OUT.read_text().splitlines()}  # never a held-out one
    for line in lines:
        kept_turn(line, seen)
    seed = int(seeds.read_text()) if seeds.exists() else 0
    console = Console(stderr=True)
    # The session `dflash train` answers with: its answers are the ones it reads.
    options = TrainOptions(
        target=args.target, prompts=str(path), output=str(args.out), distill_batch_size=16, threads=args.threads
    )
    session, run = answering_session(options, console)

    def answer(requests: list) -> None:
        with Progress(console=console, transient=True) as progress:
            distill(session, run, requests, args.out / "distill", progress)

    if args.answer and lines:  # (a run stopped while answering left some unanswered: distill skips the rest)
        answer(load_prompts(path))
    tokenizer = session.tokenizer
    prefix, end = template_ends(tokenizer)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    barren = 0
    while len(lines) < args.count:
        batch = session.batch(speculative=False)
        rows: dict[object, list[int]] = {}
        ended: list[list[int]] = []
        try:
            for offset in range(ROUND):
                params = SamplingParams(
                    max_new_tokens=MAX_TURN_TOKENS,
                    temperature=1.0,
                    top_p=0.95,
                    seed=seed + offset,
                    stop_token_ids=(end,),
                )
                rows[batch.add(prefix_ids, params)] = []
            while not batch.idle:
                for row, event in batch.step():
                    if isinstance(event, BaseException):
                        raise event
                    rows[row] += event.token_ids
                    if event.finish_reason is not None:
                        ended.append(rows[row])
        finally:
            batch.close()
        seed += ROUND
        texts = [text for ids in ended if (text := turn_text(tokenizer, ids, end)) is not None]
        new = [turn for text in texts if (turn := kept_turn(text, seen))][: args.count - len(lines)]
        with path.open("a") as out:  # (one write a round: a kill leaves at most a cut last line, dropped on resume)
            out.write("".join(json.dumps({"prompt": turn}) + "\n" for turn in new))
        seeds.write_text(f"{seed}\n")
        lines += new
        if args.answer and new:  # (read back as `dflash train --prompts` reads them: the same answer keys)
            answer(load_prompts(path)[-len(new) :])
        console.print(f"{len(lines)} prompts ({len(new)} of {ROUND} samples kept this round)")
        barren = 0 if new else barren + 1
        if barren == BARREN_ROUNDS:
            console.print(f"{BARREN_ROUNDS} rounds kept no turn: the target does not end its user turns; stopped")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
