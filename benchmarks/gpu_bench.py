"""GPU fast-path benchmark (issue 8): our decode loop against the memory-bandwidth floor and z-lab's reference.

One invocation builds a Qwen3-8B-shaped target (random weights: per-step time does not depend on what is
accepted) and a matching 5-layer block-16 drafter, then for bf16 and NF4 measures:

- the device's copy bandwidth and the floor of one decode step (bytes the step must read / bandwidth);
- the AR step (1-token target forward with KV cache), verify for block sizes 1..16, the drafter step;
- the whole speculative step and end-to-end tokens/s through the real `engine.generate`, with a drafter
  double of controlled acceptance (the target's own greedy continuation for the first slots, a wrong token
  after) so tau is what we ask for; the predicted tokens/s and speedup at tau = 6.5;
- host overhead per step: wall clock (synchronized) against CUDA events and against profiled kernel time;
- z-lab's reference (`dflash==0.1.0`, imported from its wheel) on the same target and drafter weights.

Every figure is printed next to its target from the issue. `--smoke` runs the same code on tiny shapes on
the CPU (CI runs it: tests/benchmarks/test_gpu_bench.py). The exact device command is in benchmarks/results/history.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import whole_buffer_attention
from dflash_cli.engine import SamplingParams, Step, generate
from dflash_cli.engine.drafter import DFlashDrafter, DraftCache, DrafterConfig
from dflash_cli.engine.target import attention as target_attention
from dflash_cli.engine.target.attention import AttentionState
from dflash_cli.setup.sizes import module_weight_bytes, tensor_bytes

PUBLISHED_TAU = 6.5  # z-lab's Qwen3-8B drafter on GSM8K (6.55); every configuration's taus include it
PUBLISHED = f"{PUBLISHED_TAU:g}"  # its key in the end-to-end results
REFERENCE_WHEEL = "dflash-0.1.0-py3-none-any.whl"

# The issue's targets (bf16, Qwen3-8B shape, H100/H200).
AR_STEP_MAX_X_FLOOR = 1.15
SPEC_STEP_MAX_X_AR_FLOOR = 1.35
SPEC_STEP_MAX_X_REFERENCE = 1 / 3
HOST_OVERHEAD_MAX_MS = 1.0


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_layers: int
    block_size: int
    mask_token_id: int
    max_positions: int


QWEN3_8B = Shape(36, 4096, 12288, 32, 8, 128, 151936, 5, 16, 151669, 40960)
TINY = Shape(6, 64, 128, 4, 2, 16, 384, 2, 8, 383, 2048)


@dataclass(frozen=True)
class Settings:
    shape: Shape
    device: str
    dtype: str  # the dense precision; NF4 computes in it too
    precisions: tuple[str, ...]
    context: int  # prompt length: the KV cache every measured step reads
    new_tokens: int  # tokens per end-to-end run
    taus: tuple[float, ...]
    warmup: int
    reps: int
    profile_steps: int
    verify_sizes: tuple[int, ...]
    reference_precisions: tuple[str, ...]
    reference_tokens: int
    reference_repeats: int
    copy_mib: int
    time_budget_s: float
    seed: int = 0
    compile: bool = False  # the engine's compiled steps (CUDA graphs for the target's)


def smoke_settings() -> Settings:
    # float32 on the CPU: the controlled-acceptance double then hits its tau exactly (no bf16 near-ties).
    return Settings(
        TINY,
        "cpu",
        "float32",
        ("float32", "nf4"),
        context=16,
        new_tokens=16,
        taus=(1.0, 6.5, 16.0),
        warmup=1,
        reps=3,
        profile_steps=2,
        verify_sizes=(1, 2, 8),
        reference_precisions=("float32",),
        reference_tokens=8,
        reference_repeats=1,
        copy_mib=16,
        time_budget_s=300.0,
    )


def full_settings() -> Settings:
    return Settings(
        QWEN3_8B,
        "cuda",
        "bfloat16",
        ("bf16", "nf4"),
        context=1024,
        new_tokens=128,
        taus=(1.0, 3.0, 6.5, 16.0),
        warmup=3,
        reps=20,
        profile_steps=8,
        verify_sizes=tuple(range(1, 17)),
        reference_precisions=("bf16", "nf4"),
        reference_tokens=48,
        reference_repeats=3,
        copy_mib=1024,
        time_budget_s=540.0,
    )


# --- timing ---------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float, float | None, float]:
    """Run fn once: (result, wall ms synchronized, CUDA-event ms or None, ms until fn returned to the host)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
    sync(device)
    t0 = time.perf_counter()
    if events:
        events[0].record()
    result = fn()
    issued = time.perf_counter()
    if events:
        events[1].record()
    sync(device)
    wall = (time.perf_counter() - t0) * 1e3
    return result, wall, events[0].elapsed_time(events[1]) if events else None, (issued - t0) * 1e3


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def timing_summary(walls: list[float], gpus: list[float | None], issues: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(walls), "median_ms": statistics.median(walls), "p90_ms": p90(walls)}
    out["issue_median_ms"] = statistics.median(issues)
    if gpus and all(g is not None for g in gpus):
        out["events_median_ms"] = statistics.median(gpus)
        out["events_p90_ms"] = p90(gpus)
        # Time the host adds around the device work of one call (launch latency, final sync).
        out["sync_minus_events_ms"] = out["median_ms"] - out["events_median_ms"]
    else:
        out["events_median_ms"] = out["events_p90_ms"] = out["sync_minus_events_ms"] = None
    return out


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> dict[str, Any]:
    for _ in range(warmup):
        fn()
    samples = [timed_call(fn, device)[1:] for _ in range(reps)]
    return timing_summary(*map(list, zip(*samples)))


HOST_OPS_SHOWN = 15


def kernel_ms_per_call(
    fn: Callable[[], Any], device: torch.device, calls: int, host_ops: list[dict[str, Any]] | None = None
) -> float | None:
    """Device busy time per call (sum of kernel and memcpy durations, profiled); None off CUDA. `host_ops`, if
    given, receives the ops that took the host longest per call (self CPU time): where a step's host time goes."""
    if device.type != "cuda" or calls < 1:
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        wall_ms = (time.perf_counter() - started) * 1e3 / calls
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    averages = prof.key_averages()
    if busy_us == 0:  # older profilers attribute kernels to the ops that launched them
        busy_us = sum(e.self_device_time_total for e in averages)
    if host_ops is not None:
        top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:HOST_OPS_SHOWN]
        host_ops += [{"op": "(wall time per call, profiled)", "self_cpu_ms": wall_ms, "count": 1.0}]
        host_ops += [
            {"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3 / calls, "count": e.count / calls} for e in top
        ]
    return busy_us / 1e3 / calls


# --- models ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def building(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create modules directly on the device in the dtype: no fp32 copy, no host-side init of 8B weights."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_target(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """A random-init Qwen3ForCausalLM of this shape (transformers' own class and init, std 0.02)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with building(device, dtype):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()  # a no-op unless transformers built it elsewhere


def build_drafter(shape: Shape, target: nn.Module, dtype: torch.dtype, seed: int) -> DFlashDrafter:
    config = DrafterConfig.for_target(
        target.config, layers=shape.draft_layers, block_size=shape.block_size, mask_token_id=shape.mask_token_id
    )
    torch.manual_seed(seed)
    device = target.get_input_embeddings().weight.device
    with building(device, dtype):
        drafter = DFlashDrafter(config, target)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    return drafter.eval()


def quantize_nf4(target: nn.Module, compute_dtype: torch.dtype) -> int:
    """Replace every decoder-layer Linear by a bitsandbytes NF4 Linear4bit, in place, with the settings of
    our loader (nf4, double quant, compute in the dense dtype); embeddings and lm_head stay dense, as
    transformers leaves them. Returns the number of layers quantized."""
    import bitsandbytes as bnb

    device = target.get_input_embeddings().weight.device
    count = 0
    for layer in target.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                # (a dense Linear, or the engine's SmallRowLinear after a CPU float32 run: engine.kernels.layers)
                if not isinstance(child, nn.Linear) or isinstance(child, bnb.nn.Linear4bit):
                    continue
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=compute_dtype,
                    compress_statistics=True,
                    quant_type="nf4",
                    device="meta",
                )
                weight = bnb.nn.Params4bit(
                    child.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4", module=q
                )
                q.weight = weight.to(device)  # quantizes
                if child.bias is not None:
                    q.bias = child.bias
                setattr(parent, name, q)
                count += 1
    return count


# --- the floor ------------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, mib: int, warmup: int, reps: int) -> dict[str, Any]:
    """Large device-to-device copy; bytes read plus bytes written over the time (the usual convention)."""
    n = mib * 2**20 // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)  # random, never zeros
    dst = torch.empty_like(src)
    timing = time_calls(functools.partial(dst.copy_, src), device, warmup, reps)
    ms = timing["events_median_ms"] or timing["median_ms"]
    moved = 2 * tensor_bytes(src)
    del src, dst
    return {"bytes_moved": moved, "median_ms": ms, "gb_per_s": moved / (ms / 1e3) / 1e9}


def kv_bytes(shape: Shape, tokens: int, dtype: torch.dtype) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * dtype.itemsize


def step_floors(
    shape: Shape, target: nn.Module, drafter: DFlashDrafter, context: int, dtype: torch.dtype, gb_per_s: float
) -> dict[str, Any]:
    """Fewest bytes one step must read from device memory, and that over the measured bandwidth."""
    embed = target.get_input_embeddings().weight
    row = embed.shape[1] * embed.element_size()  # a lookup reads one row per token, not the table
    target_weights = module_weight_bytes(target, exclude=(embed,))
    lm_head = module_weight_bytes(target.get_output_embeddings())
    draft_weights = module_weight_bytes(drafter)
    block = shape.block_size
    draft_kv = 2 * shape.draft_layers * shape.kv_heads * shape.head_dim * (context + block) * embed.element_size()
    ar = target_weights + row + kv_bytes(shape, context, dtype)
    # Verify reads what an AR step reads; the draft adds its own weights, the lm_head again (drafter logits
    # come from the target's head) and its context cache.
    spec = target_weights + block * row + kv_bytes(shape, context + block, dtype) + draft_weights + lm_head + draft_kv
    to_ms = 1e3 / (gb_per_s * 1e9)
    return {
        "target_weight_bytes": target_weights,
        "lm_head_bytes": lm_head,
        "drafter_weight_bytes": draft_weights,
        "kv_bytes_at_context": kv_bytes(shape, context, dtype),
        "ar_step_bytes": ar,
        "spec_step_bytes": spec,
        "ar_floor_ms": ar * to_ms,
        "spec_floor_ms": spec * to_ms,
        "spec_floor_x_ar_floor": spec / ar,
    }


# --- the pieces of a step -------------------------------------------------------------------------------


def measure_target_steps(target: nn.Module, layer_ids: list[int], prompt: torch.Tensor, s: Settings) -> dict[str, Any]:
    """AR step (1 token, no features) and verify for every block size (features captured), through the engine's
    own static state: each call writes the block after the context and commits nothing, as a rejected step."""
    device = prompt.device
    ctx = prompt.shape[1]
    gen = torch.Generator(device="cpu").manual_seed(s.seed)
    states = {}
    for ids in ((), tuple(layer_ids)):
        state = states[ids] = AttentionState(target)
        state.reserve(ctx + 1, max(s.verify_sizes), ids, compile=s.compile)
        with torch.inference_mode():
            state.prefill(prompt)

    def forward(size: int, ids: tuple[int, ...]) -> Callable[[], Any]:
        block = torch.randint(0, s.shape.vocab - 1, (1, size), generator=gen).to(device)
        state = states[ids]

        @torch.inference_mode()
        def run() -> None:
            state.verify(block).argmax(dim=-1)

        return run

    ar = forward(1, ())
    result = {"ar_step": time_calls(ar, device, s.warmup, s.reps)}
    result["ar_step"]["kernel_ms"] = kernel_ms_per_call(ar, device, s.profile_steps)
    sweep_reps = max(1, s.reps // 2)
    result["verify"] = {
        str(size): time_calls(forward(size, tuple(layer_ids)), device, s.warmup, sweep_reps) for size in s.verify_sizes
    }
    return result


def measure_draft_step(drafter: DFlashDrafter, prompt: torch.Tensor, s: Settings) -> dict[str, Any]:
    """One drafting pass as the engine runs it: new context features (tau rows) + block -> proposed ids."""
    device = prompt.device
    ctx = prompt.shape[1]
    dtype = drafter.fc.weight.dtype
    width = drafter.fc.in_features
    cache = drafter.new_cache(ctx + 2 * drafter.block_size)
    with torch.inference_mode():
        drafter.draft([torch.randn(1, ctx, width, device=device, dtype=dtype)], prompt[:, -1:], [ctx], cache)
    cached = cache.length
    new_rows = max(1, round(PUBLISHED_TAU))
    features = torch.randn(1, new_rows, width, device=device, dtype=dtype)
    block = torch.full((1, drafter.block_size), drafter.mask_token_id, device=device)
    block[0, 0] = prompt[0, -1]

    @torch.inference_mode()
    def run() -> None:
        drafter.propose([features], block, [cached + new_rows], cache)
        cache.length = cached  # a rewind is a length move

    result = time_calls(run, device, s.warmup, s.reps)
    result["new_context_rows"] = new_rows
    return result


def measure_whole_buffer_attention(s: Settings, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """One step's attention over a whole K/V buffer (the compiled CUDA step's layout: MIN_CAPACITY positions, the
    context's visible), every layer's own K/V: transformers' SDPA path as dynamo traces it against the engine's,
    eager and compiled, by query count (benchmarks/whole_buffer_attention.py has more ways)."""
    shape = s.shape
    return whole_buffer_attention.measure(
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        context=s.context,
        queries=(1, shape.block_size),
        capacities=(max(target_attention.MIN_CAPACITY, s.context + shape.block_size),),
        device=device,
        dtype=dtype,
        warmup=s.warmup,
        reps=s.reps,
        flex=False,
        only=("packed", "engine", "engine_compiled"),
    )


# --- the decode loop, end to end ------------------------------------------------------------------------


def acceptance_plan(tau: float, block_size: int, tokens: int) -> list[int]:
    """Acceptance lengths (bonus included, each in 1..block_size) adding up to at least `tokens`, whose mean
    is tau to within 1/len: a_i = floor((i+1) tau) - floor(i tau), e.g. 6, 7, 6, 7, ... for 6.5."""
    tau = min(max(tau, 1.0), float(block_size))
    plan: list[int] = []
    while sum(plan) < tokens:
        i = len(plan)
        plan.append(math.floor((i + 1) * tau + 1e-9) - math.floor(i * tau + 1e-9))
    return plan


class ControlledAcceptanceDrafter:
    """A drafter double: runs the real drafter's whole pass (so a step costs what a real one does), then
    proposes the target's own greedy continuation (`sequence`: prompt + greedy tokens) for the first a-1
    slots and a wrong token at slot a. While the target agrees with `sequence`, the real decode loop then
    commits exactly a tokens per step, a taken in turn from `plan`. The proposal is built on the device:
    the double adds no host sync.
    """

    def __init__(self, inner: DFlashDrafter, sequence: list[int], plan: list[int]) -> None:
        self.inner = inner
        self.sequence = torch.tensor(sequence, device=inner.fc.weight.device)
        self.plan = plan
        self.steps = 0
        self.vocab = inner.config.vocab_size

    def __getattr__(self, name: str) -> Any:  # block_size, mask_token_id, config, layers: the real drafter's
        return getattr(self.inner, name)

    @torch.no_grad()
    def propose(
        self,
        features: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        starts: Sequence[int],
        cache: DraftCache,
        **rows: Any,
    ) -> torch.Tensor:
        # the real pass, so the step costs what it does (one sequence: the benchmark decodes one row)
        drafted = self.inner.propose(features, block_ids, starts, cache, **rows)
        (start,), slots = starts, drafted.shape[1]
        accept = self.plan[min(self.steps, len(self.plan) - 1)]
        self.steps += 1
        proposal = self.sequence[start + 1 : start + 1 + slots].clone()
        if accept <= slots:
            proposal[accept - 1] = (proposal[accept - 1] + 1) % self.vocab  # the first wrong slot
        return proposal.view(1, slots)


def run_generation(
    target: nn.Module,
    drafter: Any,
    prompt_ids: list[int],
    max_new: int,
    block: int | None,
    device: torch.device,
    compile: bool = False,
) -> dict[str, Any]:
    """One real `engine.generate` run, every decode step timed (wall synchronized, CUDA events)."""
    params = SamplingParams(max_new_tokens=max_new)
    steps = generate(target, drafter, prompt_ids, params, block_size=block, compile=compile)
    first = next(steps)
    tokens = list(first.token_ids)
    walls: list[float] = []
    gpus: list[float | None] = []
    issues: list[float] = []
    step: Step = first
    while step.finish_reason is None:
        step, wall, gpu, issued = timed_call(lambda: next(steps), device)
        tokens.extend(step.token_ids)
        walls.append(wall)
        gpus.append(gpu)
        issues.append(issued)
    stats = step.stats
    steps_n = max(1, len(stats.acceptance_lengths))
    return {
        "tokens": tokens,
        "acceptance_lengths": list(stats.acceptance_lengths),
        "tau": stats.tau,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "ms_per_step_mean": 1e3 * stats.decode_s / steps_n,
        # the loop's own phase clock (CUDA events between the step's marks): where a step's time goes
        "draft_ms_per_step": 1e3 * stats.draft_s / steps_n,
        "verify_ms_per_step": 1e3 * stats.verify_s / steps_n,
        "compile_s": stats.compile_s,
        "step": timing_summary(walls, gpus, issues) if walls else None,
    }


def profile_steps(
    target: nn.Module,
    drafter: Any,
    prompt_ids: list[int],
    max_new: int,
    calls: int,
    device: torch.device,
    compile: bool = False,
    host_ops: list[dict[str, Any]] | None = None,
) -> float | None:
    """Device busy time per decode step, from a separate profiled run (profiling slows the host)."""
    if device.type != "cuda":
        return None
    steps = decoding(target, drafter, prompt_ids, max_new, compile)
    return kernel_ms_per_call(lambda: next(steps), device, calls, host_ops)


def decoding(target: nn.Module, drafter: Any, prompt_ids: list[int], max_new: int, compile: bool) -> Iterator[Step]:
    """A separate run of the real loop (blocks of the drafter's size), its prefill done: next() is one decode step."""
    block = None if drafter is None else drafter.block_size
    params = SamplingParams(max_new_tokens=max_new)
    steps = generate(target, drafter, prompt_ids, params, block_size=block, compile=compile)
    next(steps)  # the prefill
    return steps


PYTHON_FUNCTIONS_SHOWN = 12


def python_profile(
    target: nn.Module,
    drafter: Any,
    prompt_ids: list[int],
    max_new: int,
    calls: int,
    compile: bool = False,
) -> list[dict[str, Any]]:
    """The Python functions that took the host longest per decode step (own time, cProfile), from a separate run:
    the host time no torch op accounts for (cProfile slows Python down, so read them as shares, not as times; a call
    that reads a device tensor, such as `.tolist()`, includes its wait for the device)."""
    import cProfile
    import pstats

    steps = decoding(target, drafter, prompt_ids, max_new, compile)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(calls):
        next(steps)
    profiler.disable()
    wall_ms = (time.perf_counter() - started) * 1e3 / calls
    steps.close()
    rows = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    top = sorted(rows.items(), key=lambda item: item[1][2], reverse=True)[:PYTHON_FUNCTIONS_SHOWN]
    return [
        {"function": "(wall time per step, profiled)", "own_ms": wall_ms, "cumulative_ms": wall_ms, "count": 1.0}
    ] + [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "own_ms": 1e3 * own / calls,
            "cumulative_ms": 1e3 * cumulative / calls,
            "count": count / calls,
        }
        for (file, line, name), (_, count, own, cumulative, _) in top
    ]


def host_overhead(step: dict[str, Any] | None, kernel_ms: float | None) -> float | None:
    """Time per step the device waits on the host: synchronized wall time minus device busy time."""
    if step is None:
        return None
    if kernel_ms is not None:
        return step["median_ms"] - kernel_ms
    return step["sync_minus_events_ms"]


def measure_end_to_end(
    target: nn.Module, drafter: DFlashDrafter, prompt_ids: list[int], s: Settings, device: torch.device
) -> dict[str, Any]:
    block = s.shape.block_size
    # Warm-up (kernels, allocator), then the baseline; its greedy tokens are what the double proposes.
    run_generation(target, None, prompt_ids, 4, None, device, s.compile)
    run_generation(target, drafter, prompt_ids, 4, block, device, s.compile)
    baseline = run_generation(target, None, prompt_ids, s.new_tokens + block, None, device, s.compile)
    # What the double proposes: the target's greedy continuation as a block verify computes it (a run that keeps
    # one token a step, slot 0's). Outside float32 a one-token step rounds otherwise than a block, and a random
    # target's logits are full of near-ties: proposing the plain decoding's tokens, every step of a bf16 run on an
    # H200 was rejected at its first draft (tau 1.0 for every plan).
    ones = [1] * (s.new_tokens + block)
    blockwise = run_generation(
        target,
        ControlledAcceptanceDrafter(drafter, list(prompt_ids) + baseline["tokens"], ones),
        prompt_ids,
        len(ones),
        block,
        device,
        s.compile,
    )
    sequence = list(prompt_ids) + blockwise["tokens"]
    runs = {}
    for tau in s.taus:
        # The plan fills the run exactly, so no step is cut short and tau is the plan's mean.
        plan = acceptance_plan(tau, block, s.new_tokens - 1)
        double = ControlledAcceptanceDrafter(drafter, sequence, plan)
        run = run_generation(target, double, prompt_ids, 1 + sum(plan), block, device, s.compile)
        run.update(
            tau_requested=tau,
            tau_planned=sum(plan) / len(plan),
            tau_measured=run.pop("tau"),
            schedule_followed=run["acceptance_lengths"] == plan,
            # Lossless: the plain decoding's tokens. Outside float32 a block verify rounds otherwise than a one-token
            # step, and random weights are full of near-ties: there, the blockwise decoding (what the double
            # proposes) is what a run that followed its plan reproduces, up to the rounding of later slots.
            lossless=run["tokens"] == baseline["tokens"][: len(run["tokens"])],
            equals_blockwise_decoding=run["tokens"] == blockwise["tokens"][: len(run["tokens"])],
            speedup_vs_baseline=run["decode_tokens_per_s"] / baseline["decode_tokens_per_s"],
        )
        del run["tokens"]
        runs[f"{tau:g}"] = run
    # The real drafter (random weights: tau about 1) beside the double's tau-1 run: a step costs the same whatever
    # is accepted, so a gap between the two is the double's (or the run order's), not the engine's.
    real = run_generation(target, drafter, prompt_ids, s.new_tokens, block, device, s.compile)
    del baseline["tokens"], blockwise["tokens"], real["tokens"]
    plan = acceptance_plan(PUBLISHED_TAU, block, s.new_tokens - 1)
    calls = min(s.profile_steps, len(plan))
    host_ops: dict[str, list[dict[str, Any]]] = {"ar_step": [], "spec_step": []}  # (filled on CUDA)
    kernels = {
        "ar_step": profile_steps(target, None, prompt_ids, calls + 1, calls, device, s.compile, host_ops["ar_step"]),
        "spec_step": profile_steps(
            target,
            ControlledAcceptanceDrafter(drafter, sequence, plan),
            prompt_ids,
            1 + sum(plan),
            calls,
            device,
            s.compile,
            host_ops["spec_step"],
        ),
    }
    python_functions = {
        "ar_step": python_profile(target, None, prompt_ids, calls + 1, calls, s.compile),
        "spec_step": python_profile(
            target, ControlledAcceptanceDrafter(drafter, sequence, plan), prompt_ids, 1 + sum(plan), calls, s.compile
        ),
    }
    return {
        "baseline": baseline,
        "controlled": runs,
        "real_drafter": real,
        "kernel_ms": kernels,
        "host_ops": host_ops,
        "python_functions": python_functions,
        "host_overhead_ms": {
            "ar_step": host_overhead(baseline["step"], kernels["ar_step"]),
            "spec_step": host_overhead(runs[PUBLISHED]["step"], kernels["spec_step"]),
        },
    }


# --- z-lab's reference ----------------------------------------------------------------------------------


def measure_reference(
    target: nn.Module, drafter: DFlashDrafter, prompt_ids: list[int], s: Settings, device: torch.device
) -> dict[str, Any]:
    """The reference's `dflash_generate` and ours on the same target and drafter weights, timed the same way:
    decode time / verify steps (its own stats), median over `reference_repeats` runs. Random drafter
    weights: tau is about 1 for both, and a step costs the same whatever is accepted."""
    try:
        from dflash import model as ref
    except ImportError as exc:
        return {"status": "unavailable", "reason": f"import dflash failed: {exc}"}
    if device.type != "cuda":  # its stats call torch.cuda.synchronize(); the CPU has nothing to wait for
        ref._cuda_time = time.perf_counter
    from transformers import Qwen3Config

    with building(device, drafter.fc.weight.dtype):
        ref_drafter = ref.DFlashDraftModel(Qwen3Config(**drafter.config.to_dict()))
    missing, unexpected = ref_drafter.load_state_dict(drafter.state_dict(), strict=False)
    if missing or unexpected:
        return {"status": "failed", "reason": f"weights do not map: missing {missing[:4]}, unexpected {unexpected[:4]}"}
    ref_drafter.eval()
    input_ids = torch.tensor([prompt_ids], device=device)
    block = s.shape.block_size

    def reference_ms_per_step(size: int, n: int, ref_drafter: Any = ref_drafter) -> float:
        out = ref.dflash_generate(
            ref_drafter, target, input_ids, max_new_tokens=n, stop_token_ids=None, block_size=size, return_stats=True
        )
        return 1e3 * out.time_per_output_token * out.num_output_tokens / len(out.acceptance_lengths)

    def ours_ms_per_step(size: int, n: int) -> float:
        run = run_generation(target, drafter if size > 1 else None, prompt_ids, n, size, device, s.compile)
        return run["ms_per_step_mean"]

    result: dict[str, Any] = {"status": "ok", "tokens_per_run": s.reference_tokens}
    for name, fn in (("reference", reference_ms_per_step), ("ours", ours_ms_per_step)):
        fn(block, 4)  # warm-up
        fn(1, 4)
        result[name] = {
            "spec_step_ms": statistics.median(fn(block, s.reference_tokens) for _ in range(s.reference_repeats)),
            "baseline_step_ms": statistics.median(fn(1, s.reference_tokens) for _ in range(s.reference_repeats)),
        }
    for kind in ("spec_step", "baseline_step"):
        result[f"{kind}_ours_x_reference"] = result["ours"][f"{kind}_ms"] / result["reference"][f"{kind}_ms"]
    del ref_drafter
    return result


# --- one precision, and the whole run -------------------------------------------------------------------


def predictions(floors: dict[str, Any], e2e: dict[str, Any]) -> dict[str, Any]:
    ar_ms = e2e["baseline"]["step"]["median_ms"]
    spec_ms = e2e["controlled"][PUBLISHED]["step"]["median_ms"]
    return {
        "tau": PUBLISHED_TAU,
        "baseline_tokens_per_s": 1e3 / ar_ms,
        "spec_tokens_per_s": PUBLISHED_TAU * 1e3 / spec_ms,
        "speedup": PUBLISHED_TAU * ar_ms / spec_ms,
        "speedup_at_floor": PUBLISHED_TAU * floors["ar_floor_ms"] / floors["spec_floor_ms"],
    }


def target_checks(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each figure against its target from the issue (the targets are set for bf16; NF4 is reported alike)."""
    floors, e2e = run["floors"], run["end_to_end"]
    ar_ms = e2e["baseline"]["step"]["median_ms"]
    spec_ms = e2e["controlled"][PUBLISHED]["step"]["median_ms"]
    overhead = e2e["host_overhead_ms"]
    checks = [
        ("AR step / AR floor", ar_ms / floors["ar_floor_ms"], "<=", AR_STEP_MAX_X_FLOOR),
        ("spec step / AR floor", spec_ms / floors["ar_floor_ms"], "<=", SPEC_STEP_MAX_X_AR_FLOOR),
        (
            "spec step ours / reference",
            run["reference"].get("spec_step_ours_x_reference"),
            "<=",
            SPEC_STEP_MAX_X_REFERENCE,
        ),
        ("host overhead per AR step (ms)", overhead["ar_step"], "<", HOST_OVERHEAD_MAX_MS),
        ("host overhead per spec step (ms)", overhead["spec_step"], "<", HOST_OVERHEAD_MAX_MS),
    ]
    out = []
    for figure, value, op, bound in checks:
        met = None if value is None else (value <= bound if op == "<=" else value < bound)
        out.append({"figure": figure, "value": value, "target": f"{op} {bound:.3g}", "met": met})
    return out


def measure_precision(
    run: dict[str, Any],
    target: nn.Module,
    drafter: DFlashDrafter,
    s: Settings,
    device: torch.device,
    gb_per_s: float,
    deadline: float,
    with_reference: bool,
    save: Callable[[], None],
) -> None:
    """Fill `run` part by part (`save` after each: a run cut short keeps what it measured)."""
    name = run["precision"]
    dtype = getattr(torch, s.dtype)
    gen = torch.Generator(device="cpu").manual_seed(s.seed)
    prompt_ids = torch.randint(0, s.shape.vocab - 1, (s.context,), generator=gen).tolist()
    prompt = torch.tensor([prompt_ids], device=device)
    run["floors"] = step_floors(s.shape, target, drafter, s.context, dtype, gb_per_s)
    save()
    if s.verify_sizes:  # (none: the decode loop alone, e.g. to spare a compiled run the graphs of every size)
        run["micro"] = measure_target_steps(target, drafter.config.target_layer_ids, prompt, s)
        run["micro"]["draft_step"] = measure_draft_step(drafter, prompt, s)
        log(f"{name}: step micro-benchmarks done")
        save()
    run["end_to_end"] = measure_end_to_end(target, drafter, prompt_ids, s, device)
    log(f"{name}: end to end done")
    run["predicted"] = predictions(run["floors"], run["end_to_end"])
    save()
    if not with_reference:
        run["reference"] = {"status": "skipped", "reason": "--no-reference"}
    elif name not in s.reference_precisions:
        run["reference"] = {"status": "skipped", "reason": f"not measured for {name} in this configuration"}
    elif time.monotonic() > deadline:
        run["reference"] = {"status": "skipped", "reason": "time budget spent"}
    else:
        try:
            run["reference"] = measure_reference(target, drafter, prompt_ids, s, device)
        except Exception:
            run["reference"] = {"status": "failed", "reason": traceback.format_exc()}
    run["targets"] = target_checks(run)


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    try:
        import bitsandbytes

        env["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        env["bitsandbytes"] = None
    try:
        import dflash  # noqa: F401

        env["dflash_reference"] = metadata.version("dflash")  # a wheel on sys.path carries its metadata too
    except ImportError:
        env["dflash_reference"] = None
    except metadata.PackageNotFoundError:
        env["dflash_reference"] = "unknown version"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=props.total_memory / 2**30,
            multiprocessors=props.multi_processor_count,
        )
    return env


def run_benchmark(s: Settings, *, with_reference: bool, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    started = time.monotonic()
    deadline = started + s.time_budget_s
    device = torch.device(s.device)
    dtype = getattr(torch, s.dtype)
    results: dict[str, Any] = {"settings": asdict(s), "environment": environment(device), "runs": {}}
    results["bandwidth"] = copy_bandwidth(device, s.copy_mib, s.warmup, s.reps)
    save(results)
    log(f"copy bandwidth {results['bandwidth']['gb_per_s']:.0f} GB/s; building the target")
    t0 = time.monotonic()
    target = build_target(s.shape, device, dtype, s.seed)
    drafter = build_drafter(s.shape, target, dtype, s.seed + 1)
    results["build_s"] = time.monotonic() - t0
    try:
        results["whole_buffer_attention"] = measure_whole_buffer_attention(s, device, dtype)
    except Exception:
        results["whole_buffer_attention"] = {"error": traceback.format_exc()}
    save(results)
    for name in s.precisions:
        if time.monotonic() > deadline:
            results["runs"][name] = {"precision": name, "skipped": "time budget spent"}
            continue
        log(f"measuring {name}")
        run = results["runs"][name] = {"precision": name}
        try:  # one device call is all there is: a failure is recorded and the next precision still runs
            if name == "nf4":
                t0 = time.monotonic()
                results["nf4_quantized_layers"] = quantize_nf4(target, dtype)
                results["nf4_quantize_s"] = time.monotonic() - t0
            measure_precision(
                run,
                target,
                drafter,
                s,
                device,
                results["bandwidth"]["gb_per_s"],
                deadline,
                with_reference,
                lambda: save(results),
            )
        except Exception:
            run["error"] = traceback.format_exc()
            log(f"{name} failed:\n{run['error']}")
        save(results)
    results["nf4_vs_dense"] = compare_precisions(results["runs"], s.precisions)
    results["total_s"] = time.monotonic() - started
    save(results)
    return results


def compare_precisions(runs: dict[str, Any], precisions: tuple[str, ...]) -> dict[str, Any] | None:
    """Which precision wins per step kind, so the planner uses only what wins."""
    dense = next((runs.get(p) for p in precisions if p != "nf4"), None)
    nf4 = runs.get("nf4")
    if not dense or not nf4 or "end_to_end" not in dense or "end_to_end" not in nf4:
        return None

    def ms(run: dict[str, Any], kind: str) -> float:
        e2e = run["end_to_end"]
        return (e2e["baseline"] if kind == "ar_step" else e2e["controlled"][PUBLISHED])["step"]["median_ms"]

    out = {}
    for kind in ("ar_step", "spec_step"):
        ratio = ms(nf4, kind) / ms(dense, kind)
        out[kind] = {"nf4_x_dense": ratio, "faster": "nf4" if ratio < 1 else "dense"}
    return out


# --- output ---------------------------------------------------------------------------------------------


_STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[gpu_bench {time.monotonic() - _STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def median_p90(t: dict[str, Any]) -> str:
    return f"{t['median_ms']:.3g} ms (p90 {t['p90_ms']:.3g})"


def render_run(name: str, run: dict[str, Any]) -> list[str]:
    if "targets" not in run:
        why = run.get("skipped") or "failed: " + (run.get("error") or "cut short").strip().splitlines()[-1]
        return [f"\n== {name}: {why}"]
    floors, e2e, pred, ref = run["floors"], run["end_to_end"], run["predicted"], run["reference"]
    lines = [
        f"\n== {name}",
        f"floor: AR step {floors['ar_floor_ms']:.3g} ms ({floors['ar_step_bytes'] / 1e9:.3g} GB), "
        f"spec step {floors['spec_floor_ms']:.3g} ms ({floors['spec_floor_x_ar_floor']:.3g}x the AR floor)",
    ]
    if "micro" in run:
        micro = run["micro"]
        lines += [
            f"AR forward {median_p90(micro['ar_step'])}, draft pass {median_p90(micro['draft_step'])}",
            "verify by block size (median ms): "
            + "  ".join(f"{b}:{t['median_ms']:.3g}" for b, t in micro["verify"].items()),
        ]
    lines.append(
        f"engine AR step {median_p90(e2e['baseline']['step'])}, {e2e['baseline']['decode_tokens_per_s']:.3g} tok/s"
    )
    for tau, r in e2e["controlled"].items():
        lines.append(
            f"  tau {tau:>4}: measured {r['tau_measured']:.3g}, step {median_p90(r['step'])}, "
            f"{r['decode_tokens_per_s']:.3g} tok/s = {r['speedup_vs_baseline']:.3g}x; "
            f"plan followed {fmt(r['schedule_followed'])}, lossless {fmt(r['lossless'])} "
            f"(= blockwise decoding {fmt(r['equals_blockwise_decoding'])}); draft {r['draft_ms_per_step']:.3g} ms, "
            f"verify {r['verify_ms_per_step']:.3g} ms a step"
        )
    real = e2e["real_drafter"]
    lines.append(
        f"  real drafter: tau {real['tau']:.3g}, step {median_p90(real['step'])}; draft {real['draft_ms_per_step']:.3g} ms,"
        f" verify {real['verify_ms_per_step']:.3g} ms a step"
    )
    for kind, functions in e2e["python_functions"].items():
        shown = ", ".join(f"{f['function']} {f['own_ms']:.3g}" for f in functions[:5])
        lines.append(f"  python, {kind} (own ms a step, profiled): {shown}")
    lines.append(
        f"predicted at tau {pred['tau']}: {pred['spec_tokens_per_s']:.3g} tok/s against "
        f"{pred['baseline_tokens_per_s']:.3g} = {pred['speedup']:.3g}x (at the floors: {pred['speedup_at_floor']:.3g}x)"
    )
    if ref.get("status") == "ok":
        theirs, ours = ref["reference"], ref["ours"]
        lines.append(
            f"reference per step: spec {theirs['spec_step_ms']:.3g} ms (ours {ours['spec_step_ms']:.3g}), "
            f"baseline {theirs['baseline_step_ms']:.3g} ms (ours {ours['baseline_step_ms']:.3g})"
        )
    else:
        lines.append(f"reference: {ref.get('status')} ({''.join((ref.get('reason') or '').strip().splitlines()[-1:])})")
    lines.append(f"{'figure':<36} {'measured':>10} {'target':>10}  met")
    lines += [f"{c['figure']:<36} {fmt(c['value']):>10} {c['target']:>10}  {fmt(c['met'])}" for c in run["targets"]]
    return lines


def render_table(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        f"device: {env.get('gpu', env['device'])}  torch {env['torch']}  transformers {env['transformers']}"
        f"  bitsandbytes {env['bitsandbytes']}  reference {env['dflash_reference']}",
        f"copy bandwidth: {results['bandwidth']['gb_per_s']:.0f} GB/s (read + write)",
    ]
    attention = results.get("whole_buffer_attention") or {}
    for capacity, by_query in attention.get("by_capacity", {}).items():
        for q, ways in by_query.items():
            lines.append(
                f"attention over a whole buffer ({capacity} positions, {attention['layers']} layers), {q} quer"
                f"{'y' if q == '1' else 'ies'}, ms a step: "
                + ", ".join(f"{name} {t['ms_per_step']:.3g}" for name, t in ways.items() if "ms_per_step" in t)
            )
    for name, run in results["runs"].items():
        lines += render_run(name, run)
    if results.get("nf4_vs_dense"):
        lines.append(
            "\nNF4 step time / dense: "
            + ", ".join(
                f"{k} {v['nf4_x_dense']:.3g}x ({v['faster']} is faster)" for k, v in results["nf4_vs_dense"].items()
            )
        )
    return "\n".join(lines)


def block_sizes(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(",") if part.strip())
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"block sizes must be >= 1, got {text}")
    return values


def taus(text: str) -> tuple[float, ...]:
    values = tuple(float(part) for part in text.split(",") if part.strip())
    if any(value < 1 for value in values):  # (a step commits one token at least)
        raise argparse.ArgumentTypeError(f"acceptance lengths must be >= 1, got {text}")
    return values


def at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark the DFlash fast path on a GPU: floor, step times, end to end, and z-lab's reference.",
        epilog="Example (device machine): python -m benchmarks.gpu_bench --reference-wheel .whl/"
        + REFERENCE_WHEEL
        + " --output $OUT/gpu_bench.json",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: every code path, in seconds")
    parser.add_argument("--output", type=Path, help="write the results as JSON here (rewritten after each section)")
    parser.add_argument("--json", action="store_true", help="print the JSON to stdout instead of the table")
    parser.add_argument(
        "--reference-wheel", type=Path, help=f"import z-lab's reference from its wheel ({REFERENCE_WHEEL})"
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the reference comparison")
    parser.add_argument("--precisions", help="comma-separated subset of the default precisions (e.g. bf16)")
    parser.add_argument("--context", type=at_least(1), help="prompt length, i.e. KV cache length of the measured steps")
    parser.add_argument("--new-tokens", type=at_least(2), help="tokens per end-to-end run")
    parser.add_argument("--reps", type=at_least(1), help="timed repetitions per micro-benchmark")
    parser.add_argument("--time-budget", type=float, help="seconds after which remaining sections are skipped")
    parser.add_argument("--compile", action="store_true", help="measure the engine's compiled steps (CUDA graphs)")
    parser.add_argument(
        "--layers", type=at_least(1), help="the target's decoder layers (the shape's widths kept; floors follow)"
    )
    parser.add_argument(
        "--verify-sizes",
        type=block_sizes,
        help="block sizes of the verify sweep, comma-separated (empty: no micro-benchmarks, the decode loop alone;"
        " each size is one more graph to compile with --compile)",
    )
    parser.add_argument("--taus", type=taus, help=f"controlled acceptance lengths (must include {PUBLISHED})")
    parser.add_argument(
        "--capacity",
        type=at_least(1),
        help="the whole-buffer state's least capacity in positions (engine.target.attention.MIN_CAPACITY, 8192): "
        "what a compiled step's attention costs over a buffer sized near the context",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = smoke_settings() if args.smoke else full_settings()
    if s.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --smoke to run the CPU configuration", file=sys.stderr)
        return 2
    overrides: dict[str, Any] = {}
    if args.precisions:
        wanted = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
        unknown = set(wanted) - set(s.precisions)
        if unknown:
            print(f"error: unknown precision {sorted(unknown)}; choose from {', '.join(s.precisions)}", file=sys.stderr)
            return 2
        overrides["precisions"] = wanted
    for field_name, value in (
        ("context", args.context),
        ("new_tokens", args.new_tokens),
        ("reps", args.reps),
        ("time_budget_s", args.time_budget),
        ("compile", args.compile or None),
        ("verify_sizes", args.verify_sizes),
        ("taus", args.taus),
    ):
        if value is not None:
            overrides[field_name] = value
    if args.layers:
        overrides["shape"] = replace(s.shape, layers=args.layers)
    if args.taus is not None and PUBLISHED_TAU not in args.taus:
        print(f"error: --taus must include {PUBLISHED} (the predictions and targets read it)", file=sys.stderr)
        return 2
    s = replace(s, **overrides)
    if args.capacity:  # (read by AttentionState.reserve and the whole-buffer micro-benchmark)
        target_attention.MIN_CAPACITY = args.capacity
    if args.reference_wheel:
        if not args.reference_wheel.is_file():
            print(f"error: no such wheel: {args.reference_wheel}", file=sys.stderr)
            return 2
        sys.path.insert(0, str(args.reference_wheel))  # a pure-Python wheel imports as a zip

    def save(results: dict[str, Any]) -> None:
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(results, indent=2) + "\n")

    if args.smoke:
        torch.set_num_threads(1)  # tiny matrices gain nothing from threads, and spinning ones stall a busy CI box
    results = run_benchmark(s, with_reference=not args.no_reference, save=save)
    print(json.dumps(results, indent=2) if args.json else render_table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
