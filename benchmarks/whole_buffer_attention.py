"""One decode step's attention over a whole K/V buffer (the compiled CUDA step's layout, engine.target.attention), by
way of computing it: which one brings the plain step near its floor (issue 45).

On the H200 (fourth GPU session) the engine's PACKED_SDPA took 6.35 of the plain step's 14.3 ms at a 1,024-token
context in an 8,192-position buffer, where reading that buffer's K/V is ~0.25 ms: SDPA's kernel for a short query runs
one block per K/V head (8 of the GPU's 132 processors), each walking every key. The ways measured here, each over
every layer's own K/V (one layer's alone would sit in L2), for 1 and `block_size` queries and at each capacity:

- `repeat_kv`: transformers' SDPA as dynamo traces it (K/V copied per query head); `packed`: the engine's until
  then (each K/V head's query heads as rows of one SDPA call);
- `packed_filled`: packed over the filled positions only (what attention over the filled length, or capacity
  buckets, would cost with that kernel);
- `engine`, `engine_compiled`: the engine's now (engine.target.attention.whole_buffer_attention): eager it is
  `packed`, compiled `split`'s way;
- `matmul`: the same attention as two batched products and a float32 softmax between them (scores rounded to the
  dtype, as transformers' eager attention does); `matmul_f32_scores`: the scores kept in float32 (`bmm`'s
  out_dtype, CUDA only);
- `split`: the keys cut in SPLITS pieces, each piece's softmax and sum apart, then combined (flash-decoding, by
  hand; eager here, fused when compiled: `split_compiled`);
- `flex_whole` / `flex_filled`: FlexAttention compiled (its decoding kernel splits the keys across processors) with a
  block mask over the whole buffer (a fixed shape, as CUDA graphs need) or over the filled blocks only.

Device time per step (profiled kernels, launch cost excluded: the engine's steps are CUDA graphs) on CUDA, wall time
elsewhere; each way's largest difference from `repeat_kv`'s output.

    python -m benchmarks.whole_buffer_attention [--output FILE] [--capacities 8192,2048] [--smoke]
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
from torch import nn

from dflash_cli.engine.target import attention as target_attention
from dflash_cli.engine.target.attention import whole_buffer_attention

SPLITS = 16  # pieces of the keys `split` cuts (flash-decoding picks by the processors; 16 x 8 K/V heads > 132)


def packed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The engine's whole-buffer attention until the fifth GPU session: each K/V head's query heads as rows of one
    SDPA call (K/V read once), for any query length."""
    kv_heads, heads = key.shape[1], query.shape[1]
    out = F.scaled_dot_product_attention(
        grouped(query, kv_heads)[None], key, value, attn_mask=mask.repeat(1, 1, heads // kv_heads, 1)
    )
    return ungrouped(out[0], heads)


def grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[1, heads, q, d] -> [kv heads, groups * q, d]: each K/V head's query heads as rows (repeat_kv's order)."""
    _, heads, q, d = query.shape
    return query.reshape(kv_heads, heads // kv_heads * q, d)


def ungrouped(out: torch.Tensor, heads: int) -> torch.Tensor:
    kv_heads, rows, d = out.shape
    return out.reshape(1, heads, rows * kv_heads // heads, d)


def matmul_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, f32_scores: bool = False
) -> torch.Tensor:
    kv_heads, heads = key.shape[1], query.shape[1]
    q = grouped(query, kv_heads) * query.shape[-1] ** -0.5
    keys = key[0].transpose(1, 2)
    scores = torch.bmm(q, keys, out_dtype=torch.float32) if f32_scores else torch.bmm(q, keys)
    visible = mask[0, 0].repeat(heads // kv_heads, 1)  # [groups * q, capacity]
    weights = scores.float().masked_fill(~visible, float("-inf")).softmax(-1).to(value.dtype)
    return ungrouped(torch.bmm(weights, value[0]), heads)


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    kv_heads, heads, d = key.shape[1], query.shape[1], query.shape[-1]
    capacity = key.shape[2]
    piece = capacity // SPLITS
    q = (grouped(query, kv_heads) * d**-0.5)[:, None]  # [kv, 1, rows, d]
    keys = key[0].reshape(kv_heads, SPLITS, piece, d)
    values = value[0].reshape(kv_heads, SPLITS, piece, d)
    visible = mask[0, 0].repeat(heads // kv_heads, 1).reshape(-1, SPLITS, piece).transpose(0, 1)  # [S, rows, piece]
    scores = torch.matmul(q, keys.transpose(-1, -2)).float()  # [kv, S, rows, piece]
    # A piece with no visible key: its finite floor gives it a weight exp(floor - best) = 0 below, not a NaN.
    scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
    best = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - best)
    sums = weights.sum(-1, keepdim=True)
    parts = torch.matmul(weights.to(value.dtype), values).float()  # [kv, S, rows, d]
    scale = torch.exp(best - best.amax(1, keepdim=True))  # each piece's share of the common maximum
    out = (parts * scale).sum(1) / (sums * scale).sum(1)
    return ungrouped(out.to(value.dtype), heads)


def per_step_ms(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    from benchmarks.gpu_bench import kernel_ms_per_call, time_calls

    for _ in range(warmup):
        fn()
    per_step = kernel_ms_per_call(fn, device, reps)
    return per_step if per_step is not None else time_calls(fn, device, 0, reps)["median_ms"]


def ways_for(
    query: torch.Tensor, mask: torch.Tensor, context: int, kv_heads: int, flex: bool
) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Each way of computing one layer's attention of `query` over K/V (module docstring), as fn(key, value)."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // kv_heads
    q, capacity, device = query.shape[2], mask.shape[-1], query.device
    filled = context + q
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    compiled_split = torch.compile(split_attention, dynamic=False)
    compiled_engine = torch.compile(whole_buffer_attention, dynamic=False)
    ways: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "repeat_kv": lambda k, v: F.scaled_dot_product_attention(
            query, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask
        ),
        "packed": lambda k, v: packed_sdpa(query, k, v, mask),
        "packed_filled": lambda k, v: packed_sdpa(query, k[:, :, :filled], v[:, :, :filled], mask[..., :filled]),
        "engine": lambda k, v: whole_buffer_attention(module, query, k, v, mask)[0].transpose(1, 2),
        "engine_compiled": lambda k, v: compiled_engine(module, query, k, v, mask)[0].transpose(1, 2),
        "matmul": lambda k, v: matmul_attention(query, k, v, mask),
        "matmul_f32_scores": lambda k, v: matmul_attention(query, k, v, mask, f32_scores=True),
        "split": lambda k, v: split_attention(query, k, v, mask),
        "split_compiled": lambda k, v: compiled_split(query, k, v, mask),
    }
    if flex:
        compiled_flex = torch.compile(flex_attention, dynamic=False)
        length = torch.tensor(context, device=device)  # (read on the device: the block mask does not change with it)
        # Every block partial, the length read by the mask function on the device: a fixed block mask, as a CUDA
        # graph needs (create_block_mask would drop the blocks past today's length).
        blocks = -(-capacity // 128)
        whole = BlockMask.from_kv_blocks(
            torch.full((1, 1, 1), blocks, dtype=torch.int32, device=device),
            torch.arange(blocks, dtype=torch.int32, device=device).view(1, 1, 1, blocks),
            BLOCK_SIZE=128,
            mask_mod=lambda b, h, i, j: j <= length + i,
            seq_lengths=(q, capacity),
        )
        only_filled = create_block_mask(lambda b, h, i, j: j <= context + i, None, None, q, capacity, device=device)
        ways["flex_whole"] = lambda k, v: compiled_flex(query, k, v, block_mask=whole, enable_gqa=True)
        ways["flex_filled"] = lambda k, v: compiled_flex(query, k, v, block_mask=only_filled, enable_gqa=True)
    return ways


def measure(
    *,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    context: int,
    queries: tuple[int, ...],
    capacities: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    warmup: int,
    reps: int,
    time_budget_s: float = 240.0,
    flex: bool = True,
    only: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Each way's ms a step (every layer's attention once) by capacity and query count, and its largest difference
    from `repeat_kv` (see the module docstring)."""
    started = time.monotonic()
    out: dict[str, Any] = {"layers": layers, "context": context, "splits": SPLITS, "by_capacity": {}}
    for capacity in capacities:
        caches = [
            tuple(torch.randn(1, kv_heads, capacity, head_dim, device=device, dtype=dtype) for _ in "kv")
            for _ in range(layers)
        ]
        by_query: dict[str, Any] = {}
        out["by_capacity"][str(capacity)] = by_query
        for q in queries:
            query = torch.randn(1, heads, q, head_dim, device=device, dtype=dtype)
            positions = torch.arange(context, context + q, device=device)
            mask = (torch.arange(capacity, device=device) <= positions[:, None])[None, None]
            times = by_query[str(q)] = measure_ways(
                {
                    name: way
                    for name, way in ways_for(query, mask, context, kv_heads, flex).items()
                    if not only or name in only or name == "repeat_kv"
                },
                caches,
                device,
                warmup,
                reps,
                started + time_budget_s,
            )
            print(
                f"capacity {capacity}, {q} quer{'y' if q == 1 else 'ies'}: "
                + ", ".join(f"{n} {t['ms_per_step']:.3g}" for n, t in times.items() if "ms_per_step" in t),
                file=sys.stderr,
                flush=True,
            )
    out["seconds"] = time.monotonic() - started
    return out


def measure_ways(
    ways: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
    caches: list[tuple[torch.Tensor, ...]],
    device: torch.device,
    warmup: int,
    reps: int,
    deadline: float,
) -> dict[str, Any]:
    times: dict[str, Any] = {}
    with torch.inference_mode():
        expected = ways["repeat_kv"](*caches[-1]).float()
        for name, way in ways.items():
            if time.monotonic() > deadline:
                times[name] = {"skipped": "time budget spent"}
                continue
            try:
                error = (way(*caches[-1]).float() - expected).abs().max().item()

                def step(way: Callable[..., torch.Tensor] = way) -> torch.Tensor:
                    for key, value in caches:
                        last = way(key, value)
                    return last

                times[name] = {"ms_per_step": per_step_ms(step, device, warmup, reps), "max_error": error}
            except Exception as failure:  # (one way failing, e.g. an op this torch lacks, is a result)
                times[name] = {"error": f"{type(failure).__name__}: {str(failure)[:300]}"}
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="write the JSON here too")
    parser.add_argument("--capacities", default=f"{target_attention.MIN_CAPACITY},2048")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--time-budget", type=float, default=240.0)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: every way, in seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        shape = dict(layers=2, heads=4, kv_heads=2, head_dim=16, context=24, queries=(1, 4), capacities=(64,))
        device, dtype, warmup, reps = torch.device("cpu"), torch.float32, 1, 2
    else:  # Qwen3-8B's attention
        capacities = tuple(int(c) for c in args.capacities.split(","))
        shape = dict(layers=36, heads=32, kv_heads=8, head_dim=128, context=args.context, queries=(1, 16),
                     capacities=capacities)  # fmt: skip
        device, dtype, warmup, reps = torch.device("cuda"), torch.bfloat16, 3, 20
    result = measure(
        **shape, device=device, dtype=dtype, warmup=warmup, reps=reps, time_budget_s=args.time_budget,
        flex=not args.no_flex,
    )  # fmt: skip
    return report(result, device, args.output, dtype=str(dtype))


def report(result: dict[str, Any], device: torch.device, output: str | None, **environment: str) -> int:
    """Print `result` as JSON with the environment it ran in (and write it to `output`); the exit status."""
    result["environment"] = {"torch": torch.__version__, "device": str(device), **environment}
    if device.type == "cuda":
        result["environment"]["gpu"] = torch.cuda.get_device_name(device)
    text = json.dumps(result, indent=1)
    if output:
        with open(output, "w") as file:
            file.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
