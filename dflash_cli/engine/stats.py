"""What a generation measured: token counts, acceptance lengths and phase times, taken without extra host syncs."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens its slot held (engine.prefix): kept, not prefilled
    # prompt tokens its slot held but the state could not continue from (a hybrid's recurrent state between its
    # snapshots, a drafter's ring that evicted what the next block sees)
    unreused_tokens: int = 0
    generated_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    block_size: int = 1  # the largest block a step may verify (every step's, unless adaptive)
    speculative: bool = False
    adaptive: bool = False  # a policy chose each step's block size (engine.policy)
    block_sizes: list[int] = field(default_factory=list)  # each verify step's block size
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    compile_s: float = 0.0  # steps that compiled a graph, kept out of decode_s (and draft_s, verify_s)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step, bonus included (1.0 for the baseline)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 1.0

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.acceptance_lengths).items()))

    @property
    def size_histogram(self) -> dict[int, int]:
        """Verify steps per block size."""
        return dict(sorted(Counter(self.block_sizes).items()))

    @property
    def current_block_size(self) -> int:
        """The last step's block size (the block size before the first step)."""
        return self.block_sizes[-1] if self.block_sizes else self.block_size

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first one, over the time after the first one (TTFT is reported apart)."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            tau=self.tau,
            histogram=self.histogram,
            size_histogram=self.size_histogram,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )
        return out


class PhaseClock:
    """Marks points in a step and measures between them without adding host syncs.

    On CUDA the marks are events, read after the step's one sync; elsewhere kernels run synchronously
    and a wall clock is exact.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start
