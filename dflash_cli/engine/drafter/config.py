"""The drafter's configuration, read from the published z-lab checkpoint formats (the modules: `layers`, `model`).

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

"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, fields
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dflash_cli.errors import DflashError
from dflash_cli.protocol.drafters import DEFAULT_BLOCK_SIZE, DFLASH_FIELDS, dflash_field

ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
ARCHITECTURES = (ARCHITECTURE, DFLASH2_ARCHITECTURE)
LAYER_TYPES = ("full_attention", "sliding_attention")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


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
    # Our extension (dflash_config.draft_vocab_size, read there only: EAGLE-3 configs have a top-level key of that
    # name): the drafter proposes only these many target tokens, listed beside its weights
    # (protocol.drafters.DRAFT_VOCAB_FILE); its loss is trained over them alone (training/objective.py). None: all.
    draft_vocab_size: int | None = None
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
    def for_target(
        cls,
        target_config: Any,
        *,
        layers: int,
        block_size: int,
        mask_token_id: int,
        feature_layers: int | None = None,
        **fields: Any,
    ) -> DrafterConfig:
        """A new drafter's config shaped for a target (its transformers text config): the target's hidden size,
        vocabulary, layer count, context length and, unless `fields` say otherwise, its attention heads and MLP
        width; `feature_layers` of the target's layers, evenly spaced, feed it (default: one per drafter layer)."""
        hidden, n_target = target_config.hidden_size, target_config.num_hidden_layers
        # (read only where `fields` does not say: targets whose heads differ per layer, such as Gemma 4, warn on a
        # global read of their head counts)
        defaults: dict[str, Any] = {
            "intermediate_size": lambda: getattr(target_config, "intermediate_size", None),
            "num_attention_heads": lambda: target_config.num_attention_heads,
            "num_key_value_heads": lambda: (
                getattr(target_config, "num_key_value_heads", None) or target_config.num_attention_heads
            ),
            "head_dim": lambda: getattr(target_config, "head_dim", None) or hidden // target_config.num_attention_heads,
            "vocab_size": lambda: target_config.vocab_size,
            "max_position_embeddings": lambda: target_config.max_position_embeddings,
            "target_layer_ids": lambda: default_target_layer_ids(n_target, min(feature_layers or layers, n_target)),
        }
        shaped = {name: make() for name, make in defaults.items() if name not in fields}
        return cls(
            hidden_size=hidden,
            **shaped,
            **fields,
            num_hidden_layers=layers,
            num_target_layers=n_target,
            block_size=block_size,
            mask_token_id=mask_token_id,
        )

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

        def integer(name: str, default: Any = None, minimum: int = 1) -> int:
            got = dflash_field(raw, name, default)
            if not isinstance(got, int) or isinstance(got, bool) or got < minimum:
                raise fail(where(name), f"an integer >= {minimum} (in dflash_config or at the top level), got {got!r}")
            return got

        def number(name: str, default: Any) -> float | None:
            got = dflash_field(raw, name, default)
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
        mask_token_id = dflash_field(raw, "mask_token_id")
        if not isinstance(mask_token_id, int) or isinstance(mask_token_id, bool) or mask_token_id < 0:
            raise fail(
                "dflash_config.mask_token_id",
                f"the id of the mask token (in dflash_config or at the top level), got {mask_token_id!r}",
            )
        layer_ids = dflash_field(raw, "target_layer_ids")
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

        draft_vocab_size = dflash.get("draft_vocab_size")
        if draft_vocab_size is not None and (
            not isinstance(draft_vocab_size, int)
            or isinstance(draft_vocab_size, bool)
            or not 1 <= draft_vocab_size <= raw["vocab_size"]
        ):
            raise fail(
                where("draft_vocab_size"),
                f"an integer from 1 to vocab_size {raw['vocab_size']}, got {draft_vocab_size!r}",
            )

        rope = dict(hf.rope_parameters or {})
        rope_theta = float(rope.pop("rope_theta", 1e6))
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        consumed = set(DFLASH_FIELDS) | (set(DFLASH2_FIELDS) if dflash2 else set())
        known = (
            ({f.name for f in fields(cls)} - {"draft_vocab_size"})  # (read in dflash_config only)
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
            draft_vocab_size=draft_vocab_size,
            nested="block_size" in dflash,
            extra={k: v for k, v in raw.items() if k not in known},
            dflash_extra={k: v for k, v in dflash.items() if k not in consumed | {"draft_vocab_size"}},
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
        if self.draft_vocab_size is not None:
            dflash["draft_vocab_size"] = self.draft_vocab_size
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
