"""Every target family decodes losslessly: tiny random models of each (MoE, Gemma 4 dense and MoE, gpt-oss, Llama 4,
and the hybrids: Qwen3.5 / Qwen3.5-MoE / Qwen3-Next Gated DeltaNet, Bamba's Mamba-2), through the public API and
through `dflash chat --target DIR`.

The property: speculative greedy output equals transformers' own greedy `generate`, at block sizes 1 to 16, with
drafts that are partly accepted (an oracle drafting a varying number of right tokens per step), so every step
both commits and rejects. Float32 throughout.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from dflash_cli import speculative_generate
from dflash_cli.cli.app import app
from helpers.drafters import OracleDrafter, RowOracle, save_random_drafter
from helpers.runs import run_batch
from helpers.sampling import chi2_p_value, exact_marginals
from helpers.tiny_models import build_tiny, family_target, hf_greedy, make_tiny, make_tiny_mxfp4_gpt_oss

HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "bamba"]  # a rejected draft must roll their state back
FAMILIES = ["qwen3_moe", "gemma4", "gemma4_moe", "gpt_oss", "llama4", *HYBRIDS]
NEW_TOKENS = 40


@functools.cache
def reference(family: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(family_target(family), list(prompt), NEW_TOKENS)


PROMPT = (5, 17, 42, 8, 9, 3, 3, 11, 12)  # longer than the tiny models' sliding windows (4)


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_greedy_equals_generate_with_partial_acceptance(family: str, block_size: int) -> None:
    model, expected = family_target(family), reference(family, PROMPT)
    pattern = [0, block_size - 1, 1, block_size // 2, 2]  # right drafts per step: rejections at varying depths
    drafter = OracleDrafter(model, list(PROMPT) + expected, block_size=block_size, correct=pattern)
    result = speculative_generate(model, drafter, list(PROMPT), NEW_TOKENS)
    assert result.token_ids == expected
    assert sum(result.acceptance_lengths) == NEW_TOKENS - 1
    if block_size >= 4:  # steps that kept some drafts and threw the rest away
        assert any(1 < n < block_size for n in result.acceptance_lengths)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(FAMILIES),
    prompt=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    block_size=st.sampled_from([2, 4, 8, 16]),
    pattern=st.lists(st.integers(0, 15), min_size=1, max_size=4),
)
def test_any_prompt_and_acceptance_pattern_is_lossless(
    family: str, prompt: list[int], block_size: int, pattern: list[int]
) -> None:
    model = family_target(family)
    expected = hf_greedy(model, prompt, 24)
    drafter = OracleDrafter(model, prompt + expected, block_size=block_size, correct=pattern)
    assert speculative_generate(model, drafter, prompt, 24).token_ids == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_dflash_chat_runs_every_family_from_local_directories(family: str, tmp_path: Path) -> None:
    """The user's path: checkpoints on disk, loaded by our loader (attention chosen per model), one answer."""
    target_dir = make_tiny(family, tmp_path / "target", seed=2)
    drafter_dir = save_random_drafter(
        tmp_path / "drafter", AutoModelForCausalLM.from_pretrained(target_dir), block_size=4
    )
    args = [
        "chat",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--prompt",
        "Hello there",
        "--max-tokens",
        "12",
        "--dtype",
        "fp32",
        "--stats",
    ]
    speculative, baseline = (CliRunner().invoke(app, args + extra) for extra in ([], ["--no-spec"]))
    assert speculative.exit_code == 0, speculative.output
    assert baseline.exit_code == 0, baseline.output
    assert "DFlash adaptive block ≤4" in speculative.stderr and " tokens, " in speculative.stderr
    assert speculative.stdout == baseline.stdout  # the same answer with and without the drafter


def test_gpt_oss_published_as_mxfp4_loads_dequantized_here_and_decodes_losslessly(tmp_path: Path) -> None:
    """gpt-oss ships its experts as MXFP4 blocks and scales. Where transformers has no MXFP4 kernels (this CPU),
    the loader dequantizes them explicitly, to exactly the values the blocks encode, and the plan sizes them so."""
    from dflash_cli.loading.checkpoint import read_checkpoint
    from dflash_cli.loading.models import load_target
    from dflash_cli.setup.planning import Plan

    directory, expected_model = make_tiny_mxfp4_gpt_oss(tmp_path / "gpt-oss")
    checkpoint = read_checkpoint(directory)
    assert checkpoint.prequantized == "mxfp4"
    assert checkpoint.nbytes("float32") > 2 * checkpoint.stored_bytes  # dequantized: much bigger than stored
    model = load_target(directory, Plan("cpu", "float32", "none", None, "sdpa", "cpu", None, None, ()))
    for (name, got), (_, want) in zip(model.named_parameters(), expected_model.named_parameters(), strict=True):
        assert torch.equal(got, want), name
    prompt = list(PROMPT)
    expected = hf_greedy(model, prompt, 24)
    drafter = OracleDrafter(model, prompt + expected, block_size=8, correct=[0, 7, 3])
    assert speculative_generate(model, drafter, prompt, 24).token_ids == expected


@pytest.mark.slow
def test_speculative_sampling_on_a_hybrid_matches_the_target_distribution() -> None:
    """Exact sampling where a rejection must also roll the recurrent state back: the 2nd and 3rd sampled tokens'
    frequencies against their exact marginals (enumerated), chi-square at alpha = 0.001, fixed seeds."""
    model = build_tiny(
        "qwen3_5", seed=11, vocab_size=6, hidden_size=32, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8
    )
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(12)
    prompt, temperature, runs = [1, 4, 2], 0.8, 800
    p2, p3 = exact_marginals(model, prompt, temperature)
    drafter = OracleDrafter(model, prompt + hf_greedy(model, prompt, 3), block_size=4)
    counts, multi = torch.zeros(2, 6), 0
    for seed in range(runs):
        result = speculative_generate(model, drafter, prompt, 3, temperature=temperature, seed=seed)
        counts[0, result.token_ids[1]] += 1
        counts[1, result.token_ids[2]] += 1
        multi += result.acceptance_lengths[0] > 1
    assert runs // 10 < multi < runs  # both paths taken: accepted drafts, and rejections that roll back
    assert chi2_p_value(counts[0], p2) > 1e-3 and chi2_p_value(counts[1], p3) > 1e-3


def test_a_hybrid_target_says_it_runs_eager_when_compiling_is_asked_for(tmp_path: Path) -> None:
    target_dir = make_tiny("qwen3_5", tmp_path / "target", seed=2)
    args = [
        "chat",
        "--target",
        str(target_dir),
        "--prompt",
        "Hi",
        "--max-tokens",
        "3",
        "--dtype",
        "fp32",
        "--compile",
        "on",
        "--explain",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "compile off: hybrid targets run eager" in result.stderr and "compiled" not in result.stderr


@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_of_a_batch_decodes_as_it_does_alone(family: str) -> None:
    """Rows of different lengths share each verify (hybrids too: each row's recurrent state is its own and rolls
    back to its own kept count), each row's greedy output is transformers' own; sliding, chunked and full layers
    each get their own row mask."""
    from dflash_cli.engine import Batch, SamplingParams
    from dflash_cli.engine.target.base import batch_limit

    model = family_target(family)
    prompts = [list(PROMPT), [3, 1, 4], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8], [27]]
    lengths = [NEW_TOKENS, 12, 30, 20]
    expected = [reference(family, tuple(p))[:n] for p, n in zip(prompts, lengths)]
    drafter = RowOracle(
        model,
        [p + e for p, e in zip(prompts, expected)],
        [len(p) for p in prompts],
        block_size=8,
        correct=[0, 7, 3, 5, 1],
    )
    requests = [(p, SamplingParams(max_new_tokens=n), i) for i, (p, n) in enumerate(zip(prompts, lengths))]
    got, widest = run_batch(model, drafter, requests, rows=3)
    assert [g[0] for g in got] == expected
    assert widest == 3
    assert batch_limit(model) is None and Batch(model, None, rows=3).rows == 3
