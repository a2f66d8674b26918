"""The DFlash drafter: our own module for the published z-lab checkpoint format.

A stack of Qwen3-style decoder layers with no embedding and no lm_head of its own (it borrows the
target's). Hidden states of a few target layers are concatenated, projected by `fc` and normed by
`hidden_norm` once per call; that fused context is injected into the keys and values of every layer.
Queries come from the block only, and the block attends to the whole context and to itself
bidirectionally: one forward pass proposes a whole block.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash_cli.errors import DflashError

ARCHITECTURE = "DFlashDraftModel"


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
    """The fields of a z-lab `config.json` that the drafter uses; everything else round-trips in `extra`."""

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
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "DrafterConfig":
        def fail(field_name: str, expected: str) -> DflashError:
            return DflashError(
                f"{source}: unsupported drafter config field '{field_name}': expected {expected}",
                fix="use a DFlash drafter in the z-lab checkpoint format (architectures: [\"DFlashDraftModel\"])",
            )

        archs = raw.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise fail("architectures", f'["{ARCHITECTURE}"], got {archs!r}')
        if raw.get("hidden_act", "silu") != "silu":
            raise fail("hidden_act", f'"silu", got {raw.get("hidden_act")!r}')
        dflash = dict(raw.get("dflash_config") or {})
        if dflash.get("causal") or raw.get("causal"):
            raise fail("dflash_config.causal", "false (causal drafters are not supported)")
        block_size = dflash.get("block_size", raw.get("block_size"))
        if not isinstance(block_size, int) or block_size < 1:
            raise fail("block_size", f"a positive integer at top level or in dflash_config, got {block_size!r}")
        if "mask_token_id" not in dflash:
            raise fail("dflash_config.mask_token_id", "the id of the mask token")
        required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
        for name in required:
            if not isinstance(raw.get(name), int):
                raise fail(name, f"an integer, got {raw.get(name)!r}")
        n_layers = raw["num_hidden_layers"]
        n_target = raw.get("num_target_layers")
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            if not isinstance(n_target, int):
                raise fail("num_target_layers", "an integer (needed when dflash_config.target_layer_ids is absent)")
            layer_ids = default_target_layer_ids(n_target, n_layers)
        if dflash.get("use_swa") and "sliding_attention" not in (raw.get("layer_types") or []):
            raise fail("dflash_config.use_swa", "layer_types naming the sliding_attention layers")
        layer_types = list(raw.get("layer_types") or [])
        for kind in layer_types:
            if kind not in ("full_attention", "sliding_attention"):
                raise fail("layer_types", f'"full_attention" or "sliding_attention", got {kind!r}')
        if "sliding_attention" in layer_types and not (raw.get("sliding_window") or dflash.get("swa_window_size")):
            raise fail("sliding_window", "a window size for the sliding_attention layers")
        if layer_types and len(layer_types) != n_layers:
            raise fail("layer_types", f"{n_layers} entries (one per layer), got {len(layer_types)}")
        rope = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        known = {f.name for f in fields(cls)} | {"dflash_config", "rope_parameters", "architectures"}
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            vocab_size=raw["vocab_size"],
            num_target_layers=n_target if isinstance(n_target, int) else max(layer_ids) + 1,
            block_size=block_size,
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(i) for i in layer_ids],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", rope.get("rope_theta", 1e6)),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            layer_types=layer_types,
            sliding_window=raw.get("sliding_window") or dflash.get("swa_window_size"),
            attention_bias=bool(raw.get("attention_bias", False)),
            input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
            output_multiplier=float(dflash.get("output_multiplier", 1.0)),
            final_logit_softcapping=dflash.get("final_logit_softcapping"),
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        """The published format: top-level `block_size` (older readers) and `dflash_config` (newer ones)."""
        dflash: dict[str, Any] = {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids}
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}
        out = {
            **self.extra,
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
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
        if self.rope_scaling:
            out["rope_scaling"] = self.rope_scaling
        return out

    def rope_config(self) -> Qwen3Config:
        """A transformers config carrying only what RoPE needs, so YaRN and friends come from transformers."""
        return Qwen3Config(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
        )


class DraftCache:
    """Per-layer K/V of committed context only (after RoPE and k_norm). Block K/V are never stored."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., :length, :], v[..., :length, :]


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
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None

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
        ctx_len = context.shape[1]
        both = torch.cat([context, block], dim=1)
        q = self.q_norm(self._heads(self.q_proj(block), self.num_heads)).transpose(1, 2)
        k = self.k_norm(self._heads(self.k_proj(both), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(both), self.num_kv_heads).transpose(1, 2)
        # Queries sit at the block's positions, the last q_len rows of cos/sin.
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -q_len:], sin[:, -q_len:])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        if cache is not None:
            past_k, past_v = cache.keys[self.layer_idx], cache.values[self.layer_idx]
            if past_k is not None:
                k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            # Only context rows are committed; the block is re-drafted next step.
            cache.keys[self.layer_idx] = k[:, :, : k.shape[2] - q_len]
            cache.values[self.layer_idx] = v[:, :, : v.shape[2] - q_len]
        mask = attention_mask
        if self.sliding_window is not None:
            past_len = k.shape[2] - ctx_len - q_len
            past_pos = torch.arange(past_len, device=k.device) + (positions[0, 0] - past_len)
            key_pos = torch.cat([past_pos, positions[0]])
            window = (positions[0, -q_len:, None] - key_pos[None, :]) < self.sliding_window
            mask = window[None, None] if mask is None else mask & window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DraftLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(Qwen3Config(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size))

    def forward(self, x: torch.Tensor, context: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        # The context goes into K/V as is: it was normed once by hidden_norm, not by input_layernorm.
        x = x + self.self_attn(self.input_layernorm(x), context, *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        embeds = self.target.get_input_embeddings()(token_ids)
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
        return torch.tanh(logits / cap) * cap if cap else logits

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
        are appended to it. `attention_mask` (bool, True = attend, [b|1, 1, q, keys]) is for training only:
        at inference every block position sees all context and the whole block.
        """
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rope(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, context, cos, sin, position_ids, cache, attention_mask)
        return self.norm(x)

    @torch.no_grad()
    def draft(
        self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache
    ) -> torch.Tensor:
        """One drafting pass: new context features + block [last token, MASK...] -> logits for slots 1..q-1.

        `start` is the position of the block's first token; the new context covers positions
        cache.length .. start-1.
        """
        ctx_len = features.shape[1]
        positions = torch.arange(start - ctx_len, start + block_ids.shape[1], device=block_ids.device)[None]
        hidden = self(self.embed(block_ids), self.fuse_context(features), positions, cache)
        return self.logits(hidden[:, 1:])

    def save_pretrained(self, directory: str | Path) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        config["dtype"] = str(self.fc.weight.dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


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


def target_decoder_layers(target: PreTrainedModel) -> nn.ModuleList:
    """The decoder layer stack of a transformers causal LM (Qwen3, Llama and their kin)."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise DflashError(f"cannot find the decoder layers of {type(target).__name__}", fix="use a Qwen3 or Llama target")
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
    """Load a DFlash drafter (local directory or Hugging Face repo id) bound to a loaded target.

    The drafter runs in the target's compute dtype on the target's device.
    """
    from dflash_cli.hub import resolve_model_dir

    directory = resolve_model_dir(str(path_or_repo_id), revision=revision, what="drafter")
    config = read_drafter_config(directory)
    state = _read_safetensors(directory)
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
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
