"""4-bit and 8-bit weight-only linears for the CPU, on torch's own packed kernels.

A decode step on a CPU reads every weight once per step, so its time is the weights' bytes over the memory
bandwidth; 4-bit weights read a quarter of bf16's. torch ships the kernels llama.cpp-style weight-only layouts
need: `_weight_int4pack_mm_for_cpu` (int4, asymmetric, one scale and zero per group of 32 inputs, weights packed
once for the machine's SIMD width) and `_weight_int8pack_mm` (int8, one scale per output channel). Measured on
the 2-core AVX512-BF16 VM against MKL's bf16 product (benchmarks/results/history.md): a 576x1536 product at one
row 82 / 50 / 51 us (bf16 / int8 / int4), the 576x49152 lm_head 5.9 / 3.2 / 1.5 ms; both kernels cost time in proportion
to the rows, so verify blocks of 8-16 rows are slower than bf16's. torchao's CPU layouts call the same two kernels;
we use them directly rather than add the dependency. Both want bf16 activations: with float32 ones they run
10-30x slower than the dense product, so a quantized target computes in bf16 (planning enforces it).

`Int4Linear.from_groups` takes the (codes, scale, min) of formats that store w = q * scale + min per group of 32,
GGUF's Q4_1 among them, without a detour through float weights; `Int4Linear.quantize` makes those groups from a
float weight by min-max (the same rule Q4_1 uses).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

GROUP_SIZE = 32  # inputs per int4 scale/zero group (Q4_1's block)
KINDS = ("int4", "int8")
_INNER_K_TILES = 2  # the CPU packing's tile parameter (any of 2, 4, 8 packs the same; 2 allows K % 64 == 0)
# Weight elements quantized at once: float32 temporaries of 1 MiB however large the weight (a 248k-row head's would
# be 5 GB whole), so loading.streaming's peak stays the quantized weights and the tensor being read.
QUANTIZE_SLICE_ELEMENTS = 2**18


class Int4Linear(nn.Module):
    """y = x @ dequant(W).T + b with W held as packed int4 codes and per-group (scale, zero) in the compute dtype."""

    weight_buffers = ("packed", "scales_zeros")  # what its weight is held in (setup.sizes counts them)

    def __init__(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)  # [in/GROUP_SIZE, out, 2]: w = (q - 8) * scale + zero
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_groups(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """From codes [out, in] in 0..15 and per-group scales and mins [out, in/GROUP_SIZE] (w = q * scale + min)."""
        out_features, in_features = codes.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), _INNER_K_TILES)
        # The kernel's rule is w = (q - 8) * scale + zero, so zero = min + 8 * scale.
        zeros = mins.float() + 8 * scales.float()
        scales_zeros = torch.stack([scales.float(), zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls(packed, scales_zeros, out_features, in_features, None if bias is None else bias.to(dtype))

    @classmethod
    def quantize(cls, linear: nn.Linear, dtype: torch.dtype) -> Int4Linear:
        """`from_weight` of a float linear's weight and bias."""
        bias = None if linear.bias is None else linear.bias.detach()
        return cls.from_weight(linear.weight.detach(), dtype, bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> Int4Linear:
        """Min-max int4 per group of GROUP_SIZE inputs of a float weight [out, in]: the group's min maps to 0 and
        its max to 15. Rows are quantized a slice at a time (each group is within a row, so the codes are those of
        the whole), so the float32 temporaries stay small beside a large weight."""
        out_features, in_features = weight.shape
        codes = torch.empty(out_features, in_features, dtype=torch.int32)
        scales = torch.empty(out_features, in_features // GROUP_SIZE, dtype=torch.float32)
        low = torch.empty_like(scales)
        for rows in _row_slices(weight):
            groups = weight[rows].float().reshape(-1, in_features // GROUP_SIZE, GROUP_SIZE)
            low[rows], high = groups.amin(dim=-1), groups.amax(dim=-1)
            scales[rows] = ((high - low[rows]) / 15).clamp(min=1e-12)
            quantized = ((groups - low[rows][..., None]) / scales[rows][..., None]).round().clamp(0, 15)
            codes[rows] = quantized.reshape(-1, in_features)
        return cls.from_groups(codes, scales, low, dtype, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float weight [out, in] this layer multiplies by (for tests and loss reports)."""
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scales_zeros).T

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {GROUP_SIZE}"


class Int8Linear(nn.Module):
    """y = x @ (W_int8 * scale).T + b, symmetric int8 with one scale per output channel."""

    weight_buffers = ("weight_int8", "scales")

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_int8", weight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def quantize(cls, linear: nn.Linear, dtype: torch.dtype) -> Int8Linear:
        bias = None if linear.bias is None else linear.bias.detach()
        return cls.from_weight(linear.weight.detach(), dtype, bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> Int8Linear:
        """Symmetric int8 per output channel of a float weight [out, in], a slice of rows at a time (a head is
        large, and each row's scale is its own)."""
        codes = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(weight.shape[0], dtype=torch.float32)
        for rows in _row_slices(weight):
            part = weight[rows].float()
            scales[rows] = (part.abs().amax(dim=1) / 127).clamp(min=1e-12)
            codes[rows] = (part / scales[rows][:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return cls(codes, scales.to(dtype), None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def _row_slices(weight: torch.Tensor) -> list[slice]:
    """Slices of `weight`'s rows of about QUANTIZE_SLICE_ELEMENTS elements each."""
    step = max(1, QUANTIZE_SLICE_ELEMENTS // max(1, weight.shape[1]))
    return [slice(start, start + step) for start in range(0, weight.shape[0], step)]


def quantizable(linear: nn.Module, kind: str) -> bool:
    """Whether the kernel of `kind` can take this layer: a plain CPU `nn.Linear` (or one on the meta device, not
    read yet: its size is counted, or its weight is about to be read); int4's packing also wants the outputs in
    multiples of 16 and the inputs in whole groups of 64."""
    if type(linear) is not nn.Linear or linear.weight.device.type not in ("cpu", "meta"):
        return False
    return kind != "int4" or int4_packable(*linear.weight.shape)


def int4_packable(out_features: int, in_features: int) -> bool:
    """Whether the int4 packing takes a weight of this shape: outputs in multiples of 16, inputs in whole groups of 64."""
    return in_features % (GROUP_SIZE * _INNER_K_TILES) == 0 and out_features % 16 == 0


def quantize_linears(model: nn.Module, kind: str, dtype: torch.dtype, skip: Iterable[nn.Module] = ()) -> int:
    """Replace `model`'s quantizable linears (all but those in `skip`) by `kind` ("int4" | "int8") layers that
    compute in `dtype`, in place; returns how many. Tied weights (an lm_head sharing the embedding) are quantized
    as the head's own copy: the embedding keeps its float table."""
    if kind not in KINDS:
        raise ValueError(f"unknown weight-only quantization {kind!r}; use one of {KINDS}")
    layer = Int4Linear if kind == "int4" else Int8Linear
    skipped = {id(m) for m in skip}
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) not in skipped and quantizable(child, kind):
                setattr(parent, name, layer.quantize(child, dtype))
                replaced += 1
    return replaced


def quantize_target(target: nn.Module, kind: str, dtype: torch.dtype) -> int:
    """`quantize_linears` for a transformers causal LM, its output head in int8 whatever `kind`: GGUF's 4-bit
    files keep their output matrix at 6-8 bits (the demo's is Q8_0), and a 4-bit head is where 4 bits cost the
    most quality (benchmarks/results/history.md). Returns how many linears were replaced."""
    head = target.get_output_embeddings()
    replaced = quantize_linears(target, kind, dtype, skip=[head] if head is not None else [])
    if head is not None and quantizable(head, "int8"):
        target.set_output_embeddings(Int8Linear.quantize(head, dtype))
        replaced += 1
    return replaced
