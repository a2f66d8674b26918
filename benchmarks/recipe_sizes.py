"""Sizes for recipes/*.toml, derived from the published architectures (no download).

Each target's published dimensions (model cards, config.json copies quoted in the recipe comments) are built
into the transformers model on the meta device, and its parameters counted the way the planner needs them:
bf16 bytes, NF4 bytes (bitsandbytes quantizes nn.Linear layers but the output head; transformers' fused MoE
experts stay bf16), the experts alone, the KV cache per token as dflash keeps it (every attention layer at
full length: sliding layers too, since the decode loop rewinds its cache) and, for hybrid targets, one row's
linear-attention state. Drafter sizes come from the drafter shapes we know (layers, taps) with the target's
hidden size. These are estimates of what transformers loads; `dflash pull NAME --dry-run` shows the real
download sizes.

    python -m benchmarks.recipe_sizes [NAME ...]
"""

from __future__ import annotations

import sys

import torch
import transformers

from dflash_cli.engine.drafter import DFlashDrafter, DrafterConfig
from dflash_cli.loading.checkpoint import count_parameters

QWEN3 = dict(
    vocab_size=151936,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)
QWEN35 = dict(
    vocab_size=248320,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    head_dim=256,
    max_position_embeddings=262144,
)
QWEN35_MOE = dict(
    QWEN35,
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    tie_word_embeddings=False,
)
QWEN35_27B = dict(
    QWEN35,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    tie_word_embeddings=False,
)
GEMMA4 = dict(
    vocab_size=262144,
    head_dim=256,
    global_head_dim=512,
    attention_k_eq_v=True,
    sliding_window=1024,
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0,
    tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
)

# Drafter head shapes where the notes give them (gpt-oss drafters: 64 heads, 8 KV heads of 64); else estimated.
DRAFTER_HEADS = {"gpt-oss-20b": (64, 8, 64), "gpt-oss-120b": (64, 8, 64)}

# name: (config class, fields, drafter (layers, taps))
TARGETS = {
    "demo": (
        "LlamaConfig",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
        ),
        (1, 5),
    ),
    "qwen3-4b": (
        "Qwen3Config",
        dict(QWEN3, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True),
        (5, 5),
    ),
    "qwen3-8b": ("Qwen3Config", dict(QWEN3, hidden_size=4096, intermediate_size=12288), (5, 5)),
    "llama3.1-8b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=False,
        ),
        (5, 5),
    ),
    "qwen3.5-4b": (
        "Qwen3_5TextConfig",
        dict(
            QWEN35,
            hidden_size=2560,
            intermediate_size=9216,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=4,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            tie_word_embeddings=True,
        ),
        (6, 8),
    ),
    "qwen3.5-9b": (
        "Qwen3_5TextConfig",
        dict(
            QWEN35,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=4,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            tie_word_embeddings=False,
        ),
        (5, 5),
    ),
    "qwen3.5-27b": ("Qwen3_5TextConfig", QWEN35_27B, (5, 5)),
    "qwen3.6-27b": ("Qwen3_5TextConfig", QWEN35_27B, (5, 5)),
    "qwen3.5-35b-a3b": ("Qwen3_5MoeTextConfig", QWEN35_MOE, (5, 5)),
    "qwen3.6-35b-a3b": ("Qwen3_5MoeTextConfig", QWEN35_MOE, (5, 5)),
    "qwen3-coder-30b-a3b": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            intermediate_size=6144,
            tie_word_embeddings=False,
        ),
        (8, 8),
    ),
    "qwen3-coder-next": (
        "Qwen3NextConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            intermediate_size=5120,
            tie_word_embeddings=False,
        ),
        (5, 5),
    ),
    "gpt-oss-20b": ("GptOssConfig", dict(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4), (8, 5)),
    "gpt-oss-120b": ("GptOssConfig", dict(num_hidden_layers=36, num_local_experts=128, num_experts_per_tok=4), (8, 5)),
    # DFlash2's target: assumed to have the Qwen3.6-27B architecture (not in the notes: check its config.json)
    "qwen3.8-27b": ("Qwen3_5TextConfig", QWEN35_27B, (5, 5)),
    "gemma-4-31b": (
        "Gemma4TextConfig",
        dict(
            GEMMA4,
            hidden_size=5376,
            intermediate_size=21504,
            num_hidden_layers=60,
            num_attention_heads=32,
            num_key_value_heads=16,
            num_global_key_value_heads=4,
        ),
        (5, 5),
    ),
    "gemma-4-26b-a4b": (
        "Gemma4TextConfig",
        dict(
            GEMMA4,
            hidden_size=2816,
            intermediate_size=2112,
            num_hidden_layers=30,
            num_attention_heads=16,
            num_key_value_heads=8,
            num_global_key_value_heads=2,
            enable_moe_block=True,
            num_experts=128,
            top_k_experts=8,
            moe_intermediate_size=704,
        ),
        (5, 5),
    ),
}


def kv_bytes_per_token(config) -> int:
    """bf16 K and V of every attention layer (linear-attention layers keep a fixed-size state instead)."""
    total = 0
    text = config.get_text_config()
    for i, kind in enumerate(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers):
        if kind not in ("full_attention", "sliding_attention"):
            continue
        layer = text.per_layer_config[i] if hasattr(text, "per_layer_config") else text
        heads = getattr(layer, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(layer, "head_dim", None) or text.hidden_size // text.num_attention_heads
        total += 2 * heads * head_dim * 2
    return total


def state_bytes_per_row(config) -> int:
    """One row's fixed-size state of the linear-attention (Gated DeltaNet) layers, as the engine keeps it: the
    float32 recurrent state [value heads, key dim, value dim] and the bf16 conv window [channels, kernel]."""
    text = config.get_text_config()
    layers = sum(kind == "linear_attention" for kind in getattr(text, "layer_types", None) or ())
    if not layers:
        return 0
    recurrent = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
    channels = 2 * text.linear_num_key_heads * text.linear_key_head_dim
    channels += text.linear_num_value_heads * text.linear_value_head_dim
    return layers * (recurrent + channels * text.linear_conv_kernel_dim * 2)


def drafter_bytes(name: str, config, layers: int, taps: int) -> tuple[int, int]:
    """(bf16 bytes, KV bytes per token) of a drafter of `layers` Qwen3-style layers on this target's hidden size."""
    text = config.get_text_config()
    hidden = text.hidden_size
    estimated = (32, 8, 128) if hidden >= 4096 else (hidden // 128, max(hidden // 512, 1), 128)
    heads, kv_heads, head_dim = DRAFTER_HEADS.get(name, estimated)
    cfg = DrafterConfig.for_target(
        text,
        layers=layers,
        block_size=16,
        mask_token_id=0,
        feature_layers=taps,
        intermediate_size=getattr(text, "intermediate_size", None) or 3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    return sum(p.numel() for p in drafter.parameters()) * 2, layers * 2 * kv_heads * head_dim * 2


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    for name in names or TARGETS:
        class_name, fields, (layers, taps) = TARGETS[name]
        config = getattr(transformers, class_name)(**fields)
        counts = count_parameters(config)
        d_bytes, d_kv = drafter_bytes(name, config, layers, taps)
        print(f"# {name}: {counts.total / 1e9:.2f} B params loaded ({counts.experts / 1e9:.2f} B in fused experts)")
        print(f"params_billion = {counts.total / 1e9:.2f}")
        print(f"drafter_bytes = {d_bytes:_}")
        print(f"kv_bytes_per_token = {kv_bytes_per_token(config) + d_kv:_}")
        if state := state_bytes_per_row(config):
            print(f"state_bytes_per_row = {state:_}")
        if counts.experts:
            print(f"expert_bytes = {counts.experts * 2:_}")
        print(f"bf16 = {counts.nbytes('bfloat16'):_}")
        print(f"nf4 = {counts.nbytes('bfloat16', 'nf4'):_}")
        # the CPU formats (engine.kernels.quantized): linears int4 / int8, the output head int8, the rest bf16
        print(f"int4 = {counts.nbytes('bfloat16', 'int4'):_}")
        print(f"int8 = {counts.nbytes('bfloat16', 'int8'):_}")
        # fine-grained FP8 (Qwen's -FP8 checkpoints): linear layers and experts at 1 byte plus one fp32 scale per
        # 128x128 block; embeddings, output head and norms stay bf16
        quantized = counts.linear + counts.experts
        print(f"fp8 = {int(quantized * (1 + 4 / 128**2) + counts.other * 2):_}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
