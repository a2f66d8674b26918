"""The drafter's context cache: its K/V of the committed context (after RoPE and k_norm), written in place.

One layout for a single sequence and for the rows of a batch: per layer a buffer [slots, kv heads, rows, head dim],
a slot per sequence (a single sequence is slot 0 of a one-slot cache). A full-attention layer indexes its rows by
position (attention reads the prefix up to the block's end: a view). A sliding layer keeps a ring of
`window - 1 + 2 * block` rows indexed by position modulo its size, which always holds the `window - 1` committed
rows a block can still see plus one call's context and block, so its memory stays bounded in long conversations;
one table per slot says which position each ring row holds (every sliding layer writes the same positions), and
the mask drops the rest. Buffers are zeros: attention multiplies masked rows by a zero weight, and a NaN left in
memory there would survive the mask.

Two ways to write it, one per forward kind (on a CPU the drafter's stored steps, engine.drafter.compiled_step, run both
with the same writes):
- a forward over one sequence (`DraftCache.update`, the compiled draft step's path) writes its new context and
  block rows after `length` in slot 0; `length` then moves past the context only, so the block's rows are never
  committed: the next call writes its own rows over them (a length move, no crop, no cat);
- a forward over several rows (`SlotsForward`) writes every row's context and block at that row's own positions,
  known from its block's start, so the cache keeps no lengths for them. A row that joins a slot resets nothing:
  every forward writes each position its queries may see before they read it, and the slot's previous row left
  rows at or past the new row's block end (masked) or, in a ring, older than its window (its position says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dflash_cli.engine.target.base import cache_zeros

if TYPE_CHECKING:
    from dflash_cli.engine.compiled.jit import CompiledStep, Notify
    from dflash_cli.engine.drafter.config import DrafterConfig


def ring_rows(window: int | None, block_size: int) -> int | None:
    """A sliding layer's ring: the `window - 1` committed rows a block can still see, plus one call's context and
    block (None: a full layer)."""
    return None if window is None else window - 1 + 2 * block_size


def window_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """The reference's attention rule on absolute positions -> bool [b, 1, q, keys] (True = attend).

    `query_positions` [b, q], `key_positions` [b|1, keys].
    """
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # query position - key position
    visible = torch.ones_like(distance, dtype=torch.bool)
    if causal:
        visible &= distance >= 0
    if window is not None:
        visible &= distance < window
        if not causal:
            visible &= -distance < window
    return visible[:, None]


class DraftCache:
    """The drafter's context K/V for `slots` sequences (see the module docstring). Room for `capacity` positions
    per slot (`make_room` grows it, keeping what full layers hold), verified in blocks of up to `block_size`."""

    def __init__(
        self,
        config: DrafterConfig,
        slots: int = 1,
        capacity: int = 0,
        block_size: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
        self.slots = slots
        self.block_size = block_size or config.block_size
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.values: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.ring = (
            ring_rows(config.sliding_window, self.block_size) if any(w is not None for w in self.windows) else None
        )
        # each ring row's position, per slot (-1: not written)
        self.ring_positions = (
            None if self.ring is None else torch.full((slots, self.ring), -1, dtype=torch.long, device=device)
        )
        self.length = 0  # a single sequence's committed context (slot 0, `update`)
        self.device = device or torch.device("cpu")  # where the drafter runs (its buffers)
        self.step: CompiledStep | None = None  # the compiled draft step (engine.compiled.jit) of a single sequence
        self.notify: Notify | None = None

    def make_room(self, capacity: int) -> None:
        """Room for `capacity` positions in every slot (full layers keep what they hold)."""
        if capacity <= self.capacity:
            return
        for buffers in (self.keys, self.values):
            for index, old in enumerate(buffers):
                if old is not None and self.windows[index] is None:
                    grown = cache_zeros((*old.shape[:2], capacity, old.shape[3]), old.dtype, old.device)
                    grown[:, :, : self.capacity].copy_(old)
                    buffers[index] = grown
        self.capacity = capacity

    def rewind(self, slot: int, length: int, resume: int) -> int:
        """Keep slot `slot`'s context positions 0 .. length-1 for a sequence whose next block starts at `resume`
        (the positions from `length` on are written again before any query reads them); return how many it keeps.
        A full layer keeps them all; a ring may have evicted, for positions written after `length`, older rows the
        next block still sees: then it keeps only the positions out of that block's window (at most `length`)."""
        if self.ring is not None:
            window = max(w for w in self.windows if w is not None)
            seen = max(0, resume - window + 1)  # the oldest position the next block sees
            if seen < length:
                positions = torch.arange(seen, length, device=self.ring_positions.device)
                if not bool((self.ring_positions[slot, positions % self.ring] == positions).all()):
                    length = seen
        if self.slots == 1:
            self.length = length
        return length

    def copy_out(self, slot: int, n: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """Host copies of slot `slot`'s context rows of positions 0 .. n-1 (a prefix store): per layer its K/V
        [kv heads, n, dim] (a ring: its rows, [kv heads, ring, dim]), and the ring rows' positions."""
        from dflash_cli.engine.prefix import to_host

        rows = []
        for keys, values, window in zip(self.keys, self.values, self.windows):
            if keys is None:
                return [], None  # (never drafted: nothing to keep)
            cut = slice(None) if window is not None else slice(0, n)
            rows.append((to_host(keys[slot, :, cut]), to_host(values[slot, :, cut])))
        ring = None if self.ring_positions is None else to_host(self.ring_positions[slot])
        return rows, ring

    def copy_in(
        self, slot: int, rows: list[tuple[torch.Tensor, torch.Tensor]], ring_positions: torch.Tensor | None
    ) -> None:
        """Write `copy_out`'s rows back into slot `slot` (a ring of the same size)."""
        for index, (keys, values) in enumerate(rows):
            if self.windows[index] is None:
                self.make_room(keys.shape[1])
            buffer_k, buffer_v = self.buffers(index, keys[None].to(self.device))
            buffer_k[slot, :, : keys.shape[1]].copy_(keys, non_blocking=True)
            buffer_v[slot, :, : keys.shape[1]].copy_(values, non_blocking=True)
        if ring_positions is not None:
            self.ring_positions[slot].copy_(ring_positions, non_blocking=True)

    def buffers(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s buffers, allocated on its first write (`like`: [1, kv heads, n, head dim])."""
        if self.keys[layer_idx] is None:
            if self.ring_positions is not None and self.ring_positions.device != like.device:
                self.ring_positions = self.ring_positions.to(like.device)
            rows = self.capacity if self.windows[layer_idx] is None else self.ring
            shape = (self.slots, like.shape[1], rows, like.shape[3])
            self.keys[layer_idx] = cache_zeros(shape, like.dtype, like.device)
            self.values[layer_idx] = cache_zeros(shape, like.dtype, like.device)
        return self.keys[layer_idx], self.values[layer_idx]

    def update(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A single sequence: write the rows of positions `length ..` (new context, then block) into slot 0 and
        return the keys and values to attend over, with their positions when they are not simply 0 .. n-1 (a ring)."""
        n = keys.shape[-2]
        end = self.length + n
        if self.windows[layer_idx] is None:
            self.make_room(end)
            buffer_k, buffer_v = self.buffers(layer_idx, keys)
            buffer_k[:1, :, self.length : end].copy_(keys)
            buffer_v[:1, :, self.length : end].copy_(values)
            return buffer_k[:1, :, :end], buffer_v[:1, :, :end], None
        buffer_k, buffer_v = self.buffers(layer_idx, keys)
        keep = min(n, self.ring)  # a long first context: its rows older than the ring can hold are out of every window
        at = torch.arange(end - keep, end, device=keys.device)
        rows = at % self.ring
        buffer_k[:1].index_copy_(2, rows, keys[:, :, n - keep :])
        buffer_v[:1].index_copy_(2, rows, values[:, :, n - keep :])
        self.ring_positions[0].index_copy_(0, rows, at)
        return buffer_k[:1], buffer_v[:1], self.ring_positions[0]


class SlotsForward:
    """One drafting forward over several slots of a `DraftCache`, handed to each layer's attention in place of the
    cache. Its K/V inputs are packed, no padding: every row's new context rows, then every row's block of `width`
    [n, width]. Row i's context sits at positions starts[i] - contexts[i] .. starts[i] - 1 and its block at
    starts[i] .. starts[i] + width - 1, of which the first sizes[i] are real: row i's queries see its keys before
    starts[i] + sizes[i] (and the layer's own rule), so the pad slots, written like the block's but beyond its end,
    change nothing; their outputs are the caller's to drop.
    """

    def __init__(
        self,
        cache: DraftCache,
        contexts: Sequence[int],
        starts: Sequence[int],
        sizes: Sequence[int],
        slots: Sequence[int],
        width: int,
        device: torch.device,
    ) -> None:
        # (built on the host, then moved: a few small transfers per step, not per layer)
        starts_t, slots_t = torch.tensor(starts), torch.tensor(slots)
        block = starts_t[:, None] + torch.arange(width)
        positions = torch.cat([*(torch.arange(s - c, s) for s, c in zip(starts, contexts)), block.reshape(-1)])
        token_slots = torch.cat([slots_t.repeat_interleave(torch.tensor(contexts)), slots_t.repeat_interleave(width)])
        self.cache, self.width, self.end = cache, width, max(starts) + width
        cache.make_room(self.end)
        self.positions, self.token_slots = positions.to(device), token_slots.to(device)
        self.query_positions = block.to(device)
        self.limits = (starts_t + torch.tensor(sizes)).to(device)
        first = slots[0]
        contiguous = list(slots) == list(range(first, first + len(slots)))
        self.rows: slice | torch.Tensor = slice(first, first + len(slots)) if contiguous else slots_t.to(device)
        self.masks: dict[tuple[bool, int | None], torch.Tensor] = {}
        if cache.ring is not None:
            # each row writes its last `ring` positions (a long first context: older rows are out of every window)
            ring_end = torch.cat(
                [
                    (starts_t + width).repeat_interleave(torch.tensor(contexts)),
                    (starts_t + width).repeat_interleave(width),
                ]
            )
            keep = positions >= ring_end - cache.ring
            at = positions[keep].to(device)
            self.ring_tokens = keep.nonzero()[:, 0].to(device)
            self.ring_slots, self.ring_at = token_slots[keep].to(device), at % cache.ring
            if cache.ring_positions.device != at.device:
                cache.ring_positions = cache.ring_positions.to(at.device)
            cache.ring_positions[self.ring_slots, self.ring_at] = at

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This forward's rows of a [slots, ...] tensor (a view when the slots are contiguous)."""
        return tensor[self.rows] if isinstance(self.rows, slice) else tensor.index_select(0, self.rows)

    def attend(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, causal: bool, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write layer `layer_idx`'s packed keys and values [1, kv heads, tokens, head dim] at their rows' positions;
        return each row's keys and values to attend over [n, kv heads, keys, head dim] and the mask [n, 1, width, keys]."""
        buffer_k, buffer_v = self.cache.buffers(layer_idx, keys)
        keys, values = keys[0].transpose(0, 1), values[0].transpose(0, 1)  # [tokens, kv heads, head dim]
        if self.cache.windows[layer_idx] is None:
            buffer_k[self.token_slots, :, self.positions] = keys
            buffer_v[self.token_slots, :, self.positions] = values
            buffer_k, buffer_v = buffer_k[:, :, : self.end], buffer_v[:, :, : self.end]
        else:
            buffer_k[self.ring_slots, :, self.ring_at] = keys[self.ring_tokens]
            buffer_v[self.ring_slots, :, self.ring_at] = values[self.ring_tokens]
        return self.take(buffer_k), self.take(buffer_v), self.mask(causal, window)

    def mask(self, causal: bool, window: int | None) -> torch.Tensor:
        """Row i's queries see its keys before its block's end, under the layer's rule (the same for every layer of
        one kind: made once per forward)."""
        if (causal, window) not in self.masks:
            if window is None:  # full layers: buffers indexed by position
                key_positions = torch.arange(self.end, device=self.limits.device)[None]
            else:  # rows not yet written are -1
                key_positions = self.take(self.cache.ring_positions)
            visible = ((key_positions >= 0) & (key_positions < self.limits[:, None]))[:, None, None]
            if causal or window is not None:
                visible = visible & window_mask(self.query_positions, key_positions, causal, window)
            self.masks[causal, window] = visible
        return self.masks[causal, window]
