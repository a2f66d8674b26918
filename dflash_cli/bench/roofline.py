"""The memory-bandwidth floor of a decode step: what a step must read, and how fast this machine reads.

At batch 1 a plain decode step reads every weight once (the input embedding only for its one row, unless
it doubles as the output head) plus the K/V of the context, and does little arithmetic per byte: its time
cannot drop below bytes / read bandwidth (the "floor"). `dflash bench` and `scripts/cpu_decode_floor.py` report steps
against that floor, as gpt-fast reports "bandwidth achieved".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StepBytes:
    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def step_bytes(target: Any, context_tokens: int) -> StepBytes:
    """Bytes a one-token step of `target` reads with `context_tokens` positions of K/V behind it."""
    embedding = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    weights = 0
    for param in {id(p): p for p in target.parameters()}.values():
        if param is embedding and not tied:
            weights += embedding.shape[-1] * embedding.element_size()  # one row is looked up
        else:
            weights += param.numel() * param.element_size()
    config = target.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * embedding.element_size()
    return StepBytes(weights, per_token * context_tokens)


def read_bandwidth(target: Any, repeats: int = 3, clock: Callable[[], float] = time.perf_counter) -> float:
    """Bytes per second this machine reads `target`'s weights: the best of a few passes summing every weight
    tensor of at least 1 MiB (smaller ones would time op overhead, not memory), with torch's current threads.

    Reading the step's own bytes, in the same process and threads as the steps, makes the floor a measurement
    of this run, not a datasheet figure. (Weights smaller than the last-level cache give a cache bandwidth.)
    `clock=time.process_time` times CPU time instead of wall time (with one thread: the time it really ran).
    A sum is the fastest way to read memory, so this is the physical floor; `hardware.weight_bandwidth` (doctor,
    before any model is loaded) times a matrix-vector product instead, to see what decoding in a dtype reaches.
    """
    tensors = [p for p in {id(p): p for p in target.parameters()}.values() if p.numel() * p.element_size() >= 1 << 20]
    if not tensors:
        tensors = list(target.parameters())
    total = sum(t.numel() * t.element_size() for t in tensors)
    device = tensors[0].device
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first pass warms the kernels
            _sync(device)
            started = clock()
            for tensor in tensors:
                tensor.sum()
            _sync(device)
            best = min(best, clock() - started)
    return total / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
