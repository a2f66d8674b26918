"""Held-out tau without decoding: the acceptance greedy decoding gets on answers whose features are stored.

Greedy decoding with a drafter commits the target's own greedy answer, and its draft block at a position sees
exactly what training shows a block anchored there: the target's features before it and the anchor's token. So
drafting every position of a stored answer at once (one forward, as a training batch drafts its anchors) and
walking it as the decode loop does (from the first answer token, on by each step's accepted drafts plus one)
gives decoding's acceptance lengths without the target's forwards: a second where decoding 16 held-out prompts
took minutes on a CPU. Step for step on the conformance drafter (float32); on the demo's int4 target, decoding
parts from the walk at some steps of about half the answers (the same answers): 1.593 walked against 1.589 decoded
for the shipped drafter, 1.596 against 1.533-1.561 for stage B's, walked on features of the bf16 forward: the served
int8 head and int4 features tip near-ties (benchmarks/results/history.md). Runs since walk the served prefill's
features (training.features.ServedFeatures); decoding's later features come from verify blocks, which the int4/int8
kernels compute alike at any row count. A curve to compare runs by; a candidate to ship is checked by decoding.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.engine.sampling import accepted_drafts
from dflash_cli.training.data import make_batch
from dflash_cli.training.distill import Sample
from dflash_cli.training.objective import drafted_hidden


def step_lengths(drafter: DFlashDrafter, sample: Sample) -> list[int]:
    """The tokens each decode step commits on the sample's answer (its stored features attached): the answer's
    first token comes from the prefill; then every step commits its accepted drafts and one token of the target's,
    the last step no more than the answer has left. (Within a block of --max-tokens the decode loop drafts shorter
    blocks, whose proposals may differ: there the walk estimates.) For the drafters `dflash train` makes: blocks
    side by side in one forward stay apart only where every layer sees its whole block and context (no sliding or
    causal layers, no DFlash2 convolutions over block positions)."""
    config = drafter.config
    if config.is_dflash2 or any(
        config.layer_is_causal(i) or config.layer_window(i) for i in range(config.num_hidden_layers)
    ):
        raise ValueError("held-out tau walks drafters whose layers all see their whole block (`dflash train`'s)")
    anchors = len(sample.response_ids) - 1
    if anchors < 1:
        return []
    B, device = drafter.block_size, drafter.fc.weight.device
    batch = make_batch([sample], anchors, B, drafter.mask_token_id, 0, random.Random(0)).to(device)
    features = torch.nn.functional.pad(sample.features, (0, 0, 0, 1))[None].to(device, drafter.fc.weight.dtype)
    with torch.no_grad():
        hidden = drafted_hidden(drafter, features, batch)[0]
        drafts = drafter.select(hidden, batch.block_ids.view(anchors, B)[:, 0])
    accepted = (accepted_drafts(drafts[None], batch.labels)[0] + 1).tolist()
    lengths, at = [], 0
    while at < anchors:
        lengths.append(min(accepted[at], anchors - at))
        at += accepted[at]
    return lengths


def decoded_tau(drafter: DFlashDrafter, samples: Sequence[Sample]) -> float:
    """Mean acceptance length over every decode step of the samples' answers (as the decode loop's steps pool)."""
    lengths = [length for sample in samples for length in step_lengths(drafter, sample)]
    return sum(lengths) / max(1, len(lengths))
