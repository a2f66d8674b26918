"""Tiny real models and Hugging Face caches for tests.

Everything here builds real artifacts offline, in milliseconds:

- `make_tiny(family, dir, seed)`: a random-init transformers model of one of `FAMILIES` (Qwen3, Llama, Qwen3-MoE,
  the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrids, Gemma 4 dense and MoE, gpt-oss) saved with `save_pretrained`
  (safetensors, float32) plus a real byte-level BPE tokenizer with a ChatML chat template;
  `make_tiny_qwen3(dir, seed)` / `make_tiny_llama(dir, seed)` are its two oldest uses. `build_tiny(family, seed)`
  builds the same model in memory; `family_target(family)` that one with a sharpened output head, shared.
- `sharp_tiny(arch, seed, layers)`: the engine tests' Qwen3 / Llama (vocabulary 96, hidden 32) with a sharpened
  output head; `hf_greedy(model, prompt, n)`: transformers' own greedy continuation, what lossless decoding equals.
- `make_hf_cache(hf_home, repo_id, src_dir)`: the files of `src_dir` laid out the way huggingface_hub stores a
  download (`hub/models--org--name/{blobs,refs/main,snapshots/<sha>}`), so the real hub calls find them.
- `tiny_tokenizer()`: the tokenizer alone.

Stable interface: other test files import these names; keep their signatures.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

# ChatML, the format of the Qwen chat templates; `enable_thinking` is accepted the way Qwen3's template does.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 320  # 256 byte symbols + a few merges + the special tokens
MODEL_VOCAB = 384  # >= the tokenizer's vocabulary; a multiple of 64 like real models

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a block of tokens and the target verifies them in one pass.",
    "def add(a, b):\n    return a + b\n",
    "What is 2 + 2? The answer is 4.",
    "Hello! How can I help you today?",
]


@functools.cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer() -> Any:
    """A fresh PreTrainedTokenizerFast: byte-level BPE (any text encodes), ChatML template, eos `<|im_end|>`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


# The structural features of each target family, at toy size: the rules under test (recurrent state rollback,
# sliding windows, attention sinks, K = V global layers, softcapped logits, routed experts) live in these fields,
# not in the size. Fields not given here come from `_BASE_FIELDS`; keyword overrides win over both.
_LINEAR_ATTENTION = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_GEMMA4 = dict(
    num_hidden_layers=3,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],  # 5:1 in the real models
    sliding_window=4,  # shorter than the test prompts: the window is really applied
    attention_k_eq_v=True,  # global layers: keys are values, one KV head of twice the head size
    global_head_dim=32,
    num_global_key_value_heads=1,
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0,
    tie_word_embeddings=True,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {}),
    "llama": ("LlamaConfig", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(**_EXPERTS, norm_topk_prob=True)),
    # hybrids: 3 Gated DeltaNet layers (conv + recurrent state) and 1 gated full-attention layer
    "qwen3_5": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, **_LINEAR_ATTENTION)),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        dict(num_hidden_layers=4, **_LINEAR_ATTENTION, **_EXPERTS, shared_expert_intermediate_size=32),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(num_hidden_layers=4, **_LINEAR_ATTENTION, **_EXPERTS, shared_expert_intermediate_size=32),
    ),
    "gemma4": ("Gemma4TextConfig", _GEMMA4),
    "gemma4_moe": (
        "Gemma4TextConfig",
        dict(_GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    ),
    # chunked attention (window 4) and MoE; its decoder keeps the layers without a `get_decoder().layers`
    "llama4": (
        "Llama4TextConfig",
        dict(
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size_mlp=128,
            attention_chunk_size=4,
            interleave_moe_layer_step=1,
        ),
    ),
    # a Mamba-2 hybrid (not a Gated DeltaNet): its state is rolled back by the general method
    "bamba": (
        "BambaConfig",
        dict(
            num_hidden_layers=3,
            attn_layer_indices=[1],
            mamba_d_state=8,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_expand=2,
            mamba_chunk_size=16,
        ),
    ),
    # alternating sliding (window 4 here, 128 in the real model) and full layers, learned attention sinks
    "gpt_oss": (
        "GptOssConfig",
        dict(
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
}
_BASE_FIELDS = dict(
    vocab_size=MODEL_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
)


def tiny_config(family: str, **overrides: Any) -> Any:
    """The transformers config of a tiny model of `family` (a key of FAMILIES), with `overrides` applied."""
    import transformers

    class_name, fields = FAMILIES[family]
    tok = tiny_tokenizer()
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return getattr(transformers, class_name)(**{**_BASE_FIELDS, **ids, **fields, **overrides})


def build_tiny(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A random-init float32 model of `family` in memory, in eval mode (see `tiny_config`)."""
    import torch
    import transformers

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@functools.cache
def family_target(family: str, seed: int = 1) -> Any:
    """A tiny model of `family` (`build_tiny`) with a sharpened output head (fewer near-ties between the top two
    logits); one object per family and seed, shared by the tests that decode it."""
    import torch

    model = build_tiny(family, seed)
    if not model.config.get_text_config().tie_word_embeddings:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8)
    return model


def sharp_tiny(arch: str, seed: int, layers: int = 2) -> Any:
    """A random-init float32 Qwen3 (`arch="qwen3"`) or Llama of 96 tokens and hidden size 32, its output head scaled
    by 8: sharper distributions, so fewer near-ties between the top two logits and more varied text."""
    import torch
    import transformers

    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    config = transformers.Qwen3Config(**common) if arch == "qwen3" else transformers.LlamaConfig(**common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def int4_packable_tiny(arch: str, seed: int, *, tied: bool = False, **fields: Any) -> Any:
    """A random-init float32 Qwen3 (`arch="qwen3"`) or Llama whose every linear has the shapes the CPU int4 packing
    takes (outputs x16, inputs x64), its head scaled by 4 for sharp distributions (few near-ties); `fields` set the
    vocabulary and special tokens."""
    import torch
    import transformers

    config_class = transformers.Qwen3Config if arch == "qwen3" else transformers.LlamaConfig
    config = config_class(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, tie_word_embeddings=tied, **fields,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4)
    return model


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Exactly `n` tokens of transformers' greedy `generate` after `prompt` (no end-of-sequence stop)."""
    import torch

    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def make_tiny(
    family: str,
    model_dir: str | os.PathLike,
    seed: int = 0,
    *,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a random-init model of `family` (float32, safetensors) and the tiny tokenizer to `model_dir`.

    `overrides` change config fields (e.g. `num_hidden_layers=4`); `max_shard_size="100KB"` saves a sharded
    checkpoint with an index. Returns `model_dir` as a Path.
    """
    model_dir = Path(model_dir)
    model = build_tiny(family, seed, **overrides)
    # safetensors is the default; a small max_shard_size writes shards plus model.safetensors.index.json
    model.save_pretrained(model_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if with_tokenizer:
        tiny_tokenizer().save_pretrained(model_dir)
    return model_dir


def make_tiny_qwen3(
    model_dir: str | os.PathLike,
    seed: int = 0,
    *,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    **cfg: Any,
) -> Path:
    """Save a random-init Qwen3ForCausalLM (2 layers, hidden 64, vocab 384, float32) to `model_dir`; see `make_tiny`."""
    return make_tiny("qwen3", model_dir, seed, with_tokenizer=with_tokenizer, max_shard_size=max_shard_size, **cfg)


def make_tiny_llama(
    model_dir: str | os.PathLike,
    seed: int = 0,
    *,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    **cfg: Any,
) -> Path:
    """Save a random-init LlamaForCausalLM (2 layers, hidden 64, vocab 384, float32) to `model_dir`; see `make_tiny`."""
    return make_tiny("llama", model_dir, seed, with_tokenizer=with_tokenizer, max_shard_size=max_shard_size, **cfg)


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_hf_cache(
    hf_home: str | os.PathLike,
    repo_id: str,
    src_dir: str | os.PathLike,
    *,
    sha: str = "0123456789abcdef0123456789abcdef01234567",
    revision: str = "main",
) -> Path:
    """Lay out `src_dir`'s files as a huggingface_hub cache entry of `repo_id` under `hf_home/hub`.

    Blobs are named like the Hub's etags (sha256 for weights, git sha1 for the rest); snapshot files are
    relative symlinks to them; `refs/<revision>` holds `sha`. Returns the snapshot directory.
    Call it again with another `sha`/`revision` to add a second revision of the same repo.
    """
    storage = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / sha
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    src_dir = Path(src_dir)
    for src in sorted(p for p in src_dir.rglob("*") if p.is_file()):
        data = src.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if src.suffix == ".safetensors" else _git_blob_sha1(data)
        blob = storage / "blobs" / etag
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snapshot / src.relative_to(src_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs" / revision).write_text(sha)
    return snapshot


_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes; codes 8-15 are their negatives


def _mxfp4(matrix: Any) -> tuple[Any, Any]:
    """MXFP4 encoding of a [..., rows, cols] tensor along its last dim: blocks [..., rows, cols/32, 16] (two 4-bit
    codes per byte, the even element in the low nibble) and scales [..., rows, cols/32] (a power of two, +127)."""
    import torch

    groups = matrix.reshape(*matrix.shape[:-1], matrix.shape[-1] // 32, 32).float()
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(_FP4_VALUES)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def make_tiny_mxfp4_gpt_oss(model_dir: str | os.PathLike, seed: int = 0) -> tuple[Path, Any]:
    """A tiny gpt-oss checkpoint laid out as OpenAI publishes gpt-oss: the experts stored as MXFP4 blocks and
    scales with a `quantization_config`, the rest in float32. Returns (directory, the model whose expert weights
    are exactly the MXFP4 values: what a loader that dequantizes must reproduce)."""
    import torch
    from safetensors.torch import save_file

    model = build_tiny("gpt_oss", seed)
    model_dir = Path(model_dir)
    model.save_pretrained(model_dir)
    lut = torch.tensor(_FP4_VALUES + tuple(-v for v in _FP4_VALUES))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = state.pop(name).transpose(1, 2)  # the checkpoint keeps [experts, out, in]
        blocks, scales = _mxfp4(stored)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        # what dequantization gives back, put into the reference model
        values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], -1).flatten(-2)
        values = values * torch.exp2(scales.float() - 127)[..., None]
        with torch.no_grad():
            model.get_parameter(name).copy_(values.reshape(stored.shape).transpose(1, 2))
    for stale in model_dir.glob("*.safetensors*"):
        stale.unlink()
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir, model


def quantizable_tiny(seed: int, tied: bool = False) -> Any:
    """A float32 Qwen3 the int4 packing takes whole (int4_packable_tiny), 128 tokens."""
    return int4_packable_tiny(
        "qwen3", seed, tied=tied, vocab_size=128, bos_token_id=None, eos_token_id=None, pad_token_id=0
    )
