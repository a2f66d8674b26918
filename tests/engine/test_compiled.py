"""Compiled target steps: one graph per block size, no recompiles while decoding, same tokens as eager."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_module
from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs
from torch._dynamo.utils import counters

import dflash_cli.engine.scheduler as scheduler_module
import dflash_cli.engine.target.attention as target_module
from dflash_cli.engine import SamplingParams, collect, generate
from dflash_cli.engine.compiled import jit
from dflash_cli.engine.compiled.jit import CompiledStep, run_drafter, run_target
from dflash_cli.engine.policy import target_key
from dflash_cli.engine.target.attention import (
    KEY_PIECES,
    MIN_CAPACITY,
    SPLIT_QUERIES,
    WHOLE_BUFFER,
    AttentionState,
    whole_buffer_attention,
)
from helpers.drafters import OracleDrafter, random_drafter
from helpers.golden import GOLDEN_SETS, check_golden_sets
from helpers.tiny_models import build_tiny, hf_greedy, sharp_tiny


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def traced_only(
    monkeypatch: pytest.MonkeyPatch, fresh_dynamo
) -> tuple[CompileCounterWithBackend, CompileCounterWithBackend]:
    """Both compiled steps traced by dynamo exactly as for inductor, then run by the eager backend (seconds, not
    minutes); each counts the graphs dynamo compiles for it."""
    counters = CompileCounterWithBackend("eager"), CompileCounterWithBackend("eager")
    target_step = CompiledStep(run_target, "target step", "cpu", backend=counters[0], cuda_graphs=True)
    draft_step = CompiledStep(run_drafter, "draft step", "cpu", backend=counters[1])
    monkeypatch.setattr(target_module, "compiled_step", lambda device: target_step)
    monkeypatch.setattr(scheduler_module, "compiled_draft_step", lambda device: draft_step)
    return counters


@pytest.fixture
def whole_buffer(monkeypatch: pytest.MonkeyPatch, fresh_dynamo) -> Iterator[list[torch.fx.GraphModule]]:
    """The target's step as CUDA takes it (fixed shapes, so the state hands attention whole K/V buffers), traced
    by dynamo and run by the eager backend on the CPU. Returns the graphs dynamo made."""
    backend = EagerAndRecordGraphs()
    step = CompiledStep(run_target, "target step", "cpu", backend=backend, cuda_graphs=True, fixed_shapes=True)
    draft_step = CompiledStep(run_drafter, "draft step", "cpu", backend="eager")
    monkeypatch.setattr(target_module, "compiled_step", lambda device: step)
    monkeypatch.setattr(scheduler_module, "compiled_draft_step", lambda device: draft_step)
    yield backend.graphs


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


class VaryingOracle(OracleDrafter):
    """Runs its own drafter forward (compiled when the loop compiles), then proposes the target's continuation
    right for 0..3 slots depending on the position: steps commit 1 to 4 tokens, so the draft step sees 1 to 4
    new context rows."""

    def propose(self, features, block_ids, starts, cache, **rows):
        self.draft_hidden(features, block_ids, starts, cache, **rows)
        self.correct = random.Random(starts[0]).randrange(4)
        return super().propose(features, block_ids, starts, cache, **rows)


@pytest.mark.slow
def test_no_recompiles_in_a_generation_at_a_fixed_block_size(traced_only) -> None:
    target_graphs, draft_graphs = traced_only
    target = sharp_tiny("llama", 1)
    params = SamplingParams(max_new_tokens=64)
    for prompt in ([1, 2, 3], list(range(5, 30))):
        reference = hf_greedy(target, prompt, 64)
        drafter = VaryingOracle(target, prompt + reference, block_size=4)
        result = collect(generate(target, drafter, prompt, params, compile=True))
        assert result.token_ids == reference
        assert set(result.acceptance_lengths) == {1, 2, 3, 4}
        # one graph per step function, for both generations: the context grows, 1 to 4 new rows reach the
        # drafter, the last blocks shorten, and another drafter object of the same shape takes the same graph
        assert (target_graphs.frame_count, draft_graphs.frame_count) == (1, 1)
    baseline = collect(generate(target, None, [9, 8, 7], params, compile=True))
    assert target_graphs.frame_count == 2, "the plain step is the target's second (and last) graph"
    assert baseline.token_ids == hf_greedy(target, [9, 8, 7], 64)


@pytest.mark.slow
def test_a_step_that_compiles_counts_as_compiling_not_decoding(traced_only) -> None:
    """A step that compiles a graph (minutes on a CPU) is reported as `compile_s`, kept out of the decode time
    (tok/s) and out of the draft and verify times that the block policy and bench read."""
    target = sharp_tiny("llama", 2)
    prompt, params = [4, 5, 6], SamplingParams(max_new_tokens=24)
    reference = hf_greedy(target, prompt, 24)
    drafter = VaryingOracle(target, prompt + reference, block_size=4)
    started = time.perf_counter()
    first = collect(generate(target, drafter, prompt, params, compile=True)).stats
    wall = time.perf_counter() - started
    again = collect(generate(target, drafter, prompt, params, compile=True)).stats
    assert again.compile_s == 0 and first.compile_s > 5 * again.decode_s  # tracing dwarfs a tiny decode
    assert first.decode_s < first.compile_s and first.decode_s + first.compile_s < wall
    assert first.draft_s + first.verify_s <= first.decode_s


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "block_size"), [(0, 2), (1, 8)])
def test_compiled_greedy_equals_transformers_greedy(traced_only, seed: int, block_size: int) -> None:
    target = sharp_tiny("llama", seed)
    drafter = random_drafter(target, seed=seed, block_size=block_size)
    prompt = [1 + (seed * 7 + i * 13) % 90 for i in range(3 + seed * 5)]
    result = collect(generate(target, drafter, prompt, SamplingParams(max_new_tokens=33), compile=True))
    assert result.token_ids == hf_greedy(target, prompt, 33)
    assert sum(result.acceptance_lengths) == 32


@pytest.mark.slow
def test_a_compiled_conversation_reuses_its_prefix_exactly(traced_only) -> None:
    """Prefix reuse with compiled steps: the first draft of a later turn (a context of many kept and new rows, in
    the compiled draft step) gives what an eager whole prefill gives."""
    target = sharp_tiny("qwen3", 0)
    drafter = random_drafter(target, fmt="swa", block_size=4, window=6)
    params = SamplingParams(max_new_tokens=12)
    prompt = [5, 6, 7, 8, 9]
    for turn in range(3):
        compiled = collect(generate(target, drafter, prompt, params, compile=True))
        eager = collect(generate(target, drafter, prompt, params, prefix_cache=False))
        assert (compiled.token_ids, compiled.acceptance_lengths) == (eager.token_ids, eager.acceptance_lengths)
        assert turn == 0 or compiled.stats.cached_tokens >= len(prompt) - 3
        prompt = prompt + compiled.token_ids + [11, 12]


@pytest.mark.slow
def test_every_golden_set_with_traced_steps(traced_only) -> None:
    target_graphs, draft_graphs = traced_only
    shown: list[str] = []
    sizes = check_golden_sets(["qwen3-tiny", *GOLDEN_SETS], shown)
    assert len(sizes) >= 5 and target_graphs.frame_count >= 1 and draft_graphs.frame_count >= 3
    assert any("draft step" in m for m in shown) and any("target step" in m for m in shown)


@pytest.mark.slow
def test_whole_buffer_steps_reproduce_the_golden_sets(whole_buffer: list[torch.fx.GraphModule]) -> None:
    """The CUDA-graph layout (attention over the whole K/V buffer, a length on the device) on the CPU: DFlash and
    the plain decoding give the reference's tokens. A one-token step once attended every slot of the buffer
    (transformers drops its mask for one query): the plain decoding was wrong on the GPU."""
    check_golden_sets(["qwen3-tiny", "qwen3-tiny-dflash2"], [], baseline=True)
    # Inside the graph nothing but the K/V buffers is written (CUDA graphs hold those as static): the drafter's
    # features leave as outputs. A graph that copied into the features buffer ran without CUDA graphs.
    assert whole_buffer and all(
        node.target != "copy_" for graph in whole_buffer for node in graph.graph.nodes if node.op == "call_method"
    )
    assert any(graph.graph.find_nodes(op="call_method", target="index_copy_") for graph in whole_buffer)


@pytest.mark.slow
def test_whole_buffer_steps_keep_compiling_past_dynamos_default_limit(
    fresh_dynamo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server on a GPU decodes at many block sizes, drafted and plain, each a graph of the target's step (fixed
    shapes): past dynamo's default limit of 8 graphs the step would stop compiling and run eagerly for good. Nine
    block sizes and a plain decoding, from dynamo's default: every one compiled, each the eager decoding's tokens."""
    with torch._dynamo.config.patch(recompile_limit=8):  # (dynamo's default, whatever an earlier test set)
        backend = EagerAndRecordGraphs()
        step = CompiledStep(run_target, "target step", "cpu", backend=backend, cuda_graphs=True, fixed_shapes=True)
        monkeypatch.setattr(target_module, "compiled_step", lambda device: step)
        draft_step = CompiledStep(run_drafter, "draft step", "cpu", backend="eager")
        monkeypatch.setattr(scheduler_module, "compiled_draft_step", lambda device: draft_step)
        target = sharp_tiny("qwen3", seed=3)
        prompt, params = [5, 17, 3, 42, 9, 11], SamplingParams(max_new_tokens=12)
        eager = collect(generate(target, None, prompt, params))
        assert collect(generate(target, None, prompt, params, compile=True)).token_ids == eager.token_ids
        for block_size in range(2, 11):
            oracle = OracleDrafter(target, prompt + eager.token_ids, block_size=block_size, correct=[0, 1])
            assert collect(generate(target, oracle, prompt, params, compile=True)).token_ids == eager.token_ids
        assert step.broken is None and len(backend.graphs) >= 10


@pytest.mark.slow
def test_whole_buffer_attention_reads_each_kv_head_once(
    whole_buffer: list[torch.fx.GraphModule], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the whole buffer an SDPA target with grouped query heads runs WHOLE_BUFFER: no K/V copy per query head
    (transformers' repeat_kv, which its SDPA path takes under dynamo when a mask is given) in a step's graph, and
    the eager decoding's tokens, plain and drafted (blocks of 1 to 4 tokens)."""
    repeats = []
    original = sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda *args: repeats.append(1) or original(*args))
    target = sharp_tiny("qwen3", seed=3)
    prompt, params = [5, 17, 3, 42, 9, 11], SamplingParams(max_new_tokens=24)
    eager = collect(generate(target, None, prompt, params))
    assert collect(generate(target, None, prompt, params, compile=True)).token_ids == eager.token_ids
    assert target.config._attn_implementation == WHOLE_BUFFER and whole_buffer
    oracle = OracleDrafter(target, prompt + eager.token_ids, block_size=4, correct=[0, 3, 1, 2])
    drafted = collect(generate(target, oracle, prompt, params, compile=True))
    assert drafted.token_ids == eager.token_ids and set(drafted.acceptance_lengths) == {1, 2, 3, 4}
    assert not repeats
    # Kept for a later state that reads no whole buffer (the same attention; a switch back would make the compiled
    # state's graphs fail their guards on its next step), and the step costs' key says SDPA either way.
    assert collect(generate(target, None, prompt, params)).token_ids == eager.token_ids
    assert target.config._attn_implementation == WHOLE_BUFFER and target_key(target, True)["attention"] == "sdpa"


@pytest.mark.parametrize("queries", [1, 5, SPLIT_QUERIES + 1])
@pytest.mark.parametrize("keys", [3 * KEY_PIECES, 3 * KEY_PIECES + 1])
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_whole_buffer_attention_is_sdpa(queries: int, keys: int, additive: bool, compiled: bool, fresh_dynamo) -> None:
    """WHOLE_BUFFER's attention equals transformers' SDPA attention (which copies K/V per query head under a mask)
    in float32: eager (SDPA, packed) and traced as a compiled step traces it (keys in pieces, for a short query
    under a boolean mask over a multiple of KEY_PIECES keys); two rows, each under its own mask (boolean, or
    additive as eager masks are) that hides different keys from each query, a whole piece of keys included.
    Softcapping, which transformers' SDPA refuses, is refused alike."""
    torch.manual_seed(queries + keys)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    query, key, value = torch.randn(2, 8, queries, 16), torch.randn(2, 2, keys, 16), torch.randn(2, 2, keys, 16)
    mask = torch.rand(2, 1, queries, keys) < 0.6
    mask[..., KEY_PIECES : 2 * KEY_PIECES] = False  # a piece no query sees
    mask[..., 0] = True
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    attention = (
        torch.compile(whole_buffer_attention, backend="eager", fullgraph=True) if compiled else whole_buffer_attention
    )
    ours, _ = attention(module, query, key, value, mask, scaling=0.25)
    theirs, _ = sdpa_module.sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert ours.shape == theirs.shape == (2, queries, 8, 16)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="softcap"):
        whole_buffer_attention(module, query, key, value, mask, scaling=0.25, softcap=30.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keys_in_pieces_stay_finite_and_close_in_half_precision(dtype: torch.dtype, fresh_dynamo) -> None:
    """Large values over pieces of many keys, most pieces unseen (a short context in a long buffer): each piece's sum
    is normalized before it is rounded, so float16 does not overflow (inf * 0 was a NaN), and the result is SDPA's
    to the dtype's rounding."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    capacity = 16 * 512
    query, key = torch.randn(1, 8, 2, 64, dtype=dtype), torch.randn(1, 2, capacity, 64, dtype=dtype)
    value = (200 + torch.randn(1, 2, capacity, 64)).to(dtype)
    mask = torch.zeros(1, 1, 2, capacity, dtype=torch.bool)
    mask[..., :700] = True  # one whole piece, part of the next, fourteen unseen
    attention = torch.compile(whole_buffer_attention, backend="eager", fullgraph=True)
    ours, _ = attention(module, query, key, value, mask)
    theirs, _ = sdpa_module.sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.float(), theirs, rtol=2e-2, atol=0.5)


def test_whole_buffer_capacity_splits_into_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-buffer state's capacity is a multiple of KEY_PIECES, as reserved and as grown (a compiled step's
    attention then cuts its keys in pieces)."""
    step = CompiledStep(run_target, "target step", "cpu", backend="eager", cuda_graphs=True, fixed_shapes=True)
    monkeypatch.setattr(target_module, "compiled_step", lambda device: step)
    target = sharp_tiny("qwen3", seed=3)
    state = AttentionState(target)
    state.reserve(MIN_CAPACITY + 3, 4, (), compile=True)
    assert state.full_view and state.capacity % KEY_PIECES == 0 and state.capacity >= MIN_CAPACITY + 7
    state.make_room(state.capacity + 5, 4)
    assert state.capacity % KEY_PIECES == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_whole_buffer_steps_keep_sliding_windows(whole_buffer: list[torch.fx.GraphModule], family: str) -> None:
    """Targets with sliding-window layers beside full ones (a mask per layer kind; gpt-oss's eager attention takes
    additive masks): the whole-buffer steps decode past the window as the eager steps do."""
    target = build_tiny(family, seed=1)
    prompt, params = list(range(3, 13)), SamplingParams(max_new_tokens=16)  # (the window is 4)
    eager = collect(generate(target, None, prompt, params))
    assert collect(generate(target, None, prompt, params, compile=True)).token_ids == eager.token_ids
    assert whole_buffer


@pytest.mark.slow
def test_inductor_reproduces_the_public_golden_sets(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, fresh_dynamo
) -> None:
    """The real compiler (inductor) for both steps on the three public sets (classic, sliding, DFlash2): minutes
    cold on a small CPU, so its cache lives in pytest's cache folder."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(request.config.cache.mkdir("inductor")))
    # The products in inductor's own C++ GEMM kernels over frozen weights, the CPU's compiled path; autotuning
    # each tiny shape against MKL as well would double this test's minutes (MKL's products are the eager path's).
    options = {**jit.CPU_INDUCTOR_OPTIONS, "max_autotune_gemm_backends": "CPP"}
    monkeypatch.setattr(jit, "CPU_INDUCTOR_OPTIONS", options)
    monkeypatch.setattr(jit, "_STEPS", {})
    shown: list[str] = []
    check_golden_sets(["qwen3-tiny", "qwen3-tiny-swa", "qwen3-tiny-dflash2"], shown)
    assert any("draft step" in m for m in shown) and any("target step for blocks of 8" in m for m in shown)


@pytest.mark.slow
def test_a_cpu_step_runs_inductors_gemm_kernels_over_frozen_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_dynamo
) -> None:
    """What brings a compiled CPU step near the bandwidth floor (docs/benchmarks.md): the weights frozen into the
    graph, so that inductor's C++ GEMM kernels over packed weights become candidates beside MKL's and each product
    is timed (autotuned) to pick one. Given as torch.compile's `options`, freezing is silently not applied.
    (inductor then packs the weights as MKL tensors, which its graph cache cannot pickle: each new process lowers
    the graph again; benchmarks/results/history.md has the cost.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing cached: the choice is timed here
    layer = torch.nn.Linear(64, 96)
    step = CompiledStep(lambda module, x: module(x), "test step", "cpu")
    x = torch.randn(1, 3, 64)
    with torch.inference_mode():  # as the engine steps: freezing applies to inference graphs only
        torch.testing.assert_close(step(layer, x), layer(x), rtol=1e-5, atol=1e-5)
    assert counters["inductor"]["select_algorithm_autotune"] >= 1
