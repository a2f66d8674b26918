"""Choosing tokens from the target's logits, and the one rule that decides how many drafts stand.

Lossless: a draft token is accepted only where the target's own choice (its argmax, or its sample at
temperature > 0) equals it. With a one-hot proposal (the drafter's greedy token) that is exact speculative
sampling: the committed token at each position is distributed exactly as the target's.
"""

from __future__ import annotations

import torch

from dflash_cli.params import SamplingParams

__all__ = ["SamplingParams", "accepted_drafts", "sample_tokens"]


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `logits` [n, vocab]: argmax at temperature 0, else a draw from the filtered distribution."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p:
        probs = probs.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p * sorted_probs.sum(-1, keepdim=True)
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def accepted_drafts(drafts: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """How many leading drafts stand: the length of the run where `drafts` equal the target's `choices`.

    `drafts[..., j]` is the draft for the position after block slot j and `choices[..., j]` the target's token
    there; the last dim is reduced. The decode loop commits that many drafts plus the target's next token;
    training reports the same count (plus one) as the acceptance length its drafts would get.
    """
    return (drafts == choices).long().cumprod(dim=-1).sum(dim=-1)
