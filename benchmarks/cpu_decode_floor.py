"""The engine's target steps against the memory-bandwidth floor, on this CPU.

Loads a recipe's target the way `dflash` does (same plan, loading and thread choice), prefills a context,
then measures in rounds, interleaved so that load from other processes hits every figure alike:

- the floor of a plain step: the bytes it reads (weights + K/V of the context, `dflash_cli.bench.roofline`) at the
  speed this process reads the target's own weights (a sum over them, same threads);
- the plain step (a 1-token verify: the baseline's step) and verify steps of 2, 4, 8 tokens, through the
  engine's own `AttentionState` and its products (engine.kernels.layers): eager, compiled (`--compile`), eager with
  the products as transformers asks them (`--compare-kernel`: `F.linear` for every row count), and eager with
  the weights stored column-major (`--compare-layout`: faster for 1-2 rows, slower for 4-8 on the CPU
  measured, so not used); with `--compile`, compiled over each variant.

Every figure is taken in wall time and in CPU time. With one thread, CPU time is the time the step actually
ran, so its ratios hold on a machine shared with other busy processes; wall-time ratios drift with the load.
Prints each round and the medians: plain step / floor, verify q / plain step, variant / eager.

    python -m benchmarks.cpu_decode_floor                      # the demo target (SmolLM2-135M), float32
    python -m benchmarks.cpu_decode_floor --compare-layout --compile --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_cli.bench.roofline import read_bandwidth
from dflash_cli.engine.compiled.jit import compiled_step, use_compile_cache
from dflash_cli.engine.kernels.layers import use_cpu_products
from dflash_cli.engine.target.attention import AttentionState
from dflash_cli.setup.sizes import step_bytes

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def load(recipe_name: str, dtype: str) -> Any:
    from dflash_cli.loading import models as loading
    from dflash_cli.setup.hardware import detect_machine
    from dflash_cli.setup.planning import PlanOverrides, make_plan
    from dflash_cli.setup.recipes import get_recipe

    recipe = get_recipe(recipe_name)
    plan = make_plan(detect_machine(), recipe, PlanOverrides(device="cpu", dtype=dtype))
    return loading.load_target(loading.resolve_ref(recipe.target, "target"), plan)


def column_major(model: Any) -> Any:
    """Store every linear and embedding weight as the contiguous transpose of itself (same values, shape, tying):
    MKL then takes another kernel for the products of one or a few rows."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and module.weight.is_contiguous():
                module.weight.data = module.weight.data.t().contiguous().t()
    return model


def per_call_ms(fn: Callable[[], Any], calls: int) -> dict[str, float]:
    """Median wall and CPU milliseconds per call."""
    times: dict[str, list[float]] = {"wall": [], "cpu": []}
    for _ in range(calls):
        started = {name: clock() for name, clock in CLOCKS.items()}
        fn()
        for name, clock in CLOCKS.items():
            times[name].append(clock() - started[name])
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, help="default: the cores other processes leave free")
    parser.add_argument("--context", type=int, default=128, help="tokens of K/V behind each step")
    parser.add_argument("--blocks", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=8, help="calls per figure per round (median taken)")
    parser.add_argument("--compare-layout", action="store_true", help="also measure column-major weights")
    parser.add_argument("--compile", action="store_true", help="also measure the compiled steps")
    parser.add_argument(
        "--compare-kernel", action="store_true", help="also measure F.linear where the engine asks W @ x.T"
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    from dflash_cli.setup.thread_count import apply_threads

    threads = apply_threads(args.threads)
    load_before = os.getloadavg()
    print(f"{threads.reason}\nload average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    blocks = [int(b) for b in args.blocks.split(",")]
    sizes = [1, *blocks]
    generator = torch.Generator().manual_seed(0)
    targets = {"eager": load(args.recipe, args.dtype)}
    use_cpu_products(targets["eager"])  # the products as the engine asks them (engine.kernels.layers)
    if args.compare_kernel:
        targets["F.linear"] = load(args.recipe, args.dtype)  # the products as transformers asks them
    if args.compare_layout:
        targets["column-major"] = column_major(load(args.recipe, args.dtype))
    reference = targets["eager"]
    vocab = reference.get_input_embeddings().num_embeddings
    prompt = torch.randint(0, vocab, (1, args.context), generator=generator)
    ids = {q: torch.randint(0, vocab, (1, q), generator=generator) for q in sizes}
    bytes_ = step_bytes(reference, args.context)
    variants: dict[str, AttentionState] = {}
    compile_s = None
    with torch.inference_mode():
        for name, target in targets.items():
            state = variants[name] = AttentionState(target)
            state.reserve(args.context + 1, max(sizes), ())
            state.prefill(prompt)
        for name, target in list(targets.items()) if args.compile else ():
            compiled_name = "compiled" if name == "eager" else f"compiled {name}"
            state = variants[compiled_name] = AttentionState(target)
            state.reserve(args.context + 1, max(sizes), ())
            state.prefill(prompt)
            state.step = compiled_step(torch.device("cpu"))
            print(f"compiling {compiled_name} (inductor cache: {use_compile_cache()}) ...", flush=True)
            started = time.perf_counter()
            for q in sizes:
                state.verify(ids[q])
            compile_s = time.perf_counter() - started
            print(f"compiled in {compile_s:.0f} s", flush=True)
        rounds = []
        for number in range(args.rounds):
            row: dict[str, float] = {}
            for clock_name, clock in CLOCKS.items():
                row[f"floor_{clock_name}"] = bytes_.total / read_bandwidth(reference, clock=clock) * 1e3
            for name, state in variants.items():
                for q in sizes:  # verify without commit: every call writes the same slots
                    for clock_name, ms in per_call_ms(functools.partial(state.verify, ids[q]), args.calls).items():
                        row[f"{name}_{q}_{clock_name}"] = ms
            rounds.append(row)
            cells = [f"{k.removesuffix('_wall')} {v:.1f}" for k, v in row.items() if k.endswith("_wall")]
            print(f"round {number + 1} (wall ms): " + ", ".join(cells), flush=True)
    load_after = os.getloadavg()

    def median(key: str, over: str | None = None) -> float:
        return statistics.median(r[key] / (r[over] if over else 1.0) for r in rounds)

    summary: dict[str, Any] = {
        "recipe": args.recipe,
        "dtype": args.dtype,
        "threads": threads.threads,
        "context": args.context,
        "step_bytes": {"weights": bytes_.weights, "kv": bytes_.kv, "total": bytes_.total},
        "load_average": {"before": load_before, "after": load_after},
        "compile_s": compile_s,
        "rounds": rounds,
    }
    print(
        f"\nstep reads {bytes_.total / 1e6:.0f} MB (weights {bytes_.weights / 1e6:.0f}, K/V {bytes_.kv / 1e6:.1f}); "
        f"{threads.label()}; medians over {args.rounds} rounds; load average {load_after[0]:.2f} at the end"
    )
    for clock in CLOCKS:
        floor = median(f"floor_{clock}")
        summary[clock] = {"floor_ms": floor, "read_gb_s": bytes_.total / floor / 1e6}
        print(f"[{clock} time] floor {floor:.1f} ms ({bytes_.total / floor / 1e6:.1f} GB/s)")
        for name in variants:
            plain = median(f"{name}_1_{clock}")
            figures = summary[clock][name] = {
                "plain_ms": plain,
                "plain_over_floor": median(f"{name}_1_{clock}", f"floor_{clock}"),
                "bandwidth_achieved_gb_s": bytes_.total / plain / 1e6,
                **{f"verify_{q}_over_plain": median(f"{name}_{q}_{clock}", f"{name}_1_{clock}") for q in blocks},
                **{f"step_{q}_over_eager": median(f"{name}_{q}_{clock}", f"eager_{q}_{clock}") for q in sizes},
            }
            ratios = ", ".join(f"verify {q} {figures[f'verify_{q}_over_plain']:.2f}x" for q in blocks)
            versus = ", ".join(f"{figures[f'step_{q}_over_eager']:.2f}" for q in sizes)
            print(
                f"  {name:>21}: plain step {plain:.1f} ms = {figures['plain_over_floor']:.2f}x the floor "
                f"({figures['bandwidth_achieved_gb_s']:.1f} GB/s achieved); {ratios} the plain step; "
                f"steps {'/'.join(map(str, sizes))} vs eager {versus}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
