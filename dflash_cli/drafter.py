"""The DFlash drafters: our own modules for the published z-lab checkpoint formats.

A stack of Qwen3-style decoder layers with no embedding and no lm_head of its own (it borrows the
target's). Hidden states of a few target layers are concatenated, projected by `fc` and normed by
`hidden_norm` once per call; that fused context is injected into the keys and values of every layer.
Queries come from the block only: one forward pass proposes a whole block.

Formats (`architectures` in config.json), with the semantics of z-lab's reference (`dflash==0.1.0`):

- Config schemas: legacy (top-level `block_size`, `rope_theta`) and nested (2026: `dflash_config.block_size`,
  `rope_parameters`). Each DFlash field (block size, mask token, target layers, head scales, DFlash2 sizes)
  is read from `dflash_config` first, then the top level, then its default; the mask token has no default.
  The rest of the top level is read as transformers' `Qwen3Config` reads it (`use_sliding_window`,
  `max_window_layers`, `rope_parameters` over `rope_theta`). vLLM-only keys (`use_swa`, `swa_window_size`,
  `attention_sink_bias`, `dflash_config.causal`) are ignored, as the reference ignores them.
- Attention: a `sliding_attention` layer is causal (a block position sees keys at or before its own absolute
  position, within `sliding_window`), a `full_attention` layer sees all context and the whole block; a
  top-level `is_causal` overrides causality for every layer. The window is on absolute positions and, in a
  non-causal sliding layer, applies on both sides. Sliding layers keep only the context rows a later block
  can still see (window - 1), so their cache stays bounded in long conversations.
- Heads: the block embedding is the target's raw embedding row times `input_embedding_scale`; logits are
  the target's lm_head times `output_multiplier`, then `tanh(x / c) * c` for `final_logit_softcapping` c > 0.
- `DFlashDraftModel` proposes the argmax of each slot. `DFlash2DraftModel` adds a grouped dynamic causal
  convolution over block positions around attention and around the MLP of every layer, and a candidate
  selector: the top-k logits of each slot are rescored with two codebooks conditioned on the previous
  slot's choice, and the proposal is the selector's greedy chain.

Sampling (T > 0) uses the same deterministic proposal (argmax; DFlash2: the selector's greedy chain) and the
engine's one rule: a draft stands only where the target's own sample equals it. That is rejection sampling
with a one-hot proposal, so every committed token is distributed exactly as the target's (the reference
instead samples its drafts and accepts against their distribution; both are lossless).
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from huggingface_hub.errors import StrictDataclassError
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash_cli.errors import DflashError

ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
ARCHITECTURES = (ARCHITECTURE, DFLASH2_ARCHITECTURE)
LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 16  # the reference's default when neither dflash_config nor the top level sets it
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DFlash fields the reference looks up in dflash_config first, then at the top level.
DFLASH_FIELDS = (
    "block_size", "mask_token_id", "target_layer_ids", "input_embedding_scale", "output_multiplier",
    "final_logit_softcapping",
)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layers the published drafters read when their config does not list them: evenly spaced."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    if span < num_draft_layers - 1:  # tiny targets: the published formula would leave the layer range
        return [round(i * (num_target_layers - 1) / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    """The fields of a z-lab `config.json` that the drafter uses; everything else round-trips in `extra`
    (top level) and `dflash_extra` (inside `dflash_config`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None  # top-level override of every layer's causality
    attention_bias: bool = False
    hidden_act: str = "silu"
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    architecture: str = ARCHITECTURE
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    nested: bool = False  # block_size lives in dflash_config (the 2026 schema) rather than at the top level
    extra: dict[str, Any] = field(default_factory=dict)
    dflash_extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == DFLASH2_ARCHITECTURE

    def layer_is_causal(self, layer_idx: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer_idx] == "sliding_attention"

    def layer_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "DrafterConfig":
        def fail(field_name: str, expected: str) -> DflashError:
            return DflashError(
                f"{source}: unsupported drafter config field '{field_name}': expected {expected}",
                fix=f"check '{field_name}' in the drafter's config.json (`dflash pull` fetches a fresh copy); dflash "
                f"runs drafters in the z-lab formats ({' and '.join(ARCHITECTURES)})",
            )

        archs = raw.get("architectures") or []
        architecture = next((a for a in archs if a in ARCHITECTURES), None) if isinstance(archs, list) else None
        if architecture is None:
            raise fail("architectures", f"{' or '.join(json.dumps([a]) for a in ARCHITECTURES)}, got {archs!r}")
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise fail("dflash_config", f"an object, got {dflash!r}")

        def where(name: str) -> str:
            return f"dflash_config.{name}" if name in dflash else name

        def value(name: str, default: Any = None) -> Any:
            """A DFlash field as the reference reads it: dflash_config, then the top level, then the default."""
            return dflash.get(name, raw.get(name, default))

        def integer(name: str, default: Any = None, minimum: int = 1) -> int:
            got = value(name, default)
            if not isinstance(got, int) or isinstance(got, bool) or got < minimum:
                raise fail(where(name), f"an integer >= {minimum} (in dflash_config or at the top level), got {got!r}")
            return got

        def number(name: str, default: Any) -> float | None:
            got = value(name, default)
            if got is not None and (not isinstance(got, (int, float)) or isinstance(got, bool)):
                raise fail(where(name), f"a number, got {got!r}")
            return None if got is None else float(got)

        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if not isinstance(raw.get(name), int) or raw[name] < 1:
                raise fail(name, f"a positive integer, got {raw.get(name)!r}")
        n_layers = raw["num_hidden_layers"]
        layer_types = raw.get("layer_types")
        if layer_types is not None:
            if not isinstance(layer_types, list) or len(layer_types) != n_layers:
                raise fail("layer_types", f"{n_layers} entries (one per layer), got {layer_types!r}")
            for kind in layer_types:
                if kind not in LAYER_TYPES:
                    raise fail("layer_types", f'"full_attention" or "sliding_attention", got {kind!r}')
        # The top level as transformers (and so the reference) reads it: defaults, use_sliding_window,
        # layer types from max_window_layers when not listed, rope_parameters standardised from rope_theta.
        try:
            # (a deep copy: transformers edits the rope dicts it is given)
            hf = Qwen3Config.from_dict(copy.deepcopy({k: v for k, v in raw.items() if k != "dflash_config"}))
        except (ValueError, TypeError, KeyError, StrictDataclassError) as exc:
            raise DflashError(
                f"{source}: invalid drafter config ({exc})",
                fix="check the field it names in the drafter's config.json (`dflash pull` fetches a fresh copy)",
            ) from None
        if hf.num_attention_heads % hf.num_key_value_heads:
            raise fail("num_key_value_heads", f"a divisor of num_attention_heads {hf.num_attention_heads}, got {hf.num_key_value_heads}")
        rope_type = (hf.rope_parameters or {}).get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise fail("rope_parameters.rope_type", f"one of default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}; got {rope_type!r}")
        if hf.hidden_act not in ACT2FN:
            raise fail("hidden_act", f"an activation transformers knows (silu, gelu, ...), got {hf.hidden_act!r}")
        if "sliding_attention" in hf.layer_types:
            window = hf.sliding_window
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise fail(
                    "sliding_window",
                    "a positive window for the sliding_attention layers, with use_sliding_window: true; got "
                    f"sliding_window={raw.get('sliding_window')!r}, use_sliding_window={raw.get('use_sliding_window')!r}",
                )
        head_dim = hf.head_dim if hf.head_dim is not None else raw["hidden_size"] // raw["num_attention_heads"]
        is_causal = raw.get("is_causal")

        block_size = integer("block_size", DEFAULT_BLOCK_SIZE)
        mask_token_id = value("mask_token_id")
        if not isinstance(mask_token_id, int) or isinstance(mask_token_id, bool) or mask_token_id < 0:
            raise fail("dflash_config.mask_token_id", f"the id of the mask token (in dflash_config or at the top level), got {mask_token_id!r}")
        layer_ids = value("target_layer_ids")
        n_target = raw.get("num_target_layers", dflash.get("num_target_layers"))  # the reference: top level
        if layer_ids is None:
            if not isinstance(n_target, int):
                raise fail("num_target_layers", "an integer (needed when dflash_config.target_layer_ids is absent)")
            layer_ids = default_target_layer_ids(n_target, n_layers)
        if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) for i in layer_ids):
            raise fail(where("target_layer_ids"), f"a list of target layer indices, got {layer_ids!r}")
        dflash2: dict[str, int] = {}
        if architecture == DFLASH2_ARCHITECTURE:
            dflash2 = {name: integer(name) for name in DFLASH2_FIELDS}
            if raw["hidden_size"] % dflash2["conv_group_size"]:
                raise fail(where("conv_group_size"), f"a divisor of hidden_size {raw['hidden_size']}, got {dflash2['conv_group_size']}")
            if dflash2["selector_top_k"] > raw["vocab_size"]:
                raise fail(where("selector_top_k"), f"at most vocab_size {raw['vocab_size']}, got {dflash2['selector_top_k']}")

        rope = dict(hf.rope_parameters or {})
        rope_theta = float(rope.pop("rope_theta", 1e6))
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        consumed = set(DFLASH_FIELDS) | (set(DFLASH2_FIELDS) if dflash2 else set())
        known = (
            {f.name for f in fields(cls)} | consumed
            | {"dflash_config", "rope_parameters", "architectures", "use_sliding_window", "is_causal"}
        )
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=raw["vocab_size"],
            num_target_layers=n_target if isinstance(n_target, int) else max(layer_ids) + 1,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=[int(i) for i in layer_ids],
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.max_position_embeddings,
            layer_types=list(hf.layer_types),
            sliding_window=hf.sliding_window if "sliding_attention" in hf.layer_types else None,
            is_causal=None if is_causal is None else bool(is_causal),
            attention_bias=bool(hf.attention_bias),
            hidden_act=hf.hidden_act,
            input_embedding_scale=number("input_embedding_scale", 1.0),
            output_multiplier=number("output_multiplier", 1.0),
            final_logit_softcapping=number("final_logit_softcapping", None),
            architecture=architecture,
            nested="block_size" in dflash,
            extra={k: v for k, v in raw.items() if k not in known},
            dflash_extra={k: v for k, v in dflash.items() if k not in consumed},
            **dflash2,
        )

    def to_dict(self) -> dict[str, Any]:
        """The published format. Drafters made by `dflash train` get the legacy schema (top-level
        `block_size`); a drafter read from the nested schema keeps `block_size` in `dflash_config`."""
        dflash: dict[str, Any] = {
            **self.dflash_extra, "mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids,
        }
        if self.nested:
            dflash["block_size"] = self.block_size
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.is_dflash2:
            dflash.update({name: getattr(self, name) for name in DFLASH2_FIELDS})
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}
        out = {
            **self.extra,
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "num_target_layers": self.num_target_layers,
            **({} if self.nested else {"block_size": self.block_size}),
            "dflash_config": dflash,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
        }
        if self.sliding_window is not None:
            out["use_sliding_window"] = True  # transformers drops the window without it
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out

    def rope_config(self) -> Qwen3Config:
        """A transformers config carrying only what RoPE needs, so YaRN and friends come from transformers."""
        return Qwen3Config(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,  # a copy: transformers edits it
        )


class DraftCache:
    """Per-layer K/V of committed context only (after RoPE and k_norm). Block K/V are never stored.

    `length` counts the committed positions. A full-attention layer keeps all of them; a sliding layer keeps
    only its last `window - 1` rows (the oldest a later block can still see), so the stored rows of layer i
    are the positions `length - rows_i .. length - 1`.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def rows(self, layer_idx: int) -> int:
        keys = self.keys[layer_idx]
        return 0 if keys is None else keys.shape[-2]

    def crop(self, length: int) -> None:
        """Forget committed positions from `length` on. A sliding layer does not get back rows its window
        already let go, so after a crop it may hold fewer than window - 1 (its later drafts then see less)."""
        drop = self.length - length
        if drop <= 0:
            return
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                keep = max(0, k.shape[-2] - drop)
                self.keys[i], self.values[i] = k[..., :keep, :], v[..., :keep, :]
        self.length = length


def _window_mask(positions: torch.Tensor, past_rows: int, q_len: int, causal: bool, window: int | None) -> torch.Tensor:
    """The reference's attention rule on absolute positions -> bool [b, 1, q, keys] (True = attend).

    Keys are [`past_rows` cached rows just before positions[:, 0] ; the rows at `positions`]; the queries
    are the last `q_len` of `positions`.
    """
    past = positions[:, :1] - past_rows + torch.arange(past_rows, device=positions.device)
    key_pos = torch.cat([past, positions], dim=1)
    distance = positions[:, -q_len:, None] - key_pos[:, None, :]  # query position - key position
    visible = torch.ones_like(distance, dtype=torch.bool)
    if causal:
        visible &= distance >= 0
    if window is not None:
        visible &= distance < window
        if not causal:
            visible &= -distance < window
    return visible[:, None]


class DraftAttention(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.causal = config.layer_is_causal(layer_idx)
        self.sliding_window = config.layer_window(layer_idx)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.head_dim)

    def forward(
        self,
        block: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftCache | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        bsz, q_len, _ = block.shape
        both = torch.cat([context, block], dim=1)
        q = self.q_norm(self._heads(self.q_proj(block), self.num_heads)).transpose(1, 2)
        k = self.k_norm(self._heads(self.k_proj(both), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(both), self.num_kv_heads).transpose(1, 2)
        # Queries sit at the block's positions, the last q_len rows of cos/sin.
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -q_len:], sin[:, -q_len:])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        past_rows = 0
        if cache is not None:
            past_k, past_v = cache.keys[self.layer_idx], cache.values[self.layer_idx]
            if past_k is not None:
                past_rows = past_k.shape[2]
                k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            # Only context rows are committed; the block is re-drafted next step. A sliding layer keeps the
            # last window - 1 of them: the next block starts after them and sees no further back.
            committed = k.shape[2] - q_len
            first = 0 if self.sliding_window is None else max(0, committed - (self.sliding_window - 1))
            cache.keys[self.layer_idx] = k[:, :, first:committed]
            cache.values[self.layer_idx] = v[:, :, first:committed]
        mask = attention_mask
        if self.causal or self.sliding_window is not None:
            rule = _window_mask(positions, past_rows, q_len, self.causal, self.sliding_window)
            mask = rule if mask is None else mask & rule
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class GroupedDynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over the positions of a block.

    For offsets o < K: out_t = sum_o (base[o] + dyn[t, o]) * x_{t-o}, zero before the block's first position.
    `base` is per channel; `dyn` is one coefficient per group of `group_size` channels, predicted from the
    normed layer input by `kernel_projection`. Half 0 (and base_kernel[0]) runs before the sublayer
    (`prepare`), half 1 (and base_kernel[1]) on the sublayer's output (`finish`).
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0  # a fresh convolution starts as the identity
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        b, length, hidden = x.shape
        grouped = x.view(b, length, self.groups, self.group_size)
        dynamic = dynamic.reshape(b, length, self.kernel_size, self.groups, 1)
        out = torch.zeros_like(grouped)
        for offset in range(self.kernel_size):
            # x_{t - offset}: shifted down the block, zeros entering at the top
            shifted = grouped if offset == 0 else F.pad(grouped[:, :-offset], (0, 0, 0, 0, offset, 0))
            out = out + base[offset].view(1, 1, self.groups, self.group_size).to(x.dtype) * shifted
            out = torch.addcmul(out, dynamic[:, :, offset], shifted)
        return out.view(b, length, hidden)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, dynamic, self.base_kernel[1])


class DraftLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        mlp_config = Qwen3Config(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, hidden_act=config.hidden_act
        )
        self.mlp = Qwen3MLP(mlp_config)
        self.attention_conv: GroupedDynamicConv | None = None
        self.mlp_conv: GroupedDynamicConv | None = None
        if config.is_dflash2:
            assert config.conv_kernel_size is not None and config.conv_group_size is not None
            self.attention_conv = GroupedDynamicConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def forward(self, x: torch.Tensor, context: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        # The context goes into K/V as is: it was normed once by hidden_norm, not by input_layernorm.
        x = x + self._sublayer(self.input_layernorm(x), self.attention_conv, lambda h: self.self_attn(h, context, *attn_args))
        return x + self._sublayer(self.post_attention_layernorm(x), self.mlp_conv, self.mlp)

    @staticmethod
    def _sublayer(h: torch.Tensor, conv: GroupedDynamicConv | None, sublayer: Any) -> torch.Tensor:
        if conv is None:
            return sublayer(h)
        h, dynamic = conv.prepare(h)
        return conv.finish(sublayer(h), dynamic)


class CandidateSelector(nn.Module):
    """DFlash2's proposal: rescore the top-k logits of each slot given the previous slot's token.

    score(slot p, candidate c) = logit[p, c] + <predecessor[prev] * hidden_projection(h_p), successor[c]>,
    walking left to right from the block's first token; the greedy chain takes the best candidate each time.
    The codebooks are plain parameters: the published files store them without a `.weight` suffix.
    """

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        assert config.selector_rank is not None and config.selector_top_k is not None
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(config.vocab_size, config.selector_rank))
        self.successor_codebook = nn.Parameter(torch.randn(config.vocab_size, config.selector_rank))
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)

    def greedy_chain(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """hidden [b, n, H], logits [b, n, V] of slots 1..n, anchor_ids [b] -> chosen ids [b, n]."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        previous = anchor_ids
        chain = []
        for slot in range(hidden.shape[1]):
            query = self.predecessor_codebook[previous] * projected[:, slot]
            scores = unary[:, slot] + torch.einsum("br,bkr->bk", query, self.successor_codebook[candidates[:, slot]])
            previous = candidates[:, slot].gather(-1, scores.argmax(dim=-1, keepdim=True))[:, 0]
            chain.append(previous)
        return torch.stack(chain, dim=1)


class DFlashDrafter(nn.Module):
    """Drafter bound to a target: uses the target's input embeddings and lm_head (not saved with it)."""

    def __init__(self, config: DrafterConfig, target: PreTrainedModel | None = None) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        with torch.device("cpu"):
            rope = Qwen3RotaryEmbedding(config.rope_config())
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self._inv_freq = rope.inv_freq.float()
        self._rope_scale = rope.attention_scaling
        # A tuple keeps the target's modules out of this module's parameters and state dict.
        self._target: tuple[PreTrainedModel, ...] = ()
        if target is not None:
            self.bind(target)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def bind(self, target: PreTrainedModel) -> None:
        check_compatible(self.config, target)
        self._target = (target,)

    @property
    def target(self) -> PreTrainedModel:
        if not self._target:
            raise RuntimeError("drafter is not bound to a target; call drafter.bind(target)")
        return self._target[0]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # The embedding table's raw rows, as the reference takes them: a target whose embedding module scales
        # its output (Gemma) is not scaled here; only input_embedding_scale is applied.
        embeds = F.embedding(token_ids, self.target.get_input_embeddings().weight)
        return embeds * self.config.input_embedding_scale if self.config.input_embedding_scale != 1.0 else embeds

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.target.get_output_embeddings()
        # As rows of a 2-D matrix: a 3-D slice such as hidden[:, 1:] keeps its parent's batch stride, and
        # CPU linear sends such inputs down a batched-matmul path about 10x slower than one GEMM.
        rows = hidden.reshape(-1, hidden.shape[-1]).to(head.weight.dtype)
        logits = head(rows)
        logits = logits.view(*hidden.shape[:-1], logits.shape[-1])
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap is not None and cap > 0 else logits

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != position_ids.device:  # moved once, not copied every step
            self._inv_freq = self._inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self._inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self._rope_scale).to(dtype), (emb.sin() * self._rope_scale).to(dtype)

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target layer outputs [b, c, n*H] -> fused context [b, c, H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_embeds: torch.Tensor,
        context: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block embeddings [b, q, H] + fused context [b, c, H] at `position_ids` [b, c+q] -> hidden [b, q, H].

        With a cache, the keys/values of earlier committed context are prepended and the new context rows
        are appended to it. `attention_mask` (bool, True = attend, [b|1, 1, q, keys]) is for training; each
        layer's own rule (causal, sliding window, on `position_ids`) is applied on top of it.
        """
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rope(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, context, cos, sin, position_ids, cache, attention_mask)
        if cache is not None:
            cache.length += context.shape[1]
        return self.norm(x)

    def draft_hidden(self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache) -> torch.Tensor:
        """One drafting pass: new context features + block [last token, MASK...] -> hidden of slots 1..q-1.

        `start` is the position of the block's first token; the new context covers positions
        cache.length .. start-1.
        """
        ctx_len = features.shape[1]
        positions = torch.arange(start - ctx_len, start + block_ids.shape[1], device=block_ids.device)[None]
        return self(self.embed(block_ids), self.fuse_context(features), positions, cache)[:, 1:]

    @torch.no_grad()
    def draft(self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache) -> torch.Tensor:
        """The drafter's logits for slots 1..q-1 (see `draft_hidden`)."""
        return self.logits(self.draft_hidden(features, block_ids, start, cache))

    @torch.no_grad()
    def propose(self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache) -> torch.Tensor:
        """The draft token ids for block slots 1..q-1 [b, q-1]: what the engine verifies, at any temperature."""
        return self.draft(features, block_ids, start, cache).argmax(dim=-1)

    def save_pretrained(self, directory: str | Path) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        config["dtype"] = str(self.fc.weight.dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


class DFlash2Drafter(DFlashDrafter):
    """`DFlash2DraftModel`: convolutions in every layer (see `DraftLayer`) and the candidate selector."""

    def __init__(self, config: DrafterConfig, target: PreTrainedModel | None = None) -> None:
        super().__init__(config, target)
        self.candidate_selector = CandidateSelector(config)

    @torch.no_grad()
    def propose(self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache) -> torch.Tensor:
        hidden = self.draft_hidden(features, block_ids, start, cache)
        return self.candidate_selector.greedy_chain(hidden, self.logits(hidden), block_ids[:, 0])


def make_drafter(config: DrafterConfig, target: PreTrainedModel | None = None) -> DFlashDrafter:
    """The drafter module for the config's format."""
    return (DFlash2Drafter if config.is_dflash2 else DFlashDrafter)(config, target)


def check_compatible(config: DrafterConfig, target: PreTrainedModel) -> None:
    tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    if tcfg.hidden_size != config.hidden_size:
        raise DflashError(
            f"drafter hidden size {config.hidden_size} does not match the target's {tcfg.hidden_size}",
            fix="pair the drafter with the target it was trained for (see `dflash recipes list`)",
        )
    n_layers = tcfg.num_hidden_layers
    bad = [i for i in config.target_layer_ids if not 0 <= i < n_layers]
    if bad:
        raise DflashError(
            f"drafter reads target layers {bad}, but the target has {n_layers} layers",
            fix="pair the drafter with the target it was trained for",
        )
    vocab = target.get_input_embeddings().num_embeddings
    if not 0 <= config.mask_token_id < vocab:
        raise DflashError(
            f"drafter mask token id {config.mask_token_id} is outside the target's vocabulary ({vocab})",
            fix="pair the drafter with the target (and tokenizer) it was trained for",
        )
    head = target.get_output_embeddings()
    head_vocab = getattr(head, "out_features", vocab)
    if config.is_dflash2 and head_vocab > config.vocab_size:
        raise DflashError(
            f"the DFlash2 drafter's selector codebooks cover {config.vocab_size} tokens, but the target's lm_head "
            f"scores {head_vocab}",
            fix="pair the drafter with the target it was trained for",
        )


def target_decoder_layers(target: PreTrainedModel) -> nn.ModuleList:
    """The decoder layer stack of a transformers causal LM: `get_decoder().layers` (Qwen3, Llama and their kin),
    else the module list holding one module per decoder layer (Llama 4's `get_decoder()` is the model itself)."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    layers = getattr(base, "layers", None)
    if layers is None:
        count = target.config.get_text_config().num_hidden_layers
        layers = next((m for m in target.modules() if isinstance(m, nn.ModuleList) and len(m) == count), None)
    if layers is None:
        raise DflashError(
            f"cannot find the decoder layers of {type(target).__name__}",
            fix="use a transformers causal LM whose decoder keeps its layers in a module list",
        )
    return layers


@contextlib.contextmanager
def capture_layers(target: PreTrainedModel, layer_ids: list[int]) -> Iterator[list[torch.Tensor]]:
    """Record the outputs of the chosen decoder layers (only those) during forwards inside the block."""
    captured: list[torch.Tensor] = []
    layers = target_decoder_layers(target)
    slots: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            slots[index] = output[0] if isinstance(output, tuple) else output
            if len(slots) == len(layer_ids):
                captured.append(torch.cat([slots[i] for i in range(len(layer_ids))], dim=-1))
                slots.clear()

        return record

    handles = [layers[layer_id].register_forward_hook(hook(i)) for i, layer_id in enumerate(layer_ids)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def capture_target_features(
    target: PreTrainedModel, input_ids: torch.Tensor, layer_ids: list[int], **forward_kwargs: Any
) -> tuple[Any, torch.Tensor]:
    """Run the target once; return its outputs and the concatenated features of `layer_ids` [b, s, n*H]."""
    with capture_layers(target, layer_ids) as captured:
        outputs = target(input_ids=input_ids, **forward_kwargs)
    return outputs, captured[-1]


def read_drafter_config(directory: Path) -> DrafterConfig:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise DflashError(f"no config.json in drafter directory {directory}", fix="point at a DFlash drafter directory or repo id") from None
    except json.JSONDecodeError as exc:
        raise DflashError(f"{path} is not valid JSON ({exc})", fix="delete the file and download the drafter again (`dflash pull`)") from None
    return DrafterConfig.from_dict(raw, source=str(path))


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(directory.glob("*.safetensors"))]
    if not files:
        raise DflashError(f"no .safetensors weights in drafter directory {directory}", fix="only safetensors checkpoints are loaded; download the drafter again")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.exists():
            raise DflashError(f"drafter shard {path} is missing", fix="download the drafter again (`dflash pull`)")
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError) as exc:
            raise DflashError(f"drafter weights {path} are corrupt or truncated ({exc})", fix="delete the file and download the drafter again (`dflash pull`)") from None
    return state


def load_drafter(path_or_repo_id: str | Path, target: PreTrainedModel, *, revision: str | None = None) -> DFlashDrafter:
    """Load a DFlash or DFlash2 drafter (local directory or Hugging Face repo id) bound to a loaded target.

    The drafter runs in the target's compute dtype on the target's device.
    """
    from dflash_cli.hub import resolve_model_dir

    directory = resolve_model_dir(str(path_or_repo_id), revision=revision, what="drafter")
    config = read_drafter_config(directory)
    state = _read_safetensors(directory)
    for name in ("predecessor_codebook", "successor_codebook"):  # also accept an nn.Embedding-style save
        key = f"candidate_selector.{name}"
        if key + ".weight" in state and key not in state:
            state[key] = state.pop(key + ".weight")
    with torch.device("meta"):
        drafter = make_drafter(config)
    expected = set(drafter.state_dict())
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise DflashError(
            f"drafter weights in {directory} do not match its config: "
            f"missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}",
            fix="check that config.json and the safetensors come from the same checkpoint",
        )
    device = target.get_input_embeddings().weight.device
    dtype = compute_dtype(target)
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    drafter.to(device=device, dtype=dtype)
    drafter.bind(target)
    return drafter.eval()


def compute_dtype(target: PreTrainedModel) -> torch.dtype:
    """The dtype activations flow in: the embedding's dtype (NF4 targets keep embeddings unquantized)."""
    return target.get_input_embeddings().weight.dtype
