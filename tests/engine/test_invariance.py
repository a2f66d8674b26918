"""Batch invariance in bf16 on a CPU: a row's tokens do not depend on what its steps compute it with.

With eager attention (the CPU plan's default) and one-row bf16 products run as two (engine.kernels.layers), a row's
numbers are the same bits whatever its step holds: one token or a verify block of any size, alone or beside
other rows of other lengths, its prompt prefilled whole, in chunks, or continued from a kept prefix. So greedy
text equals the baseline's and the same request alone, and seeded sampling reproduces, in bf16 as in float32.
PyTorch's fused CPU attention (SDPA) rounds a row by the step's shape: the same checks fail with it.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dflash_cli.engine import SamplingParams, collect, generate
from dflash_cli.engine.kernels import native
from dflash_cli.engine.kernels.layers import INVARIANT_EAGER, invariant_eager_attention, use_cpu_products
from dflash_cli.engine.policy import FixedBlock
from dflash_cli.engine.target import attention
from helpers.drafters import random_drafter
from helpers.runs import conversation, run_batch, turns
from helpers.tiny_models import build_tiny


@functools.cache
def bf16_target(family: str, seed: int, attn: str = "eager"):
    """A random tiny model in bf16, unsharpened: near-ties between its top tokens are common, so any rounding
    difference between two ways of computing a row shows up as different text."""
    model = build_tiny(family, seed).to(torch.bfloat16)
    model.set_attn_implementation(attn)
    return model


PROMPTS = [[5, 17, 42, 9, 33], [8, 9, 3, 3, 11, 12, 30, 31, 2, 2, 70], [1, 60], [44] * 23, [7, 6, 5, 4, 3, 2, 1]]


def alone(target, drafter, prompt, params, block=None):
    policy = FixedBlock(block) if block else None
    return collect(generate(target, drafter, prompt, params, policy=policy)).token_ids


def texts(target, attn_note: str) -> None:
    """Every way of decoding each prompt gives the baseline's greedy tokens."""
    drafter = random_drafter(target, seed=1, block_size=8, dtype=torch.bfloat16)
    params = SamplingParams(max_new_tokens=40)
    baseline = [alone(target, None, p, params) for p in PROMPTS]
    for block in (2, 3, 8):
        assert [alone(target, drafter, p, params, block) for p in PROMPTS] == baseline, (attn_note, block)
    for rows in (2, 3, 4):
        requests = [(p, params, i % 3) for i, p in enumerate(PROMPTS)]
        got, widest = run_batch(target, drafter, requests, rows)
        assert widest > 1 and [g[0] for g in got] == baseline, (attn_note, rows)
        got, _ = run_batch(target, None, requests, rows)
        assert [g[0] for g in got] == baseline, (attn_note, rows, "baseline batched")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "gemma4", "gpt_oss"])
def test_greedy_text_is_the_same_alone_batched_and_in_any_block(family: str) -> None:
    texts(bf16_target(family, 0), family)


@pytest.mark.slow
def test_the_same_checks_fail_with_the_fused_attention_kernel() -> None:
    """The test above can fail: with SDPA a row's rounding follows the step's shape, and some text differs."""
    differs = 0
    for seed in range(3):
        try:
            texts(bf16_target("qwen3", seed, "sdpa"), "sdpa")
        except AssertionError:
            differs += 1
    assert differs > 0


@pytest.mark.slow
def test_seeded_sampling_reproduces_across_batch_compositions() -> None:
    target = bf16_target("qwen3", 1)
    drafter = random_drafter(target, seed=2, block_size=4, dtype=torch.bfloat16)
    params = [SamplingParams(max_new_tokens=32, temperature=0.9, top_p=0.95, seed=123 + i) for i in range(len(PROMPTS))]
    solo = [alone(target, drafter, p, q) for p, q in zip(PROMPTS, params)]
    assert solo == [alone(target, None, p, q) for p, q in zip(PROMPTS, params)]  # drafting or not
    for rows, joins in ((2, (0, 0, 1, 1, 2)), (4, (0, 3, 0, 1, 0))):
        got, widest = run_batch(target, drafter, list(zip(PROMPTS, params, joins)), rows)
        assert widest > 1 and [g[0] for g in got] == solo


@pytest.mark.parametrize("family", ["llama", "gemma4", "gpt_oss"])
def test_a_prompt_prefilled_in_chunks_continues_as_prefilled_whole(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 16 queries: sliding windows (gemma4, gpt_oss, window 4) and attention sinks across chunk edges."""
    target = bf16_target(family, 2)
    drafter = random_drafter(target, seed=3, block_size=4, dtype=target.dtype)
    prompt = [(i * 37) % 90 + 1 for i in range(70)]
    params = SamplingParams(max_new_tokens=24)
    whole = alone(target, drafter, prompt, params)
    monkeypatch.setattr(attention, "PREFILL_SCORES_BYTES", 1)  # chunks of MIN_PREFILL_CHUNK queries
    assert attention.AttentionState(target).prefill_chunk(len(prompt)) == attention.MIN_PREFILL_CHUNK
    assert alone(target, drafter, prompt, params) == whole == alone(target, None, prompt, params)


@pytest.mark.slow
def test_a_conversation_reusing_its_prefix_decodes_as_without() -> None:
    """A chat's later turns continue from the K/V its earlier turns left (one-token and block steps, another
    prefill's chunks): in bf16 the replies equal a fresh prefill's, token for token."""
    target = bf16_target("qwen3", 2)
    drafter = random_drafter(target, seed=4, block_size=4, dtype=torch.bfloat16)
    params = SamplingParams(max_new_tokens=30)
    prompts = conversation(target, drafter, [5, 6, 7, 8, 9, 10], params, 4)
    with_reuse, without, cached = turns(target, drafter, prompts, params)
    assert with_reuse == without and all(n > 0 for n in cached[1:])


def test_the_engines_eager_attention_runs_one_query_as_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """MKL's one-row kernel also serves attention's [1, keys] x values product of a plain step (the review saw a
    one-token verify part from a 2-token verify's first row at 2,500 keys, 8 KV heads x 128, on the first try;
    address-dependent like the linears' case). The engine's eager attention on a CPU hands the family's own eager
    function two queries (the one twice) and keeps the first: the row a block's product computes."""
    import transformers.models.qwen3.modeling_qwen3 as family

    target = bf16_target("qwen3", 3)
    assert target.config._attn_implementation == "eager"
    drafter = random_drafter(target, seed=1, block_size=4, dtype=torch.bfloat16)
    seen: list[int] = []
    eager = family.eager_attention_forward

    def spy(module, query, *args, **kwargs):
        seen.append(query.shape[2])
        return eager(module, query, *args, **kwargs)

    monkeypatch.setattr(family, "eager_attention_forward", spy)
    tokens = alone(target, None, PROMPTS[1], SamplingParams(max_new_tokens=6))
    assert target.config._attn_implementation == INVARIANT_EAGER  # the engine switched it (engine.kernels.layers)
    assert seen and 1 not in seen and seen.count(2) >= 5 * target.config.num_hidden_layers
    assert tokens == alone(target, drafter, PROMPTS[1], SamplingParams(max_new_tokens=6), 3)


def test_a_hybrids_prefill_in_chunks_carries_its_recurrent_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid's linear-attention states start from zero only at position 0 and carry from chunk to chunk: chunks
    of 16 end where a whole prefill ends (float32: the chunked recurrence rounds by chunk, within 1e-5)."""
    from dflash_cli.engine.target.hybrid import HybridState

    target = build_tiny("qwen3_5", 2)
    ids = torch.tensor([[(i * 37) % 90 + 1 for i in range(70)]])

    def prefilled(chunk: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setattr(attention, "MAX_PREFILL_CHUNK", chunk)
        state = HybridState(target)
        state.reserve(100, 4, ())
        with torch.inference_mode():
            logits = state.prefill(ids)
        states = [stored[0].clone() for layer in state.linear for stored in layer.storage.values()]
        state.close()
        return logits, states

    whole, chunked = prefilled(512), prefilled(16)
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-4, atol=1e-5)
    assert len(chunked[1]) == len(whole[1]) > 0
    for got, expected in zip(chunked[1], whole[1]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@functools.cache
def wide_heads_target(family: str, seed: int):
    """`bf16_target` with heads 32 wide: the engine's eager attention runs dflash's fused kernel on it (engine.kernels.layers)."""
    model = build_tiny(family, seed, head_dim=32).to(torch.bfloat16)
    model.set_attn_implementation("eager")
    return model


fused_kernel = pytest.mark.skipif(not native.available(), reason="dflash's CPU kernels are not built here")


@fused_kernel
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_eager_decoding_runs_the_fused_attention(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager start (no stored step yet, or --compile off) of a bf16 standard target: every attention call of its
    plain and drafted steps, prefill included, runs dflash's fused kernel, not the family's eager attention (0.69x of
    SDPA's speed), and the text is the same either way."""
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    target = wide_heads_target(family, 4)
    drafter = random_drafter(target, seed=1, block_size=4, dtype=torch.bfloat16)
    seen: list[int] = []
    module = {"llama": llama, "qwen3": qwen3}[family]
    eager = module.eager_attention_forward

    def spy(attention_module, query, *args, **kwargs):
        seen.append(query.shape[2])
        return eager(attention_module, query, *args, **kwargs)

    monkeypatch.setattr(module, "eager_attention_forward", spy)
    params = SamplingParams(max_new_tokens=12)
    plain = alone(target, None, PROMPTS[1], params)
    assert plain == alone(target, drafter, PROMPTS[1], params, 3)
    assert target.config._attn_implementation == INVARIANT_EAGER and seen == []


@fused_kernel
def test_the_fused_eager_attention_is_the_familys_attention() -> None:
    """The fused path computes the family's eager attention (query heads folded onto their KV head, each query over
    its own row's keys up to its position) to bf16 rounding, for rows of different lengths and a one-query step."""
    target = wide_heads_target("qwen3", 5)
    use_cpu_products(target)
    layer = target.model.layers[0].self_attn
    assert layer.dflash_attention
    torch.manual_seed(0)
    for positions in (torch.tensor([[3, 4, 5, 6, 7], [7, 8, 9, 10, 11]]), torch.tensor([[9], [2]])):
        rows, q = positions.shape
        query = torch.randn(rows, 4, q, 32, dtype=torch.bfloat16)
        key, value = (torch.randn(rows, 2, 12, 32, dtype=torch.bfloat16) for _ in range(2))
        future = torch.arange(12)[None, None, None, :] > positions[:, None, :, None]
        mask = torch.zeros(future.shape, dtype=torch.bfloat16).masked_fill(future, torch.finfo(torch.bfloat16).min)
        fused, _ = invariant_eager_attention(
            layer, query, key, value, mask, scaling=layer.scaling, position_ids=positions
        )
        layer.dflash_attention = False
        try:
            expected, _ = invariant_eager_attention(layer, query, key, value, mask, scaling=layer.scaling)
        finally:
            layer.dflash_attention = True
        assert fused.shape == expected.shape == (rows, q, 4, 32)
        torch.testing.assert_close(fused.float(), expected.float(), rtol=0.02, atol=0.02)


@fused_kernel
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_text_is_the_same_alone_batched_and_in_any_block_on_the_fused_attention(family: str) -> None:
    texts(wide_heads_target(family, 0), f"{family}, fused eager attention")
