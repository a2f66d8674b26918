"""4-bit weights for verify blocks (issue 45, item 3): one Qwen3-8B decoder layer's seven products at 1, 8 and 16
rows, bf16 against bitsandbytes' NF4 (the loader's settings) and torch's own int4 kernel (tinygemm, gpt-fast's:
`aten._weight_int4pack_mm`, tensor cores, so many rows cost about what one does), with each 4-bit output's error.

bitsandbytes dequantizes the whole weight for a product of more than one row (eager, the fourth session: a verify
of 16 cost 1.6x a verify of 1); tinygemm reads the packed weight once for up to 16 rows. Device time per layer
(profiled kernels) on CUDA, wall time elsewhere; each kernel's bytes read and the rows-16 / rows-1 ratio; the
error is |y - y_bf16| / |y_bf16| over the layer's outputs (random weights and rows: the formats' rounding, not a
model's quality, which the golden sets measure once a format is in the engine).

    python -m benchmarks.gpu_4bit [--output FILE] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# one decoder layer of Qwen3-8B: (out, in) of q, k, v, o, gate, up, down
QWEN3_8B_LAYER = ((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096), (4096, 12288))
SMOKE_LAYER = ((256, 256), (64, 256), (64, 256), (256, 256), (512, 256), (512, 256), (256, 512))
TINYGEMM_GROUP = 128  # gpt-fast's and torchao's default group for tinygemm
INNER_K_TILES = 8


def nf4(weight: torch.Tensor, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A bitsandbytes Linear4bit as dflash's loader makes it (NF4, double quant, compute in `dtype`)."""
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    layer = bnb.nn.Linear4bit(
        in_features, out_features, bias=False, compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
        device="meta",
    )  # fmt: skip
    layer.weight = bnb.nn.Params4bit(
        weight.cpu(), requires_grad=False, compress_statistics=True, quant_type="nf4", module=layer
    ).to(weight.device)  # (quantizes)
    return layer


def tinygemm(weight: torch.Tensor, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch's int4 kernel: min-max codes per group of TINYGEMM_GROUP inputs, w = (q - 8) * scale + zero."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, -1, TINYGEMM_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-6)
    codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).reshape(out_features, in_features)
    zeros = low + 8 * scales
    scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
    if weight.is_cuda:
        codes = codes.to(torch.int32)
        packed_bytes = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_bytes, INNER_K_TILES)
        return lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, TINYGEMM_GROUP, scales_zeros)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), INNER_K_TILES)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, TINYGEMM_GROUP, scales_zeros)


def layer_bytes(layer: tuple[tuple[int, int], ...], kernel: str) -> int:
    weights = sum(n * k for n, k in layer)
    if kernel == "bf16":
        return 2 * weights
    if kernel == "nf4":  # codes, an int8 absmax per 64 and its float32 per 256 blocks of those
        return weights // 2 + weights // 64 + weights // 64 // 256 * 4
    return weights // 2 + weights // TINYGEMM_GROUP * 4  # codes, bf16 scale and zero per group


def measure(
    layer: tuple[tuple[int, int], ...],
    rows: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    warmup: int,
    reps: int,
) -> dict[str, Any]:
    from benchmarks.whole_buffer_attention import per_step_ms

    torch.manual_seed(0)
    weights = [torch.randn(n, k, device=device, dtype=dtype) * k**-0.5 for n, k in layer]
    makers: dict[str, Callable[[torch.Tensor, torch.dtype], Callable[[torch.Tensor], torch.Tensor]]] = {
        "bf16": lambda w, d: lambda x: F.linear(x, w),
        "nf4": nf4,
        "int4_tinygemm": tinygemm,
    }
    out: dict[str, Any] = {"layer": [list(s) for s in layer], "rows": list(rows), "kernels": {}}
    inputs = {m: [torch.randn(m, k, device=device, dtype=dtype) for _, k in layer] for m in rows}
    with torch.inference_mode():
        expected = {m: [F.linear(x, w).float() for x, w in zip(inputs[m], weights)] for m in rows}
        for name, make in makers.items():
            result: dict[str, Any] = {"bytes_per_layer": layer_bytes(layer, name)}
            out["kernels"][name] = result
            try:
                products = [make(w, dtype) for w in weights]
                for m in rows:
                    xs = inputs[m]

                    def step(xs: list[torch.Tensor] = xs, products: list[Any] = products) -> torch.Tensor:
                        for x, product in zip(xs, products):
                            last = product(x)
                        return last

                    ms = per_step_ms(step, device, warmup, reps)
                    ys = [product(x).float() for x, product in zip(xs, products)]
                    error = max((y - e).norm().item() / e.norm().item() for y, e in zip(ys, expected[m]))
                    result[str(m)] = {"ms_per_layer": ms, "gb_per_s": result["bytes_per_layer"] / ms / 1e6,
                                      "relative_error": error}  # fmt: skip
                first, last = result[str(rows[0])]["ms_per_layer"], result[str(rows[-1])]["ms_per_layer"]
                result[f"rows_{rows[-1]}_over_rows_{rows[0]}"] = last / first
            except Exception as failure:  # (a kernel this torch or device lacks is a result)
                result["error"] = f"{type(failure).__name__}: {str(failure)[:300]}"
            print(f"{name}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="write the JSON here too")
    parser.add_argument("--smoke", action="store_true", help="small shapes on the CPU: every kernel, in seconds")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.smoke:
        layer, device, warmup, reps = SMOKE_LAYER, torch.device("cpu"), 1, 3
    else:
        layer, device, warmup, reps = QWEN3_8B_LAYER, torch.device("cuda"), 5, 30
    from benchmarks.whole_buffer_attention import report

    result = measure(layer, (1, 8, 16), device, torch.bfloat16, warmup, reps)
    result["seconds"] = time.monotonic() - started
    return report(result, device, args.output)


if __name__ == "__main__":
    sys.exit(main())
