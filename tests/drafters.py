"""Drafters for tests: random ones in the z-lab format, and an oracle double of controlled acceptance.

- `random_drafter(target, ...)`: a real `DFlashDrafter` with random weights, bound to `target`.
- `save_random_drafter(dir, target, ...)`: the same, saved in the published checkpoint format.
- `OracleDrafter(target, continuation, correct=None)`: proposes the target's own continuation for the
  first `correct` slots of each block (all when None) and a wrong token after, so a test can demand an
  exact acceptance length from the real decode loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from dflash_cli.drafter import DFlashDrafter, DraftCache, DrafterConfig, default_target_layer_ids


def drafter_config(target, *, num_layers: int = 1, block_size: int = 4, layer_ids: list[int] | None = None) -> DrafterConfig:
    """A drafter for `target`: the target's hidden size (its embeddings and lm_head are shared), 4 heads of its own
    (targets such as Gemma 4 differ in head shape from layer to layer; the drafter never needs to match them)."""
    tc = target.config.get_text_config()
    hidden = tc.hidden_size
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=getattr(tc, "intermediate_size", None) or 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        vocab_size=tc.vocab_size,
        num_target_layers=tc.num_hidden_layers,
        block_size=block_size,
        mask_token_id=tc.vocab_size - 1,
        target_layer_ids=layer_ids or default_target_layer_ids(tc.num_hidden_layers, num_layers),
        max_position_embeddings=tc.max_position_embeddings,
    )


def random_drafter(target, *, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(drafter_config(target, **kwargs), target).to(dtype).eval()
    # Random init leaves norms at 1 and projections tiny; scale up so drafts vary with the context.
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return drafter


def save_random_drafter(directory: str | Path, target, **kwargs) -> Path:
    drafter = random_drafter(target, **kwargs)
    drafter.save_pretrained(directory)
    return Path(directory)


class OracleDrafter(DFlashDrafter):
    """Knows the target's continuation; drafts it right for `correct` slots per block, then wrong."""

    def __init__(self, target, continuation: Sequence[int], *, block_size: int, correct: int | None = None) -> None:
        super().__init__(drafter_config(target, block_size=block_size), target)
        self.sequence = list(continuation)  # prompt + target continuation, position-indexed
        self.correct = correct
        self.vocab = target.config.get_text_config().vocab_size

    @torch.no_grad()
    def draft(self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache) -> torch.Tensor:
        slots = block_ids.shape[1] - 1
        logits = torch.zeros(1, slots, self.vocab)
        for j in range(slots):
            pos = start + 1 + j
            right = self.sequence[pos] if pos < len(self.sequence) else 0
            token = right if self.correct is None or j < self.correct else (right + 1) % self.vocab
            logits[0, j, token] = 1.0
        return logits.to(block_ids.device)
