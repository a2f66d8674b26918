"""One reusable decoding state per target: its buffers, hooks and compiled steps stay from one request to the
next. The kind of state comes from the model's cache layers (`AttentionState`, or `HybridState` for targets
with linear-attention layers); this module sits above both so that neither imports the other's user."""

from __future__ import annotations

import weakref

import torch
from transformers import PreTrainedModel

from dflash_cli.engine.kernels.layers import EAGER
from dflash_cli.engine.target.attention import AttentionState
from dflash_cli.engine.target.base import compute_dtype
from dflash_cli.engine.target.compiled_step import loaded_step
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


def rounding_cause(target: PreTrainedModel, compiled: bool = False) -> str | None:
    """Why a row's logits depend on how its step is shaped here (one token or a verify block, alone or beside other
    rows, its prompt whole or in chunks); None where they do not: bf16 compute on a CPU, eager attention (the engine
    runs it as INVARIANT_EAGER there), attention layers only, no fused expert weights, eager steps (engine.kernels.layers:
    one-row bf16 products and one-query attention run as two; the int4/int8 kernels agree at every row count); or
    bf16 through the stored exported step (one graph for every step, whose kernels give a row the same bits)."""
    device = target.get_input_embeddings().weight.device
    attention, dtype = target.config._attn_implementation, compute_dtype(target)
    if device.type != "cpu":
        return f"{device.type}: fused attention and matrix kernels pick their tiling by the step's shape"
    if compiled:
        return "compiled steps: inductor's kernels pick their tiling by the step's shape"
    if loaded_step(target) is not None and dtype == torch.bfloat16:
        return None  # every step, one row or several, runs the exported graph: a row's bits in any step are the same
    if dtype == torch.float32:
        return "float32: MKL rounds a row by the product's row count (within a few ulps)"
    if dtype != torch.bfloat16:
        return f"{dtype} on a CPU: its products round a row by the product's row count"
    if attention not in EAGER:
        return f"attention {attention}: its kernel rounds a row by the step's queries and keys"
    if linear_cache_layers(target):
        return "linear-attention layers: a prompt runs their chunked recurrence, a step the one-token one"
    if any(parameter.dim() > 2 for parameter in target.parameters()):
        return "MoE experts: their products are no nn.Linear, and a one-token expert call rounds otherwise"
    return None
