"""The few-row products of a decode step on this CPU, kernel against kernel: `python -m benchmarks.cpu_products
[--rows 1 2 4 16] [--repeats N]`, run from a checkout.

Random weights in the shapes of a model's layers (default: the demo target, SmolLM2-135M: 30 layers of q/k/v/o
and gate/up/down, and its 49152 x 576 output head), enough layers that the weights exceed the last-level cache,
so every call reads memory as a decode step does. For each row count: the time for one pass over every layer's
products on dflash's bf16 kernel (`engine.kernels.native`, where this machine has it), MKL's bf16 product (two rows
at least: `engine.kernels.layers`' rule for it), the int4 plan's kernel (dflash's int8-activation one where it runs), and the head on each; with the
GB/s the bf16 pass reads.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash_cli.engine.kernels import native
from dflash_cli.engine.kernels.quantized import Int4Linear

# (outputs, inputs) of one layer's products: q, k, v, o, gate, up, down (the demo target's shapes)
DEMO_LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
DEMO_HEAD = (49152, 576)


def best_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def bytes_of(weights: list[torch.Tensor]) -> int:
    return sum(w.numel() * w.element_size() for w in weights)


def row_cells(
    rows: int, bf16: list[torch.Tensor], int4: list[Int4Linear], head: torch.Tensor, repeats: int, ours: bool
) -> list[str]:
    """One table row: each kernel's pass over every layer at `rows` rows, then the head's."""
    x = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {w.shape[1] for w in bf16}}
    x2 = {k: torch.randn(max(rows, 2), k).to(torch.bfloat16) for k in x}  # MKL's bf16 rule: two rows at least
    weight_bytes = bytes_of(bf16)
    cells = ["-"]
    if ours:
        ms = best_ms(lambda: [torch.ops.dflash.bf16_linear(x[w.shape[1]], w) for w in bf16], repeats)
        cells = [f"{ms:.2f} ({weight_bytes / ms / 1e6:.0f})"]
    cells.append(f"{best_ms(lambda: [F.linear(x2[w.shape[1]], w) for w in bf16], repeats):.2f}")
    cells.append(f"{best_ms(lambda: [m(x[m.in_features]) for m in int4], repeats):.2f}")  # (the layer's kernel)
    h, h2 = (
        torch.randn(rows, head.shape[1]).to(torch.bfloat16),
        torch.randn(max(rows, 2), head.shape[1]).to(torch.bfloat16),
    )
    cells.append(f"{best_ms(lambda: torch.ops.dflash.bf16_linear(h, head), repeats):.2f}" if ours else "-")
    cells.append(f"{best_ms(lambda: F.linear(h2, head), repeats):.2f}")
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bf16, int4 = [], []
    for _ in range(args.layers):
        for out_features, in_features in DEMO_LAYER:
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            bf16.append(linear.weight.detach().to(torch.bfloat16))
            int4.append(Int4Linear.quantize(linear, torch.bfloat16))
    head = (torch.randn(*DEMO_HEAD) * 0.02).to(torch.bfloat16)
    weight_bytes = bytes_of(bf16)
    ours = native.available()
    print(
        f"{args.layers} layers x {len(DEMO_LAYER)} products ({weight_bytes / 1e6:.0f} MB bf16), head {DEMO_HEAD}, "
        f"{args.threads} threads; dflash's kernels: {'yes' if ours else native.unavailable()}"
    )
    print(
        "| rows | dflash bf16 (ms, GB/s) | MKL bf16 | int4 (dflash where it runs, else torch) | head: dflash bf16 | head: MKL bf16 |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        print(f"| {rows} | " + " | ".join(row_cells(rows, bf16, int4, head, args.repeats, ours)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
