"""Which row decodes where: the queue of rows waiting to join, the slots they decode in (one per row, in the target's
state and the drafter's cache alike), and prefix placement (engine.prefix): a joining row takes the slot, or the
stored prefix, that holds the most of its prompt, and its prefill starts after what it keeps. A row that leaves
frees its slot at once; what it committed stays there for a later request. engine.loop's `Batch` asks who joins
and runs the steps (draft, verify, accept).
"""

from __future__ import annotations

from collections import deque

import torch

from dflash_cli.engine.compiled.jit import Notify, compiled_draft_step
from dflash_cli.engine.drafter import DFlashDrafter, DraftCache
from dflash_cli.engine.drafter.cache import ring_rows
from dflash_cli.engine.prefix import Held, PrefixStore, Stored, choose_slot, common_prefix, to_host
from dflash_cli.engine.row import Row
from dflash_cli.engine.target.attention import AttentionState


class Scheduler:
    """The waiting rows and the slots of a batch of `rows`. `draft_slots`: the drafter's cache of a slot per row (a
    batch of one row keeps a one-slot cache of its generation's own, and the compiled draft step with `compile`).
    `prefix_cache`: a joining row keeps what its slot holds of its prompt; `prefix_store` keeps prefixes beyond the
    slots, in host memory."""

    def __init__(
        self,
        rows: int,
        drafter: DFlashDrafter | None,
        draft_slots: DraftCache | None,
        block: int,
        device: torch.device,
        *,
        compile: bool,
        notify: Notify | None,
        prefix_cache: bool,
        prefix_store: PrefixStore | None,
    ) -> None:
        self.drafter, self.draft_slots, self.block, self.device = drafter, draft_slots, block, device
        self.compile, self.notify = compile, notify
        self.prefix_cache = prefix_cache
        self.prefix_store = prefix_store if prefix_cache else None
        self.slots: list[Row | None] = [None] * rows
        self.waiting: deque[Row] = deque()

    @property
    def active(self) -> list[Row]:
        return [row for row in self.slots if row is not None]

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    @property
    def room(self) -> int:
        """How many more rows can join now without waiting."""
        return self.slots.count(None) - len(self.waiting)

    def queue(self, row: Row) -> None:
        """`row` waits to join (in order)."""
        self.waiting.append(row)

    @property
    def joining(self) -> bool:
        """Whether a waiting row has a free slot to join (the next step prefills it)."""
        return bool(self.waiting and None in self.slots)

    def join(self) -> Row:
        """The next waiting row, in the first free slot for now (its prefill places it: `place`)."""
        row = self.waiting.popleft()
        row.slot = self.slots.index(None)
        self.slots[row.slot] = row
        return row

    def cancel(self, row: Row, state: AttentionState | None) -> None:
        """Drop `row`: a waiting one leaves the queue, a decoding one frees its slot now (what it committed stays
        there for a later request with the same prefix)."""
        if row in self.waiting:
            self.waiting.remove(row)
        elif row.slot is not None and self.slots[row.slot] is row:
            self.free(row, state, keep=True)

    def free(self, row: Row, state: AttentionState | None, *, keep: bool) -> None:
        """Free `row`'s slot; `keep`: what the row committed stays there for a later request (engine.prefix)."""
        self.slots[row.slot] = None
        if state is None:
            return
        if not keep or not row.ids:  # failed (maybe half-written), or failed before its prefill ended
            state.forget(row.slot)
            return
        pending = None
        if row.pending:  # (copied: the last verify's features live in a buffer the next verify overwrites)
            pending = torch.cat(row.pending, dim=1) if len(row.pending) > 1 else row.pending[0].clone()
        cache = row.draft_cache if row.draft_cache is not None else self.draft_slots
        state.hold(row.slot, Held(row.ids, self.drafter, cache, row.drafted, pending))

    def place(self, row: Row, state: AttentionState) -> None:
        """Move a joining row to the free slot with the longest common prefix with its prompt (engine.prefix); or,
        when a stored prefix shares more, to an empty or the least recently used slot, the stored prefix copied
        back into it (what that slot held goes to the store)."""
        if not self.prefix_cache:
            return
        prompt = row.generation.prompt_ids
        free = [slot for slot, taken in enumerate(self.slots) if taken is None or taken is row]
        slot = choose_slot(free, state.held, prompt)
        store = self.prefix_store if state.storable else None
        if store is not None:
            held = state.held[slot]
            # (taken out of the store as it is found: the stash below, which makes room there, cannot evict it)
            stored = store.take(prompt, self._fits, common_prefix(held.ids, prompt) if held is not None else 0)
            if stored is not None:
                slot = choose_slot(free, state.held, ())
                self._stash(state, slot)
                state.forget(slot)  # (a copy that fails half-way leaves nothing a later request would reuse)
                try:
                    self._restore(state, slot, stored, row.generation.end)
                except BaseException:
                    store.add(stored)  # still whole in host memory: it stays for a later request
                    raise
        self.slots[row.slot], self.slots[slot], row.slot = None, row, slot

    def _fits(self, stored: Stored) -> bool:
        """Whether a stored prefix's drafter context is this batch's drafter's, in a ring of this batch's size."""
        if stored.held.drafter is not self.drafter:
            return False
        if stored.ring_positions is None or self.drafter is None:
            return True
        ring = (
            self.draft_slots.ring
            if self.draft_slots is not None
            else ring_rows(self.drafter.config.sliding_window, self.block)
        )
        return stored.ring_positions.shape[0] == ring

    def _stash(self, state: AttentionState, slot: int) -> None:
        """Copy what `slot` holds into the prefix store (host memory) before a request overwrites it."""
        held = state.held[slot]
        if held is None or self.prefix_store is None or not state.storable:
            return
        keys, values = state.copy_out(slot, len(held.ids))
        draft, ring = [], None
        if held.draft_cache is not None and held.drafted > 0:
            draft, ring = held.draft_cache.copy_out(0 if held.draft_cache.slots == 1 else slot, held.drafted)
        pending = None if held.pending is None else to_host(held.pending)
        kept = Held(held.ids, held.drafter, None, held.drafted, pending)
        self.prefix_store.add(Stored(kept, keys, values, draft, ring))

    def _restore(self, state: AttentionState, slot: int, stored: Stored, end: int) -> None:
        """Copy a stored prefix back into `slot` (for a row that may reach position `end`): the slot then holds it."""
        state.make_room(len(stored.held.ids), self.block)
        state.copy_in(slot, stored.keys, stored.values)
        held, cache = stored.held, self.draft_slots
        if self.drafter is not None:
            if cache is None:  # one row: a cache of its own
                cache = self.drafter.new_cache(end + self.block, self.block)
            if held.drafted > 0:
                cache.copy_in(0 if cache.slots == 1 else slot, stored.draft, stored.ring_positions)
        pending = None if held.pending is None else held.pending.to(self.device, non_blocking=True)
        state.hold(slot, Held(held.ids, held.drafter, cache, held.drafted, pending))

    def resume(self, row: Row, state: AttentionState) -> tuple[int, torch.Tensor | None]:
        """Where `row`'s prefill starts: the positions of its prompt its slot already holds (engine.prefix), short
        of the last (whose logits give the first token), as far as the target state (`resumable`) and the drafter's
        cache (`rewind`) can continue from. Sets up the row's drafter context: its cache rewound to the kept
        positions it has read; returns their count and the kept features it has not read (None: none)."""
        prompt, generation = row.generation.prompt_ids, row.generation
        held = state.held[row.slot] if self.prefix_cache else None
        cache, slot = self.draft_slots, row.slot
        if self.draft_slots is not None:
            self.draft_slots.make_room(generation.end + self.block)
        elif self.drafter is not None:  # one row: its slot's own cache when it fits, else a new one
            cache, slot = held.draft_cache if held is not None and held.drafter is self.drafter else None, 0
            # (the block size shapes only a sliding layer's ring: a full-attention cache serves any block, so a new
            # block size, chat's /set block_size, keeps the prefix)
            if cache is None or cache.slots != 1 or (cache.ring is not None and cache.block_size != self.block):
                cache = self.drafter.new_cache(generation.end + self.block, self.block)
            cache.make_room(generation.end + self.block)
            if self.compile:
                cache.step, cache.notify = compiled_draft_step(self.device), self.notify
            row.draft_cache = cache
        matched = min(common_prefix(held.ids, prompt), len(prompt) - 1) if held is not None else 0
        kept = matched
        if self.drafter is not None and kept > 0:
            read = min(kept, held.drafted)
            if held.drafter is not self.drafter or held.draft_cache is not cache:
                kept = 0  # the drafter has no context for these positions
            elif (usable := cache.rewind(slot, read, len(prompt))) < read:  # a ring evicted rows the next block sees
                kept = usable
        kept = state.resumable(row.slot, kept)
        unread = None
        if self.drafter is not None:
            row.drafted = cache.rewind(slot, min(kept, held.drafted) if kept > 0 else 0, len(prompt))
            if kept > row.drafted:
                unread = held.pending[:, : kept - row.drafted]  # (then row.drafted == held.drafted)
        if held is not None and kept < len(held.ids):  # the prefill overwrites the rest: keep it in the store
            self._stash(state, row.slot)
        generation.stats.cached_tokens, generation.stats.unreused_tokens = kept, matched - kept
        return kept, unread
