"""The target's static state: preallocated K/V rewound by length, features captured without per-step hooks."""

from __future__ import annotations

import pytest
import torch

from dflash_cli.engine import SamplingParams, generate, speculative_generate
from dflash_cli.engine.target import _STATES, acquire_state, release_state
from dflash_cli.engine.target.attention import AttentionState
from helpers.drafters import OracleDrafter, random_drafter
from helpers.tiny_models import hf_greedy, sharp_tiny


def _hooks(target) -> int:
    return sum(len(layer._forward_hooks) for layer in target.model.layers)


def test_steps_write_in_place_and_rejections_only_move_the_length():
    target = sharp_tiny("qwen3", 3, 3)
    prompt = [5, 17, 42, 8, 9]
    reference = hf_greedy(target, prompt, 40)
    drafter = OracleDrafter(target, prompt + reference, block_size=8, correct=2)  # every step rejects 5 drafts
    hooks_before = _hooks(target)
    pointers, lengths, hooks_during = set(), [], set()
    steps = generate(target, drafter, prompt, SamplingParams(max_new_tokens=40))
    state = None
    committed = 0
    for step in steps:
        state = state or _STATES[target]
        committed += len(step.token_ids)
        pointers.add((state._keys[0].data_ptr(), state._values[-1].data_ptr(), state._block_features.data_ptr()))
        hooks_during.add(_hooks(target))
        # the newest token is not in the state yet: it opens the next block
        lengths.append((state.lengths[0], len(prompt) + committed - 1))
    assert len(pointers) == 1, "buffers must be written in place, never reallocated during a generation"
    assert hooks_during == {hooks_before + len(drafter.config.target_layer_ids)}, (
        "hooks are installed once, not per step"
    )
    assert all(a == b for a, b in lengths[:-1])
    assert committed == 40


def test_state_is_reused_across_requests_and_shared_safely():
    target = sharp_tiny("qwen3", 4, 3)
    drafter = random_drafter(target, block_size=4)
    prompts = ([1, 2, 3], [7, 8, 9, 10, 11, 12])
    expected = [hf_greedy(target, p, 20) for p in prompts]
    assert [speculative_generate(target, drafter, p, 20).token_ids for p in prompts] == expected
    state = _STATES[target]
    assert [speculative_generate(target, None, p, 20).token_ids for p in prompts] == expected
    assert _STATES[target] is state, "one state per target, reused"
    # Two generations interleaved on one target: the second gets a one-off state, which leaves no hooks behind.
    hooks = _hooks(target)
    first = generate(target, drafter, prompts[0], SamplingParams(max_new_tokens=20))
    second = generate(target, drafter, prompts[1], SamplingParams(max_new_tokens=20))
    outputs = {0: [], 1: []}
    for a, b in zip(first, second):
        outputs[0] += a.token_ids
        outputs[1] += b.token_ids
    outputs[0] += [t for s in first for t in s.token_ids]
    outputs[1] += [t for s in second for t in s.token_ids]
    assert [outputs[0], outputs[1]] == expected
    assert _hooks(target) == hooks and not state.busy


def test_baseline_captures_no_features():
    target = sharp_tiny("qwen3", 5, 3)
    drafter = random_drafter(target, block_size=4)
    speculative_generate(target, drafter, [1, 2, 3], 8)
    state = _STATES[target]
    assert _hooks(target) == len(drafter.config.target_layer_ids)
    state._features = state._block_features = None  # a hook that recorded anything now would fail
    assert speculative_generate(target, None, [1, 2, 3], 8).token_ids == hf_greedy(target, [1, 2, 3], 8)
    assert _hooks(target) == len(drafter.config.target_layer_ids), (
        "hooks stay installed (compiled steps keep their guards)"
    )


def test_one_off_state_is_closed():
    target = sharp_tiny("qwen3", 6, 3)
    held = acquire_state(target)
    other = acquire_state(target)
    assert other is not held and isinstance(other, AttentionState)
    other.reserve(16, 4, (0, 1))
    assert _hooks(target) == 2
    release_state(other)
    assert _hooks(target) == 0
    release_state(held)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cache_zeros_costs_memory_only_where_written(dtype) -> None:
    """A batch's K/V buffers are zeros (masked slots must hold no NaN) without writing every page up front: rows
    that never decode cost nothing (`dflash serve demo` held 2.9 GB for 15 idle rows at 8k tokens)."""
    import psutil

    from dflash_cli.engine.target.base import cache_zeros

    process = psutil.Process()
    before = process.memory_info().rss
    buffer = cache_zeros((16, 4, 2**16, 64), dtype, "cpu")  # 512 MiB (bf16) or 1 GiB
    assert buffer.shape == (16, 4, 2**16, 64) and buffer.dtype == dtype and buffer.is_contiguous()
    buffer[0, :, :1024] = 1.0
    grown = process.memory_info().rss - before
    assert grown < 64 * 2**20, grown
    assert buffer[0, :, :1024].eq(1).all() and not buffer[1:].any()
