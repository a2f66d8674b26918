"""Hybrid targets: attention layers plus linear-attention layers (Gated DeltaNet, Mamba, short convolutions),
whose state is rolled back after a speculative verify.

An attention layer forgets a rejected draft by its length: the K/V past the committed length are never read. A
linear-attention layer folds every token it sees into fixed-size states, in place: a convolution window (the
last K inputs) and a recurrent state. A verify of B tokens leaves both B tokens ahead, so after it keeps n of
them the layer must be put back to its state after n. transformers cannot do it (`is_croppable` is False once
a recurrent state exists).

How, by measurement (docs/benchmarks.md, "Hybrid targets: rolling back the recurrent state"):

- Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next and their kin: every transformers model whose layers
  call a `torch_chunk_gated_delta_rule`): while the verify runs, record what the recurrence was given (q, k, v,
  decay, beta and the state it started from) and the convolution's inputs. To keep n tokens, run the same
  recurrence kernel over the first n recorded steps from the recorded start, for all layers in one batched call,
  and cut the convolution window at n. No projection, attention or MLP is recomputed: 1-5% of a verify on
  CPU, against 25-85% for re-running the target on the kept tokens.
- Any other linear-attention layer (Mamba-2 hybrids such as Bamba or Granite 4, short-convolution models): keep a
  copy of the states from before the verify; to keep n tokens, restore it and run the target once more over the
  n kept tokens (exact for any architecture; costs a forward of n tokens).

Keeping all B tokens costs nothing: the verify's own final state is the right one.

`HybridState` is the engine's `TargetState` for such targets: `AttentionState` (static K/V rewound by length) with
these layers in its cache, recording during `verify` and rolling back in `commit`. It runs eager: the recording
is Python-side (a wrapped kernel and tensor references), which CUDA graphs would not replay.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from dflash_cli.engine.compiled import Notify
from dflash_cli.engine.target import AttentionState

RULE = "torch_chunk_gated_delta_rule"  # the module-level kernel transformers' Gated DeltaNet layers call


class RecordingLinearLayer(LinearAttentionLayer):
    """transformers' linear-attention cache layer that also keeps the convolution window of the last multi-token
    forward (the previous K inputs followed by the new ones), so the window after any prefix can be cut from it."""

    def __init__(self, number_of_states: int = 1, **kwargs: Any) -> None:
        super().__init__(number_of_states=number_of_states, **kwargs)
        self.windows: dict[int, torch.Tensor] = {}

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        window = super().update_conv_state(conv_states, state_idx, **kwargs)
        self.windows[state_idx] = window
        return window

    def keep_conv(self, n: int, verified: int) -> None:
        """The convolution window after the first n of the `verified` tokens of the last forward."""
        for state_idx, window in self.windows.items():
            kernel = self.conv_kernel_size[state_idx]
            end = window.shape[-1] - (verified - n)
            self.conv_states[state_idx].copy_(window[..., end - kernel : end])


def _rule_modules(target: PreTrainedModel) -> list[ModuleType]:
    """The modeling modules of `target` that define a Gated DeltaNet recurrence kernel."""
    modules = {sys.modules[type(module).__module__] for module in target.modules()}
    return [module for module in modules if callable(getattr(module, RULE, None))]


class _Recording:
    """One verify's Gated DeltaNet calls: the recurrence inputs per layer, keyed by the layer's state tensor."""

    def __init__(self, states: dict[int, LinearAttentionCacheLayerMixin]) -> None:
        self.states = states  # data_ptr of a layer's recurrent state -> the layer
        self.calls: list[tuple[LinearAttentionCacheLayerMixin, dict[str, Any], Callable[..., Any]]] = []

    def wrap(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        def recording_kernel(query, key, value, g, beta, initial_state=None, **kwargs: Any):  # noqa: ANN001
            layer = self.states.get(initial_state.data_ptr()) if initial_state is not None else None
            if layer is not None:  # the start state is the cache's own tensor, overwritten after this call
                inputs = dict(query=query, key=key, value=value, g=g, beta=beta, initial_state=initial_state.clone())
                options = {k: v for k, v in kwargs.items() if k == "use_qk_l2norm_in_kernel"}
                self.calls.append((layer, {**inputs, **options}, kernel))
            return kernel(query, key, value, g, beta, initial_state=initial_state, **kwargs)

        return recording_kernel


class LinearStateRollback:
    """Undo what a verify did to the linear-attention layers of `cache` beyond the tokens it keeps.

    Use: `with rollback.verifying(): <the verify forward>`, then `rollback.keep(n, verified, rerun)`, where
    `rerun(n)` runs the target over the first n tokens of that block again from the restored state (only called
    for layers the fast path does not cover).
    """

    def __init__(self, target: PreTrainedModel, cache: Cache) -> None:
        self.cache = cache
        self.layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self._modules = _rule_modules(target)
        self._recording: _Recording | None = None
        self._snapshot: list[tuple[list[torch.Tensor | None], list[torch.Tensor | None]]] | None = None
        self._replayable = False  # every layer with a recurrent state was recorded by the last verify

    @contextlib.contextmanager
    def verifying(self) -> Iterator[None]:
        """Around one verify forward: record (fast path) or copy (fallback) what `keep` needs."""
        states = {
            layer.recurrent_states[i].data_ptr(): layer
            for layer in self.layers
            for i, ready in layer.is_recurrent_states_initialized.items()
            if ready
        }
        recording = _Recording(states)
        # A layer this cannot record (not a Gated DeltaNet) is rolled back from a copy: take it now, the verify
        # overwrites the states in place.
        fallback = not self._modules or len(states) != sum(
            sum(layer.is_recurrent_states_initialized.values()) for layer in self.layers
        )
        self._snapshot = self._copy_states() if fallback or not self._conv_recorded() else None
        kernels = {module: getattr(module, RULE) for module in self._modules}
        for module, kernel in kernels.items():
            setattr(module, RULE, recording.wrap(kernel))
        try:
            yield
        finally:
            for module, kernel in kernels.items():
                setattr(module, RULE, kernel)
        self._recording = recording
        recorded = {id(layer) for layer, _, _ in recording.calls}
        self._replayable = not fallback and recorded == {id(layer) for layer in states.values()}

    def _conv_recorded(self) -> bool:
        return all(isinstance(layer, RecordingLinearLayer) for layer in self.layers)

    def _copy_states(self) -> list[tuple[list[torch.Tensor | None], list[torch.Tensor | None]]]:
        def copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.clone()

        return [
            ([copy(layer.conv_states[i]) for i in range(layer.number_of_states)],
             [copy(layer.recurrent_states[i]) for i in range(layer.number_of_states)])
            for layer in self.layers
        ]  # fmt: skip

    def keep(self, n: int, verified: int, rerun: Callable[[int], None]) -> None:
        """Put every linear-attention layer in its state after the first n of the `verified` tokens."""
        if n >= verified:
            return
        if self._replayable:
            for layer in self.layers:
                if isinstance(layer, RecordingLinearLayer):
                    layer.keep_conv(n, verified)
            self._replay(n)
            return
        assert self._snapshot is not None, "keep() after a verify that recorded nothing"
        for layer, (convs, recurrents) in zip(self.layers, self._snapshot):
            for i in range(layer.number_of_states):
                if convs[i] is not None:
                    layer.conv_states[i].copy_(convs[i])
                if recurrents[i] is not None:
                    layer.recurrent_states[i].copy_(recurrents[i])
        rerun(n)

    def _replay(self, n: int) -> None:
        """The recurrence over the first n recorded steps, from the recorded start states: one kernel call for all
        layers whose inputs have the same shapes (all of them, in the published models)."""
        groups: dict[tuple[Any, ...], list[tuple[LinearAttentionCacheLayerMixin, dict[str, Any], Callable]]] = {}
        for layer, inputs, kernel in self._recording.calls:
            shape = (kernel, *(tuple(t.shape) for t in inputs.values() if isinstance(t, torch.Tensor)))
            groups.setdefault(shape, []).append((layer, inputs, kernel))
        for calls in groups.values():
            kernel = calls[0][2]
            stacked = {
                name: torch.cat([inputs[name] for _, inputs, _ in calls])
                for name in ("query", "key", "value", "g", "beta", "initial_state")
            }
            for name in ("query", "key", "value", "g", "beta"):
                stacked[name] = stacked[name][:, :n]
            options = {k: v for k, v in calls[0][1].items() if k not in stacked}
            # called the way transformers calls it (q, k, v positional): kernels from fla name them otherwise.
            # transformers' own torch kernel pads to its chunk (64 by default): a chunk the size of a draft block
            # does the same math on less padding (fla's kernels take no chunk_size and never see it).
            q, k, v = stacked.pop("query"), stacked.pop("key"), stacked.pop("value")
            chunk = max(16, 1 << (n - 1).bit_length())
            _, final = kernel(q, k, v, **stacked, output_final_state=True, chunk_size=chunk, **options)
            for row, (layer, _, _) in enumerate(calls):
                layer.recurrent_states[0].copy_(final[row : row + 1])


def hybrid_cache(target: PreTrainedModel) -> DynamicCache:
    """The cache a hybrid target needs: transformers' per-layer kinds from its config, with full-length attention
    layers (sliding ones cannot be cropped back once their window is full; the masks still apply the window) and
    linear-attention layers that keep their convolution window for `LinearStateRollback`."""
    cache = DynamicCache(config=target.config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer:
            cache.layers[i] = RecordingLinearLayer(number_of_states=layer.number_of_states)
        elif isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
            cache.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
        elif isinstance(layer, DynamicSlidingWindowLayer):
            cache.layers[i] = DynamicLayer()
    return cache


def linear_cache_layers(target: PreTrainedModel) -> dict[int, LinearAttentionCacheLayerMixin]:
    """transformers' cache layers for the linear-attention layers of `target`, by layer index (empty: no hybrid)."""
    template = DynamicCache(config=target.config)
    return {i: layer for i, layer in enumerate(template.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)}


class HybridState(AttentionState):
    """The target state of a hybrid model: attention K/V as in `AttentionState`, linear-attention layers in the same
    cache, put back to the kept tokens on `commit` (see the module docstring)."""

    def __init__(self, target: PreTrainedModel) -> None:
        super().__init__(target)
        for index, layer in linear_cache_layers(target).items():
            kind = RecordingLinearLayer if type(layer) is LinearAttentionLayer else type(layer)
            self.cache.layers[index] = kind(number_of_states=layer.number_of_states)
        self.rollback = LinearStateRollback(target, self.cache)
        self._block: torch.Tensor | None = None  # the last verified block, until it is committed

    def reserve(
        self, positions: int, block_size: int, feature_layers: tuple[int, ...], *, rows: int = 1,
        compile: bool = False, notify: Notify | None = None,
    ) -> None:  # fmt: skip
        assert rows == 1, "a hybrid state holds one sequence (target.batch_limit)"
        super().reserve(positions, block_size, feature_layers, compile=False, notify=notify)  # eager: see above

    def prefill(self, token_ids: torch.Tensor, slot: int = 0) -> torch.Tensor:
        for layer in self.rollback.layers:  # a new sequence: no state carried over from the last request
            layer.reset()
        return super().prefill(token_ids, slot)

    def verify(self, block_ids: torch.Tensor, slots: Sequence[int] = (0,)) -> torch.Tensor:
        self._block = block_ids
        with self.rollback.verifying():
            return super().verify(block_ids, slots)

    def commit(self, n: int, slot: int = 0) -> None:
        block, self._block = self._block, None
        if block is not None and n < block.shape[1]:
            # the fallback reruns the kept tokens from the committed length (their K/V and features come out
            # the same as the verify's)
            self.rollback.keep(n, block.shape[1], lambda kept: AttentionState.verify(self, block[:, :kept]))
        super().commit(n, slot)
