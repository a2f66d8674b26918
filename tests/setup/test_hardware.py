"""GPU classes and the planner, with fabricated machine facts for every class, plus the real detection."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dflash_cli.errors import DflashError
from dflash_cli.setup.choices import Quant
from dflash_cli.setup.hardware import MachineFacts, detect_machine, gpu_class
from dflash_cli.setup.planning import (
    MAX_BATCH_ROWS,
    PLAN_CONTEXT_TOKENS,
    PlanOverrides,
    block_size_note,
    estimate_bytes,
    make_plan,
    native_formats,
)
from dflash_cli.setup.recipes import ModelRef, Recipe, adhoc_recipe, get_recipe
from dflash_cli.setup.sizes import BYTES_PER_ELEMENT, prefill_activation_bytes
from helpers.machines import GIB
from helpers.machines import cuda_machine as cuda

# What torch reports for these cards (total memory in GiB as torch.cuda.mem_get_info returns it).
RTX_5090 = cuda("NVIDIA GeForce RTX 5090", (12, 0), 31.4)
GB10 = cuda("NVIDIA GB10", (12, 1), 119.7)
B200 = cuda("NVIDIA B200", (10, 0), 178.4, count=8)
B300 = cuda("NVIDIA B300 SXM6 AC", (10, 3), 268.0, count=8)
H100 = cuda("NVIDIA H100 80GB HBM3", (9, 0), 79.2)
H200 = cuda("NVIDIA H200", (9, 0), 139.8)
RTX_4090 = cuda("NVIDIA GeForce RTX 4090", (8, 9), 23.6, free_gib=22.9)
A100_40 = cuda("NVIDIA A100-SXM4-40GB", (8, 0), 39.4)
A100_80 = cuda("NVIDIA A100-SXM4-80GB", (8, 0), 79.2)
RTX_3080 = cuda("NVIDIA GeForce RTX 3080", (8, 6), 9.8, free_gib=9.2)
T4 = cuda("Tesla T4", (7, 5), 14.6)
THOR = cuda("NVIDIA Thor", (11, 0), 122.0)
MAC_36 = MachineFacts(
    kind="mps",
    gpu_name="Apple silicon GPU",
    total_memory=27 * GIB,
    free_memory=27 * GIB,
    gpu_count=1,
    cpu_ram_total=36 * GIB,
    cpu_ram_available=30 * GIB,
)
MAC_16 = dataclasses.replace(MAC_36, total_memory=int(10.7 * GIB), free_memory=int(10.7 * GIB), cpu_ram_total=16 * GIB)
CPU_64 = MachineFacts(kind="cpu", cpu_ram_total=64 * GIB, cpu_ram_available=60 * GIB, torch_version="2.13.0+cpu")
CPU_32 = dataclasses.replace(CPU_64, cpu_ram_total=32 * GIB, cpu_ram_available=28 * GIB)
CPU_8 = dataclasses.replace(CPU_64, cpu_ram_total=8 * GIB, cpu_ram_available=6 * GIB)

# A dense 32B model (Qwen3-32B shapes): bf16 fits 80 GB cards, NF4 fits 32-40 GB cards, nothing fits 24 GB.
DENSE_32B = Recipe(
    name="dense-32b",
    description="test recipe",
    target=ModelRef("Qwen/Qwen3-32B"),
    drafter=ModelRef("someone/Qwen3-32B-DFlash"),
    block_size=16,
    params_billion=32.8,
    weight_bytes={"bf16": 65_530_000_000, "nf4": 19_200_000_000},
    drafter_bytes=5_140_000_000,
    kv_bytes_per_token=282_624,
)


@pytest.mark.parametrize(
    ("facts", "key", "label_has"),
    [
        (RTX_5090, "blackwell-consumer", "sm_120"),
        (GB10, "blackwell-consumer", "sm_121"),
        (B200, "blackwell-datacenter", "B200"),
        (B300, "blackwell-datacenter", "B300"),
        (H100, "hopper", "sm_90"),
        (H200, "hopper", "H200"),
        (RTX_4090, "ada", "sm_89"),
        (A100_40, "ampere", "sm_80"),
        (A100_80, "ampere", "sm_80"),
        (RTX_3080, "ampere", "sm_86"),
        (T4, "cuda-other", "sm_75"),
        (THOR, "cuda-other", "sm_110"),
        (MAC_36, "mps", "MPS"),
        (CPU_64, "cpu", "CPU"),
    ],
)
def test_gpu_class_by_compute_capability(facts: MachineFacts, key: str, label_has: str) -> None:
    cls = gpu_class(facts)
    assert cls.key == key
    assert label_has in cls.label


def test_gpu_class_ignores_the_marketing_name() -> None:
    assert gpu_class(dataclasses.replace(RTX_5090, capability=(8, 9))).key == "ada"
    assert (
        gpu_class(dataclasses.replace(H100, gpu_name="NVIDIA Blackwell something", capability=(9, 0))).key == "hopper"
    )


@pytest.mark.parametrize("facts", [RTX_5090, GB10, B200, B300, H100, H200, RTX_4090, A100_40, A100_80])
def test_qwen3_8b_runs_in_bf16_on_every_modern_gpu(facts: MachineFacts) -> None:
    plan = make_plan(facts, get_recipe("qwen3-8b"))
    assert (plan.device, plan.dtype, plan.quant, plan.block_size) == ("cuda", "bfloat16", "none", 16)
    assert plan.attn_implementation == "sdpa"
    assert plan.gpu_class == gpu_class(facts).key
    assert plan.estimated_bytes is not None and plan.estimated_bytes <= plan.budget_bytes
    assert plan.torch_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("facts", "dtype", "quant"),
    [
        (H100, "bfloat16", "none"),
        (H200, "bfloat16", "none"),
        (B200, "bfloat16", "none"),
        (B300, "bfloat16", "none"),
        (A100_80, "bfloat16", "none"),
        (A100_40, "bfloat16", "nf4"),
        (RTX_5090, "bfloat16", "nf4"),
    ],
)
def test_a_32b_model_goes_nf4_where_bf16_does_not_fit(facts: MachineFacts, dtype: str, quant: str) -> None:
    plan = make_plan(facts, DENSE_32B)
    assert (plan.dtype, plan.quant) == (dtype, quant)
    if quant == "nf4":
        assert any("bfloat16 weights do not fit" in reason for reason in plan.reasons)
        assert any("double quant" in reason for reason in plan.reasons)


def test_refusal_when_nothing_fits_names_the_numbers_and_a_fix() -> None:
    with pytest.raises(DflashError) as info:
        make_plan(RTX_4090, DENSE_32B)
    assert "even with NF4" in info.value.message
    assert "dense-32b" in info.value.message
    assert "dflash export vllm dense-32b" in info.value.fix
    with pytest.raises(DflashError, match="even with NF4"):
        make_plan(RTX_3080, get_recipe("qwen3-8b"))  # 10 GB: NF4 weights + drafter + KV cache do not fit


def test_gpus_without_bf16_use_float16() -> None:
    plan = make_plan(T4, get_recipe("qwen3-8b"))  # 15 GB, sm_75: fp16, and NF4 to fit
    assert (plan.dtype, plan.quant) == ("float16", "nf4")
    assert any("no native bf16" in reason for reason in plan.reasons)


def test_mps_uses_float16_and_never_quantizes_on_its_own() -> None:
    plan = make_plan(MAC_36, get_recipe("qwen3-8b"))
    assert (plan.device, plan.dtype, plan.quant) == ("mps", "float16", "none")
    with pytest.raises(DflashError):
        make_plan(MAC_16, get_recipe("qwen3-8b"))


def test_cpu_prefers_float32_then_bf16_then_refuses() -> None:
    assert (make_plan(CPU_64, get_recipe("qwen3-8b")).dtype, make_plan(CPU_64, get_recipe("qwen3-8b")).quant) == (
        "float32",
        "none",
    )
    plan = make_plan(CPU_32, get_recipe("qwen3-8b"))
    assert (plan.dtype, plan.quant) == ("bfloat16", "none")
    assert any("float32 would not fit" in reason for reason in plan.reasons)
    with pytest.raises(DflashError) as info:
        make_plan(CPU_8, get_recipe("qwen3-8b"))
    assert "--quant nf4" not in info.value.fix  # 4-bit would not fit 6 GB either: not offered
    with pytest.raises(DflashError) as info:
        make_plan(dataclasses.replace(CPU_8, cpu_ram_available=12 * GIB), get_recipe("qwen3-8b"))
    assert "--quant nf4 (~10.6 GB, slow on CPU)" in info.value.fix  # eager scores 0.27 GB + runtime 0.75 GB
    with pytest.raises(DflashError) as info:  # pre-quantized: NF4 does not apply, so it is not suggested
        make_plan(dataclasses.replace(CPU_64, cpu_ram_available=30 * GIB), get_recipe("gpt-oss-20b"))
    assert "nf4" not in info.value.fix


def test_cpu_with_bf16_instructions_prefers_bf16() -> None:
    facts = dataclasses.replace(CPU_64, cpu_bf16=True)
    plan = make_plan(facts, get_recipe("qwen3-8b"))
    assert (plan.device, plan.dtype, plan.quant) == ("cpu", "bfloat16", "none")
    assert any("AVX512-BF16" in reason and "--dtype fp32" in reason for reason in plan.reasons)
    assert make_plan(facts, get_recipe("qwen3-8b"), PlanOverrides(dtype="fp32")).dtype == "float32"


def test_forced_nf4_on_cpu_is_honoured_with_a_warning() -> None:
    plan = make_plan(CPU_8, get_recipe("qwen3-8b"), PlanOverrides(quant="nf4"))
    assert (plan.device, plan.dtype, plan.quant) == ("cpu", "float32", "nf4")
    assert any(reason.startswith("warning:") for reason in plan.reasons)
    assert any(note.startswith("NF4 on CPU is slow") for note in plan.notes)  # shown without --explain too
    assert not make_plan(CPU_64, get_recipe("qwen3-8b")).notes  # the planner's own choices need no note


def test_a_cpu_plan_runs_eager_attention_and_says_why() -> None:
    """Eager attention on a CPU: a row's numbers then do not depend on the step's shape (engine.kernels.layers); a recipe's
    override still wins, and GPUs keep the fused kernel."""
    plan = make_plan(CPU_64, get_recipe("demo"))
    assert plan.attn_implementation == "eager"
    assert any(r.startswith("attention eager:") and "alone or batched" in r for r in plan.reasons), plan.reasons
    assert make_plan(H100, get_recipe("qwen3-8b")).attn_implementation == "sdpa"
    fused = make_plan(CPU_64, get_recipe("demo"), PlanOverrides(attention="sdpa"))  # --attention sdpa: the user's
    assert fused.attn_implementation == "sdpa"
    assert any(r.startswith("attention sdpa: --attention") and "depend on the rows" in r for r in fused.reasons)


def test_the_plan_line_names_the_class_only_where_it_adds_something() -> None:
    assert (
        make_plan(CPU_64, get_recipe("demo"))
        .one_line()
        .startswith("cpu float32, block adaptive up to the drafter's, eager")
    )
    assert (
        make_plan(CPU_64, get_recipe("demo"))
        .one_line(drafter_block_size=8)
        .startswith("cpu float32, block ≤8 adaptive,")
    )
    fixed = make_plan(CPU_64, get_recipe("demo"), PlanOverrides(block_size=4))
    assert fixed.one_line(drafter_block_size=8).startswith("cpu float32, block 4,") and not fixed.adaptive_block
    assert make_plan(H100, get_recipe("qwen3-8b")).one_line().startswith("cuda (hopper) bfloat16, block ≤16 adaptive")
    assert make_plan(CPU_64, get_recipe("demo")).one_line(drafting=False).startswith("cpu float32, no drafter, eager")


def test_a_block_longer_than_the_drafter_was_trained_for_gets_a_note() -> None:
    note = block_size_note(1000, 8)
    assert note is not None and "block 1000 is longer than the 8" in note and "--block-size 8" in note
    assert block_size_note(8, 8) is None and block_size_note(4, 16) is None and block_size_note(None, 8) is None


def test_user_overrides_are_honoured() -> None:
    recipe = get_recipe("qwen3-8b")
    plan = make_plan(H100, recipe, PlanOverrides(dtype="fp16", quant="nf4", block_size=8))
    assert (plan.dtype, plan.quant, plan.block_size) == ("float16", "nf4", 8)
    assert any("--block-size" in reason for reason in plan.reasons)
    assert make_plan(H100, recipe, PlanOverrides(device="cpu")).dtype == "float32"
    assert make_plan(H100, recipe, PlanOverrides(device="cpu")).budget_bytes == H100.cpu_ram_available
    assert make_plan(B200, recipe, PlanOverrides(device="cuda:3")).device == "cuda:3"


@pytest.mark.parametrize(
    ("facts", "device", "message"),
    [
        (CPU_64, "cuda", "no CUDA device"),
        (H100, "cuda:1", "1 CUDA GPU"),
        (H100, "mps", "no MPS device"),
        (H100, "tpu", "unknown device"),
    ],
)
def test_impossible_devices_are_clear_errors(facts: MachineFacts, device: str, message: str) -> None:
    with pytest.raises(DflashError, match=message):
        make_plan(facts, get_recipe("qwen3-8b"), PlanOverrides(device=device))


def test_unknown_dtype_and_quant_are_errors() -> None:
    with pytest.raises(DflashError, match="unknown dtype"):
        make_plan(H100, get_recipe("qwen3-8b"), PlanOverrides(dtype="int8"))
    with pytest.raises(DflashError, match="unknown quantization"):
        make_plan(H100, get_recipe("qwen3-8b"), PlanOverrides(quant="q3_k"))


def test_block_size_precedence_user_then_gpu_override_then_recipe_then_drafter() -> None:
    tuned = dataclasses.replace(
        get_recipe("qwen3-8b"),
        gpu_overrides={"blackwell-consumer": {"block_size": 8, "attn_implementation": "eager"}},
    )
    on_5090 = make_plan(RTX_5090, tuned)
    assert (on_5090.block_size, on_5090.attn_implementation) == (8, "eager")
    assert any("override for blackwell-consumer" in reason for reason in on_5090.reasons)
    assert (make_plan(H100, tuned).block_size, make_plan(H100, tuned).attn_implementation) == (16, "sdpa")
    assert make_plan(RTX_5090, tuned, PlanOverrides(block_size=12)).block_size == 12
    from_drafter = make_plan(H100, dataclasses.replace(tuned, block_size=None))
    assert from_drafter.block_size is None
    assert "adaptive up to the drafter's" in from_drafter.one_line()


def test_gpu_override_of_quant_and_dtype() -> None:
    tuned = dataclasses.replace(get_recipe("qwen3-8b"), gpu_overrides={"hopper": {"quant": "nf4", "dtype": "float16"}})
    plan = make_plan(H100, tuned)
    assert (plan.dtype, plan.quant) == ("float16", "nf4")
    assert make_plan(A100_80, tuned).quant == "none"


def test_not_runnable_recipes_are_refused_with_the_export_hand_off() -> None:
    with pytest.raises(DflashError) as info:
        make_plan(B200, get_recipe("qwen3.5-122b-a10b"))
    assert "fit no single GPU" in info.value.message
    assert info.value.fix == "serve it with vLLM or SGLang: `dflash export vllm qwen3.5-122b-a10b`"


def test_adhoc_recipes_plan_without_a_fit_check() -> None:
    plan = make_plan(H100, adhoc_recipe("someone/model", "someone/model-dflash"))  # no recipe knows its size
    assert (plan.dtype, plan.quant, plan.estimated_bytes) == ("bfloat16", "none", None)
    assert any("fit was not checked" in reason for reason in plan.reasons)


def test_estimates_scale_with_dtype_and_quantization() -> None:
    recipe = get_recipe("qwen3-8b")
    bf16, fp32, nf4 = (
        estimate_bytes(recipe, d, q, "cuda")
        for d, q in [("bfloat16", "none"), ("float32", "none"), ("bfloat16", "nf4")]
    )
    assert nf4 < bf16 < fp32
    assert fp32 - bf16 > recipe.weight_bytes["bf16"]  # weights, drafter and KV cache all double
    assert 20e9 < bf16 < 23e9  # 16.4 GB weights + 2.1 GB drafter + 1.4 GB KV cache + 1.5 GB runtime


def test_plan_explains_every_decision() -> None:
    plan = make_plan(H100, get_recipe("qwen3-8b"))
    text = "\n".join(plan.reasons)
    for topic in ("device cuda", "memory:", "dtype bfloat16", "quant none", "block size 16", "attention sdpa"):
        assert topic in text
    assert plan.one_line().startswith("cuda (hopper) bfloat16")
    assert plan.to_dict()["reasons"] == list(plan.reasons)


def test_detect_machine_on_this_machine() -> None:
    facts = detect_machine()
    assert facts.kind in ("cuda", "mps", "cpu")
    assert facts.torch_version == torch.__version__
    assert facts.torch_cuda_version == torch.version.cuda
    assert facts.cpu_ram_total and facts.cpu_ram_total >= (facts.cpu_ram_available or 0) > 0
    if facts.kind == "cpu":
        assert (facts.gpu_count, facts.capability, facts.total_memory) == (0, None, None)
    else:
        assert facts.gpu_count >= 1 and facts.total_memory >= facts.free_memory > 0


# --- the 2026 recipes on the GPUs users have: what fits, in what precision, and refusals with the numbers --------

NEW_RECIPES = {
    # name: expected weights on (RTX 5090, H100, H200, B200) without MXFP4 kernels; None = refused
    "qwen3.5-4b": ("bfloat16", "bfloat16", "bfloat16", "bfloat16"),
    "qwen3.5-9b": ("bfloat16", "bfloat16", "bfloat16", "bfloat16"),
    "qwen3.5-27b": ("nf4", "bfloat16", "bfloat16", "bfloat16"),
    "qwen3.6-27b": ("nf4", "bfloat16", "bfloat16", "bfloat16"),
    "qwen3.8-27b": ("nf4", "bfloat16", "bfloat16", "bfloat16"),
    "qwen3.5-35b-a3b": (None, "bfloat16", "bfloat16", "bfloat16"),
    "qwen3.6-35b-a3b": (None, "bfloat16", "bfloat16", "bfloat16"),
    "qwen3-coder-30b-a3b": (None, "bfloat16", "bfloat16", "bfloat16"),
    "qwen3-coder-next": (None, "fp8", "fp8", "bfloat16"),
    "gpt-oss-20b": (None, "bfloat16", "bfloat16", "bfloat16"),
    "gpt-oss-120b": (None, None, None, None),
    "gemma-4-31b": ("nf4", "bfloat16", "bfloat16", "bfloat16"),
    "gemma-4-26b-a4b": (None, "bfloat16", "bfloat16", "bfloat16"),
}
USER_GPUS = (RTX_5090, H100, H200, B200)


@pytest.mark.parametrize(("name", "expected"), NEW_RECIPES.items())
def test_new_recipes_on_a_5090_h100_h200_and_b200(name: str, expected: tuple[str | None, ...]) -> None:
    recipe = get_recipe(name)
    for facts, weights in zip(USER_GPUS, expected):
        if weights is None:
            with pytest.raises(DflashError) as info:
                make_plan(facts, recipe)
            # every option weighed is named with its size, and the free memory it was measured against
            assert info.value.message.count(" GB") >= 2 and f"{name} needs ~" in info.value.message
            assert "dflash export vllm" in info.value.fix
            continue
        plan = make_plan(facts, recipe)
        assert plan.weights == weights, (name, facts.gpu_name)
        assert plan.estimated_bytes is not None and plan.estimated_bytes <= plan.budget_bytes
        if weights == "fp8":
            assert any(recipe.checkpoints["fp8"].id in reason for reason in plan.reasons)


def test_moe_nf4_is_counted_with_its_experts_in_bf16_so_it_never_promises_4_bit_memory() -> None:
    recipe = get_recipe("qwen3.6-35b-a3b")
    nf4, bf16 = estimate_bytes(recipe, "bfloat16", "nf4", "cuda"), estimate_bytes(recipe, "bfloat16", "none", "cuda")
    assert nf4 > 0.9 * bf16  # the experts are 93% of the weights and bitsandbytes leaves them alone
    assert estimate_bytes(recipe, "float16", "nf4", "cuda") == nf4  # fp16 experts: as big as bf16 ones
    activations = prefill_activation_bytes(recipe, "bfloat16", PLAN_CONTEXT_TOKENS, eager=False)
    doubled = recipe.expert_bytes + recipe.drafter_bytes + recipe.kv_bytes_per_token * PLAN_CONTEXT_TOKENS + activations
    fp32 = estimate_bytes(recipe, "float32", "nf4", "cuda")
    assert fp32 - nf4 == pytest.approx(doubled, rel=1e-6)  # fp32 experts and MLP activations: 2x
    with pytest.raises(DflashError) as info:
        make_plan(RTX_5090, recipe)
    message = info.value.message
    assert "~38.0 GB with the FP8 checkpoint" in message and "~69.5 GB even with NF4" in message
    assert "64.4 GB of fused expert weights in bf16" in message and "33.1 GB free" in message


def test_each_batch_row_of_a_hybrid_target_counts_its_kv_and_twice_its_linear_attention_state() -> None:
    """Qwen3.5-27B keeps 155 MB of DeltaNet state per row, and a verify records a copy of it for the rollback: each
    row past the first costs its KV cache plus twice that (the first row's is in the runtime overhead)."""
    recipe = get_recipe("qwen3.5-27b")
    state = recipe.state_bytes_per_row
    assert state == 48 * (48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 4 * 2)
    stateless = dataclasses.replace(recipe, state_bytes_per_row=None)
    for facts in (H100, RTX_5090):
        plan, without = make_plan(facts, recipe), make_plan(facts, stateless)
        # the state changes the rows only, not the fit or the single-row estimate
        assert (plan.weights, plan.estimated_bytes) == (without.weights, without.estimated_bytes)
        room = plan.budget_bytes - plan.estimated_bytes
        kv = recipe.kv_bytes_per_token * BYTES_PER_ELEMENT[plan.dtype] / 2 * PLAN_CONTEXT_TOKENS
        assert without.batch_size == min(MAX_BATCH_ROWS, int(room // kv) + 1)
        assert plan.batch_size == min(MAX_BATCH_ROWS, int(room // (kv + 2 * state)) + 1)
        batch = next(reason for reason in plan.reasons if reason.startswith("batch "))
        assert f"KV {kv / 1e6:.0f} MB + recurrent state {state / 1e6:.0f} MB x2" in batch
        assert "state" not in next(reason for reason in without.reasons if reason.startswith("batch "))
    nf4, nf4_without = make_plan(RTX_5090, recipe), make_plan(RTX_5090, stateless)
    assert nf4.weights == "nf4" and nf4.batch_size < nf4_without.batch_size < MAX_BATCH_ROWS
    assert make_plan(RTX_5090, recipe, PlanOverrides(batch_size=12)).batch_size == 12  # --batch-size still rules


def test_a_published_fp8_checkpoint_is_offered_on_sm89_and_newer_only() -> None:
    recipe = get_recipe("qwen3-coder-next")
    assert make_plan(H200, recipe).quant == "fp8"
    forced = make_plan(RTX_4090, get_recipe("qwen3-coder-30b-a3b"), PlanOverrides(quant="fp8"))
    assert forced.weights == "fp8"  # Ada is sm_89
    with pytest.raises(DflashError, match="compute capability 8.9") as info:
        make_plan(A100_80, recipe, PlanOverrides(quant="fp8"))
    assert "--quant none" in info.value.fix
    with pytest.raises(DflashError) as info:
        make_plan(A100_80, recipe)  # no FP8 on sm_80, bf16 does not fit 80 GB: refused, saying why
    assert "its FP8 checkpoint (80.4 GB) needs compute capability 8.9+" in info.value.message
    with pytest.raises(DflashError, match="names no published FP8 checkpoint"):
        make_plan(H100, get_recipe("qwen3-8b"), PlanOverrides(quant="fp8"))


@pytest.mark.parametrize(
    ("facts", "kernels", "formats"),
    [
        (RTX_5090, True, ("mxfp4", "fp8")),
        (RTX_5090, False, ("fp8",)),
        (H100, True, ("mxfp4", "fp8")),
        (B200, False, ("fp8",)),
        (RTX_4090, True, ("mxfp4", "fp8")),
        (A100_80, True, ("mxfp4",)),
        (T4, True, ("mxfp4",)),
        (CPU_64, True, ()),
        (MAC_36, True, ()),
    ],
)
def test_which_prequantized_formats_run_natively(facts: MachineFacts, kernels: bool, formats: tuple) -> None:
    kind = facts.kind
    assert native_formats(kind, dataclasses.replace(facts, mxfp4_kernels=kernels)) == formats


def test_gpt_oss_runs_its_mxfp4_weights_where_the_kernels_are_and_bf16_elsewhere() -> None:
    with_kernels = dataclasses.replace(RTX_5090, mxfp4_kernels=True)
    plan = make_plan(with_kernels, get_recipe("gpt-oss-20b"))
    assert (plan.weights, plan.quant, plan.native_formats) == ("mxfp4", "none", ("mxfp4", "fp8"))
    assert plan.estimated_bytes < 20e9 and "mxfp4 weights" in plan.one_line()
    assert any("runs the published MXFP4 weights as they are" in reason for reason in plan.reasons)
    on_h100 = make_plan(H100, get_recipe("gpt-oss-20b"))  # no triton/kernels: dequantized, and it still fits
    assert on_h100.weights == "bfloat16" and on_h100.estimated_bytes > 41.8e9
    assert any("transformers dequantizes the published MXFP4 weights" in reason for reason in on_h100.reasons)
    with pytest.raises(DflashError) as info:
        make_plan(RTX_5090, get_recipe("gpt-oss-20b"))
    assert "~45.5 GB in bfloat16" in info.value.message
    assert "its MXFP4 weights as stored would take 13.8 GB" in info.value.message and "kernels" in info.value.message
    on_cpu = make_plan(CPU_64, get_recipe("gpt-oss-20b"))  # transformers dequantizes on CPU
    assert on_cpu.weights == on_cpu.dtype
    big = make_plan(dataclasses.replace(H100, mxfp4_kernels=True), get_recipe("gpt-oss-120b"))
    assert big.weights == "mxfp4" and big.estimated_bytes < H100.free_memory


def test_nf4_is_refused_for_a_prequantized_checkpoint() -> None:
    with pytest.raises(DflashError, match="published pre-quantized \\(mxfp4\\)"):
        make_plan(H100, get_recipe("gpt-oss-20b"), PlanOverrides(quant="nf4"))


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_cpu_weight_only_quant_computes_in_bf16_and_says_why(quant: str) -> None:
    plan = make_plan(CPU_64, get_recipe("demo"), PlanOverrides(quant=quant))  # no bf16 instructions: fp32 default
    assert (plan.device, plan.dtype, plan.quant, plan.weights) == ("cpu", "bfloat16", quant, quant)
    assert f"{quant} weights" in plan.one_line()
    explained = "\n".join(plan.reasons)
    assert "bf16 activations" in explained and "torch's packed CPU kernel" in explained
    with pytest.raises(DflashError, match=f"--quant {quant} computes in bfloat16") as err:
        make_plan(CPU_64, get_recipe("demo"), PlanOverrides(quant=quant, dtype="float32"))
    assert "--dtype bf16" in err.value.fix


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_cpu_weight_only_quant_is_refused_on_a_gpu_with_the_gpu_format_as_fix(quant: str) -> None:
    with pytest.raises(DflashError, match="run on the CPU") as err:
        make_plan(H100, get_recipe("qwen3-8b"), PlanOverrides(quant=quant))
    assert "--quant nf4" in err.value.fix
    plan = make_plan(H100, get_recipe("qwen3-8b"), PlanOverrides(quant=quant, device="cpu"))
    assert plan.quant == quant and plan.device == "cpu"


def test_a_plan_holds_one_quant_that_says_how_it_loads_and_prints_as_its_flag() -> None:
    """--quant and a recipe's override arrive as text; the plan holds the Quant, whose own facts the loader asks,
    and which reads as the flag's word wherever it is printed or saved."""
    int4 = make_plan(CPU_64, get_recipe("qwen3-8b"), PlanOverrides(quant="int4"))
    assert int4.quant is Quant.INT4 and int4.quant.cpu_kernels and int4.quant.quantizes_on_load
    assert [q for q in Quant if q.quantizes_on_load] == [Quant.NF4, Quant.INT4, Quant.INT8]
    assert not Quant.FP8.quantizes_on_load and not Quant.NF4.cpu_kernels
    assert (f"{int4.quant}", f"{int4.quant:>5}", int4.weights) == ("int4", " int4", "int4")
    assert any(reason.startswith("quant int4: --quant;") for reason in int4.reasons)
    assert json.loads(json.dumps(int4.to_dict()))["quant"] == "int4"
    with pytest.raises(DflashError, match="unknown quantization 'q3_k'") as unknown:
        Quant.named("q3_k")
    assert unknown.value.fix == "use one of none, nf4, fp8, int4, int8"


def test_cpu_weight_only_quant_never_estimates_more_than_bf16() -> None:
    bf16 = make_plan(CPU_64, get_recipe("qwen3-8b"), PlanOverrides(dtype="bf16")).estimated_bytes
    int4 = make_plan(CPU_64, get_recipe("qwen3-8b"), PlanOverrides(quant="int4")).estimated_bytes
    assert int4 is not None and bf16 is not None and int4 <= bf16


def test_the_demo_runs_int4_on_a_bf16_cpu_and_yields_to_dtype_and_quant_flags() -> None:
    bf16_cpu = dataclasses.replace(CPU_64, cpu_bf16=True)
    demo = get_recipe("demo")
    plan = make_plan(bf16_cpu, demo)
    assert (plan.dtype, plan.quant) == ("bfloat16", "int4")
    assert any(r.startswith("quant int4: the recipe's override for cpu") for r in plan.reasons)
    assert (make_plan(bf16_cpu, demo, PlanOverrides(quant="none")).quant, plan.dtype) == ("none", "bfloat16")
    fp32 = make_plan(bf16_cpu, demo, PlanOverrides(dtype="fp32"))
    assert (fp32.dtype, fp32.quant) == ("float32", "none")
    assert any("(int4) skipped" in r and "--dtype float32" in r for r in fp32.reasons)
    no_bf16 = make_plan(CPU_64, demo)  # neither bf16 instructions nor AVX2 (an older or non-x86 CPU)
    assert (no_bf16.dtype, no_bf16.quant) == ("float32", "none")
    assert any("neither bf16 instructions nor AVX2" in r for r in no_bf16.reasons)
    assert make_plan(H100, demo).quant == "none"  # a GPU class: the CPU override does not apply


def test_an_avx2_cpu_runs_the_demo_and_the_cpu_formats_in_int4_on_dflashs_avx2_kernels() -> None:
    """No bf16 instructions but AVX2 (most laptops and desktops: AMD Zen 1-4's consumer parts, Intel's since Alder
    Lake): dflash's AVX2 int4 / int8 kernels run (the demo 4.9x its float32 speed), computing in bf16 as elsewhere
    (float32 activations would run faster there, 1.23x, but float32 attention rounds a row by the rows beside it,
    which int8 activations magnify into other tokens: not lossless), so the recipe's int4 stands and a large target
    falls back to int8 and int4 as on a bf16 CPU; unquantized weights run bf16 too (on dflash's AVX2 bf16 product: half
    float32's bytes, the demo 3.1x float32's speed)."""
    avx2 = dataclasses.replace(CPU_64, cpu_avx2=True)
    demo = make_plan(avx2, get_recipe("demo"))
    assert (demo.dtype, demo.quant) == ("bfloat16", "int4")
    assert any("AVX2" in r for r in demo.reasons if r.startswith("quant int4"))
    unquantized = make_plan(avx2, get_recipe("demo"), PlanOverrides(quant="none"))
    assert unquantized.dtype == "bfloat16" and any("AVX2 kernels run bf16 products" in r for r in unquantized.reasons)
    large = dataclasses.replace(avx2, cpu_ram_available=23 * GIB)
    assert make_plan(large, get_recipe("qwen3.6-27b")).quant == "int4"
    with pytest.raises(DflashError, match="computes in bfloat16"):
        make_plan(avx2, get_recipe("demo"), PlanOverrides(dtype="fp32", quant="int4"))


def test_a_bf16_cpu_runs_int8_then_int4_where_the_bf16_weights_do_not_fit() -> None:
    """qwen3.6-27b: ~59 GB in bf16, ~33 GB in int8, ~24 GB in int4 with its bf16 drafter, KV cache and runtime. The
    planner takes the first that fits, and says why the larger ones were passed over."""
    recipe = get_recipe("qwen3.6-27b")
    by_ram = {gib: dataclasses.replace(CPU_64, cpu_bf16=True, cpu_ram_available=gib * GIB) for gib in (23, 40, 60)}
    plans = {gib: make_plan(facts, recipe) for gib, facts in by_ram.items()}
    assert [(plans[gib].dtype, plans[gib].quant) for gib in (23, 40, 60)] == [
        ("bfloat16", "int4"),
        ("bfloat16", "int8"),
        ("bfloat16", "none"),
    ]
    assert plans[23].estimated_bytes is not None and plans[23].estimated_bytes < 23 * GIB
    assert "int4 weights" in plans[23].one_line() and plans[23].weights == "int4"
    why = next(reason for reason in plans[23].reasons if reason.startswith("quant int4:"))
    assert why.startswith("quant int4: the bfloat16 weights do not fit (~59.0 GB in all), nor int8 (~33.4 GB)")
    assert "the output head int8" in why
    assert any(r.startswith("quant int8: the bfloat16 weights do not fit (~59.0 GB") for r in plans[40].reasons)
    assert not plans[23].notes  # the planner's own choice: nothing to warn about
    # a user's choice still wins: --quant, and --dtype bf16 (which keeps the 4-bit fallback)
    assert make_plan(by_ram[60], recipe, PlanOverrides(quant="int4")).quant == "int4"
    assert make_plan(by_ram[23], recipe, PlanOverrides(dtype="bf16")).quant == "int4"
    forced = make_plan(by_ram[23], recipe, PlanOverrides(quant="none"))
    assert forced.quant == "none" and any("out-of-memory" in note for note in forced.notes)
    with pytest.raises(DflashError) as refused:  # too small for any: every size weighed is named
        make_plan(dataclasses.replace(by_ram[23], cpu_ram_available=16 * GIB), recipe)
    assert "~59.0 GB in bfloat16, ~33.4 GB in int8, ~24.2 GB in int4" in refused.value.message


def test_the_cpu_formats_are_offered_only_where_they_run_well_and_are_sized() -> None:
    """int4 / int8 compute in bf16: not on a CPU without bf16 instructions, nor under --dtype fp32; not for a
    pre-quantized checkpoint; and not for a recipe that does not list their sizes (the planner could not tell
    whether they fit)."""
    recipe = get_recipe("qwen3.6-27b")
    small = dataclasses.replace(CPU_64, cpu_bf16=True, cpu_ram_available=23 * GIB)
    with pytest.raises(DflashError) as refused:
        make_plan(dataclasses.replace(small, cpu_bf16=False), recipe)
    assert "int4" not in refused.value.message and "int8" not in refused.value.message
    fp32 = make_plan(small, recipe, PlanOverrides(dtype="fp32"))  # forced: planned as asked, with a warning
    assert (fp32.dtype, fp32.quant) == ("float32", "none") and fp32.notes
    unsized = dataclasses.replace(
        recipe, weight_bytes={k: v for k, v in recipe.weight_bytes.items() if k not in ("int4", "int8")}
    )
    with pytest.raises(DflashError):
        make_plan(small, unsized)
    gpt_oss = get_recipe("gpt-oss-20b")  # published in MXFP4: never quantized again
    with pytest.raises(DflashError) as refused:
        make_plan(dataclasses.replace(small, cpu_ram_available=30 * GIB), gpt_oss)
    assert "int4" not in refused.value.message


def test_the_prefix_store_takes_a_quarter_of_the_free_ram_at_most_8_gib() -> None:
    recipe = get_recipe("demo")
    assert make_plan(CPU_64, recipe).cache_ram_mib == 8192
    small = dataclasses.replace(CPU_64, cpu_ram_available=8 * GIB)
    plan = make_plan(small, recipe)
    assert plan.cache_ram_mib == 2048 and any(r.startswith("prefix store 2048 MiB") for r in plan.reasons)
    assert make_plan(small, recipe, PlanOverrides(cache_ram_mib=0)).cache_ram_mib == 0  # --cache-ram 0


def test_a_cache_ram_beyond_the_machines_ram_runs_with_a_note() -> None:
    """--cache-ram is MiB: 99999999 (95 TiB) on 8 GiB is kept as asked, with a note; a large but possible one is not
    noted."""
    recipe = get_recipe("demo")
    plan = make_plan(CPU_8, recipe, PlanOverrides(cache_ram_mib=99_999_999))
    assert plan.cache_ram_mib == 99_999_999
    assert any(
        note.startswith("--cache-ram 99999999 MiB is more than the 8,192 MiB of RAM here") for note in plan.notes
    )
    assert not make_plan(CPU_8, recipe, PlanOverrides(cache_ram_mib=6144)).notes  # more than the free RAM: possible
    assert not make_plan(CPU_8, recipe).notes
