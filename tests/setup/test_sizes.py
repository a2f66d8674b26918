"""One model's size, counted by every part that counts it, agrees: the planner (from a recipe's listed sizes, made as
benchmarks/recipe_sizes.py makes them), the loader's memory check (from the checkpoint's files), doctor's speed bound,
the GPU benchmark (the loaded module, NF4's quantization data included) and the roofline (what a step reads)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dflash_cli.engine.target.attention import AttentionState
from dflash_cli.loading.checkpoint import read_checkpoint
from dflash_cli.loading.models import load_target
from dflash_cli.setup.hardware import MachineFacts
from dflash_cli.setup.planning import (
    PLAN_CONTEXT_TOKENS,
    Plan,
    PlanOverrides,
    make_plan,
    target_weight_bytes,
)
from dflash_cli.setup.recipes import adhoc_recipe, get_recipe
from dflash_cli.setup.sizes import (
    BYTES_PER_ELEMENT,
    PREFILL_CHUNK_TOKENS,
    PREFILL_SCORES_BYTES,
    RUNTIME_BYTES,
    kv_bytes_per_token,
    memory_estimate,
    module_weight_bytes,
    prefill_activation_bytes,
    prefill_chunk_tokens,
    recipe_stored_bytes,
    step_bytes,
    tensor_bytes,
)
from dflash_cli.setup.speed import expected_speed
from helpers.machines import GIB
from helpers.tiny_models import make_tiny


def cpu_plan(dtype: str, quant: str = "none") -> Plan:
    return Plan("cpu", dtype, quant, None, "sdpa", "cpu", None, None, ())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_count_of_one_models_size_agrees(tiny_qwen3_dir: Path, dtype: str) -> None:
    checkpoint = read_checkpoint(tiny_qwen3_dir)
    counts = checkpoint.parameter_counts
    assert counts is not None and counts.linear > 0
    listed = {"bf16": counts.nbytes("bfloat16"), "nf4": counts.nbytes("bfloat16", "nf4")}
    recipe = dataclasses.replace(adhoc_recipe(str(tiny_qwen3_dir), None), weight_bytes=listed)

    planned = target_weight_bytes(recipe, dtype, "none")
    target = load_target(tiny_qwen3_dir, cpu_plan(dtype))
    held = module_weight_bytes(target)
    assert planned == checkpoint.nbytes(dtype) == held == counts.total * BYTES_PER_ELEMENT[dtype]
    assert expected_speed(recipe, cpu_plan(dtype), 1e9).bytes_per_token == planned  # doctor's bound
    assert recipe_stored_bytes(recipe) == listed["bf16"]  # doctor's disk check: the checkpoint as listed

    # the roofline reads every weight but the input embedding's unused rows (this model does not tie it)
    embedding = target.get_input_embeddings().weight
    assert target.get_output_embeddings().weight is not embedding
    unread = tensor_bytes(embedding) - embedding.shape[-1] * embedding.element_size()
    assert step_bytes(target, 0).weights == held - unread


def test_nf4_counts_agree_with_what_bitsandbytes_holds(tiny_qwen3_dir: Path) -> None:
    checkpoint = read_checkpoint(tiny_qwen3_dir)
    counts = checkpoint.parameter_counts
    listed = {"bf16": counts.nbytes("bfloat16"), "nf4": counts.nbytes("bfloat16", "nf4")}
    recipe = dataclasses.replace(adhoc_recipe(str(tiny_qwen3_dir), None), weight_bytes=listed)

    planned = target_weight_bytes(recipe, "bfloat16", "nf4")
    assert planned == checkpoint.nbytes("bfloat16", "nf4")
    held = module_weight_bytes(load_target(tiny_qwen3_dir, cpu_plan("bfloat16", "nf4")))
    # (packing rounds each tensor's blocks up: a few bytes per tensor)
    assert held == pytest.approx(planned, rel=0.005)
    assert held < checkpoint.nbytes("bfloat16")  # it did quantize


CPU = MachineFacts(kind="cpu", cpu_ram_total=64 * GIB, cpu_ram_available=60 * GIB, cpu_bf16=True)


@pytest.mark.parametrize(
    "family",
    [
        "qwen3",  # an untied head: int8 in place of the bf16 one
        "gemma4",  # a tied head: its own int8 copy beside the bf16 embedding
        "qwen3_5_moe",  # fused experts and a shared expert's one-output gate: left in bf16
        "llama4",  # a router that subclasses nn.Linear: left in bf16
    ],
)
@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_the_cpu_formats_count_the_bytes_the_loaded_model_holds(tmp_path: Path, family: str, quant: str) -> None:
    """The int4 / int8 estimate (what recipes list, from scripts/recipe_sizes.py, and what the loader checks) is what
    `quantize_target` leaves: quantized linears with their scales, the head in int8, everything else in bf16."""
    checkpoint = read_checkpoint(make_tiny(family, tmp_path / family, with_tokenizer=False))
    target = load_target(checkpoint.path, cpu_plan("bfloat16", quant), check_free_memory=False)
    assert checkpoint.nbytes("bfloat16", quant) == module_weight_bytes(target)
    assert checkpoint.nbytes("bfloat16", "int4") < checkpoint.nbytes("bfloat16", "int8") < checkpoint.nbytes("bfloat16")


def test_the_memory_estimate_is_its_parts_at_the_plans_context() -> None:
    demo = get_recipe("demo")
    estimate = memory_estimate(demo, 269_030_016, "bfloat16", "cpu", PLAN_CONTEXT_TOKENS)
    assert estimate is not None
    assert estimate.weights == 269_030_016 and estimate.drafter == demo.drafter_bytes
    assert estimate.kv_cache == demo.kv_bytes_per_token * PLAN_CONTEXT_TOKENS  # target and drafter K/V, bf16
    chunk = PREFILL_SCORES_BYTES // (12 * 9 * PLAN_CONTEXT_TOKENS)  # 303 rows: eager scores near 256 MiB
    assert estimate.activations == 12 * 9 * chunk * PLAN_CONTEXT_TOKENS  # float32 scores, softmax, bf16 copy
    assert estimate.runtime == RUNTIME_BYTES["cpu"]
    parts = (estimate.weights, estimate.drafter, estimate.kv_cache, estimate.activations, estimate.runtime)
    assert estimate.total == sum(parts)
    fp32 = memory_estimate(demo, 2 * 269_030_016, "float32", "cpu", PLAN_CONTEXT_TOKENS)
    assert fp32 is not None and (fp32.drafter, fp32.kv_cache) == (2 * estimate.drafter, 2 * estimate.kv_cache)
    assert fp32.activations == estimate.activations  # the scores are float32 in every dtype
    assert memory_estimate(demo, None, "bfloat16", "cpu", PLAN_CONTEXT_TOKENS) is None
    baseline = dataclasses.replace(demo, drafter=None)
    assert memory_estimate(baseline, 1, "bfloat16", "cpu", PLAN_CONTEXT_TOKENS).drafter == 0  # type: ignore[union-attr]


def test_prefill_activations_are_the_last_chunks_scores_or_its_mlp() -> None:
    qwen = get_recipe("qwen3-8b")  # 32 heads, MLP 12288
    eager = prefill_activation_bytes(qwen, "bfloat16", 8192, eager=True)
    assert eager == 12 * 32 * 85 * 8192  # chunks of 85 rows: one layer's scores near 256 MiB
    assert prefill_activation_bytes(qwen, "bfloat16", 100, eager=True) == 3 * 100 * 12288 * 2  # one short chunk
    fused = prefill_activation_bytes(qwen, "bfloat16", 8192, eager=False)
    assert fused == 3 * PREFILL_CHUNK_TOKENS * 12288 * 2  # a fused kernel never holds the scores: the MLP's
    assert prefill_activation_bytes(qwen, "float32", 8192, eager=False) == 2 * fused
    unknown = dataclasses.replace(qwen, attention_heads=None, mlp_width=None)
    assert prefill_activation_bytes(unknown, "bfloat16", 8192, eager=True) == 0


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_estimates_prefill_chunks_are_the_engines(attn: str) -> None:
    """setup.sizes (torch-free) counts the chunks engine.target.attention prefills in: one rule, held equal here."""
    from dflash_cli.engine.kernels.layers import use_cpu_products
    from dflash_cli.engine.target.attention import AttentionState
    from helpers.tiny_models import build_tiny

    for heads in (4, 8, 32):
        target = build_tiny("qwen3", num_attention_heads=heads, num_key_value_heads=2, head_dim=16)
        target.set_attn_implementation(attn)
        use_cpu_products(target)
        state = AttentionState(target)
        for end in (10, 600, 8192, 40_000, 200_000):
            assert state.prefill_chunk(end) == prefill_chunk_tokens(heads, end, attn == "eager"), (heads, end)


def test_batch_rows_add_their_kv_and_twice_their_recurrent_state() -> None:
    hybrid = get_recipe("qwen3.5-4b")
    estimate = memory_estimate(hybrid, 1, "bfloat16", "cuda", PLAN_CONTEXT_TOKENS)
    assert estimate is not None and estimate.state == 2 * hybrid.state_bytes_per_row
    assert estimate.next_row == estimate.kv_cache + estimate.state
    assert estimate.with_rows(1) == estimate.total
    assert estimate.with_rows(16) == estimate.total + 15 * estimate.next_row


def test_the_banner_says_the_context_and_a_batch_holds_every_row() -> None:
    plan = make_plan(CPU, get_recipe("demo"))
    assert plan.memory is not None and plan.estimated_bytes == plan.memory.total
    one = plan.one_line()
    assert one.endswith(f"~{plan.memory.total / 1e9:.1f} GB at 8,192 tokens")
    assert f"~{plan.memory.with_rows(16) / 1e9:.1f} GB at 8,192 tokens" in plan.one_line(rows=16)
    memory = next(reason for reason in plan.reasons if reason.startswith("memory:"))
    for part in ("weights 151 MB", "drafter 10 MB", "KV cache 195 MB", "prefill activations 268 MB", "--cache-ram"):
        assert part in memory
    # the prefix store has its own bound (--cache-ram): not in the estimate, so not counted twice
    assert make_plan(CPU, get_recipe("demo"), PlanOverrides(cache_ram_mib=0)).memory == plan.memory


def test_the_kv_part_is_what_the_state_reserves_for_a_row(tiny_qwen3_dir: Path) -> None:
    """The estimate's K/V (a recipe's bf16 bytes per token, in the plan's dtype) against the buffers AttentionState
    allocates for one row: the same bytes for as many positions."""
    target = load_target(tiny_qwen3_dir, cpu_plan("float32"))
    bf16_per_token = kv_bytes_per_token(target.config, BYTES_PER_ELEMENT["bfloat16"])
    recipe = dataclasses.replace(adhoc_recipe(str(tiny_qwen3_dir), None), kv_bytes_per_token=bf16_per_token)
    state = AttentionState(target)
    state.reserve(16, 4, ())  # a short first request: the state reserves a long context (the model's, here)
    with torch.inference_mode():
        state.prefill(torch.tensor([[1, 2, 3]]))
    held = sum(tensor_bytes(t) for t in (*state._keys, *state._values))
    estimate = memory_estimate(recipe, 1, "float32", "cpu", state.capacity)
    assert estimate is not None and estimate.kv_cache == held == 2 * bf16_per_token * state.capacity
