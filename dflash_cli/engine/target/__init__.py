"""One reusable decoding state per target: its buffers, hooks and compiled steps stay from one request to the
next. The kind of state comes from the model's cache layers (`AttentionState`, or `HybridState` for targets
with linear-attention layers); this module sits above both so that neither imports the other's user."""

from __future__ import annotations

import weakref

import torch
from transformers import PreTrainedModel

from dflash_cli.engine.target.attention import AttentionState
from dflash_cli.engine.target.base import compute_dtype
from dflash_cli.engine.target.hybrid import HybridState, linear_cache_layers

_STATES: weakref.WeakKeyDictionary[PreTrainedModel, AttentionState] = weakref.WeakKeyDictionary()


def acquire_state(target: PreTrainedModel) -> AttentionState:
    """The target's reusable state, or a fresh one while another generation on the same target is still running.
    Release with `release_state`."""
    state = _STATES.get(target)
    if state is None or state.busy:
        fresh = (HybridState if linear_cache_layers(target) else AttentionState)(target)
        if state is None:
            _STATES[target] = fresh
        state = fresh
    state.busy = True
    return state


def forget_prefixes(target: PreTrainedModel) -> None:
    """What the slots of `target`'s reusable state hold is no longer offered to later requests (engine.prefix)."""
    state = _STATES.get(target)
    if state is not None:
        for slot in range(len(state.held)):
            state.forget(slot)


def release_state(state: AttentionState) -> None:
    state.busy = False
    target = state._target()
    if target is None or _STATES.get(target) is not state:  # a one-off state: nothing may stay on the target
        state.close()


def batch_invariant(target: PreTrainedModel) -> bool:
    """Whether a row's logits are the same bits however its steps are shaped (one token or a verify block, alone or
    beside other rows, its prompt whole or in chunks): bf16 compute on a CPU with eager attention and attention
    layers only (engine.kernels: a one-row bf16 product runs as two; the int4/int8 kernels agree at every row count).
    Not float32 (MKL rounds a float32 row by the product's row count, within a few ulps: greedy text still agrees in
    every test), not a fused attention kernel, not linear-attention layers (a prompt runs their chunked recurrence,
    a step the one-token one)."""
    device = target.get_input_embeddings().weight.device
    return (
        device.type == "cpu"
        and compute_dtype(target) == torch.bfloat16
        and target.config._attn_implementation == "eager"
        and not linear_cache_layers(target)
    )
