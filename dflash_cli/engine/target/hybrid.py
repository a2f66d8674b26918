"""Hybrid targets: attention layers plus linear-attention layers (Gated DeltaNet, Mamba, short convolutions),
whose state is rolled back after a speculative verify, per row.

An attention layer forgets a rejected draft by its length: the K/V past the committed length are never read. A
linear-attention layer folds every token it sees into fixed-size states, in place: a convolution window (the
last K inputs) and a recurrent state. A verify of B tokens leaves both B tokens ahead, so after a row keeps n of
them the layer must be put back to that row's state after n. transformers cannot do it (`is_croppable` is False
once a recurrent state exists).

How, by measurement (benchmarks/results/history.md, "Hybrid targets: rolling back the recurrent state"):

- Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next and their kin: every transformers model whose layers
  call a `torch_chunk_gated_delta_rule`): while the verify runs, record what the recurrence was given (q, k, v,
  decay, beta and the state it started from) and the convolution's inputs. To keep n_r tokens in row r, run the
  same recurrence kernel from the recorded start over each row's first n_r recorded steps, the steps after n_r
  zeroed (decay 0 and beta 0 leave a state as it is: the kernel pads its chunks the same way), for all layers
  and rows in one call, and cut each row's convolution window at its n_r. No projection, attention or MLP is
  recomputed: 1-5% of a verify on CPU, against 25-85% for re-running the target on the kept tokens.
- Any other linear-attention layer (Mamba-2 hybrids such as Bamba or Granite 4, short-convolution models): keep a
  copy of the states from before the verify; to keep n tokens in a row, restore its copy and run the target once
  more over that row's n kept tokens, row by row (exact for any architecture; a Mamba-2 state decays even on a
  zeroed input, so rows of different n cannot share that forward by padding).

Keeping all B tokens costs nothing: the verify's own final state is the right one.

`HybridState` is the engine's `TargetState` for such targets: `AttentionState` (static K/V rewound by length) with
these layers in its cache, their states per slot like the K/V ([rows, ...]: a forward sees the rows it runs, a
prefill starts its own row from zero), recording during `verify` and rolling every row of the verify back once
its last row has committed. It runs eager: the recording is Python-side (a wrapped kernel and tensor
references), which CUDA graphs would not replay.
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

from dflash_cli.engine.compiled.jit import Notify
from dflash_cli.engine.target.attention import AttentionState

RULE = "torch_chunk_gated_delta_rule"  # the module-level kernel transformers' Gated DeltaNet layers call
# The chunk of the verify's and the replay's recurrence: every row's replay pads to whole chunks of this size with
# zero steps, which leave a state bit for bit as it is, so a row replays to the same bits alone or beside rows of
# other lengths.
REPLAY_CHUNK = 16
# Snapshots of a slot's linear-attention states kept for prefix reuse (the newest): a conversation's last prompt
# and reply ends, and the turn before.
SNAPSHOTS = 4


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

    def keep_conv(self, rows: torch.Tensor, kept: torch.Tensor, verified: int) -> None:
        """Rows `rows` of the forward: the convolution window after the first `kept[i]` of the `verified` tokens
        of the last forward."""
        for state_idx, window in self.windows.items():
            kernel = self.conv_kernel_size[state_idx]
            # row i's window ends `verified - kept[i]` inputs before the recorded one's end
            start = window.shape[-1] - verified + kept - kernel
            index = (start[:, None] + torch.arange(kernel, device=window.device))[:, None, :]
            cut = window.index_select(0, rows).gather(-1, index.expand(-1, window.shape[1], -1))
            self.conv_states[state_idx].index_copy_(0, rows, cut)


class SlotLinearLayer(RecordingLinearLayer):
    """A linear-attention layer's states for every slot of a `HybridState` ([slots, ...] per state, like the K/V
    buffers): `select(rows)` points the layer at the rows one forward runs (views, written in place)."""

    def __init__(self, slots: Callable[[], int], number_of_states: int = 1) -> None:
        super().__init__(number_of_states=number_of_states)
        self.slots = slots  # how many slots the owning state holds now
        self.rows = slice(0, 1)
        self.storage: dict[tuple[str, int], torch.Tensor] = {}  # ("conv" | "recurrent", state_idx) -> [slots, ...]

    def lazy_initialization(
        self,
        conv_states: torch.Tensor | None = None,
        recurrent_states: torch.Tensor | None = None,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
    ) -> None:
        if conv_states is not None:
            self.dtype, self.device = conv_states.dtype, conv_states.device
            kernel = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
            self.conv_kernel_size[state_idx] = kernel
            shape = (self.slots(), *conv_states.shape[1:-1], kernel)
            self.storage["conv", state_idx] = torch.zeros(shape, dtype=conv_states.dtype, device=conv_states.device)
            self.is_conv_states_initialized[state_idx] = True
        if recurrent_states is not None:
            shape = (self.slots(), *recurrent_states.shape[1:])
            self.storage["recurrent", state_idx] = recurrent_states.new_zeros(shape)
            self.is_recurrent_states_initialized[state_idx] = True
        self._views()

    def select(self, rows: slice, fresh: bool) -> None:
        """The next forward runs `rows`; `fresh`: it starts those rows over (a prefill), from zero states."""
        self.rows = rows
        self._views()
        for state_idx in range(self.number_of_states):
            self.has_previous_state[state_idx] = not fresh
            if fresh:
                for states in (self.conv_states, self.recurrent_states):
                    if states[state_idx] is not None:
                        states[state_idx].zero_()

    def _views(self) -> None:
        for (kind, state_idx), storage in self.storage.items():
            states = self.conv_states if kind == "conv" else self.recurrent_states
            states[state_idx] = storage[self.rows]

    def drop(self) -> None:
        """Forget every slot's states (the owning state changed its number of slots)."""
        self.storage.clear()
        for state_idx in range(self.number_of_states):
            self.conv_states[state_idx] = self.recurrent_states[state_idx] = None
            self.is_conv_states_initialized[state_idx] = self.is_recurrent_states_initialized[state_idx] = False
            self.has_previous_state[state_idx] = False


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
        def recording_kernel(query, key, value, g, beta, initial_state=None, **kwargs: Any):
            layer = self.states.get(initial_state.data_ptr()) if initial_state is not None else None
            if layer is not None:  # the start state is the cache's own tensor, overwritten after this call
                inputs = dict(query=query, key=key, value=value, g=g, beta=beta, initial_state=initial_state.clone())
                options = {k: v for k, v in kwargs.items() if k == "use_qk_l2norm_in_kernel"}
                self.calls.append((layer, {**inputs, **options}, kernel))
                # transformers' torch kernel pads a verify's few tokens to its default chunk of 64, for every row;
                # the replay's chunk does the same math on less padding (fla's kernels take no chunk size: the
                # kernel wrapper drops it)
                kwargs.setdefault("chunk_size", REPLAY_CHUNK)
            return kernel(query, key, value, g, beta, initial_state=initial_state, **kwargs)

        return recording_kernel


class LinearStateRollback:
    """Undo what a verify did to the linear-attention layers of `cache` beyond the tokens each row keeps.

    Use: `with rollback.verifying(): <the verify forward>`, then `rollback.keep(kept, verified, rerun)`, where
    `kept[i]` is what row i of that forward keeps and `rerun(i, n)` runs the target over row i's first n tokens
    again from its restored state (only called for layers the fast path does not cover).
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
            (
                [copy(layer.conv_states[i]) for i in range(layer.number_of_states)],
                [copy(layer.recurrent_states[i]) for i in range(layer.number_of_states)],
            )
            for layer in self.layers
        ]

    def keep(self, kept: Sequence[int], verified: int, rerun: Callable[[int, int], None]) -> None:
        """Put every linear-attention layer, in each row i of the last verify, in its state after the first
        `kept[i]` of the `verified` tokens (a row that keeps them all is left as the verify left it)."""
        rows = [i for i, n in enumerate(kept) if n < verified]
        if not rows:
            return
        if self._replayable:
            device = self.layers[0].recurrent_states[0].device
            index = torch.tensor(rows, device=device)
            counts = torch.tensor([kept[i] for i in rows], device=device)
            for layer in self.layers:
                if isinstance(layer, RecordingLinearLayer):
                    layer.keep_conv(index, counts, verified)
            self._replay(index, counts, max(kept[i] for i in rows))
            return
        assert self._snapshot is not None, "keep() after a verify that recorded nothing"
        for layer, (convs, recurrents) in zip(self.layers, self._snapshot):
            for i in range(layer.number_of_states):
                for states, saved in ((layer.conv_states, convs), (layer.recurrent_states, recurrents)):
                    if saved[i] is not None:
                        index = torch.tensor(rows, device=saved[i].device)
                        states[i].index_copy_(0, index, saved[i].index_select(0, index))
        for row in rows:
            rerun(row, kept[row])

    def _replay(self, rows: torch.Tensor, kept: torch.Tensor, longest: int) -> None:
        """The recurrence over each of `rows`' first `kept` recorded steps, from the recorded start states: one
        kernel call for all those rows of all layers whose inputs have the same shapes (all of them, in the
        published models)."""
        groups: dict[tuple[Any, ...], list[tuple[LinearAttentionCacheLayerMixin, dict[str, Any], Callable]]] = {}
        for layer, inputs, kernel in self._recording.calls:
            shape = (kernel, *(tuple(t.shape) for t in inputs.values() if isinstance(t, torch.Tensor)))
            groups.setdefault(shape, []).append((layer, inputs, kernel))
        steps = torch.arange(longest, device=kept.device)[None] < kept[:, None]  # [rows, longest]: a kept step
        for calls in groups.values():
            kernel = calls[0][2]
            stacked = {}
            for name in ("query", "key", "value", "g", "beta", "initial_state"):
                parts = [inputs[name].index_select(0, rows) for _, inputs, _ in calls]
                if name != "initial_state":  # steps past a row's own count: zero (no decay, no update)
                    parts = [part[:, :longest] for part in parts]
                    mask = steps.reshape(*steps.shape, *[1] * (parts[0].dim() - 2))
                    parts = [
                        torch.where(mask, part, torch.zeros((), dtype=part.dtype, device=part.device)) for part in parts
                    ]
                stacked[name] = torch.cat(parts)
            options = {k: v for k, v in calls[0][1].items() if k not in stacked}
            # called the way transformers calls it (q, k, v positional): kernels from fla name them otherwise.
            q, k, v = stacked.pop("query"), stacked.pop("key"), stacked.pop("value")
            _, final = kernel(q, k, v, **stacked, output_final_state=True, chunk_size=REPLAY_CHUNK, **options)
            for i, (layer, _, _) in enumerate(calls):
                layer.recurrent_states[0].index_copy_(0, rows, final[i * len(rows) : (i + 1) * len(rows)])


def hybrid_cache(target: PreTrainedModel) -> DynamicCache:
    """A transformers cache for a hybrid target outside the engine (one sequence; benchmarks and tests): its
    per-layer kinds from the config, with full-length attention layers (sliding ones cannot be cropped back once
    their window is full; the masks still apply the window) and linear-attention layers that keep their
    convolution window for `LinearStateRollback`."""
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
    cache with their states per slot, every row of a verify put back to its own kept tokens once the verify's
    last row has committed (see the module docstring)."""

    def __init__(self, target: PreTrainedModel) -> None:
        super().__init__(target)
        self.linear: list[SlotLinearLayer] = []
        for index, layer in linear_cache_layers(target).items():
            if type(layer) is LinearAttentionLayer:
                self.cache.layers[index] = SlotLinearLayer(lambda: self.rows, number_of_states=layer.number_of_states)
                self.linear.append(self.cache.layers[index])
            else:  # a layer that is both (target.batch_limit keeps such targets at one row)
                self.cache.layers[index] = type(layer)(number_of_states=layer.number_of_states)
        self.rollback = LinearStateRollback(target, self.cache)
        # Prefix reuse: the linear-attention states cannot go back to any position, so each slot keeps copies of
        # them at the positions a next request most often continues from, a prompt's end (before its last token,
        # which is always prefilled) and a reply's (dflash-mlx's rule): per slot, position -> (layer, state key) ->
        # state. Layers that are both kinds (one row) keep no per-slot states here: such targets reuse nothing.
        self.snapshots: list[dict[int, dict[tuple[int, tuple[str, int]], torch.Tensor]]] = [{}]
        self.snapshotting = len(self.linear) == len(linear_cache_layers(target))
        # The last verify until all its rows have committed: its block, slots, forward rows, and what each kept.
        self._block: torch.Tensor | None = None
        self._slots: list[int] = []
        self._rows = slice(0, 1)
        self._kept: dict[int, int] = {}
        self._rerunning = False

    def reserve(
        self,
        positions: int,
        block_size: int,
        feature_layers: tuple[int, ...],
        *,
        rows: int = 1,
        compile: bool = False,
        notify: Notify | None = None,
    ) -> None:
        if rows != self.rows:
            for layer in self.linear:
                layer.drop()
            self.snapshots = [{} for _ in range(rows)]
        self._block, self._kept = None, {}
        super().reserve(
            positions, block_size, feature_layers, rows=rows, compile=False, notify=notify
        )  # eager: see above

    @property
    def storable(self) -> bool:
        return False  # its linear-attention states and snapshots stay in their slot (no prefix store)

    def resumable(self, slot: int, length: int) -> int:
        """The latest snapshot at or before `length` (0: none; a prefill from 0 needs none)."""
        return max((at for at in self.snapshots[slot] if at <= length), default=0)

    def prefill(self, token_ids: torch.Tensor, slot: int = 0, start: int = 0) -> torch.Tensor:
        """A prefill from a snapshot position `start` (`resumable`) restores that snapshot first; snapshots after
        `start` no longer hold (the row's positions from there on change). Snapshots the prompt but its last token
        (a prompt always prefills its last token: the same prompt again, or a longer one, continues from there):
        the prompt runs in two forwards, the last token alone, and the drafter reads both's features."""
        snapshots = self.snapshots[slot]
        for at in [at for at in snapshots if at > start or start == 0]:
            del snapshots[at]
        if start > 0:
            for (i, key), saved in snapshots[start].items():
                self.linear[i].storage[key][slot].copy_(saved)
        n = token_ids.shape[1]
        if n > 1 and self.snapshotting:
            super().prefill(token_ids[:, :-1], slot, start)
            head = self._features
            self._snapshot(slot)
            logits = super().prefill(token_ids[:, -1:], slot, start + n - 1)
            if self.capture:
                self._features = torch.cat([head, self._features], dim=1)
            return logits
        return super().prefill(token_ids, slot, start)

    def hold(self, slot: int, held: Any) -> None:
        super().hold(slot, held)
        self._snapshot(slot)  # the reply's end

    def forget(self, slot: int) -> None:
        super().forget(slot)
        self.snapshots[slot].clear()

    def _snapshot(self, slot: int) -> None:
        """Copy row `slot`'s linear-attention states at its length; keep the newest SNAPSHOTS per slot."""
        if not self.snapshotting:
            return
        snapshots = self.snapshots[slot]
        snapshots[self.lengths[slot]] = {
            (i, key): storage[slot].clone()
            for i, layer in enumerate(self.linear)
            for key, storage in layer.storage.items()
        }
        for at in sorted(snapshots)[:-SNAPSHOTS]:
            del snapshots[at]

    def _forward(self, token_ids: torch.Tensor, rows: slice, prefill: bool) -> torch.Tensor:
        for layer in self.linear:
            layer.select(rows, fresh=prefill and self.at == 0)  # a prefill from position 0 starts from zero states
        if prefill or self._rerunning:
            return super()._forward(token_ids, rows, prefill)
        self._rows = rows
        with self.rollback.verifying():
            return super()._forward(token_ids, rows, prefill)

    def verify(self, block_ids: torch.Tensor, slots: Sequence[int] = (0,)) -> torch.Tensor:
        self._block, self._slots, self._kept = block_ids, list(slots), {}
        return super().verify(block_ids, slots)

    def commit(self, n: int, slot: int = 0) -> None:
        if self._block is None or slot not in self._slots:
            return super().commit(n, slot)
        self._kept[slot] = n
        if len(self._kept) < len(self._slots):
            return  # the lengths move with the rollback, once every row of the verify has said what it keeps
        block, slots, first, self._block = self._block, self._slots, self._rows.start, None
        width = block.shape[1]
        kept = [width] * (self._rows.stop - first)  # free slots inside the forward's rows keep what they got
        for slot, n in self._kept.items():
            kept[slot - first] = n

        def rerun(row: int, n: int) -> None:
            """The fallback: row `row` of the verify again over its n kept tokens, from its restored state (the
            attention K/V and features come out as the verify's)."""
            slot = first + row
            self._rerunning = True
            try:
                AttentionState.verify(self, block[slots.index(slot)][None, :n], [slot])
            finally:
                self._rerunning = False

        self.rollback.keep(kept, width, rerun)
        for slot, n in self._kept.items():
            super().commit(n, slot)
