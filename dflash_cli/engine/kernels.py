"""Which matrix-product kernel the linear layers use for the few-row products of decoding, on a CPU.

A decode step multiplies 1 to 16 rows (a plain step, a verify block, a small batch) by every weight matrix, so
its time is the time to read the weights. `F.linear(x, W)` hands MKL `x @ W.T`; for 2-9 rows MKL then takes a
kernel that reads float32 weights far below the machine's bandwidth, while the same product asked as
`W @ x.T` streams them (measured on the 2-core AMD EPYC VM, SmolLM2-135M's 211 products: 2 / 4 / 8 rows in
1.77 / 1.64 / 2.66x the weights' read time against 2.42 / 2.63 / 3.38x; docs/benchmarks.md). One row is the
same kernel either way (bit-identical), and from 10 rows on `F.linear`'s kernel is the faster (SMALL_ROWS).

`use_small_row_products(model)` switches a model's float32 `nn.Linear` layers on the CPU to `SmallRowLinear`:
same parameters and state dict, `W @ x.T` for up to `SMALL_ROWS` rows. Rounding differs from `F.linear` in the
last bits for 2-9 rows (as any other kernel choice would), never for one row: a plain step is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_ROWS = 9  # up to this many rows, `W @ x.T`; from 10 rows on F.linear's kernel is the faster (measured)


class SmallRowLinear(nn.Linear):
    """`nn.Linear` that computes products of up to SMALL_ROWS rows as `W @ x.T` (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        # A compiled CPU step packs the weights for inductor's own kernels (engine.compiled), which recognise the
        # product only as F.linear asks it. (Asked first: comparing a traced row count would guard the graph on it.)
        if torch.compiler.is_compiling() or not 1 < rows <= SMALL_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def use_small_row_products(model: nn.Module) -> int:
    """Switch `model`'s plain float32 CPU linears to `SmallRowLinear` in place; returns how many. Quantized or
    other linear subclasses, other dtypes and devices keep theirs (their kernels differ)."""
    switched = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            type(module) is nn.Linear
            and weight is not None
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
        ):
            module.__class__ = SmallRowLinear
            switched += 1
    return switched
