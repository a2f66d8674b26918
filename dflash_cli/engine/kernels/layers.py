"""Which matrix-product kernel the linear layers use for the few-row products of decoding, on a CPU.

A decode step multiplies 1 to 16 rows (a plain step, a verify block, a small batch) by every weight matrix, so
its time is the time to read the weights. `F.linear(x, W)` hands MKL `x @ W.T`; for 2-9 rows MKL then takes a
kernel that reads float32 weights far below the machine's bandwidth, while the same product asked as
`W @ x.T` streams them (measured on the 2-core AMD EPYC VM, SmolLM2-135M's 211 products: 2 / 4 / 8 rows in
1.77 / 1.64 / 2.66x the weights' read time against 2.42 / 2.63 / 3.38x; benchmarks/results/history.md). One row is the
same kernel either way (bit-identical), and from 10 rows on `F.linear`'s kernel is the faster (SMALL_ROWS).

bf16 products run on dflash's own kernel (`engine.kernels.native`) where the process has it: it sums every output in
one order whatever the row count, and reads the weights about 2x faster than MKL at one to four rows (the demo's
210 layer products at one row: 4.7 against 10.5 ms; docs/benchmarks.md). Without it, MKL: its one-row bf16
product (a matrix-vector kernel) rounds differently from its product for 2 or more rows, so a bf16 product of one
row runs as two (the row twice) at the same cost; and on a CPU with AMX, MKL takes another kernel from about 48 rows
on, which rounds some rows otherwise (a 1536-input product: 2 of 48 rows, 25 of 300; 2 to 33 rows all agree), so a
product of more than BF16_TILE rows runs in tiles of BF16_TILE. Either way a row's output does not depend on how many rows its step holds (a plain step, a verify block,
a batch, a prefill chunk), which with eager attention makes bf16 decoding batch-invariant (docs/benchmarks.md).
float32 has no such rule here: MKL's float32 kernels round a row by the product's row count at every size.

Attention's products have the same one-row case: a one-query step (a plain decode step) multiplies [1, keys] by
the values, which MKL's one-row kernel rounded otherwise than a block's first row (seen at 2,500 keys, 8 KV heads
x 128). `invariant_eager_attention` (registered with transformers as INVARIANT_EAGER) is the model family's own
eager attention with a one-query call run as two; or, for a bf16 target of the standard families (causal attention
by position, nothing else: `plain_attention`) where the process has dflash's kernels, `torch.ops.dflash.attention`,
the fused kernel the stored step runs: invariant by construction (each query reads its own keys in one order) and
faster than SDPA, so an eager start (before its stored step is built, or `--compile off`) pays nothing for
invariance either (the demo's plain int4 decoding, eager: 0.69x of SDPA's speed before; docs/benchmarks.md).

`use_cpu_products(model)` switches a model's plain CPU `nn.Linear` layers in place, same parameters and state
dict: float32 ones to `SmallRowLinear` (`W @ x.T` for 2 to `SMALL_ROWS` rows; its rounding differs from `F.linear`
in the last bits there, never for one row), bf16 ones to `Bf16Linear`; and a CPU model's eager attention to
INVARIANT_EAGER (the fused kernel's layers marked there, `dflash_attention`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_cli.engine.kernels import native

SMALL_ROWS = 9  # up to this many rows, `W @ x.T`; from 10 rows on F.linear's kernel is the faster (measured)
BF16_TILE = 32  # MKL's bf16 products of 2 to this many rows give a row the same bits (more: tiles of this many)


class SmallRowLinear(nn.Linear):
    """`nn.Linear` that computes products of up to SMALL_ROWS rows as `W @ x.T` (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        # A compiled CPU step packs the weights for inductor's own kernels (engine.compiled.jit), which recognise the
        # product only as F.linear asks it. (Asked first: comparing a traced row count would guard the graph on it.)
        if torch.compiler.is_compiling() or not 1 < rows <= SMALL_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Bf16Linear(nn.Linear):
    """bf16 `nn.Linear` whose rows keep their bits whatever the row count: dflash's kernel where the process has it,
    else MKL with a one-row product computed as two rows (the row twice) and more than BF16_TILE rows in tiles (see
    the module docstring)."""

    dflash_kernel = False  # set by use_cpu_products: whether this process runs dflash's kernel (decided once)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dflash's kernel has no backward: a product a gradient flows through (training reads the target's output
        # head after the decode loop switched it, to measure tau) takes torch's.
        if self.dflash_kernel and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            out = torch.ops.dflash.bf16_linear(x.reshape(-1, self.in_features), self.weight)
            if self.bias is not None:
                out = out + self.bias
            return out.reshape(*x.shape[:-1], self.out_features)
        # Compiled steps leave MKL's product to inductor's kernels (as SmallRowLinear does).
        if torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        if 1 < len(rows) <= BF16_TILE:
            return F.linear(x, self.weight, self.bias)
        tiles = [  # a one-row tile (alone or last) runs as two rows, the row twice
            F.linear(tile.expand(2, -1) if len(tile) == 1 else tile, self.weight, self.bias)[: len(tile)]
            for tile in rows.split(BF16_TILE)
        ]
        return torch.cat(tiles).reshape(*x.shape[:-1], self.out_features)


CPU_PRODUCTS = {torch.float32: SmallRowLinear, torch.bfloat16: Bf16Linear}
INVARIANT_EAGER = "invariant_eager"  # (no "flash" in it: transformers reads any such name as flash attention)
EAGER = ("eager", INVARIANT_EAGER)  # attention that writes its scores out (a prefill runs in chunks of queries)


def one_row_runs_twice(model: nn.Module) -> bool:
    """Whether `model`'s bf16 products need a one-row product computed as two (MKL's, not dflash's kernel)."""
    return any(isinstance(m, Bf16Linear) and not m.dflash_kernel for m in model.modules())


def family_function(module: nn.Module, name: str) -> Any:
    """The function `name` of `module`'s modeling file (a family's own eager attention, rotary embedding), or None."""
    return getattr(sys.modules[type(module).__module__], name, None)


def _family_eager(module: nn.Module) -> Any:
    """The eager attention function of `module`'s family (attention sinks, softcapping and all)."""
    return family_function(module, "eager_attention_forward")


STANDARD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # attention is softmax(q.k * scaling) over causal keys


def plain_attention(config: Any) -> str | None:
    """Why a model of `config` has attention other than plain causal attention by position in every layer (None: it
    has that, which `torch.ops.dflash.attention` and the standard stored step compute)."""
    if config.model_type not in STANDARD_FAMILIES:
        return f"{config.model_type} is not one of the standard families ({', '.join(STANDARD_FAMILIES)})"
    kinds = set(getattr(config, "layer_types", None) or ())
    if not kinds:
        kinds = {"sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"}
    if kinds != {"full_attention"}:
        return f"layers of kind {', '.join(sorted(kinds - {'full_attention'}))}"
    return None


def invariant_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """dflash's fused attention where `module` is marked for it (`use_cpu_products`) and the call is an inference
    call in bf16 with each query's position given; else the family's eager attention, a one-query call run as two
    (the query twice), keeping the first. The fused kernel reads each query's keys up to its position, which is the
    engine's mask (causal by position: no padding); its result has the shape the family's eager function returns."""
    positions = kwargs.get("position_ids")
    if (
        getattr(module, "dflash_attention", False)
        and positions is not None
        and query.dtype == torch.bfloat16
        and not module.training
        and not (torch.is_grad_enabled() and query.requires_grad)
    ):
        batch, heads, q, dim = query.shape
        rows = query.reshape(batch, key.shape[1], heads // key.shape[1] * q, dim)  # a KV head's query heads, folded
        scaling = kwargs.get("scaling", module.scaling)
        out = torch.ops.dflash.attention(rows, key, value, positions.expand(batch, q), scaling)
        return out.reshape(batch, heads, q, dim).transpose(1, 2).contiguous(), None
    eager = _family_eager(module)
    if query.shape[2] != 1:
        return eager(module, query, key, value, attention_mask, *args, **kwargs)
    twice = query.expand(-1, -1, 2, -1)
    mask = attention_mask.expand(-1, -1, 2, -1) if attention_mask is not None else None
    out, weights = eager(module, twice, key, value, mask, *args, **kwargs)
    return out[:, :1], weights[:, :, :1] if weights is not None else None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(INVARIANT_EAGER, invariant_eager_attention)
    AttentionMaskInterface.register(INVARIANT_EAGER, eager_mask)


_register()


def use_cpu_products(model: nn.Module) -> int:
    """Switch `model`'s plain float32 and bf16 CPU linears to `CPU_PRODUCTS`' layers in place (returns how many),
    and its eager attention to INVARIANT_EAGER. Quantized or other linear subclasses, other dtypes and devices keep
    theirs (their kernels differ)."""
    switched = 0
    config = getattr(model, "config", None)
    if (
        config is not None
        and getattr(config, "_attn_implementation", None) == "eager"
        and next(model.parameters()).device.type == "cpu"
        and all(_family_eager(m) is not None for m in model.modules() if type(m).__name__.endswith("Attention"))
    ):
        model.set_attn_implementation(INVARIANT_EAGER)
        fused = native.available() and plain_attention(config) is None
        for module in model.modules():  # (decided here, outside any traced graph, as Bf16Linear's kernel is)
            if type(module).__name__.endswith("Attention"):
                module.dflash_attention = fused and getattr(module, "head_dim", 0) % 32 == 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is nn.Linear and weight is not None and weight.device.type == "cpu":
            product = CPU_PRODUCTS.get(weight.dtype)
            if product is not None:
                module.__class__ = product
                switched += 1
        if type(module) is Bf16Linear:  # decided here, outside any traced graph (dynamo would trace the build)
            module.dflash_kernel = native.available()
    return switched
