"""One reusable decoding state per target: its buffers, hooks and compiled steps stay from one request to the
next. The kind of state comes from the model's cache layers (`AttentionState`, or `HybridState` for targets
with linear-attention layers); this module sits above both so that neither imports the other's user."""

from __future__ import annotations

import weakref

from transformers import PreTrainedModel

from dflash_cli.engine.target.attention import AttentionState
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
