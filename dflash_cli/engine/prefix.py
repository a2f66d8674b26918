"""Prefix reuse: a request placed in a slot of the target state keeps the longest common prefix of its prompt with
what the slot already holds, and prefills only the rest (llama-server's slots, exact).

What a slot holds after its row leaves (`Held`): the token ids at its committed positions (the prompt and every
token committed to the target state since: the row's newest token, `Row.last`, is not in it yet), and the
drafter's side of the same positions: its context cache (K/V of the target features, the sliding-window ring too),
how far the drafter has read, and the features of the positions it has not read yet (`pending`: the plain steps'
and the last verify's). A request that keeps n positions rewinds the target's length to n (no copy), rewinds the
drafter's cache to the positions it read, and hands its first draft the kept unread features, then the prefill's:
that draft sees the whole conversation, as it would without reuse.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

_clock = itertools.count(1)


@dataclass(eq=False)
class Held:
    """What one slot of the target state holds for the next request placed in it (see the module docstring)."""

    ids: list[int]  # the token ids at the slot's positions 0 .. len(ids)-1
    drafter: Any = None  # the drafter whose `draft_cache` holds this slot's context (None: no drafter read it)
    draft_cache: Any = None  # a drafter.cache.DraftCache (not imported: the cache copies through `to_host` here)
    drafted: int = 0  # the drafter's cache holds the context of positions 0 .. drafted-1
    pending: torch.Tensor | None = None  # [1, len(ids) - drafted, F]: the features the drafter has not read
    used: int = field(default_factory=lambda: next(_clock))  # when the slot was left: least recently used first


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def choose_slot(free: Sequence[int], held: Sequence[Held | None], prompt: Sequence[int]) -> int:
    """The free slot for a request (llama-server's rule): the longest common prefix with what it holds; on a tie
    (no common prefix at all, most often), an empty slot, else the least recently used, so that what was used
    last stays for its next turn."""

    def score(slot: int) -> tuple[int, bool, int]:
        kept = held[slot]
        return (0, True, 0) if kept is None else (common_prefix(kept.ids, prompt), False, -kept.used)

    return max(free, key=score)


@dataclass(eq=False)
class Stored:
    """A slot's prefix copied into host memory (`PrefixStore`): what `Held` says (its drafter's cache left out: the
    drafter's rows are `draft`), the target's K/V of its positions, and the drafter's context rows. Ranges of
    positions, so that a block-paged store could later keep and copy them block by block."""

    held: Held
    keys: list[torch.Tensor]  # per target attention layer: [kv heads, len(ids), head dim]
    values: list[torch.Tensor]
    draft: list[tuple[torch.Tensor, torch.Tensor]]  # per drafter layer: full [kv, drafted, dim], ring [kv, ring, dim]
    ring_positions: torch.Tensor | None  # the ring rows' positions (sliding drafter layers)

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *(t for pair in self.draft for t in pair)]
        tensors += [t for t in (self.ring_positions, self.held.pending) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class PrefixStore:
    """More prefixes than slots: those a slot held before a request overwrote them, least recently used first out,
    in host memory (pinned on CUDA, for the copies back), at most `limit` bytes. A request whose prompt shares more
    with a stored prefix than with any free slot takes it out of the store (`take`) and has it copied back into a
    slot (`Batch`), then continues from it like from a slot's own.

    The store owns its entries and one lock guards them: `take` finds and removes the best entry in one step, so
    the placement that took it holds it alone (an `add` that makes room, in this thread or another, can no longer
    evict it) until it is copied back, or `add`ed again when that fails."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: list[Stored] = []  # least recently used first
        self.used = 0  # bytes
        self._lock = threading.Lock()

    def add(self, stored: Stored) -> None:
        """Keep `stored` (most recently used), dropping the least recently used ones it needs room from; one larger
        than the whole store is not kept."""
        if stored.nbytes > self.limit:
            return
        with self._lock:
            while self.entries and self.used + stored.nbytes > self.limit:
                self.used -= self.entries.pop(0).nbytes
            self.entries.append(stored)
            self.used += stored.nbytes

    def take(self, prompt: Sequence[int], fits: Callable[[Stored], bool], longer_than: int = 0) -> Stored | None:
        """Remove and return the stored prefix with the longest common prefix with `prompt` among those
        `fits(stored)` accepts, if that is longer than `longer_than` tokens (else None, and the store is as it
        was)."""
        with self._lock:
            found, length = None, longer_than
            for stored in self.entries:
                shared = common_prefix(stored.held.ids, prompt)
                if shared > length and fits(stored):
                    found, length = stored, shared
            if found is not None:
                self.entries.remove(found)
                self.used -= found.nbytes
            return found

    def clear(self) -> None:
        with self._lock:
            self.entries, self.used = [], 0


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory: pinned when it comes from a GPU (so the copy back can be asynchronous)."""
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor)
    return tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu")
