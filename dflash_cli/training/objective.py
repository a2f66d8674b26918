"""The DFlash objective and its schedule.

Per sequence, random anchors inside the answer; each block is [anchor token, MASK x (B-1)] embedded with the frozen
target embedding; a block attends to the target features strictly before its anchor and to itself
(bidirectionally), never to other blocks; block slot k is labelled with the token at anchor+k; cross-entropy
weighted by exp(-(k-1)/gamma), through the target's frozen output head (its rows of the drafter's draft vocabulary,
when it has one).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.engine.sampling import accepted_drafts
from dflash_cli.training.options import TrainOptions

if TYPE_CHECKING:
    from dflash_cli.training.data import TrainingBatch


def drafted_hidden(drafter: DFlashDrafter, features: torch.Tensor, batch: TrainingBatch) -> torch.Tensor:
    """One drafter forward over a batch's blocks: the hidden states of their drafted slots [b, n, B-1, H]."""
    b, n = batch.labels.shape[:2]
    context, blocks = drafter.fuse_context(features), drafter.embed(batch.block_ids)
    hidden = drafter(
        torch.cat([context, blocks.to(context.dtype)], dim=1),
        blocks.shape[1],
        batch.position_ids,
        attention_mask=batch.attention_mask,
    )
    return hidden.view(b, n, drafter.block_size, -1)[:, :, 1:]


def dflash_loss(
    drafter: DFlashDrafter, features: torch.Tensor, batch: TrainingBatch, gamma: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted block cross-entropy, plus the accuracy and acceptance length the drafts would get."""
    B = drafter.block_size
    b, n = batch.labels.shape[:2]
    hidden = drafted_hidden(drafter, features, batch)
    # Over the draft vocabulary when the drafter has one (its labels outside it are ignored: never proposed).
    logits = drafter.vocab_logits(hidden).float()
    vocab = drafter.draft_vocab if drafter.config.draft_vocab_size is not None else None
    labels = batch.labels if vocab is None else vocabulary_positions(batch.labels, vocab)
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view(b, n, B - 1)
    learned = labels != -100
    weights = torch.exp(-torch.arange(B - 1, dtype=torch.float32, device=ce.device) / gamma) * learned
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-6)
    with torch.no_grad():
        drafts = logits.argmax(-1)
        drafts = drafts if vocab is None else vocab[drafts]
        valid = batch.labels != -100
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


def vocabulary_positions(labels: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Target token ids -> their positions in an ascending draft vocabulary; -100 for -100 and for ids outside it."""
    at = torch.searchsorted(vocab, labels.clamp_min(0)).clamp_max(len(vocab) - 1)
    return torch.where((labels >= 0) & (vocab[at] == labels), at, -100)


def draft_vocabulary(sequences: Iterable[Sequence[int]], size: int) -> torch.Tensor | None:
    """The `size` tokens most frequent in the training sequences (prompts and answers: an answer copies names from
    its prompt; ties: the lower id), ascending, at most as many as they hold; None for `size` 0 (the whole
    vocabulary). The rarest rarely matter: the demo's 12,964 answers hold 14,216 distinct tokens, and the 8,192 most
    frequent are 99.1% of their 1.29M."""
    if size == 0:
        return None
    counts = Counter(token for sequence in sequences for token in sequence)
    kept = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size]
    return torch.tensor(sorted(token for token, _ in kept), dtype=torch.long)


MAX_WARMUP_STEPS = 100


def warmup_steps(options: TrainOptions, horizon: int) -> int:
    """Steps of linear warmup: a tenth of the run's `horizon` (--steps, or where --train-minutes will stop it:
    fitted_horizon), at least 1 and at most MAX_WARMUP_STEPS; options.warmup_steps where set. A fixed 100 left a
    `--steps 5` run at 5% of --lr, never decaying."""
    if options.warmup_steps is not None:
        return options.warmup_steps
    return min(MAX_WARMUP_STEPS, max(1, horizon // 10))


def learning_rate(step: int, peak: float, warmup: int, progress: float) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine decay to a tenth of it; `progress` is how far the
    decay has gone (0 to 1)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def decay_progress(step: int, start: int, start_progress: float, horizon: int) -> float:
    """How far the decay has gone at `step`: from `start_progress` at `start` (the end of warmup, or where a run
    resumed) straight to 1 at `horizon` (--steps, or where --train-minutes will stop the run: fitted_horizon). A
    resumed run goes on from the rate it stopped at, never back up."""
    return min(1.0, start_progress + (1 - start_progress) * max(0, step - start) / max(1, horizon - start))


def fitted_horizon(step: int, steps_run: int, seconds_run: float, seconds_left: float, steps: int) -> int:
    """The step the learning rate's decay ends at under --train-minutes: where training stops at the pace so far
    (or at --steps, if that comes first), so that a run the clock stops has decayed its rate all the same."""
    return min(steps, step + int(steps_run / max(seconds_run, 1e-9) * max(0.0, seconds_left)))
