"""benchmarks/magpie_prompts.py: user turns the demo target writes itself, and their answers in `dflash train`'s
answer cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import magpie_prompts


def test_a_turn_is_kept_once_whole_and_clean() -> None:
    seen: set[str] = set()
    assert magpie_prompts.kept_turn("  How do I fix a flat bike tire?\n", seen) == "How do I fix a flat bike tire?"
    assert magpie_prompts.kept_turn("how do I fix a flat bike tire", seen) is None  # the same words: seen
    assert magpie_prompts.kept_turn("Hello there", seen) is None  # too short to be a request
    assert magpie_prompts.kept_turn("What is tea?<|im_start|>assistant", seen) is None  # the template leaked
    assert magpie_prompts.kept_turn("What is green tea made of?", seen) is not None


@pytest.mark.slow
def test_prompts_and_answers_resume_and_match_the_training_cache(tmp_path: Path) -> None:
    """Two prompts with answers, then a third on a second run: the file resumes, and every prompt has its greedy
    answer cached under the chat rendering `dflash train --prompts` gives it."""
    from rich.console import Console

    from dflash_cli.loading.session import open_session
    from dflash_cli.protocol.params import SamplingParams
    from dflash_cli.setup.options import RunOptions
    from dflash_cli.training.distill import answer_key, encode
    from dflash_cli.training.prompts import load_prompts

    assert magpie_prompts.main([str(tmp_path), "--count", "2", "--answer"]) == 0
    assert magpie_prompts.main([str(tmp_path), "--count", "3", "--answer"]) == 0
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "magpie-prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == len(set(prompts)) == 3
    cached = {
        record["key"]: record
        for record in map(json.loads, (tmp_path / "distill" / "answers.jsonl").read_text().splitlines())
    }
    run = RunOptions(recipe_name="demo", sampling=SamplingParams(max_new_tokens=128), no_spec=True)
    session = open_session(run, Console(stderr=True))
    for request, ids, params in encode(session, run, load_prompts(tmp_path / "magpie-prompts.jsonl")):
        record = cached[answer_key(ids, params.grammar)]
        assert f"user\n{request.prompt}<|im_end|>" in session.tokenizer.decode(record["prompt_ids"])  # a chat turn
        assert record["response_ids"] and record["max_new_tokens"] == 128
