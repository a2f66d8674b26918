"""benchmarks/magpie_prompts.py: user turns a target writes itself, and their answers in `dflash train`'s answer
cache. On the tiny Qwen3 (a ChatML template; random weights end a turn now and then)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import magpie_prompts
from helpers.tiny_models import tiny_tokenizer


def test_a_turn_is_kept_once_and_whole() -> None:
    seen: set[str] = set()
    assert magpie_prompts.kept_turn("  How do I fix a flat bike tire?\n", seen) == "How do I fix a flat bike tire?"
    assert magpie_prompts.kept_turn("how do I fix a flat bike tire", seen) is None  # the same words: seen
    assert magpie_prompts.kept_turn("Hello there", seen) is None  # too short to be a request
    assert magpie_prompts.kept_turn("What is green tea made of?", seen) is not None


def test_a_turn_counts_only_when_it_ends_and_leaks_no_special_token() -> None:
    tokenizer = tiny_tokenizer()
    prefix, end = magpie_prompts.template_ends(tokenizer)
    assert prefix.endswith("<|im_start|>user\n") and tokenizer.convert_ids_to_tokens(end) == "<|im_end|>"
    words = tokenizer("How do tides work?", add_special_tokens=False)["input_ids"]
    assert magpie_prompts.turn_text(tokenizer, [*words, end], end) == "How do tides work?"
    assert magpie_prompts.turn_text(tokenizer, words, end) is None  # cut off at the token limit
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert magpie_prompts.turn_text(tokenizer, [*words, start, *words, end], end) is None  # another turn inside


def test_answers_land_where_dflash_train_finds_them(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """A file already at --count: nothing is sampled, and --answer answers every line (a run stopped while answering
    left some unanswered) into the cache `dflash train --prompts FILE --output DIR` reads: its session's producer,
    its keys."""
    from rich.console import Console

    from dflash_cli.training.distill import answer_key, encode, producer, read_answers
    from dflash_cli.training.loop import answering_session
    from dflash_cli.training.options import TrainOptions
    from dflash_cli.training.prompts import load_prompts

    path = tmp_path / "magpie-prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("How do tides work?", "Name three birds.")))
    path.write_text(path.read_text() + '{"prompt": "cut sho')  # a kill's last line: dropped
    target = str(tiny_qwen3_dir)
    assert magpie_prompts.main([str(tmp_path), "--count", "2", "--answer", "--target", target]) == 0
    assert not (tmp_path / "magpie-prompts.seed").exists()  # nothing sampled
    assert len(path.read_text().splitlines()) == 2
    options = TrainOptions(target=target, prompts=str(path), output=str(tmp_path), max_new_tokens=128)
    session, run = answering_session(options, Console(stderr=True))
    cached = read_answers(tmp_path / "distill" / "answers.jsonl", producer(session), 128)
    keys = [answer_key(ids, params.grammar) for _, ids, params in encode(session, run, load_prompts(path))]
    assert len(keys) == 2 and set(keys) <= set(cached)


def test_sampling_resumes_with_new_seeds_and_new_lines(
    tiny_qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds of sampled turns, a second run resuming: the seeds go on from the first run's, no line repeats. (The
    tiny model's random weights seldom end a turn: here any turn it writes counts, ended or not.)"""
    monkeypatch.setattr(magpie_prompts, "ROUND", 8)
    monkeypatch.setattr(magpie_prompts, "MAX_TURN_TOKENS", 48)
    monkeypatch.setattr(magpie_prompts, "turn_text", lambda tokenizer, ids, end: tokenizer.decode(ids))
    target = str(tiny_qwen3_dir)
    assert magpie_prompts.main([str(tmp_path), "--count", "3", "--target", target]) == 0
    seed = int((tmp_path / "magpie-prompts.seed").read_text())
    assert seed > 0 and seed % 8 == 0  # whole rounds
    assert magpie_prompts.main([str(tmp_path), "--count", "11", "--target", target]) == 0
    assert int((tmp_path / "magpie-prompts.seed").read_text()) > seed
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "magpie-prompts.jsonl").read_text().splitlines()]
    assert len({magpie_prompts.words(p) for p in prompts}) == len(prompts) == 11
