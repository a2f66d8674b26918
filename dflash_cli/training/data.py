"""Training batches: random anchors inside each answer, the blocks they start, and the labels they predict."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from dflash_cli.training.distill import Sample


def block_attention_mask(context_len: int, anchors: list[int] | torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [..., n*B, context_len + n*B] for anchors [..., n], True = may attend: block i sees context positions
    < anchors[i] and itself."""
    anchors = torch.as_tensor(anchors)
    n = anchors.shape[-1]
    rows = torch.arange(n * block_size) // block_size
    mask = torch.empty(*anchors.shape[:-1], n * block_size, context_len + n * block_size, dtype=torch.bool)
    mask[..., :context_len] = torch.arange(context_len) < anchors[..., rows, None]
    mask[..., context_len:] = rows[:, None] == rows[None, :]
    return mask


def sample_anchors(prompt_len: int, seq_len: int, count: int, rng: random.Random) -> list[int]:
    """Distinct anchors in the response: a block at anchor a predicts tokens a+1.. (so a <= seq_len-2).

    The first anchor candidate is the first response token: at inference the first block starts after the
    prefill has committed one token. Short responses give fewer anchors.
    """
    candidates = range(prompt_len, seq_len - 1)
    return sorted(rng.sample(candidates, min(count, len(candidates))))


@dataclass
class TrainingBatch:
    input_ids: torch.Tensor  # [b, S] right padded
    block_ids: torch.Tensor  # [b, n*B]: anchor token, then MASK
    labels: torch.Tensor  # [b, n, B-1]: tokens at anchor+1..anchor+B-1, -100 where absent
    position_ids: torch.Tensor  # [b, S + n*B]
    attention_mask: torch.Tensor  # [b, 1, n*B, S + n*B]

    def to(self, device: torch.device) -> TrainingBatch:
        return TrainingBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def make_batch(
    samples: list[Sample], anchors_per_sequence: int, block_size: int, mask_id: int, pad_id: int, rng: random.Random
) -> TrainingBatch:
    """A batch in a few whole-batch operations: per-row ones were thousands of small ops a step, which a busy or
    oversubscribed host turns into most of a GPU step's time."""
    rows = [s.ids for s in samples]  # (each a new list: Sample.ids joins prompt and response)
    width = max(len(ids) for ids in rows)
    n, B = anchors_per_sequence, block_size
    input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids in rows])
    # Unused anchor slots (short responses) sit at position 0 with all labels -100; they see only themselves,
    # which keeps SDPA finite.
    anchors = torch.zeros(len(samples), n, dtype=torch.long)
    used = torch.zeros(len(samples), n, dtype=torch.bool)
    for row, (sample, ids) in enumerate(zip(samples, rows)):
        chosen = sample_anchors(len(sample.prompt_ids), len(ids), n, rng)
        anchors[row, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        used[row, : len(chosen)] = True
    lengths = torch.tensor([len(ids) for ids in rows])
    slots = anchors[..., None] + torch.arange(B)  # [b, n, B]: the positions each block stands for
    tokens = input_ids.gather(1, slots.clamp(max=width - 1).flatten(1)).view_as(slots)
    block_ids = torch.full_like(slots, mask_id)  # the anchor's token, then MASK
    block_ids[..., 0] = torch.where(used, tokens[..., 0], mask_id)
    present = used[..., None] & (slots[..., 1:] < lengths[:, None, None])
    labels = torch.where(present, tokens[..., 1:], -100)
    positions = torch.cat([torch.arange(width).expand(len(samples), width), slots.flatten(1)], dim=1)
    masks = block_attention_mask(width, anchors, B)[:, None]
    return TrainingBatch(input_ids, block_ids.flatten(1), labels, positions, masks)


def batches(samples: list[Sample], batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless shuffled epochs of sample indices; each batch groups similar lengths to limit padding."""
    while True:
        order = list(range(len(samples)))
        rng.shuffle(order)
        chunks = [order[i : i + batch_size * 16] for i in range(0, len(order), batch_size * 16)]
        batches = []
        for chunk in chunks:
            chunk.sort(key=lambda i: len(samples[i].ids))
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        yield from batches
