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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dflash_cli.engine.drafter.cache import DraftCache

_clock = itertools.count(1)


@dataclass(eq=False)
class Held:
    """What one slot of the target state holds for the next request placed in it (see the module docstring)."""

    ids: list[int]  # the token ids at the slot's positions 0 .. len(ids)-1
    drafter: Any = None  # the drafter whose `draft_cache` holds this slot's context (None: no drafter read it)
    draft_cache: DraftCache | None = None
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
