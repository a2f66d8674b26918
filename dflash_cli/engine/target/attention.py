"""The target's decoding state, behind the small interface the loop uses: prefill, verify a block, commit n.

`TargetState` is all the loop sees of the target. `AttentionState` implements it for transformers models
whose layers are attention layers (Llama, Qwen3 and their kin), gpt-fast style:

- K/V live in buffers preallocated per layer and written in place. A verify writes the block's K/V after
  the committed length; `commit(n)` moves the length, so a rejected draft is a length reset, never a crop or
  a copy: its slots lie beyond the length, where no later forward reads, and the next verify overwrites them.
- Attention reads the committed prefix plus the block (a view, no copy), so a step reads the K/V it needs and
  not the whole buffer. `full_view=True` hands attention the whole buffer instead, with an explicit causal mask
  hiding what lies beyond the block (transformers drops its own mask for a one-token query, which would then
  attend every slot of the buffer): fixed shapes, for CUDA graphs.
  Over the whole buffer a target's SDPA attention runs as WHOLE_BUFFER (`whole_buffer_attention`): transformers'
  SDPA copies each K/V head once per query head of its group whenever a mask is given and dynamo traces it (K/V of
  every layer at the buffer's length, written and read 4x over at Qwen3-8B's 32/8 heads), and SDPA's kernel for a
  step's short query walks all the buffer's keys on a few of the GPU's processors; there each K/V head is read
  once, its keys in pieces side by side.
- The hidden states the drafter reads are written into a preallocated buffer by forward hooks that are
  installed once per state (not per step) and act only during this state's own forwards. Inside a compiled step
  they are outputs of the graph instead, copied into the buffer after it.

Rows: the buffers hold `rows` sequences ([rows, heads, capacity, head_dim]), each with its own committed length.
A forward over one row reads and writes that row alone, exactly as a single sequence would (the same kernels and
masks as transformers' own decoding). A forward over several rows (`verify(block, slots)`) places each row's block
at that row's own positions and hands attention the rows' K/V up to the longest row's end, with an explicit mask
per layer kind (causal on each row's positions; sliding or chunked where the layer is): the slots past a row's
end are masked, and are zeros or that row's own stale K/V, never garbage (see docs/architecture.md).

A model whose layers keep a recurrent state (hybrid models, hybrid.py beside this file) keeps it per row too and
implements `commit` by putting each row's state back to its n kept tokens.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dflash_cli.engine.compiled.jit import CACHE_ARGUMENT, CompiledStep, Notify, compiled_step, run_target
from dflash_cli.engine.kernels.layers import EAGER
from dflash_cli.engine.prefix import to_host
from dflash_cli.engine.target.base import (
    LINEAR,
    SDPA_IMPLEMENTATIONS,
    WHOLE_BUFFER,
    TargetState,
    cache_zeros,
    compute_dtype,
    context_window,
    target_decoder_layers,
)
from dflash_cli.engine.target.compiled_step import ExportedStep, loaded_step, unload

# Positions a state reserves at least, so that consecutive requests (a growing chat) rarely reallocate. On CPU
# the buffers are allocated but untouched pages cost no memory; the planner reserves an 8k-token KV cache too.
MIN_CAPACITY = 8192
# Whole-buffer attention (full_view) of a query of at most SPLIT_QUERIES tokens cuts the keys in KEY_PIECES pieces
# (`_split_attention`): with Qwen3-8B's 8 K/V heads, 128 pieces side by side for an H100/H200's 132 processors. A
# whole-buffer state's capacity is a multiple of KEY_PIECES.
SPLIT_QUERIES = 64
KEY_PIECES = 16
# A prefill runs in chunks of at most MAX_PREFILL_CHUNK queries (its products are then as fast per row as a whole
# prompt's, and its MLP's activations bounded); eager attention holds a forward's scores [heads, queries, keys] in
# float32 (a softmax and a bf16 copy beside: 12 bytes each) per layer, so with it a chunk keeps them near
# PREFILL_SCORES_BYTES. Chunking changes no row's numbers (engine.kernels.layers, eager attention). setup.sizes counts the
# same rule (a test holds them equal).
PREFILL_SCORES_BYTES = 256 * 2**20
MAX_PREFILL_CHUNK = 512
MIN_PREFILL_CHUNK = 16


def whole_buffer_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention over a whole K/V buffer (full_view), without its copy of K/V per query head:
    the g query heads of each K/V head become g x q query rows of one head, each row under its query's mask row, so
    every K/V head is read once, in place (transformers packs this way itself for an eager one-token query).
    A compiled step's short query (at most SPLIT_QUERIES) runs `_split_attention`; eager forwards and prefills run
    SDPA (eager, the pieces' float32 scores would be materialized whole: a GPU's memory plan counts SDPA's)."""
    groups = getattr(module, "num_key_value_groups", 1)
    # transformers' own path where it differs (softcapping, which it refuses; sinks; position bias) or copies nothing
    special = any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "position_bias"))
    if (
        attention_mask is None
        or groups == 1
        or attention_mask.shape[1] != 1
        or special
        or kwargs.get("output_attentions")
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, q, head_dim = query.shape
    packed = query.reshape(batch, heads // groups, groups * q, head_dim)
    mask = attention_mask.repeat(1, 1, groups, 1)
    split = q <= SPLIT_QUERIES and torch.compiler.is_compiling() and attention_mask.dtype == torch.bool
    if split and key.shape[2] % KEY_PIECES == 0 and not dropout:
        out = _split_attention(packed, key, value, mask, head_dim**-0.5 if scaling is None else scaling)
    else:
        out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, q, value.shape[-1]).transpose(1, 2).contiguous(), None


def _split_attention(
    rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of few query rows [n, kv heads, r, d] over many keys, as flash-decoding computes it: the keys cut
    in KEY_PIECES pieces, each piece's scores, softmax and weighted sum apart, then combined by the pieces' maxima.
    SDPA's kernel for a short query runs one block per K/V head, each walking every key; the pieces spread the
    keys over the GPU's processors (compiled, at Qwen3-8B's shape over 8,192 positions on an H200: 0.67 against
    6.3 ms a step; benchmarks/whole_buffer_attention.py). Scores are rounded to the dtype, the softmax is float32
    and its weights are rounded to the dtype for the sum, as transformers' eager attention rounds them."""
    n, kv_heads, count, head_dim = rows.shape
    piece = key.shape[2] // KEY_PIECES
    keys = key.reshape(n, kv_heads, KEY_PIECES, piece, head_dim)
    values = value.reshape(n, kv_heads, KEY_PIECES, piece, value.shape[-1])
    visible = visible.reshape(n, 1, count, KEY_PIECES, piece).transpose(2, 3)  # [n, 1, pieces, r, piece]
    scores = torch.matmul(rows[:, :, None], keys.transpose(-1, -2)).float() * scale  # [n, kv, pieces, r, piece]
    # A piece no query row sees: a finite floor for its maximum (no NaN from -inf - -inf), weights 0, and the share
    # exp(floor - best) = 0 below.
    scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
    best = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - best).masked_fill(~visible, 0.0)
    sums = weights.sum(-1, keepdim=True)
    # Each piece's weights normalized before they are rounded to the dtype, so its sum is a mean of values (no
    # float16 overflow over a piece's many keys); the pieces are then combined by their shares of the total.
    parts = torch.matmul((weights / sums.clamp(min=1e-30)).to(value.dtype), values).float()  # [n, kv, pieces, r, d]
    share = torch.exp(best - best.amax(2, keepdim=True)) * sums
    out = (parts * share).sum(2) / share.sum(2)
    return out.to(value.dtype)


def _in_pieces(positions: int) -> int:
    """A whole-buffer capacity of at least `positions`: a multiple of KEY_PIECES, so a step's keys cut evenly."""
    return -(-positions // KEY_PIECES) * KEY_PIECES


AttentionInterface.register(WHOLE_BUFFER, whole_buffer_attention)
AttentionMaskInterface.register(WHOLE_BUFFER, sdpa_mask)


class _KVLayer(CacheLayerMixin):
    """One attention layer's K/V for transformers: reads and writes the owning state's buffers, in the rows and at
    the positions of the state's current forward."""

    is_sliding = False  # sliding-window targets keep every position; their masks still apply the window
    # Not "compileable" in transformers' sense: that would make its masks materialize for one-token steps, which
    # changes the attention kernel (and its rounding) from the one DynamicCache and `generate()` use. (Whole-buffer
    # forwards, full_view, bring their own mask: see AttentionState._forward.)
    is_compileable = False

    def __init__(self, state: AttentionState, index: int) -> None:
        super().__init__()
        self.state, self.index = state, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("the buffers are allocated by AttentionState")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state
        keys, values = state.buffers(self.index, key_states)
        keys, values = keys[state.forward_rows], values[state.forward_rows]
        if state.forward_positions is not None:  # several rows, each block at its own row's positions
            rows = torch.arange(keys.shape[0], device=keys.device)[:, None]
            keys[rows, :, state.forward_positions] = key_states.transpose(1, 2)
            values[rows, :, state.forward_positions] = value_states.transpose(1, 2)
            return keys[:, :, : state.forward_end], values[:, :, : state.forward_end]
        q = key_states.shape[-2]
        if state.full_view:  # fixed shapes: the write position comes from the device-side length
            at = torch.arange(q, device=keys.device) + state.offset
            keys.index_copy_(2, at, key_states)
            values.index_copy_(2, at, value_states)
            return keys, values
        end = state.at + q
        keys[:, :, state.at : end].copy_(key_states)
        values[:, :, state.at : end].copy_(value_states)
        return keys[:, :, :end], values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.at + query_length, 0

    def get_seq_length(self) -> int | torch.Tensor:
        return self.state.offset

    def get_max_length(self) -> int:
        return self.state.capacity


class AttentionState(TargetState):
    """Static K/V buffers and feature capture for a transformers attention model (see the module docstring)."""

    def __init__(self, target: PreTrainedModel) -> None:
        self._target = weakref.ref(target)  # the hooks this state installs on the target must not keep it alive
        self.rows = 1
        self.lengths = [0]
        self.held: list[Any] = [None]
        self.capacity = 0
        self.layers = target_decoder_layers(target)
        self.cache = Cache(layers=[_KVLayer(self, i) for i in range(len(self.layers))])
        self._keys: list[torch.Tensor | None] = [None] * len(self.layers)
        self._values: list[torch.Tensor | None] = [None] * len(self.layers)
        # The current forward: its rows of the buffers, and either one row's committed length (`at`) or, for
        # several rows, each query's position [n, q] and how many key positions attention reads.
        self.forward_rows = slice(0, 1)
        self.at = 0
        self.forward_positions: torch.Tensor | None = None
        self.forward_end = 0
        # compiled steps (compiled.CompiledStep) or None: eager; full_view: whole-buffer attention, for CUDA graphs
        self.step: CompiledStep | None = None
        # CPU forwards, one row or several: the stored exported step (exported.py)
        self.exported: ExportedStep | None = None
        self.full_view = False
        self._length_t: torch.Tensor | None = None  # `at` on the device, for full_view
        self.notify: Notify | None = None  # shows a progress line while a step compiles
        self.feature_layers: tuple[int, ...] = ()
        self._hooks: list[Any] = []
        self._block_features: torch.Tensor | None = None  # [rows, block, F]: verify steps write here
        self._features: torch.Tensor | None = None  # what the last forward wrote (the block buffer, or a prompt's)
        self._feature_rows = slice(0, 1)  # the rows of `_features` the current forward writes
        self._feature_at = 0  # and the position in them its first token writes (a prefill chunk's offset)
        self._feature_slot = 0  # the slot of `_features`' first row
        # Inside a compiled step the hooks put each feature layer's output here (see `_record`)
        self._stash: list[torch.Tensor | None] = []
        self._stashing = False
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
        """The committed length of a one-row forward as the forward sees it: a device tensor in full_view mode
        (so graphs do not specialize on it), else a Python int."""
        return self._length_t if self.full_view else self.at

    # --- setup, between requests ---

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
        """Make room for `rows` sequences of up to `positions` positions verified in blocks of `block_size` (the
        last block may run past `positions`), with the drafter reading `feature_layers` (empty: no drafter).
        What the rows hold (their K/V, `lengths` and `held`) stays unless the buffers are allocated again.
        `compile` applies to one-row states."""
        assert rows == 1 or not compile, "compiled steps run one row"
        self.exported = loaded_step(self.target)  # (every forward: prefills, steps of one row or several)
        self.step = compiled_step(self.device) if compile and self.exported is None else None
        self.notify = notify
        full_view = self.step is not None and self.step.fixed_shapes
        needed = positions + block_size
        if needed > self.capacity or full_view != self.full_view or rows != self.rows:
            if rows == 1:  # a growing chat reuses one state: reserve a long context once
                window = context_window(self.target)
                floor = MIN_CAPACITY if window is None else min(window + block_size, MIN_CAPACITY)
                self.capacity = max(needed, floor)
            else:  # rows x capacity is real memory: what the rows need, grown when a longer row joins
                self.capacity = needed
            if full_view:
                self.capacity = _in_pieces(self.capacity)
            self.rows = rows
            self.lengths, self.held = [0] * rows, [None] * rows
            self.full_view = full_view
            self._keys = [None] * len(self.layers)
            self._values = [None] * len(self.layers)
            self._length_t = torch.zeros((), dtype=torch.long, device=self.device)
            self._static(self._length_t)
        if full_view and self.target.config._attn_implementation == "sdpa":  # (the module docstring)
            # Kept when a later state does not read whole buffers: the same attention, and a switch back and forth
            # would make this state's graphs fail their guards (and trace, and record again) on its next step.
            self.target.set_attn_implementation(WHOLE_BUFFER)
        if feature_layers and feature_layers != self.feature_layers:  # a drafter reading other layers
            self.close()
            self._hooks = [
                self.layers[layer].register_forward_hook(self._capture(slot))
                for slot, layer in enumerate(feature_layers)
            ]
            self.feature_layers = feature_layers
            self._stash = [None] * len(feature_layers)
            self._block_features = None
        # Without a drafter the hooks stay (so compiled steps keep their guards) but record nothing.
        self.capture = bool(feature_layers)
        if self.capture and (self._block_features is None or self._block_features.shape[:2] != (rows, block_size)):
            width = self.target.config.get_text_config().hidden_size * len(feature_layers)
            self._block_features = self._static(
                torch.empty(rows, block_size, width, dtype=self.dtype, device=self.device)
            )

    def make_room(self, positions: int, block_size: int) -> None:
        """Grow the buffers (keeping every row's K/V) so that a row of `positions` positions fits. CUDA graphs
        hold the buffers' addresses: a compiled CUDA state's graphs are recorded again for the grown buffers (as
        when `reserve` grows them for a longer chat)."""
        needed = positions + block_size
        if needed <= self.capacity:
            return
        if self.full_view:
            needed = _in_pieces(needed)
        for buffers in (self._keys, self._values):
            for index, old in enumerate(buffers):
                if old is not None:
                    grown = self._static(cache_zeros((*old.shape[:2], needed, old.shape[3]), old.dtype, old.device))
                    grown[:, :, : self.capacity].copy_(old)
                    buffers[index] = grown
        self.capacity = needed

    def _static(self, tensor: torch.Tensor) -> torch.Tensor:
        """Tell CUDA graphs that `tensor` keeps its address (it is written in place, never replaced)."""
        if self.full_view:
            torch._dynamo.mark_static_address(tensor)
        return tensor

    def buffers(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s K/V buffers, allocated on its first write with that write's heads, head size and dtype."""
        keys = self._keys[index]
        if keys is None:
            shape = (self.rows, like.shape[1], self.capacity, like.shape[3])
            # Attention over the whole buffer (full_view) or over several rows (past a shorter row's end) multiplies
            # unwritten slots by a zero weight: zeros, so no NaN in memory survives the mask.
            for buffers in (self._keys, self._values):
                if self.full_view or self.rows > 1:
                    buffers[index] = self._static(cache_zeros(shape, like.dtype, like.device))
                else:
                    buffers[index] = torch.empty(shape, dtype=like.dtype, device=like.device)
            keys = self._keys[index]
        return keys, self._values[index]

    def copy_out(self, slot: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Host copies of row `slot`'s K/V at positions 0 .. n-1, per layer [kv heads, n, head dim] (a prefix store)."""
        keys = [to_host(k[slot, :, :n]) for k in self._keys if k is not None]
        return keys, [to_host(v[slot, :, :n]) for v in self._values if v is not None]

    def copy_in(self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write `copy_out`'s K/V back into row `slot` at positions 0 .. n-1 and make it its length."""
        n = keys[0].shape[1]
        for index, (k, v) in enumerate(zip(keys, values)):
            buffer_k, buffer_v = self.buffers(index, k[None].to(self.device))
            buffer_k[slot, :, :n].copy_(k, non_blocking=True)
            buffer_v[slot, :, :n].copy_(v, non_blocking=True)
        self.lengths[slot] = n

    @property
    def storable(self) -> bool:
        """Whether a row's state is all in its K/V (`copy_out` keeps all of it)."""
        return True

    def _capture(self, slot: int) -> Any:
        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._capturing:
                self._record(slot, output[0] if isinstance(output, tuple) else output)

        return record

    def _record(self, slot: int, hidden: torch.Tensor) -> None:
        """Write feature layer `slot`'s output of the current forward ([rows, q, H] or [q, H]) where it belongs; inside
        a compiled step, keep it for `_forward` to write after the graph (the graph then mutates no input of its own
        but the K/V buffers, which CUDA graphs hold as static)."""
        if self._stashing:
            self._stash[slot] = hidden
            return
        width, q = hidden.shape[-1], hidden.shape[-2]
        at = self._feature_at
        self._features[self._feature_rows, at : at + q, slot * width : (slot + 1) * width].copy_(hidden)

    # --- the interface ---

    def _forward(self, token_ids: torch.Tensor, rows: slice, prefill: bool) -> torch.Tensor:
        """One forward over `rows` of the buffers (set up by the caller: `at` for one row, or the positions)."""
        self.forward_rows = rows
        if self.capture and not prefill:  # a prefill writes the prompt's own buffer (`prefill`)
            self._features, self._feature_rows, self._feature_slot, self._feature_at = self._block_features, rows, 0, 0
        self._capturing = self.capture
        try:
            if self.exported is not None:  # one row or several (each at its own positions)
                return self._exported_forward(token_ids, rows, prefill)
            if self.forward_positions is not None:
                masks = self._masks(self.forward_positions, self.forward_end)
                out = self.target(
                    input_ids=token_ids,
                    position_ids=self.forward_positions,
                    attention_mask=masks,
                    use_cache=True,
                    **{CACHE_ARGUMENT: self.cache},
                )
                return out.logits
            masks_for = None
            if self.full_view:  # the whole buffer: an explicit mask at the row's positions
                self._length_t.fill_(self.at)
                masks_for = self._whole_buffer_masks
            if prefill or self.step is None:
                return run_target(self.target, token_ids, self.cache, self.offset, 1 if prefill else 0, masks_for)
            self._stashing = self._capturing
            logits = self.step(self.target, token_ids, self.cache, self.offset, 0, masks_for, notify=self.notify)
            self._stashing = False
            for slot, hidden in enumerate(self._stash if self._capturing else ()):
                self._record(slot, hidden)  # (a CUDA graph's outputs: `finally` lets go of them)
            return logits
        finally:
            self._capturing = self._stashing = False
            self._stash[:] = [None] * len(self._stash)  # (the same list: the graphs' guards hold it)
            self.forward_positions = None

    def _exported_forward(self, token_ids: torch.Tensor, rows: slice, prefill: bool) -> torch.Tensor:
        """`_forward` through the exported step: it returns the layers' outputs, of which the drafter's are copied
        here, and the final hidden states, to which the output head is applied (for a prefill, the last row's).
        Several rows (`forward_positions` set) give logits [rows, q, vocab], one row [q, vocab]."""
        exported = self.exported
        assert exported is not None
        q = token_ids.shape[1]
        several = self.forward_positions is not None
        if several:
            positions, end = self.forward_positions, self.forward_end
        else:
            positions, end = (torch.arange(q, device=self.device) + self.at)[None], self.at + q
        like = torch.empty(1, exported.kv_heads, 0, exported.head_dim, dtype=self.dtype, device=self.device)
        buffers = [self.buffers(index, like) for index in range(len(self.layers))]
        keys, values = [k for k, _ in buffers], [v for _, v in buffers]
        if (rows.start or 0, rows.stop) != (0, self.rows):  # (whole buffers need no views: 60 of them cost ~1.5%)
            keys, values = [k[rows] for k in keys], [v[rows] for v in values]
        try:
            hidden, outputs = exported(token_ids, positions, end, keys, values)
        except RuntimeError as error:  # the package refused the call: eager from now on (nothing was committed)
            unload(self.target)
            self.exported = None
            warnings.warn(f"the exported target step failed ({error}); running it eagerly", stacklevel=2)
            return self._forward(token_ids, rows, prefill)
        if self._capturing:  # the feature layers side by side, as `_record` writes them one by one (one call here)
            chosen = [outputs[layer] for layer in self.feature_layers]
            into = self._features[self._feature_rows, self._feature_at : self._feature_at + q]
            # (cat would resize a view of the wrong shape and write past it, where copy_ raises)
            assert into.shape == (*chosen[0].shape[:-1], sum(h.shape[-1] for h in chosen)), "feature rows"
            torch.cat(chosen, dim=-1, out=into)
        logits = self.target.get_output_embeddings()(hidden[:, -1:] if prefill else hidden)
        return logits if several else logits[0]

    def _whole_buffer_masks(self, positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        return self._masks(positions, self.capacity)

    def _masks(self, positions: torch.Tensor, end: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Each row's queries see that row's keys at or before their own position (and within the layer's window
        or chunk): a 4-D mask [n, 1, q, end] per layer kind, boolean for SDPA, additive for eager attention. One
        kind: the mask itself (every model takes a 4-D mask as is); several: transformers' mapping by kind."""
        config = self.target.config.get_text_config()
        kinds = sorted(set(getattr(config, "layer_types", None) or ()))
        if not kinds:  # one kind for every layer: sliding where the config has a window (Mistral, Qwen3-MoE)
            kinds = ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"]
        keys = torch.arange(end, device=positions.device)
        queries = positions[:, None, :, None]
        distance = queries - keys
        causal = distance >= 0
        masks = {}
        for kind in kinds:
            if kind == LINEAR:
                masks[kind] = None
                continue
            visible = causal
            if kind == "sliding_attention":
                visible = causal & (distance < config.sliding_window)
            elif kind == "chunked_attention":
                chunk = config.attention_chunk_size
                visible = causal & (queries // chunk == keys // chunk)
            if self.target.config._attn_implementation not in SDPA_IMPLEMENTATIONS:
                visible = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device).masked_fill(
                    ~visible, torch.finfo(self.dtype).min
                )
            masks[kind] = visible
        return masks if len(masks) > 1 else masks[kinds[0]]

    def prefill(self, token_ids: torch.Tensor, slot: int = 0, start: int = 0) -> torch.Tensor:
        self.held[slot] = None  # the row's positions from `start` on change: the loop says what it holds after
        n = token_ids.shape[1]
        if self.capture:  # the prompt's features: their own buffer, once per request
            width = self._block_features.shape[-1]
            self._features = torch.empty(1, n, width, dtype=self.dtype, device=self.device)
            self._feature_rows, self._feature_slot = slice(0, 1), slot
        chunk = self.prefill_chunk(start + n)
        for begin in range(0, n, chunk):
            self.at, self._feature_at = start + begin, begin
            logits = self._forward(token_ids[:, begin : begin + chunk], slice(slot, slot + 1), prefill=True)
        self.lengths[slot] = start + n
        return logits

    def prefill_chunk(self, end: int) -> int:
        """How many prompt tokens one prefill forward takes when the row ends at `end` (see PREFILL_SCORES_BYTES)."""
        if self.target.config._attn_implementation not in EAGER:
            return MAX_PREFILL_CHUNK
        heads = self.target.config.get_text_config().num_attention_heads
        fits = PREFILL_SCORES_BYTES // (3 * 4 * heads * end)
        return max(MIN_PREFILL_CHUNK, min(MAX_PREFILL_CHUNK, fits))

    def verify(self, block_ids: torch.Tensor, slots: Sequence[int] = (0,)) -> torch.Tensor:
        if len(slots) == 1:  # one row: exactly a single sequence's forward
            self.at = self.lengths[slots[0]]
            return self._forward(block_ids, slice(slots[0], slots[0] + 1), prefill=False)[None]
        # Several rows: the forward covers the slots first..last; a free slot between them runs a dummy block
        # after its own (free) row's length, where it overwrites nothing that row holds, and its logits are dropped.
        first, last = min(slots), max(slots)
        index = torch.tensor([slot - first for slot in slots], device=block_ids.device)
        ids = block_ids.new_zeros((last - first + 1, block_ids.shape[1])).index_copy_(0, index, block_ids)
        starts = self.lengths[first : last + 1]
        q = block_ids.shape[1]
        self.forward_positions = torch.tensor(starts, device=block_ids.device)[:, None] + torch.arange(
            q, device=block_ids.device
        )
        self.forward_end = max(starts) + q
        return self._forward(ids, slice(first, last + 1), prefill=False).index_select(0, index)

    def commit(self, n: int, slot: int = 0) -> None:
        self.lengths[slot] += n

    def features(self, n: int, slot: int = 0) -> torch.Tensor:
        row = slot - self._feature_slot
        return self._features[row : row + 1, :n]

    @property
    def whole_blocks(self) -> bool:
        return self.step is not None

    def close(self) -> None:
        """Remove this state's hooks from the target."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self.feature_layers = [], ()
