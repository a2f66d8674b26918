"""The golden sets in tests/fixtures (tokens and acceptance lengths made with z-lab's reference) and the check that
decodes every case of them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from dflash_cli import load_drafter
from dflash_cli.engine import SamplingParams, collect, generate

FIXTURES = Path(__file__).parents[1] / "fixtures"
# Copies of shared/conformance (made with z-lab's reference, dflash==0.1.0), and golden sets we made with the
# same reference for rules the public ones do not show (reference-extra/README.md).
GOLDEN_SETS = ["qwen3-tiny-swa", "qwen3-tiny-dflash2"] + sorted(
    f"reference-extra/{p.parent.name}" for p in (FIXTURES / "reference-extra").glob("*/golden.json")
)


def check_golden_sets(
    names: list[str],
    shown: list[str] | None = None,
    *,
    compile: bool = True,
    baseline: bool = False,
    target: Any = None,
    prepare: Callable[[Any], None] | None = None,
) -> set[int]:
    """Every case of each golden set (tokens and acceptance lengths), on one target object (every set was made on the
    same target, whose copies are byte-identical; default: a fresh float32 one), both steps compiled unless not
    `compile` (progress lines into `shown`), `prepare(drafter)` first for each set's drafter, and with `baseline`
    the plain decoding's greedy tokens too. Returns the block sizes used."""
    if target is None:
        target = AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3-tiny" / "target", dtype=torch.float32).eval()
    notify = None if shown is None else (lambda message: shown.append(message) or contextlib.nullcontext())
    sizes = set()
    for name in names:
        golden = json.loads((FIXTURES / name / "golden.json").read_text())
        drafter = load_drafter(FIXTURES / name / golden.get("drafter_dir", "drafter"), target)
        if prepare is not None:
            prepare(drafter)
        for case in golden["cases"]:
            sizes.add(case.get("block_size") or drafter.block_size)
            params = SamplingParams(max_new_tokens=golden["max_new_tokens"])
            steps = generate(
                target,
                drafter,
                case["prompt_ids"],
                params,
                block_size=case.get("block_size"),
                compile=compile,
                notify=notify,
            )
            result = collect(steps)
            assert result.token_ids == case["new_token_ids"], (name, case["prompt_ids"][:4])
            assert result.acceptance_lengths == case["acceptance_lengths"], (name, case["prompt_ids"][:4])
            if baseline:
                plain = collect(generate(target, None, case["prompt_ids"], params, compile=compile))
                assert plain.token_ids == case["greedy_new_token_ids"], (name, case["prompt_ids"][:4])
    return sizes
