"""The target's decoding state, behind the small interface the loop uses: prefill, verify a block, commit n.

`TargetState` is all the loop sees of the target. `AttentionState` implements it for transformers models
whose layers are attention layers (Llama, Qwen3 and their kin), gpt-fast style:

- K/V live in buffers preallocated per layer and written in place. A verify writes the block's K/V after
  the committed length; `commit(n)` moves the length, so a rejected draft is a length reset, never a crop or
  a copy: its slots lie beyond the length, where no later forward reads, and the next verify overwrites them.
- Attention reads the committed prefix plus the block (a view, no copy), so a step reads the K/V it needs and
  not the whole buffer. `full_view=True` hands attention the whole buffer instead, with the causal mask hiding
  what lies beyond the block: fixed shapes, for CUDA graphs.
- The hidden states the drafter reads are written into a preallocated buffer by forward hooks that are
  installed once per state (not per step) and act only during this state's own forwards.

A model whose layers keep a recurrent state (hybrid models) implements `commit` by restoring the state after
n tokens; a batch holds one state per row.
"""

from __future__ import annotations

import contextlib
import weakref
from abc import ABC, abstractmethod
from typing import Any, Iterator

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from dflash_cli.engine.compiled import CompiledStep, Notify, compiled_step, run_target
from dflash_cli.errors import DflashError

# Positions a state reserves at least, so that consecutive requests (a growing chat) rarely reallocate. On CPU
# the buffers are allocated but untouched pages cost no memory; the planner reserves an 8k-token KV cache too.
MIN_CAPACITY = 8192


class TargetState(ABC):
    """The target's state for one sequence: `length` tokens committed (positions 0 .. length-1)."""

    length: int

    @abstractmethod
    def prefill(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt [1, P] from position 0 and commit it; return the logits of its last position [1, vocab]."""

    @abstractmethod
    def verify(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Run a block [1, q] at positions length .. length+q-1 without committing it; return its logits [q, vocab]."""

    @abstractmethod
    def commit(self, n: int) -> None:
        """Keep the first n positions of the last verified block; forget the rest."""

    @abstractmethod
    def features(self, n: int) -> torch.Tensor:
        """The drafter's context features of the first n positions of the last forward, [1, n, F]."""

    @property
    def whole_blocks(self) -> bool:
        """Whether verify wants every block at full size, even the shortened last ones (compiled steps keep one
        shape per block size; the target is causal, so padding after the real tokens changes nothing)."""
        return False


def target_decoder_layers(target: PreTrainedModel) -> nn.ModuleList:
    """The decoder layer stack of a transformers causal LM: `get_decoder().layers` (Qwen3, Llama and their kin),
    else the module list holding one module per decoder layer (Llama 4's `get_decoder()` is the model itself)."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    layers = getattr(base, "layers", None)
    if layers is None:
        count = target.config.get_text_config().num_hidden_layers
        layers = next((m for m in target.modules() if isinstance(m, nn.ModuleList) and len(m) == count), None)
    if layers is None:
        raise DflashError(
            f"cannot find the decoder layers of {type(target).__name__}",
            fix="use a transformers causal LM whose decoder keeps its layers in a module list",
        )
    return layers


@contextlib.contextmanager
def capture_layers(target: PreTrainedModel, layer_ids: list[int]) -> Iterator[list[torch.Tensor]]:
    """Record the outputs of the chosen decoder layers (only those) during forwards inside the `with` block.

    For training and distillation (batched, transformers' own `generate`); the decode loop captures through
    `AttentionState`'s hooks, installed once per state."""
    captured: list[torch.Tensor] = []
    layers = target_decoder_layers(target)
    slots: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            slots[index] = output[0] if isinstance(output, tuple) else output
            if len(slots) == len(layer_ids):
                captured.append(torch.cat([slots[i] for i in range(len(layer_ids))], dim=-1))
                slots.clear()

        return record

    handles = [layers[layer_id].register_forward_hook(hook(i)) for i, layer_id in enumerate(layer_ids)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def capture_target_features(
    target: PreTrainedModel, input_ids: torch.Tensor, layer_ids: list[int], **forward_kwargs: Any
) -> tuple[Any, torch.Tensor]:
    """Run the target once; return its outputs and the concatenated features of `layer_ids` [b, s, n*H]."""
    with capture_layers(target, layer_ids) as captured:
        outputs = target(input_ids=input_ids, **forward_kwargs)
    return outputs, captured[-1]


def compute_dtype(target: PreTrainedModel) -> torch.dtype:
    """The dtype activations flow in: the embedding's dtype (NF4 targets keep embeddings unquantized)."""
    return target.get_input_embeddings().weight.dtype


def context_window(target: PreTrainedModel) -> int | None:
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return getattr(config, "max_position_embeddings", None)


class _KVLayer(CacheLayerMixin):
    """One attention layer's K/V for transformers: reads and writes the owning state's buffers at its length."""

    is_sliding = False  # sliding-window targets keep every position; their masks still apply the window
    # Not "compileable" in transformers' sense: that would make its masks materialize for one-token steps, which
    # changes the attention kernel (and its rounding) from the one DynamicCache and `generate()` use.
    is_compileable = False

    def __init__(self, state: AttentionState, index: int) -> None:
        super().__init__()
        self.state, self.index = state, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("the buffers are allocated by AttentionState")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state
        keys, values = state.buffers(self.index, key_states)
        q = key_states.shape[-2]
        if state.full_view:  # fixed shapes: the write position comes from the device-side length
            at = torch.arange(q, device=keys.device) + state.offset
            keys.index_copy_(2, at, key_states)
            values.index_copy_(2, at, value_states)
            return keys, values
        end = state.length + q
        keys[:, :, state.length : end].copy_(key_states)
        values[:, :, state.length : end].copy_(value_states)
        return keys[:, :, :end], values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.state.capacity if self.state.full_view else self.state.length + query_length), 0

    def get_seq_length(self) -> int | torch.Tensor:
        return self.state.offset

    def get_max_length(self) -> int:
        return self.state.capacity


class AttentionState(TargetState):
    """Static K/V buffers and feature capture for a transformers attention model (see the module docstring)."""

    def __init__(self, target: PreTrainedModel) -> None:
        self._target = weakref.ref(target)  # the hooks this state installs on the target must not keep it alive
        self.length = 0
        self.capacity = 0
        self.layers = target_decoder_layers(target)
        self.cache = Cache(layers=[_KVLayer(self, i) for i in range(len(self.layers))])
        self._keys: list[torch.Tensor | None] = [None] * len(self.layers)
        self._values: list[torch.Tensor | None] = [None] * len(self.layers)
        # compiled steps (compiled.CompiledStep) or None: eager; full_view: whole-buffer attention, for CUDA graphs
        self.step: CompiledStep | None = None
        self.full_view = False
        self._length_t: torch.Tensor | None = None  # `length` on the device, for full_view
        self.notify: Notify | None = None  # shows a progress line while a step compiles
        self.feature_layers: tuple[int, ...] = ()
        self._hooks: list[Any] = []
        self._block_features: torch.Tensor | None = None  # [1, block, F]: verify steps write here
        self._features: torch.Tensor | None = None  # what the last forward wrote (the block buffer, or the prompt's)
        self.capture = False  # this request's drafter reads features
        self._capturing = False  # inside one of this state's forwards, with capture on
        self.busy = False  # a generation is using this state (see `acquire_state`)

    @property
    def target(self) -> PreTrainedModel:
        target = self._target()
        assert target is not None, "the target was garbage collected while its state was in use"
        return target

    @property
    def device(self) -> torch.device:
        return self.target.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return compute_dtype(self.target)

    @property
    def offset(self) -> int | torch.Tensor:
        """The committed length as the forward sees it: a device tensor in full_view mode (so graphs do not
        specialize on it), else a Python int."""
        return self._length_t if self.full_view else self.length

    # --- setup, between requests ---

    def reserve(
        self, positions: int, block_size: int, feature_layers: tuple[int, ...], *, compile: bool = False,
        notify: Notify | None = None,
    ) -> None:  # fmt: skip
        """Make room for a request of `positions` positions verified in blocks of `block_size` (the last block
        may run past `positions`), with the drafter reading `feature_layers` (empty: no drafter). Starts the
        state over at length 0."""
        self.length = 0
        self.step = compiled_step(self.device) if compile else None
        self.notify = notify
        full_view = self.step is not None and self.device.type == "cuda"
        needed = positions + block_size
        if needed > self.capacity or full_view != self.full_view:
            window = context_window(self.target)
            floor = MIN_CAPACITY if window is None else min(window + block_size, MIN_CAPACITY)
            self.capacity = max(needed, floor)
            self.full_view = full_view
            self._keys = [None] * len(self.layers)
            self._values = [None] * len(self.layers)
            self._length_t = torch.zeros((), dtype=torch.long, device=self.device)
            self._static(self._length_t)
        if feature_layers and feature_layers != self.feature_layers:  # a drafter reading other layers
            self.close()
            self._hooks = [self.layers[layer].register_forward_hook(self._capture(slot)) for slot, layer in enumerate(feature_layers)]
            self.feature_layers = feature_layers
            self._block_features = None
        # Without a drafter the hooks stay (so compiled steps keep their guards) but record nothing.
        self.capture = bool(feature_layers)
        if self.capture and (self._block_features is None or self._block_features.shape[1] != block_size):
            width = self.target.config.get_text_config().hidden_size * len(feature_layers)
            self._block_features = self._static(torch.empty(1, block_size, width, dtype=self.dtype, device=self.device))

    def _static(self, tensor: torch.Tensor) -> torch.Tensor:
        """Tell CUDA graphs that `tensor` keeps its address (it is written in place, never replaced)."""
        if self.full_view:
            torch._dynamo.mark_static_address(tensor)
        return tensor

    def buffers(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s K/V buffers, allocated on its first write with that write's heads, head size and dtype."""
        keys = self._keys[index]
        if keys is None:
            shape = (like.shape[0], like.shape[1], self.capacity, like.shape[3])
            # full_view attention multiplies unwritten rows by a zero weight: zeros, so no NaN in memory survives
            new = torch.zeros if self.full_view else torch.empty
            keys = self._keys[index] = self._static(new(shape, dtype=like.dtype, device=like.device))
            self._values[index] = self._static(new(shape, dtype=like.dtype, device=like.device))
        return keys, self._values[index]

    def _capture(self, slot: int) -> Any:
        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._capturing:
                hidden = output[0] if isinstance(output, tuple) else output
                width = hidden.shape[-1]
                self._features[:, : hidden.shape[1], slot * width : (slot + 1) * width].copy_(hidden)

        return record

    # --- the interface ---

    def _forward(self, token_ids: torch.Tensor, prefill: bool) -> torch.Tensor:
        if self.capture:
            if not prefill:
                self._features = self._block_features
            else:  # the prompt: its own buffer, once per request
                width = self._block_features.shape[-1]
                self._features = torch.empty(1, token_ids.shape[1], width, dtype=self.dtype, device=self.device)
        self._capturing = self.capture
        try:
            if prefill or self.step is None:
                return run_target(self.target, token_ids, self.cache, self.offset, 1 if prefill else 0)
            return self.step(self.target, token_ids, self.cache, self.offset, notify=self.notify)
        finally:
            self._capturing = False

    def _set_length(self, length: int) -> None:
        self.length = length
        if self.full_view:
            self._length_t.fill_(length)

    def prefill(self, token_ids: torch.Tensor) -> torch.Tensor:
        self._set_length(0)
        logits = self._forward(token_ids, prefill=True)
        self._set_length(token_ids.shape[1])
        return logits

    def verify(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self._forward(block_ids, prefill=False)

    def commit(self, n: int) -> None:
        self._set_length(self.length + n)

    def features(self, n: int) -> torch.Tensor:
        return self._features[:, :n]

    @property
    def whole_blocks(self) -> bool:
        return self.step is not None

    def close(self) -> None:
        """Remove this state's hooks from the target."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self.feature_layers = [], ()


_STATES: weakref.WeakKeyDictionary[PreTrainedModel, AttentionState] = weakref.WeakKeyDictionary()


def acquire_state(target: PreTrainedModel) -> AttentionState:
    """The target's reusable state (its buffers, hooks and compiled steps stay from one request to the next),
    or a fresh one while another generation on the same target is still running. Release with `release_state`."""
    state = _STATES.get(target)
    if state is None or state.busy:
        from dflash_cli.engine.hybrid import HybridState, linear_cache_layers  # hybrid.py builds on this module

        fresh = (HybridState if linear_cache_layers(target) else AttentionState)(target)
        if state is None:
            _STATES[target] = fresh
        state = fresh
    state.busy = True
    return state


def release_state(state: AttentionState) -> None:
    state.busy = False
    target = state._target()
    if target is None or _STATES.get(target) is not state:  # a one-off state: nothing may stay on the target
        state.close()
