"""The memory-bandwidth floor of a decode step: how fast this machine reads what a step must read.

At batch 1 a plain decode step reads every weight once (the input embedding only for its one row, unless
it doubles as the output head) plus the K/V of the context (`setup.sizes.step_bytes`), and does little arithmetic
per byte: its time cannot drop below bytes / read bandwidth (the "floor"). `dflash bench` and
`python -m benchmarks.cpu_decode_floor` report steps against that floor, as gpt-fast reports "bandwidth achieved".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


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
