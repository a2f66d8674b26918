"""Compiled target steps: one graph per block size, no recompiles while decoding, same tokens as eager."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig

import dflash_cli.engine.target as target_module
from dflash_cli import load_drafter
from dflash_cli.engine import SamplingParams, collect, generate
from dflash_cli.engine.compiled import CompiledStep
from drafters import random_drafter
from test_drafter_formats import GOLDEN_SETS

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def traced_only(monkeypatch: pytest.MonkeyPatch, fresh_dynamo) -> CompiledStep:
    """Compiled steps traced by dynamo exactly as for inductor, then run by the eager backend (seconds, not minutes)."""
    step = CompiledStep("cpu", backend="eager")
    monkeypatch.setattr(target_module, "compiled_step", lambda device: step)
    return step


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def _llama(seed: int):
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def test_no_recompiles_in_a_generation_at_a_fixed_block_size(traced_only: CompiledStep) -> None:
    target = _llama(1)
    drafter = random_drafter(target, block_size=4)
    params = SamplingParams(max_new_tokens=64)
    collect(generate(target, drafter, [1, 2, 3], params, compile=True))
    assert _graphs() == 1, "one graph for the 4-token verify: the context grows and the last blocks shorten"
    # another prompt length, another request: still the same graph
    result = collect(generate(target, drafter, list(range(5, 30)), params, compile=True))
    assert _graphs() == 1 and len(result.token_ids) == 64
    assert result.token_ids == _hf_greedy(target, list(range(5, 30)), 64)
    baseline = collect(generate(target, None, [9, 8, 7], params, compile=True))
    assert _graphs() == 2, "the plain step is the second (and last) graph"
    assert baseline.token_ids == _hf_greedy(target, [9, 8, 7], 64)
    assert traced_only.broken is None


@pytest.mark.parametrize(("seed", "block_size"), [(0, 2), (1, 8)])
def test_compiled_greedy_equals_transformers_greedy(traced_only: CompiledStep, seed: int, block_size: int) -> None:
    target = _llama(seed)
    drafter = random_drafter(target, seed=seed, block_size=block_size)
    prompt = [1 + (seed * 7 + i * 13) % 90 for i in range(3 + seed * 5)]
    result = collect(generate(target, drafter, prompt, SamplingParams(max_new_tokens=33), compile=True))
    assert result.token_ids == _hf_greedy(target, prompt, 33)
    assert sum(result.acceptance_lengths) == 32


def test_inductor_reproduces_every_golden_set(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, fresh_dynamo) -> None:
    """The real compiler (inductor) on every golden set (all made on the same target, whose copies are
    byte-identical): minutes cold on a small CPU, so its cache lives in pytest's cache folder."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(request.config.cache.mkdir("inductor")))
    target = AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3-tiny" / "target", dtype=torch.float32).eval()
    shown: list[str] = []
    sizes = set()
    for name in ["qwen3-tiny", *GOLDEN_SETS]:
        golden = json.loads((FIXTURES / name / "golden.json").read_text())
        drafter = load_drafter(FIXTURES / name / golden.get("drafter_dir", "drafter"), target)
        for case in golden["cases"]:
            sizes.add(case.get("block_size") or drafter.block_size)
            params = SamplingParams(max_new_tokens=golden["max_new_tokens"])
            steps = generate(target, drafter, case["prompt_ids"], params, block_size=case.get("block_size"),
                             compile=True, notify=lambda message: shown.append(message) or contextlib.nullcontext())  # fmt: skip
            result = collect(steps)
            assert result.token_ids == case["new_token_ids"], (name, case["prompt_ids"][:4])
            assert result.acceptance_lengths == case["acceptance_lengths"], (name, case["prompt_ids"][:4])
    assert len(sizes) >= 5
    # dynamic shapes on CPU: block sizes share one graph (dynamo may specialize a second for a later size)
    assert _graphs() <= 2 and len(shown) == len(sizes)
