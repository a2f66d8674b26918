"""The DFlash objective and its schedule.

Per sequence, random anchors inside the answer; each block is [anchor token, MASK x (B-1)] embedded with the frozen
target embedding; a block attends to the target features strictly before its anchor and to itself
(bidirectionally), never to other blocks; block slot k is labelled with the token at anchor+k; cross-entropy
weighted by exp(-(k-1)/gamma), through the target's frozen output head.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.engine.sampling import accepted_drafts
from dflash_cli.training.options import TrainOptions

if TYPE_CHECKING:
    from dflash_cli.training.data import TrainingBatch


def dflash_loss(
    drafter: DFlashDrafter, features: torch.Tensor, batch: TrainingBatch, gamma: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted block cross-entropy, plus the accuracy and acceptance length the drafts would get."""
    B = drafter.block_size
    b, n = batch.labels.shape[:2]
    context, blocks = drafter.fuse_context(features), drafter.embed(batch.block_ids)
    hidden = drafter(
        torch.cat([context, blocks.to(context.dtype)], dim=1),
        blocks.shape[1],
        batch.position_ids,
        attention_mask=batch.attention_mask,
    )
    hidden = hidden.view(b, n, B, -1)[:, :, 1:]
    logits = drafter.logits(hidden).float()
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view(b, n, B - 1)
    valid = batch.labels != -100
    weights = torch.exp(-torch.arange(B - 1, dtype=torch.float32, device=ce.device) / gamma) * valid
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-6)
    with torch.no_grad():
        drafts = logits.argmax(-1)
        correct = (drafts == batch.labels) & valid
        blocks = valid[:, :, 0]
        # Acceptance length of a draft block: the engine's rule (labels of absent slots, -100, never match).
        accepted = accepted_drafts(drafts, batch.labels)[blocks].float() + 1
        stats = {
            "loss": float(loss),
            "acc": float(correct.sum() / valid.sum().clamp_min(1)),
            "tau": float(accepted.mean()) if accepted.numel() else 1.0,
        }
    return loss, stats


def learning_rate(step: int, options: TrainOptions, progress: float) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak; `progress` is how far the decay has gone (0 to 1)."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    return options.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def decay_progress(step: int, start: int, start_progress: float, horizon: int) -> float:
    """How far the decay has gone at `step`: from `start_progress` at `start` (the end of warmup, or where a run
    resumed) straight to 1 at `horizon` (--steps, or where --train-minutes will stop the run: fitted_horizon). A
    resumed run goes on from the rate it stopped at, never back up."""
    return min(1.0, start_progress + (1 - start_progress) * max(0, step - start) / max(1, horizon - start))


def fitted_horizon(step: int, steps_run: int, seconds_run: float, seconds_left: float, steps: int) -> int:
    """The step the learning rate's decay ends at under --train-minutes: where training stops at the pace so far
    (or at --steps, if that comes first), so that a run the clock stops has decayed its rate all the same."""
    return min(steps, step + int(steps_run / max(seconds_run, 1e-9) * max(0.0, seconds_left)))
