"""4-bit and 8-bit weight-only linears for the CPU.

A decode step on a CPU reads every weight once per step, so its time is the weights' bytes over the memory
bandwidth; 4-bit weights read a quarter of bf16's, if the kernel keeps up. int4 runs on dflash's own kernel where
the process has it (engine.kernels.native's `int4_linear`: the rows quantized to int8 per group of 32, as
llama.cpp's Q4_1 x Q8_1 product, and multiplied by VPDPBUSD, 16 outputs a vector; each row alone, so a verify
block's row is that row decoded alone); elsewhere on torch's `_weight_int4pack_mm_for_cpu` (bf16 activations).
Measured on the 2-core Intel AMX VM, one thread (history.md): a 576x1536 product at one row 16 against torch's 71
us, 2.6-3.6x at 4-16 rows; the 49152x576 head 2.3x. int8 (the output head's format) runs on torch's
`_weight_int8pack_mm` (one scale per output channel). Both torch kernels want bf16 activations (with float32 ones
they run 10-30x slower than the dense product), so a quantized target computes in bf16 (planning enforces it).

`Int4Linear.from_groups` takes the (codes, scale, min) of formats that store w = q * scale + min per group of 32,
GGUF's Q4_1 among them, without a detour through float weights; `Int4Linear.quantize` makes those groups from a
float weight by min-max (the same rule Q4_1 uses).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from dflash_cli.engine.kernels.memory import give_back_freed_memory

if TYPE_CHECKING:
    from typing import Self  # (3.11+: annotations only, so 3.10 imports this module)

GROUP_SIZE = 32  # inputs per int4 scale/zero group (Q4_1's block)
KINDS = ("int4", "int8")
_INNER_K_TILES = 2  # the CPU packing's tile parameter (any of 2, 4, 8 packs the same; 2 allows K % 64 == 0)
# Weight elements quantized at once: float32 temporaries of 1 MiB however large the weight (a 248k-row head's would
# be 5 GB whole), so loading.streaming's peak stays the quantized weights and the tensor being read.
QUANTIZE_SLICE_ELEMENTS = 2**18


class _WeightOnlyLinear(nn.Module):
    """What the int4 and int8 layers share: the weight held in `buffers` (dflash's layout where they hold "codes",
    `native`, else torch's), a float bias, and y = product(x rows) + b. Subclasses make the layouts and the
    product."""

    def __init__(
        self, buffers: dict[str, torch.Tensor], out_features: int, in_features: int, bias: torch.Tensor | None
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.native = "codes" in buffers
        self.weight_buffers = tuple(buffers)  # what its weight is held in (setup.sizes counts them)
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def quantize(cls, linear: nn.Linear, dtype: torch.dtype) -> Self:
        """`from_weight` of a float linear's weight and bias."""
        bias = None if linear.bias is None else linear.bias.detach()
        return cls.from_weight(linear.weight.detach(), dtype, bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> Self:
        raise NotImplementedError

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in] -> [n, out], without the bias."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x.reshape(-1, self.in_features))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def concatenate(cls, layers: list[Self]) -> Self:
        """One layer whose outputs are `layers`' outputs in order (dflash's layouts: each layer's outputs are whole
        blocks of 16 lanes, so its buffers join along their first dimension)."""
        buffers = {name: torch.cat([getattr(layer, name) for layer in layers]) for name in layers[0].weight_buffers}
        bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
        return cls(buffers, sum(layer.out_features for layer in layers), layers[0].in_features, bias)


class Int4Linear(_WeightOnlyLinear):
    """y = x @ dequant(W).T + b with W held as int4 codes and per-group (scale, min): w = q * scale + min.

    Two layouts, chosen when the layer is made: where dflash's CPU kernels run (engine.kernels.native), theirs
    (`int4_linear`: int8 activations, VPDPBUSD, outputs in blocks of 16 lanes; scales and mins in float16, as Q4_1
    stores them; `native`); else torch's packed int4 kernel (bf16 activations; scales and zeros in the compute
    dtype). Each layout's rounding is its own: a process runs one (the stored steps are keyed by it)."""

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
        from dflash_cli.engine.kernels import native

        out_features, in_features = codes.shape
        bias = None if bias is None else bias.to(dtype)
        if native.available():
            return cls(_native_layout(codes, scales, mins), out_features, in_features, bias)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), _INNER_K_TILES)
        # The kernel's rule is w = (q - 8) * scale + zero, so zero = min + 8 * scale.
        zeros = mins.float() + 8 * scales.float()
        scales_zeros = torch.stack([scales.float(), zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls({"packed": packed, "scales_zeros": scales_zeros}, out_features, in_features, bias)

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

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.native:
            return torch.ops.dflash.int4_linear(
                rows.to(torch.bfloat16), self.codes, self.scales, self.mins, self.out_features
            ).to(rows.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_zeros)

    def dequantized(self) -> torch.Tensor:
        """The float weight [out, in] this layer multiplies by (for tests and loss reports)."""
        if self.native:
            lanes = self.codes.shape[0] * 16
            low, high = (self.codes & 15), (self.codes >> 4)  # [blocks, groups, 4, 16 lanes, 4]
            codes = torch.cat([low, high], dim=2).permute(0, 3, 1, 2, 4).reshape(lanes, self.in_features)
            scales = self.scales.transpose(1, 2).reshape(lanes, -1).float().repeat_interleave(GROUP_SIZE, dim=1)
            mins = self.mins.transpose(1, 2).reshape(lanes, -1).float().repeat_interleave(GROUP_SIZE, dim=1)
            return (codes.float() * scales + mins)[: self.out_features]
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scales_zeros).T

    def extra_repr(self) -> str:
        kernel = "dflash's int8-activation kernel" if self.native else "torch's kernel"
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {GROUP_SIZE}, {kernel}"


def _native_layout(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> dict[str, torch.Tensor]:
    """dflash's int4_linear layout (native.cpp): outputs in blocks of 16 (zero-padded), per block and group of 32
    inputs four vectors of 16 lanes x 4 bytes, byte q of lane j in vector i holding output j's codes of inputs 4i+q
    (low nibble) and 16+4i+q (high nibble); scales and mins [blocks, groups, 16] float16."""
    out_features, in_features = codes.shape
    groups, blocks = in_features // GROUP_SIZE, -(-out_features // 16)
    padded = torch.zeros(blocks * 16, groups, GROUP_SIZE, dtype=torch.uint8)
    padded[:out_features] = codes.reshape(out_features, groups, GROUP_SIZE).to(torch.uint8)
    lanes = padded.reshape(blocks, 16, groups, GROUP_SIZE)
    low, high = lanes[..., :16].reshape(blocks, 16, groups, 4, 4), lanes[..., 16:].reshape(blocks, 16, groups, 4, 4)
    packed = (low | (high << 4)).permute(0, 2, 3, 1, 4).contiguous()

    def by_lane(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(blocks * 16, groups, dtype=torch.float16)
        out[:out_features] = values.to(torch.float16)
        return out.reshape(blocks, 16, groups).transpose(1, 2).contiguous()

    return {"codes": packed, "scales": by_lane(scales), "mins": by_lane(mins)}


class Int8Linear(_WeightOnlyLinear):
    """y = x @ (W_int8 * scale).T + b, symmetric int8 with one scale per output channel, or per output and group of
    32 inputs as a GGUF's Q8_0 stores them (`from_groups`, dflash's kernel only). Two layouts, as `Int4Linear`'s:
    dflash's `int8_linear` (int8 activations) where the process runs dflash's kernels, else torch's
    `_weight_int8pack_mm` (bf16 activations). Per-channel scales are the compute dtype's either way."""

    @classmethod
    def from_weight(cls, weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> Int8Linear:
        """Symmetric int8 per output channel of a float weight [out, in], a slice of rows at a time (a head is
        large, and each row's scale is its own)."""
        from dflash_cli.engine.kernels import native

        out_features, in_features = weight.shape
        codes = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(out_features, dtype=torch.float32)
        for rows in _row_slices(weight):
            part = weight[rows].float()
            scales[rows] = (part.abs().amax(dim=1) / 127).clamp(min=1e-12)
            codes[rows] = (part / scales[rows][:, None]).round_().clamp_(-127, 127).to(torch.int8)
        scales, bias = scales.to(dtype), None if bias is None else bias.to(dtype)
        if native.available() and in_features % GROUP_SIZE == 0 and out_features % 16 == 0:  # (no padding to hold)
            return cls(_native_int8_layout(codes, scales), out_features, in_features, bias)
        return cls({"weight_int8": codes, "scales": scales}, out_features, in_features, bias)

    @classmethod
    def from_groups(
        cls, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None
    ) -> Int8Linear:
        """From codes [out, in] in -127..127 and a scale per output and group of GROUP_SIZE inputs [out, in /
        GROUP_SIZE] (w = q * scale: GGUF's Q8_0), kept as they are where dflash's kernel runs (its scales float16,
        as Q8_0 stores them); elsewhere the weight they hold, quantized per channel (`from_weight`)."""
        from dflash_cli.engine.kernels import native

        out_features, in_features = codes.shape
        if not (native.available() and in_features % GROUP_SIZE == 0):
            weight = codes.float().view(out_features, -1, GROUP_SIZE) * scales.float()[..., None]
            return cls.from_weight(weight.view(out_features, in_features), dtype, bias)
        layout = _native_int8_layout(codes, scales.to(torch.float16))
        return cls(layout, out_features, in_features, None if bias is None else bias.to(dtype))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.native:
            return torch.ops.dflash.int8_linear(
                rows.to(torch.bfloat16), self.codes, self.lane_scales, self.out_features
            ).to(rows.dtype)
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)

    def rows(self, index: torch.Tensor) -> Int8Linear:
        """A layer of the outputs `index` alone, their codes and scales as held (each output is its own dot
        product in either kernel, so it gives exactly what this layer gives for them)."""
        if not self.native:
            layout = {"weight_int8": self.weight_int8[index], "scales": self.scales[index]}
        else:  # codes [blocks, in / 4, 16 lanes, 4] of the weights + 128; scales [blocks, (groups,) 16]
            lanes = self.codes.shape[0] * 16
            codes = self.codes.permute(0, 2, 1, 3).reshape(lanes, self.in_features).to(torch.int16) - 128
            grouped = self.lane_scales.dim() == 3
            scales = self.lane_scales.transpose(1, 2) if grouped else self.lane_scales
            layout = _native_int8_layout(codes[index].to(torch.int8), scales.reshape(lanes, -1).squeeze(1)[index])
        bias = None if self.bias is None else self.bias.detach()[index]
        return Int8Linear(layout, len(index), self.in_features, bias)

    def dequantized(self) -> torch.Tensor:
        if self.native:  # codes [blocks, in / 4, 16 lanes, 4]
            lanes = self.codes.shape[0] * 16
            weight = self.codes.permute(0, 2, 1, 3).reshape(lanes, self.in_features).float() - 128
            if self.lane_scales.dim() == 3:  # a scale per group: [blocks, groups, 16]
                scales = self.lane_scales.float().transpose(1, 2).reshape(lanes, -1, 1)
                return (weight.view(lanes, -1, GROUP_SIZE) * scales).view(lanes, -1)[: self.out_features]
            return (weight * self.lane_scales.reshape(lanes, 1))[: self.out_features]
        return self.weight_int8.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        kernel = "dflash's int8-activation kernel" if self.native else "torch's kernel"
        scales = "per group of 32" if self.native and self.lane_scales.dim() == 3 else "per channel"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 {scales}, {kernel}"


def _native_int8_layout(codes: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """dflash's int8_linear layout (native.cpp): outputs in blocks of 16 (zero-padded), per block and four inputs a
    vector of 16 lanes x 4 bytes, the weights + 128 as uint8; the scales per lane: one per output [out] in the
    compute dtype's (float32 or bf16) as [blocks, 16], or one per output and group [out, groups] in float16 (Q8_0's)
    as [blocks, groups, 16]."""
    out_features, in_features = codes.shape
    blocks = -(-out_features // 16)
    padded = torch.zeros(blocks * 16, in_features, dtype=torch.int16)
    padded[:out_features] = codes
    lanes = (padded + 128).to(torch.uint8).reshape(blocks, 16, in_features // 4, 4)
    grouped = scales.dim() == 2
    dtype = torch.float16 if grouped else scales.dtype if scales.dtype == torch.bfloat16 else torch.float32
    lane_scales = torch.zeros(blocks * 16, *scales.shape[1:], dtype=dtype)  # (padded lanes: 0)
    lane_scales[:out_features] = scales
    lane_scales = lane_scales.reshape(blocks, 16, *scales.shape[1:])
    return {
        "codes": lanes.permute(0, 2, 1, 3).contiguous(),
        "lane_scales": lane_scales.transpose(1, 2).contiguous() if grouped else lane_scales,
    }


# Sibling projections of one input in transformers' decoder layers: attention's query, key and value; the MLP's
# gate and up.
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInput(nn.Module):
    """Projections of one input as one weight-only product: one kernel call, the input quantized to int8 once, where
    three or two small calls each paid a call's fixed cost and split few outputs over the threads (the demo's 210
    products a step as 120: its plain int4 decoding 1.10-1.20x faster on 2 cores). In dflash's kernels every output
    is computed alone (16-lane blocks), so each projection's outputs are the ones its own product gave. The product runs on the first
    projection's call; the other projections of the same input (the same tensor) take their part of it."""

    def __init__(self, product: _WeightOnlyLinear, sizes: list[int]) -> None:
        super().__init__()
        self.product, self.sizes = product, sizes
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._taken: set[int] = set()

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self._input is not x or index in self._taken:  # a new input: the whole product
            self._input, self._parts, self._taken = x, self.product(x).split(self.sizes, dim=-1), set()
        self._taken.add(index)
        part = self._parts[index]
        if len(self._taken) == len(self.sizes):  # every part taken: hold no tensor between forwards
            self._input, self._parts = None, ()
        return part


class Projection(nn.Module):
    """One of a `SharedInput`'s projections, in the place of the linear it was."""

    def __init__(self, shared: SharedInput, index: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.shared, self.index = shared, index
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.part(x, self.index)


def share_inputs(model: nn.Module) -> int:
    """Make each group of SHARED_INPUT_GROUPS siblings that are dflash-layout weight-only linears of one kind, input
    width and bias presence one `SharedInput`, in place; returns how many groups."""
    shared = 0
    # (the parents alone: a list of every module would keep each replaced layer, and its memory, until the end)
    parents = [
        m for m in model.modules() if any(isinstance(getattr(m, g[0], None), nn.Module) for g in SHARED_INPUT_GROUPS)
    ]
    for parent in parents:
        for names in SHARED_INPUT_GROUPS:
            layers = [getattr(parent, name, None) for name in names]
            if not all(isinstance(layer, _WeightOnlyLinear) and layer.native for layer in layers):
                continue
            if len({type(layer) for layer in layers}) > 1 or len({layer.in_features for layer in layers}) > 1:
                continue
            if len({layer.bias is None for layer in layers}) > 1 or any(layer.out_features % 16 for layer in layers):
                continue
            product = type(layers[0]).concatenate(layers)
            group = SharedInput(product, [layer.out_features for layer in layers])
            for index, (name, layer) in enumerate(zip(names, layers)):
                setattr(parent, name, Projection(group, index, layer.in_features, layer.out_features))
            del layers, product, group
            give_back_freed_memory()  # (the parts' memory, before the next group's copy: the load's peak stays)
            shared += 1
    return shared


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
