"""Which CPU kernels a test runs: dflash's own (engine.kernels.native; skipped where this CPU cannot run them: they
need AVX2 with FMA and F16C at least) or torch's, for the layers a test then makes."""

from __future__ import annotations

import pytest
import torch

from dflash_cli.engine.kernels import native
from dflash_cli.engine.kernels.quantized import GROUP_SIZE


def use_kernels(ours: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if ours and not native.available():
        pytest.skip(f"dflash's CPU kernels: {native.unusable() or native.unavailable()}")
    if not ours:
        monkeypatch.setattr(native, "available", lambda: False)


def int8_activation_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What dflash's int4 kernel computes: the rows in bf16, quantized per group of 32 to int8 (d = max|x| / 127,
    nearest even), times the dequantized weight, in float64 (the kernel adds in float32: a few ulps apart)."""
    rows = x.to(torch.bfloat16).double().reshape(*x.shape[:-1], -1, GROUP_SIZE)
    amax = rows.abs().amax(-1, keepdim=True).float()
    # (127 / amax as one division: torch's scalar / tensor multiplies by a reciprocal, one rounding more, and
    # rounds ties such as x = amax / 2 the other way)
    scale = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(rows.float() * scale)
    return ((codes.double() * (amax.double() / 127)).reshape(x.shape) @ weight.double().T).float()
