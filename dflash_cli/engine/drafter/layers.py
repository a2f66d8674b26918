"""The drafter's layers: attention whose keys and values are the fused target context and the block, the MLP,
DFlash2's grouped dynamic convolutions around both, and DFlash2's candidate selector."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, apply_rotary_pos_emb

from dflash_cli.engine.drafter.cache import DraftCache, SlotsForward, window_mask
from dflash_cli.engine.drafter.config import DrafterConfig


def rotation(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (cos, sin) at `position_ids` from float32 frequencies, scaled, in `dtype`."""
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


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
        cache: DraftCache | SlotsForward | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        bsz, q_len, _ = block.shape
        if isinstance(cache, SlotsForward):  # several rows: `rows` is their new context packed [1, c, H], then blocks
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
        if isinstance(cache, SlotsForward):
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
        cache: DraftCache | SlotsForward | None,
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
            rule = window_mask(query_positions, key_positions, self.causal, self.sliding_window)
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
