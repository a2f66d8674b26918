"""The target's forward for the standard decoder families (Llama, Mistral, Qwen2, Qwen3), over rows of an
`AttentionState`'s K/V buffers, in the form `torch.export` takes: tensors in, tensors out. engine/target/compiled_step.py
exports and compiles it once (AOTInductor) so that a CPU step runs without the Python and dispatch cost of the
eager forward: hundreds of small ops a step, half of a 2-core CPU's plain step for the demo target.

It calls the model's own modules (its linears, quantized or not, norms, rotary embedding, MLP) and its family's own
rotary function, in the order transformers' eager forward calls them, with three changes that leave each row's
numbers as they are:

- grouped-query attention folds the query heads of a KV head into the rows of one product (no repeated K/V), or
  of one call of dflash's attention kernel (bf16 with `engine.kernels.native`); on the product, one query head per
  KV head runs its rows twice, as `engine.kernels.layers` runs a one-row bf16 product;
- each query's position comes in (`positions`, per row): the rotation, where its K/V is written, and which keys
  it sees follow from it, so rows of different lengths run together (a batch's verify step) and each row's
  numbers are those of the row alone;
- where bf16 products run on MKL (`engine.kernels.layers.Bf16Linear` without dflash's kernel), the block's last row runs
  twice, so that none has one row (MKL's one-row bf16 product rounds otherwise; in a traced graph the layer cannot
  branch on the row count).

The final norm's output and every layer's output come back; the caller applies the output head to the rows it
needs (a prefill chunk's last) and copies the drafter's feature layers, so one package serves every drafter.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from dflash_cli.engine.kernels import native
from dflash_cli.engine.kernels.layers import family_function, one_row_runs_twice, plain_attention, use_cpu_products
from dflash_cli.engine.target.base import compute_dtype

# Rope types whose frequencies change with the sequence length at run time (not a constant of the graph).
_DYNAMIC_ROPE = ("dynamic", "longrope")


def unsupported(target: PreTrainedModel) -> str | None:
    """Why `target` has no standard step (None: it has one)."""
    config = target.config
    why = plain_attention(config)
    if why is not None:
        return why
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in _DYNAMIC_ROPE:
        return f"{rope} rope (its frequencies depend on the length)"
    if target.get_input_embeddings().weight.device.type != "cpu":
        return "not on a CPU"
    return None


class StandardStep(nn.Module):
    """`(token_ids [R, q], positions [R, q], span [end], keys, values) -> (normed hidden [R, q, H], each layer's
    output [R, q, H])`: a block of q tokens in each of R rows, token (r, i) at position positions[r, i], whose K/V
    it writes into `keys[l]` / `values[l]` ([R, kv heads, capacity, head dim] per layer) before each query attends
    to its row's positions up to its own. `span` carries `end`, past every row's last position, as a shape (an
    exported graph keeps shapes symbolic; an int argument would be a constant): the keys the eager products read."""

    def __init__(self, target: PreTrainedModel) -> None:
        super().__init__()
        why = unsupported(target)
        if why is not None:
            raise ValueError(f"no standard step for {type(target).__name__}: {why}")
        use_cpu_products(target)  # the products the engine runs (engine.kernels.layers), traced as they will run
        self.target = target
        config = target.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = target.model.layers[0].self_attn.head_dim
        self.fold = self.heads // self.kv_heads  # query heads per KV head
        self.copies = max(self.fold, 2)  # rows per KV head and query: a single row runs twice
        self.extra = int(one_row_runs_twice(target))  # rows the products add
        # bf16 attention on dflash's kernel (engine.kernels.native) where the process has it: every row's queries over
        # its own keys in one call, at the points where the graph below rounds (its sums and exp are its own), without
        # copying the keys for a product
        self.fused_attention = (
            native.available() and compute_dtype(target) == torch.bfloat16 and self.head_dim % 32 == 0
        )

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        span: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        base = self.target.model
        q, end = token_ids.shape[1], span.shape[0]
        x = base.embed_tokens(token_ids)
        if self.extra:
            x = torch.cat([x, x[:, -1:]], dim=1)
        cos, sin = base.rotary_emb(x, positions)
        future = None
        if not self.fused_attention:  # [rows, folded queries, end]: the keys after each query
            future = torch.arange(end, device=x.device)[None, None, :] > positions[:, :, None]
            future = future.repeat(1, self.copies, 1)[:, None]  # the rows of a folded query: (head in group, query)
        outputs = []
        for layer, layer_keys, layer_values in zip(base.layers, keys, values):
            x = self._layer(layer, x, cos, sin, future, positions, layer_keys, layer_values, end)
            outputs.append(x[:, :q])
        return base.norm(x)[:, :q], outputs

    def _layer(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        future: torch.Tensor | None,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        end: int | torch.SymInt,
    ) -> torch.Tensor:
        attention = layer.self_attn
        batch, q = x.shape[0], x.shape[1] - self.extra
        h = layer.input_layernorm(x)
        query = attention.q_proj(h)[:, :q].reshape(batch, q, self.heads, self.head_dim)
        key = attention.k_proj(h)[:, :q].reshape(batch, q, self.kv_heads, self.head_dim)
        value = attention.v_proj(h)[:, :q].reshape(batch, q, self.kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(attention, "q_norm"):  # Qwen3: per-head norms before the rotation
            query, key = attention.q_norm(query), attention.k_norm(key)
        query, key = family_function(attention, "apply_rotary_pos_emb")(
            query.transpose(1, 2), key.transpose(1, 2), cos, sin
        )
        # written in place at each query's position (index_put_: inductor writes it into the buffer; a scatter_
        # copied the whole buffer every step)
        slots = (
            torch.arange(batch, device=x.device)[:, None, None],
            torch.arange(self.kv_heads, device=x.device)[None, :, None],
            positions[:, None, :],
        )
        keys.index_put_(slots, key)
        values.index_put_(slots, value)
        rows = query.reshape(batch, self.kv_heads, self.fold * q, self.head_dim)
        if self.fused_attention:
            out = torch.ops.dflash.attention(rows, keys, values, positions, attention.scaling)
            return self._finish(layer, x, out, q)
        if self.copies != self.fold:
            rows = rows.repeat(1, 1, 2, 1)
        scores = torch.matmul(rows, keys[:, :, :end].transpose(2, 3)) * attention.scaling
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return self._finish(layer, x, torch.matmul(weights, values[:, :, :end])[:, :, : self.fold * q], q)

    def _finish(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor, q: int | torch.SymInt) -> torch.Tensor:
        """The layer after its attention's rows `out` [rows, kv heads, fold * q, head dim]: output projection, MLP."""
        attention = layer.self_attn
        batch = x.shape[0]
        out = out.reshape(batch, self.heads, q, self.head_dim).transpose(1, 2)
        out = out.reshape(batch, q, self.heads * self.head_dim)
        if self.extra:
            out = torch.cat([out, out[:, -1:]], dim=1)
        x = x + attention.o_proj(out)
        return x + layer.mlp(layer.post_attention_layernorm(x))
