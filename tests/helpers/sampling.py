"""Exact sampling, checked: a tiny target's exact distributions of its 2nd and 3rd generated tokens (enumerated)
and the chi-square test of sampled counts against them."""

from __future__ import annotations

import torch


def exact_marginals(target, prompt: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions of the 2nd and 3rd generated tokens, by enumerating the first two."""
    vocab = target.config.vocab_size
    with torch.no_grad():

        def dist(ids):
            return torch.softmax(target(torch.tensor([ids])).logits[0, -1].double() / temperature, -1)

        p1 = dist(prompt)
        p2 = torch.zeros(vocab, dtype=torch.float64)
        p3 = torch.zeros(vocab, dtype=torch.float64)
        for a in range(vocab):
            pa = dist(prompt + [a])
            p2 += p1[a] * pa
            for b in range(vocab):
                p3 += p1[a] * pa[b] * dist(prompt + [a, b])
    return p2, p3


def chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    n = counts.sum().item()
    keep = probs * n >= 5  # pool rare cells so the chi-square approximation holds
    observed = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)]).double()
    expected = torch.cat([probs[keep], probs[~keep].sum(0, keepdim=True)]) * n
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)
