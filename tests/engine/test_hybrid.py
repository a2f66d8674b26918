"""Hybrid targets (engine/hybrid.py): rolling back linear-attention state after a verify, on tiny hybrid models.

The property: verify a block of B tokens, keep n of them, and the layers' conv and recurrent states (and so every
later forward) are those of a target that only ever saw the n kept tokens. Gated DeltaNet families take the
replay path; Bamba (Mamba-2) takes the general snapshot-and-rerun path.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from dflash_cli.engine.compiled.jit import CACHE_ARGUMENT
from dflash_cli.engine.target.hybrid import LinearStateRollback, RecordingLinearLayer, hybrid_cache, linear_cache_layers
from helpers.tiny_models import build_tiny

PROMPT = [5, 17, 42, 8, 9, 3, 3, 11, 12]
BLOCK = [7, 99, 140, 2, 64, 64, 31, 5]


def crop_attention(cache, length: int) -> None:
    for layer in cache.layers:
        if isinstance(layer, CacheLayerMixin) and layer.get_seq_length() > length:
            DynamicLayer.crop(layer, length - layer.get_seq_length())


@torch.inference_mode()
def forward(model, cache, ids: list[int], start: int):
    positions = torch.arange(start, start + len(ids))[None]
    return model(input_ids=torch.tensor([ids]), position_ids=positions, use_cache=True, **{CACHE_ARGUMENT: cache})


def states(cache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            out += [t for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None]
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "bamba"])
@pytest.mark.parametrize("kept", [1, 3, 7, 8])
def test_keeping_n_verified_tokens_leaves_the_state_of_n(family: str, kept: int) -> None:
    model = build_tiny(family, seed=3)
    cache = hybrid_cache(model)
    assert linear_cache_layers(model)
    forward(model, cache, PROMPT, 0)
    rollback = LinearStateRollback(model, cache)
    with rollback.verifying():
        forward(model, cache, BLOCK, len(PROMPT))

    def rerun(row: int, n: int) -> None:
        assert row == 0
        crop_attention(cache, len(PROMPT))
        forward(model, cache, BLOCK[:n], len(PROMPT))

    with torch.inference_mode():  # as in the decode loop
        rollback.keep([kept], len(BLOCK), rerun)
    crop_attention(cache, len(PROMPT) + kept)
    # the path taken: replay for Gated DeltaNet, snapshot + rerun elsewhere
    assert rollback._replayable == (family != "bamba")

    reference = hybrid_cache(model)
    forward(model, reference, PROMPT + BLOCK[:kept], 0)
    for got, want in zip(states(cache), states(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # and the next step sees the same model: same logits from both caches
    nxt = [33, 4]
    torch.testing.assert_close(
        forward(model, cache, nxt, len(PROMPT) + kept).logits,
        forward(model, reference, nxt, len(PROMPT) + kept).logits,
        rtol=1e-4,
        atol=1e-4,
    )


def test_without_rollback_the_state_runs_ahead() -> None:
    """The test above can fail: a verify left as it is carries the rejected tokens in the recurrent state."""
    model = build_tiny("qwen3_5", seed=3)
    cache = hybrid_cache(model)
    forward(model, cache, PROMPT, 0)
    forward(model, cache, BLOCK, len(PROMPT))
    crop_attention(cache, len(PROMPT) + 3)
    reference = hybrid_cache(model)
    forward(model, reference, PROMPT + BLOCK[:3], 0)
    assert any(not torch.allclose(a, b, atol=1e-3) for a, b in zip(states(cache), states(reference)))


def test_hybrid_cache_layers() -> None:
    cache = hybrid_cache(build_tiny("qwen3_5"))
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["RecordingLinearLayer"] * 3 + ["DynamicLayer"]
    assert not linear_cache_layers(build_tiny("gemma4"))
    assert all(type(layer) is DynamicLayer for layer in hybrid_cache(build_tiny("gemma4")).layers)  # no sliding layers
    assert all(type(layer) is DynamicLayer for layer in hybrid_cache(build_tiny("gpt_oss")).layers)
    assert isinstance(cache.layers[0], RecordingLinearLayer)


def test_missing_fast_kernels_are_said_once_at_load_not_mid_answer() -> None:
    import logging

    from dflash_cli.loading.models import kernel_note

    model = build_tiny("qwen3_5")
    note = kernel_note(model, "cuda")
    assert note is not None and "flash-linear-attention" in note  # not installed on this machine
    assert kernel_note(model, "cpu") is None  # those kernels are CUDA-only: nothing to install here
    assert kernel_note(build_tiny("qwen3"), "cuda") is None
    record = logging.LogRecord(
        "transformers",
        logging.WARNING,
        "",
        0,
        "`x` is falling back to its reference PyTorch implementation because `y` is not installed.",
        None,
        None,
    )
    handlers = logging.getLogger("transformers").handlers
    assert handlers and all(not handler.filter(record) for handler in handlers)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "bamba"])
def test_each_row_of_a_batched_verify_keeps_its_own_count(family: str) -> None:
    """Several rows verify in one forward (a free slot between them runs a dummy block), each keeps its own count
    of its block, and each row's linear-attention states are those of a target that only saw that row's prompt and
    kept tokens; a row then joining the free slot (left by an earlier row) starts from zero and leaves the other
    rows' states as they are."""
    from dflash_cli.engine.target.hybrid import HybridState

    model = build_tiny(family, seed=3)
    state = HybridState(model)
    state.reserve(64, len(BLOCK), (), rows=4)
    prompts = {0: PROMPT, 2: [3, 1], 3: PROMPT[::-1] + [77]}
    blocks = {0: BLOCK, 2: BLOCK[::-1], 3: [9, 140, 2, 5, 31, 64, 7, 99]}
    kept = {0: 3, 2: 8, 3: 1}
    with torch.inference_mode():
        for slot, prompt in prompts.items():
            state.prefill(torch.tensor([prompt]), slot)
        state.verify(torch.tensor([blocks[slot] for slot in prompts]), list(prompts))
        for slot in prompts:
            state.commit(kept[slot], slot)
        assert state.lengths == [len(prompts[0]) + 3, 0, 2 + 8, len(prompts[3]) + 1]

        def row_states(slot: int) -> list[torch.Tensor]:
            return [layer.storage[kind, 0][slot] for layer in state.linear for kind in ("conv", "recurrent")]

        for slot in prompts:
            reference = hybrid_cache(model)
            forward(model, reference, prompts[slot] + blocks[slot][: kept[slot]], 0)
            for got, want in zip(row_states(slot), states(reference), strict=True):
                torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
        before = {slot: [t.clone() for t in row_states(slot)] for slot in prompts}
        state.prefill(torch.tensor([[8, 60, 8, 61]]), 1)  # a row that joins, then leaves
        state.prefill(torch.tensor([[4, 4, 4]]), 1)  # and the next one in its slot
    for slot in prompts:
        assert all(torch.equal(a, b) for a, b in zip(row_states(slot), before[slot]))
    reference = hybrid_cache(model)
    forward(model, reference, [4, 4, 4], 0)
    for got, want in zip(row_states(1), states(reference), strict=True):
        torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
