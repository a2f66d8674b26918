"""Drafters for tests: random ones in the z-lab formats, and an oracle double of controlled acceptance.

- `random_drafter(target, ..., fmt="classic")`: a real drafter with random weights, bound to `target`, in one
  of the `FORMATS`: "classic" (DFlashDraftModel, full attention), "swa" (nested schema, causal sliding layers
  + one full layer, scaled and softcapped head), "swa-noncausal" (the same with top-level is_causal false: the
  window on both sides), "dflash2" (DFlash2DraftModel: sliding non-causal layers, convolutions, selector).
- `save_random_drafter(dir, target, ...)`: the same, saved in the published checkpoint format.
- `OracleDrafter(target, continuation, correct=None)`: proposes the target's own continuation for the
  first `correct` slots of each block (all when None) and a wrong token after, so a test can demand an
  exact acceptance length from the real decode loop. `RowOracle(target, continuations, prompt_lengths, ...)`: one
  per row of a batch, each row known by its prompt's length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash_cli.engine.drafter import DFlashDrafter, DraftCache, DrafterConfig, make_drafter
from dflash_cli.engine.drafter.config import DFLASH2_ARCHITECTURE

FORMATS = ("classic", "swa", "swa-noncausal", "dflash2")


def _format_fields(fmt: str, num_layers: int, window: int, hidden: int, vocab: int) -> dict:
    if fmt == "classic":
        return {}
    sliding = ["sliding_attention"] * num_layers
    if fmt == "dflash2":
        return dict(
            architecture=DFLASH2_ARCHITECTURE,
            layer_types=sliding,
            sliding_window=window,
            is_causal=False,
            nested=True,
            conv_kernel_size=2,
            conv_group_size=math.gcd(hidden, 8),
            selector_rank=8,
            selector_top_k=min(8, vocab),
        )
    if num_layers > 1:
        sliding[-1] = "full_attention"
    fields = dict(
        layer_types=sliding,
        sliding_window=window,
        nested=True,
        input_embedding_scale=1.25,
        output_multiplier=0.9,
        final_logit_softcapping=8.0,
    )
    if fmt == "swa-noncausal":
        fields["is_causal"] = False
    elif fmt != "swa":
        raise ValueError(f"unknown drafter format {fmt!r}; one of {FORMATS}")
    return fields


def drafter_config(
    target,
    *,
    num_layers: int = 1,
    block_size: int = 4,
    layer_ids: list[int] | None = None,
    fmt: str = "classic",
    window: int = 3,
) -> DrafterConfig:
    """A drafter for `target`: the target's hidden size (its embeddings and lm_head are shared), 4 heads of its own
    (targets such as Gemma 4 differ in head shape from layer to layer; the drafter never needs to match them)."""
    tc = target.config.get_text_config()
    hidden = tc.hidden_size
    extra = {"target_layer_ids": layer_ids} if layer_ids else {}
    return DrafterConfig.for_target(
        tc,
        layers=num_layers,
        block_size=block_size,
        mask_token_id=tc.vocab_size - 1,
        intermediate_size=getattr(tc, "intermediate_size", None) or 2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        **extra,
        **_format_fields(fmt, num_layers, window, tc.hidden_size, tc.vocab_size),
    )


def random_drafter(target, *, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = make_drafter(drafter_config(target, **kwargs), target).to(dtype).eval()
    # Random init leaves norms at 1 and projections tiny; scale up so drafts vary with the context.
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("base_kernel"):  # DFlash2 convolutions: near the identity, not at it
                p.add_(torch.randn_like(p) * 0.3)
    return drafter


def save_random_drafter(directory: str | Path, target, **kwargs) -> Path:
    drafter = random_drafter(target, **kwargs)
    drafter.save_pretrained(directory)
    return Path(directory)


class OracleDrafter(DFlashDrafter):
    """Knows the target's continuation; drafts it right for `correct` slots per block, then wrong. `correct` may
    be a sequence: step i uses correct[i % len(correct)], so acceptance lengths vary from step to step."""

    def __init__(
        self, target, continuation: Sequence[int], *, block_size: int, correct: int | Sequence[int] | None = None
    ) -> None:
        super().__init__(drafter_config(target, block_size=block_size), target)
        self.sequence = list(continuation)  # prompt + target continuation, position-indexed
        self.correct = correct
        self.steps = 0
        self.vocab = target.config.get_text_config().vocab_size

    @torch.no_grad()
    def propose(
        self, features, block_ids, starts, cache: DraftCache, *, sizes=None, slots=None, constraints=None
    ) -> torch.Tensor:
        """Each row's continuation (row i: its first sizes[i] - 1 slots), padded to the block's width like the real
        drafter's. A row is known by its slot of a shared cache, or by its one-slot cache. (`constraints`: the
        rows' grammars, which an oracle has no use for.)"""
        sizes = [block_ids.shape[1]] * len(starts) if sizes is None else sizes
        rows = [id(cache)] if cache.slots == 1 else (range(len(starts)) if slots is None else slots)
        out = torch.zeros((block_ids.shape[0], block_ids.shape[1] - 1), dtype=torch.long, device=block_ids.device)
        for i, (context, start, size, row) in enumerate(zip(features, starts, sizes, rows)):
            out[i, : size - 1] = torch.tensor(self.row_proposal(context, size, start, row))
        return out

    def row_proposal(self, context: torch.Tensor, size: int, start: int, row: object) -> list[int]:
        """Row `row`'s proposal for a block of `size` at `start` (`context`: its new context features)."""
        correct = self.correct
        if isinstance(correct, Sequence):
            correct = correct[self.steps % len(correct)]
        self.steps += 1
        proposal = []
        for j in range(size - 1):
            pos = start + 1 + j
            right = self.sequence[pos] if pos < len(self.sequence) else 0
            proposal.append(right if correct is None or j < correct else (right + 1) % self.vocab)
        return proposal


class RowOracle(OracleDrafter):
    """An oracle per row: a row's first draft (its context from position 0: the whole prompt) says which request it
    is by its prompt's length (distinct here), so every row drafts its own continuation right for `correct` slots
    per block. A row is its draft cache alone, its slot in a batch."""

    def __init__(
        self, target, continuations: list[list[int]], prompt_lengths: list[int], *, block_size: int, correct: list[int]
    ) -> None:
        super().__init__(target, [], block_size=block_size, correct=correct)
        self.by_length = dict(zip(prompt_lengths, continuations, strict=True))
        assert len(self.by_length) == len(continuations), "the prompts' lengths must differ"
        self.rows: dict = {}  # id(cache) alone, the slot in a batch -> (sequence, [steps])

    def row_proposal(self, context, size, start, row):
        if start == context.shape[1]:
            self.rows[row] = (self.by_length[start], [0])
        self.sequence, steps = self.rows[row]
        self.steps = steps[0]
        steps[0] += 1
        return super().row_proposal(context, size, start, row)
