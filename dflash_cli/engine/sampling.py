"""Choosing tokens from the target's logits, and the one rule that decides how many drafts stand.

Lossless: a draft token is accepted only where the target's own choice (its argmax, or its sample at
temperature > 0) equals it. With a one-hot proposal (the drafter's greedy token) that is exact speculative
sampling: the committed token at each position is distributed exactly as the target's.

The decode loop samples by inverse CDF with one uniform per position, drawn for the whole request up front: a
position's token is then a function of its prefix and its own uniform, so a seeded generation gives the same
tokens whatever the block sizes (fixed, adaptive, or none: the baseline). A rejected row's uniform is used
again at that position after the rejection; it is still independent of everything committed before it (the
rejection depended on earlier positions' uniforms only), so sampling stays exact.
"""

from __future__ import annotations

import torch

from dflash_cli.engine.kernels import native
from dflash_cli.protocol.params import SamplingParams

__all__ = ["SamplingParams", "accepted_drafts", "greedy_tokens", "sample_tokens"]


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of `logits` [n, vocab]: argmax at temperature 0, else a draw from the filtered distribution
    (with `uniforms` [n] float64 in [0, 1): row i's token by inverse CDF at uniforms[i]; else from `generator`)."""
    if params.temperature == 0:
        return greedy_tokens(logits)
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
    if uniforms is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    cdf = probs.double().cumsum(dim=-1)
    # strictly below the total, so the draw lands on a token of nonzero probability
    at = (uniforms * (1 - 1e-12))[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, at, right=True).squeeze(-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of `logits` [..., vocab]: the first of equal maxima. On a CPU bf16 logits go to
    dflash's kernel where it runs (the demo's 49,152-token row: 85 us widened to float32 and argmaxed by torch, 40
    more to widen), else to float32 first (the same index: widening bf16 is exact; torch's bf16 argmax is slower
    still)."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    if logits.dtype == torch.bfloat16 and not torch.compiler.is_compiling() and native.available():
        return torch.ops.dflash.argmax(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])
    return logits.float().argmax(dim=-1)


def accepted_drafts(drafts: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """How many leading drafts stand: the length of the run where `drafts` equal the target's `choices`.

    `drafts[..., j]` is the draft for the position after block slot j and `choices[..., j]` the target's token
    there; the last dim is reduced. The decode loop commits that many drafts plus the target's next token;
    training reports the same count (plus one) as the acceptance length its drafts would get.
    """
    return (drafts == choices).long().cumprod(dim=-1).sum(dim=-1)
