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

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash_cli.engine.compiled import CompiledStep, Notify, run_drafter
from dflash_cli.errors import DflashError

ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
ARCHITECTURES = (ARCHITECTURE, DFLASH2_ARCHITECTURE)
LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 16  # the reference's default when neither dflash_config nor the top level sets it
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DFlash fields the reference looks up in dflash_config first, then at the top level.
DFLASH_FIELDS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "input_embedding_scale",
    "output_multiplier",
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
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
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
            raise fail(
                "num_key_value_heads",
                f"a divisor of num_attention_heads {hf.num_attention_heads}, got {hf.num_key_value_heads}",
            )
        rope_type = (hf.rope_parameters or {}).get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise fail(
                "rope_parameters.rope_type",
                f"one of default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}; got {rope_type!r}",
            )
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
            raise fail(
                "dflash_config.mask_token_id",
                f"the id of the mask token (in dflash_config or at the top level), got {mask_token_id!r}",
            )
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
                raise fail(
                    where("conv_group_size"),
                    f"a divisor of hidden_size {raw['hidden_size']}, got {dflash2['conv_group_size']}",
                )
            if dflash2["selector_top_k"] > raw["vocab_size"]:
                raise fail(
                    where("selector_top_k"), f"at most vocab_size {raw['vocab_size']}, got {dflash2['selector_top_k']}"
                )

        rope = dict(hf.rope_parameters or {})
        rope_theta = float(rope.pop("rope_theta", 1e6))
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        consumed = set(DFLASH_FIELDS) | (set(DFLASH2_FIELDS) if dflash2 else set())
        known = (
            {f.name for f in fields(cls)}
            | consumed
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
            **self.dflash_extra,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": self.target_layer_ids,
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


def ring_rows(window: int | None, block_size: int) -> int | None:
    """A sliding layer's ring: the `window - 1` committed rows a block can still see, plus one call's context and
    block (None: a full layer)."""
    return None if window is None else window - 1 + 2 * block_size


class DraftCache:
    """The drafter's K/V of committed context (after RoPE and k_norm), in buffers written in place.

    Each call writes its new context rows and its block rows at their positions; `length` then moves past the
    context only, so the block's rows are never committed: the next call writes its own rows over them (a
    length move, no crop, no cat). A full-attention layer keeps every position in a buffer indexed by position
    (attention reads the prefix up to the block's end: a view). A sliding layer keeps a ring of
    `window - 1 + 2 * block` rows indexed by position modulo its size, which always holds the `window - 1`
    committed rows a block can still see plus one call's context and block, so its memory stays bounded in
    long conversations; its keys carry their positions and the mask drops the rest.

    Buffers are allocated on a layer's first write (with that write's heads, head size and dtype) for
    `capacity` positions (the engine reserves what a request needs), and grow if a call goes beyond.
    """

    def __init__(self, config: DrafterConfig, capacity: int = 0, block_size: int | None = None) -> None:
        self.windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
        self.block_size = block_size or config.block_size
        self.capacity = capacity
        self.length = 0
        self.keys: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.values: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.positions: list[torch.Tensor | None] = [None] * config.num_hidden_layers  # sliding: each ring row's
        self.step: CompiledStep | None = None  # the compiled draft step (engine.compiled), or None: eager
        self.notify: Notify | None = None

    def ring_size(self, layer_idx: int) -> int | None:
        return ring_rows(self.windows[layer_idx], self.block_size)

    def rows(self, layer_idx: int) -> int:
        """Committed rows a later block can still see: all of them, or the last window - 1 in a sliding layer."""
        window = self.windows[layer_idx]
        return self.length if window is None else min(self.length, window - 1)

    def slots(self, layer_idx: int) -> int:
        """Rows the layer's buffer holds (bounded for a sliding layer)."""
        keys = self.keys[layer_idx]
        return 0 if keys is None else keys.shape[-2]

    def update(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write the rows of positions `length ..` (new context, then block) and return the keys and values to
        attend over, with their positions when they are not simply 0 .. n-1 (a ring)."""
        n = keys.shape[-2]
        end = self.length + n
        ring = self.ring_size(layer_idx)
        if ring is None:
            buffer_k, buffer_v = self._buffers(layer_idx, keys, max(self.capacity, end))
            buffer_k[:, :, self.length : end].copy_(keys)
            buffer_v[:, :, self.length : end].copy_(values)
            return buffer_k[:, :, :end], buffer_v[:, :, :end], None
        buffer_k, buffer_v = self._buffers(layer_idx, keys, ring)
        keep = min(n, ring)  # a long first context: its rows older than the ring can hold are out of every window
        at = torch.arange(end - keep, end, device=keys.device)
        slots = at % ring
        buffer_k.index_copy_(2, slots, keys[:, :, n - keep :])
        buffer_v.index_copy_(2, slots, values[:, :, n - keep :])
        self.positions[layer_idx].index_copy_(0, slots, at)
        return buffer_k, buffer_v, self.positions[layer_idx]

    def _buffers(self, layer_idx: int, like: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.keys[layer_idx]
        if keys is None or keys.shape[-2] < rows:
            shape = (like.shape[0], like.shape[1], rows, like.shape[3])
            # A ring's unwritten rows are masked, but attention still multiplies them by a zero weight: zeros, not
            # whatever memory held (a NaN there would survive the mask). A full layer only reads what it wrote.
            new = torch.zeros if self.windows[layer_idx] is not None else torch.empty
            grown_k = new(shape, dtype=like.dtype, device=like.device)
            grown_v = new(shape, dtype=like.dtype, device=like.device)
            if keys is not None:  # a full layer outgrew its capacity: keep the committed rows
                grown_k[:, :, : self.length].copy_(keys[:, :, : self.length])
                grown_v[:, :, : self.length].copy_(self.values[layer_idx][:, :, : self.length])
            self.keys[layer_idx], self.values[layer_idx] = grown_k, grown_v
            if self.windows[layer_idx] is not None:
                self.positions[layer_idx] = torch.full((rows,), -1, dtype=torch.long, device=like.device)
        return self.keys[layer_idx], self.values[layer_idx]


class BatchDraftCache:
    """The drafter's context K/V for the rows of a batch (`engine.Batch`), one row per slot, all drafted by one
    forward (`DFlashDrafter.draft_hidden_rows`): `DraftCache`'s layout with a slot dimension in front, [slots, kv
    heads, positions, head dim] per full layer (indexed by position) and [slots, kv heads, ring, head dim] per
    sliding layer (position modulo the ring, one table of each ring row's position per slot, shared by the sliding
    layers: they all write the same positions). Each forward writes every drafting row's new context and block at
    that row's own positions; a row's end is known from its block's start, so the cache keeps no lengths.

    A row that joins a slot resets nothing: its positions restart at 0, and every forward writes each position its
    queries may see before they read it; the slot's previous row left rows at or past the new row's block end
    (masked) or, in a ring, older than its window (each ring row's position says which). Rows joining only need room
    (`make_room`).
    """

    def __init__(self, config: DrafterConfig, slots: int, block_size: int, device: torch.device) -> None:
        self.windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
        self.slots = slots
        self.capacity = 0
        self.keys: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.values: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.ring = ring_rows(config.sliding_window, block_size) if any(w is not None for w in self.windows) else None
        self.ring_positions = (
            None if self.ring is None else torch.full((slots, self.ring), -1, dtype=torch.long, device=device)
        )

    def make_room(self, capacity: int) -> None:
        """Room for `capacity` positions in every row (full layers keep what they hold)."""
        if capacity <= self.capacity:
            return
        for buffers in (self.keys, self.values):
            for index, old in enumerate(buffers):
                if old is not None and self.windows[index] is None:
                    grown = torch.zeros((*old.shape[:2], capacity, old.shape[3]), dtype=old.dtype, device=old.device)
                    grown[:, :, : self.capacity].copy_(old)
                    buffers[index] = grown
        self.capacity = capacity

    def buffers(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s buffers, allocated on its first write (`like`: [1, kv heads, n, head dim]). Zeros:
        attention multiplies the masked rows by a zero weight, and a NaN there would survive the mask."""
        if self.keys[layer_idx] is None:
            rows = self.capacity if self.windows[layer_idx] is None else self.ring
            shape = (self.slots, like.shape[1], rows, like.shape[3])
            self.keys[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.keys[layer_idx], self.values[layer_idx]


class RowsForward:
    """One drafting forward over several rows of a `BatchDraftCache`, handed to each layer's attention in place of
    a `DraftCache` (made by `DFlashDrafter.draft_hidden_rows`). Its K/V inputs are packed, no padding: every row's
    new context rows, then every row's block of `width` [n, width]. Row i's context sits at positions
    starts[i] - contexts[i] .. starts[i] - 1 and its block at starts[i] .. starts[i] + width - 1, of which the first
    sizes[i] are real: row i's queries see its keys before starts[i] + sizes[i] (and the layer's own rule), so the
    pad slots, written like the block's but beyond its end, change nothing; their outputs are the caller's to drop.
    """

    def __init__(
        self,
        cache: BatchDraftCache,
        contexts: Sequence[int],
        starts: Sequence[int],
        sizes: Sequence[int],
        slots: Sequence[int],
        width: int,
        device: torch.device,
    ) -> None:
        # (built on the host, then moved: a few small transfers per step, not per layer)
        starts_t, slots_t = torch.tensor(starts), torch.tensor(slots)
        block = starts_t[:, None] + torch.arange(width)
        positions = torch.cat([*(torch.arange(s - c, s) for s, c in zip(starts, contexts)), block.reshape(-1)])
        token_slots = torch.cat([slots_t.repeat_interleave(torch.tensor(contexts)), slots_t.repeat_interleave(width)])
        self.cache, self.width, self.end = cache, width, max(starts) + width
        cache.make_room(self.end)
        self.positions, self.token_slots = positions.to(device), token_slots.to(device)
        self.query_positions = block.to(device)
        self.limits = (starts_t + torch.tensor(sizes)).to(device)
        first = slots[0]
        contiguous = list(slots) == list(range(first, first + len(slots)))
        self.rows: slice | torch.Tensor = slice(first, first + len(slots)) if contiguous else slots_t.to(device)
        self.masks: dict[tuple[bool, int | None], torch.Tensor] = {}
        if (
            cache.ring is not None
        ):  # each row writes its last `ring` positions (a long first context: older rows are out of every window)
            ring_end = torch.cat(
                [
                    (starts_t + width).repeat_interleave(torch.tensor(contexts)),
                    (starts_t + width).repeat_interleave(width),
                ]
            )
            keep = positions >= ring_end - cache.ring
            at = positions[keep].to(device)
            self.ring_tokens = keep.nonzero()[:, 0].to(device)
            self.ring_slots, self.ring_at = token_slots[keep].to(device), at % cache.ring
            cache.ring_positions[self.ring_slots, self.ring_at] = at

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This forward's rows of a [slots, ...] tensor (a view when the slots are contiguous)."""
        return tensor[self.rows] if isinstance(self.rows, slice) else tensor.index_select(0, self.rows)

    def attend(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, causal: bool, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write layer `layer_idx`'s packed keys and values [1, kv heads, tokens, head dim] at their rows' positions;
        return each row's keys and values to attend over [n, kv heads, keys, head dim] and the mask [n, 1, width, keys]."""
        buffer_k, buffer_v = self.cache.buffers(layer_idx, keys)
        keys, values = keys[0].transpose(0, 1), values[0].transpose(0, 1)  # [tokens, kv heads, head dim]
        if self.cache.windows[layer_idx] is None:
            buffer_k[self.token_slots, :, self.positions] = keys
            buffer_v[self.token_slots, :, self.positions] = values
            buffer_k, buffer_v = buffer_k[:, :, : self.end], buffer_v[:, :, : self.end]
        else:
            buffer_k[self.ring_slots, :, self.ring_at] = keys[self.ring_tokens]
            buffer_v[self.ring_slots, :, self.ring_at] = values[self.ring_tokens]
        return self.take(buffer_k), self.take(buffer_v), self.mask(causal, window)

    def mask(self, causal: bool, window: int | None) -> torch.Tensor:
        """Row i's queries see its keys before its block's end, under the layer's rule (the same for every layer of
        one kind: made once per forward)."""
        if (causal, window) not in self.masks:
            if window is None:  # full layers: buffers indexed by position
                key_positions = torch.arange(self.end, device=self.limits.device)[None]
            else:  # rows not yet written are -1
                key_positions = self.take(self.cache.ring_positions)
            visible = ((key_positions >= 0) & (key_positions < self.limits[:, None]))[:, None, None]
            if causal or window is not None:
                visible = visible & _window_mask(self.query_positions, key_positions, causal, window)
            self.masks[causal, window] = visible
        return self.masks[causal, window]


def _window_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """The reference's attention rule on absolute positions -> bool [b, 1, q, keys] (True = attend).

    `query_positions` [b, q], `key_positions` [b|1, keys].
    """
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # query position - key position
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
        rows: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftCache | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        bsz, q_len, _ = block.shape
        if isinstance(cache, RowsForward):  # several rows: `rows` is their new context packed [1, c, H], then blocks
            both = torch.cat([rows, block.reshape(1, bsz * q_len, -1)], dim=1)
            query_cos, query_sin = (
                cos[0, -bsz * q_len :].view(bsz, q_len, -1),
                sin[0, -bsz * q_len :].view(bsz, q_len, -1),
            )
        else:
            # K/V inputs: the fused context as is, then this layer's normed block. (Written over a copy of `rows`
            # rather than concatenated: no tensor of the context's own size appears, so a compiled draft step does
            # not specialize on one new context row.) Queries sit at the block's positions, the last q_len rows.
            both = rows.clone()
            both[:, -q_len:] = block
            query_cos, query_sin = cos[:, -q_len:], sin[:, -q_len:]
        q = self.q_norm(self._heads(self.q_proj(block), self.num_heads)).transpose(1, 2)
        k = self.k_norm(self._heads(self.k_proj(both), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(both), self.num_kv_heads).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, query_cos, query_sin)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        if isinstance(cache, RowsForward):
            k, v, mask = cache.attend(self.layer_idx, k, v, self.causal, self.sliding_window)
        else:
            k, v, mask = self._keys(k, v, positions[:, -q_len:], positions, cache, attention_mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))

    def _keys(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        query_positions: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftCache | None,
        attention_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One sequence: the keys and values to attend over (the cache's, this call's written in) and the mask."""
        key_positions, valid = positions, None
        if cache is not None:
            k, v, ring_positions = cache.update(self.layer_idx, k, v)
            if ring_positions is not None:  # rows not yet written (-1), or a stale block past this one, drop out
                key_positions = ring_positions[None]
                valid = ((key_positions >= 0) & (key_positions <= positions[:, -1:]))[:, None, None]
            else:  # the committed prefix, then this call's rows: positions 0 .. end-1
                key_positions = torch.arange(k.shape[2], device=k.device)[None]
        mask = attention_mask
        if self.causal or self.sliding_window is not None:
            rule = _window_mask(query_positions, key_positions, self.causal, self.sliding_window)
            rule = rule if valid is None else rule & valid
            mask = rule if mask is None else mask & rule
        return k, v, mask


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
            # x_{t - offset}: shifted down the block, zeros entering at the top (padded, then cut back to the
            # block's length: no tensor of length - offset, on which a compiled step would specialize)
            shifted = grouped if offset == 0 else F.pad(grouped, (0, 0, 0, 0, offset, 0))[:, :length]
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
            self.attention_conv = GroupedDynamicConv(
                config.hidden_size, config.conv_kernel_size, config.conv_group_size
            )
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        # The context goes into K/V as is: it was normed once by hidden_norm, not by input_layernorm.
        x = x + self._sublayer(
            self.input_layernorm(x), self.attention_conv, lambda h: self.self_attn(h, rows, *attn_args)
        )
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
        rows = torch.cat([context, block_embeds.to(context.dtype)], dim=1)
        return self.forward_rows(rows, block_embeds.shape[1], position_ids, cache, attention_mask)

    def forward_rows(
        self,
        rows: torch.Tensor,
        block_size: int,
        position_ids: torch.Tensor,
        cache: DraftCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` with context and block as one tensor: `rows` [b, c+q, H] = fused context, then the last
        `block_size` rows the block embeddings."""
        rows = rows.to(self.fc.weight.dtype)
        x = rows[:, -block_size:]
        cos, sin = self.rope(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, rows, cos, sin, position_ids, cache, attention_mask)
        if cache is not None:
            cache.length += rows.shape[1] - block_size
        return self.norm(x)

    def new_cache(self, capacity: int = 0, block_size: int | None = None) -> DraftCache:
        """An empty context cache for one sequence: room for `capacity` positions, verified in blocks of up to
        `block_size` (default: the config's)."""
        return DraftCache(self.config, capacity, block_size)

    def draft_hidden(
        self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache
    ) -> torch.Tensor:
        """One drafting pass: new context features + block [last token, MASK...] -> hidden of slots 1..q-1.

        `start` is the position of the block's first token; the new context covers positions
        cache.length .. start-1. With `cache.step` set, calls after the first (which reads the whole prompt)
        run compiled.
        """
        ctx_len = features.shape[1]
        positions = torch.arange(start - ctx_len, start + block_ids.shape[1], device=block_ids.device)[None]
        rows = torch.cat([self.fuse_context(features), self.embed(block_ids).to(self.fc.weight.dtype)], dim=1)
        if cache.step is not None and cache.length > 0:
            return cache.step(self, block_ids, rows, positions, cache, notify=cache.notify)[:, 1:]
        return run_drafter(self, block_ids, rows, positions, cache)[:, 1:]

    @torch.no_grad()
    def draft(self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache) -> torch.Tensor:
        """The drafter's logits for slots 1..q-1 (see `draft_hidden`)."""
        return self.logits(self.draft_hidden(features, block_ids, start, cache))

    @torch.no_grad()
    def propose(self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache) -> torch.Tensor:
        """The draft token ids for block slots 1..q-1 [b, q-1]: what the engine verifies, at any temperature."""
        return self.select(self.draft_hidden(features, block_ids, start, cache), block_ids[:, 0])

    def select(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of block slots 1..q-1 [n, q-1, H] and each block's first token [n] -> the proposal [n, q-1]."""
        return self.logits(hidden).argmax(dim=-1)

    def new_rows(self, slots: int, block_size: int | None = None) -> BatchDraftCache:
        """An empty context cache for the rows of a batch: `slots` rows (a joining row's context starts at its
        slot's position 0), verified in blocks of up to `block_size` (default: the config's)."""
        return BatchDraftCache(self.config, slots, block_size or self.config.block_size, self.fc.weight.device)

    def draft_hidden_rows(
        self,
        features: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        starts: Sequence[int],
        cache: BatchDraftCache,
        *,
        sizes: Sequence[int],
        slots: Sequence[int],
    ) -> torch.Tensor:
        """`draft_hidden` for several rows of a batch in one forward of the layers. Row i: its new context
        features[i] [1, c_i, F] (positions starts[i] - c_i .. starts[i] - 1), its block block_ids[i] at
        starts[i], of which the first sizes[i] are real (the rest padding, any id), in slot slots[i] of `cache`.
        -> hidden of block slots 1..width-1 [n, width-1, H]; row i's past sizes[i] - 1 are padding."""
        forward = RowsForward(
            cache, [f.shape[1] for f in features], starts, sizes, slots, block_ids.shape[1], block_ids.device
        )
        context = self.fuse_context(features[0] if len(features) == 1 else torch.cat(list(features), dim=1))
        x = self.embed(block_ids).to(context.dtype)
        cos, sin = self.rope(forward.positions[None], x.dtype)
        for layer in self.layers:
            x = layer(x, context, cos, sin, forward.query_positions, forward, None)
        return self.norm(x)[:, 1:]

    @torch.no_grad()
    def propose_rows(
        self,
        features: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        starts: Sequence[int],
        cache: BatchDraftCache,
        *,
        sizes: Sequence[int],
        slots: Sequence[int],
    ) -> torch.Tensor:
        """`propose` for several rows of a batch (arguments: `draft_hidden_rows`): the layers, the lm_head and the
        proposal once for all rows -> [n, width-1]; row i's proposal is its first sizes[i] - 1 (a proposal reads
        only the slots before it, so the padding changes nothing)."""
        hidden = self.draft_hidden_rows(features, block_ids, starts, cache, sizes=sizes, slots=slots)
        return self.select(hidden, block_ids[:, 0])

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

    def select(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        return self.candidate_selector.greedy_chain(hidden, self.logits(hidden), anchor_ids)


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
