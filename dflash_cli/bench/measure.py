"""`dflash bench`'s measuring: one generation in one mode (DFlash at a block size, adaptive, or the baseline), timed
by the engine's clocks with the device synchronised, its peak memory; the warm-up; the rounds over every prompt with
the modes back to back on each prompt."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from dflash_cli.loading.session import Session
    from dflash_cli.protocol.params import SamplingParams

WARMUP_MAX_TOKENS = 16  # warms kernels and the allocator and measures the pace; not part of the results


@dataclass(frozen=True)
class Mode:
    """How a prompt is decoded: the baseline (block of 1, no drafter) or DFlash with a block size, fixed or
    adaptive (each step's size chosen by the engine's policy, up to `block_size`)."""

    speculative: bool
    block_size: int
    adaptive: bool = False

    @property
    def label(self) -> str:
        if not self.speculative:
            return "baseline"
        return f"dflash auto≤{self.block_size}" if self.adaptive else f"dflash b{self.block_size}"


BASELINE = Mode(speculative=False, block_size=1)


@dataclass
class Run:
    """One timed generation."""

    token_ids: list[int]
    finish_reason: str
    ttft_s: float
    decode_s: float  # after the first token
    draft_s: float  # the parts of decode_s spent drafting and verifying
    verify_s: float
    total_s: float  # wall clock around the whole generation, device synchronised
    acceptance_lengths: list[int]
    block_sizes: list[int] = dataclasses.field(default_factory=list)  # each verify step's block size

    @property
    def decode_tokens(self) -> int:
        return max(len(self.token_ids) - 1, 0)

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_tokens and self.decode_s > 0 else None


def session_device(session: Session) -> torch.device:
    return session.target.get_input_embeddings().weight.device


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


CUDA_MEMORY, PROCESS_MEMORY = "CUDA max allocated, per mode", "process peak RSS, whole run"


def memory_kind(device: torch.device) -> str:
    """What `peak_memory` reports on this device."""
    return CUDA_MEMORY if device.type == "cuda" else PROCESS_MEMORY


def reset_peak_memory(device: torch.device) -> None:
    """Start a new CUDA peak. (A process's peak RSS cannot be reset: on CPU it covers the whole run so far.)"""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """Bytes: torch's CUDA peak since the last reset, else this process's peak resident set (None where unknown)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def measure(session: Session, prompt_ids: Sequence[int], params: SamplingParams, mode: Mode) -> Run:
    """Generate once in `mode` and read the clocks after the device is done."""
    from dflash_cli.engine import collect

    device = session_device(session)
    _synchronize(device)
    started = time.perf_counter()
    block_size = mode.block_size if mode.speculative and not mode.adaptive else None
    result = collect(session.stream(prompt_ids, params, speculative=mode.speculative, block_size=block_size))
    _synchronize(device)
    total = time.perf_counter() - started
    s = result.stats
    return Run(
        result.token_ids,
        result.finish_reason,
        s.ttft_s,
        s.decode_s,
        s.draft_s,
        s.verify_s,
        total,
        list(s.acceptance_lengths),
        list(s.block_sizes),
    )


@dataclass
class PromptRuns:
    """One prompt in one mode, over the repetitions; the identity and speedup fields compare it to the baseline."""

    prompt_id: str
    mode: Mode
    prompt_tokens: int
    runs: list[Run]
    identical: bool | None = None  # None: a baseline row, or no baseline to compare with
    first_mismatch: int | None = None  # first generated position that differs from the baseline's
    speedup: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.runs[0].token_ids

    @property
    def acceptance_lengths(self) -> list[int]:
        return [length for run in self.runs for length in run.acceptance_lengths]

    @property
    def tau(self) -> float | None:
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if self.mode.speculative and lengths else None

    @property
    def histogram(self) -> list[int]:
        """Verify steps that committed 1, 2, ..., block_size tokens, over all repetitions."""
        return histogram(self.acceptance_lengths, self.mode.block_size)

    @property
    def time_per_output_token_s(self) -> float | None:
        tokens = sum(run.decode_tokens for run in self.runs)
        return sum(run.decode_s for run in self.runs) / tokens if tokens else None


def histogram(lengths: Sequence[int], block_size: int) -> list[int]:
    counts = [0] * block_size
    for length in lengths:
        counts[length - 1] += 1
    return counts


def warm_up(
    session: Session,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    modes: Sequence[Mode],
    *,
    on_run: Callable[[Mode, str], None] | None = None,
) -> dict[Mode, Run]:
    """One untimed generation of up to WARMUP_MAX_TOKENS per mode (kernels, allocator); its pace sizes a run."""
    warmup = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, WARMUP_MAX_TOKENS))
    runs = {}
    for mode in modes:
        if on_run is not None:
            on_run(mode, "warm-up")
        runs[mode] = measure(session, prompt_ids, warmup, mode)
    return runs


def run_bench(
    session: Session,
    prompts: Sequence[tuple[str, list[int]]],
    params: SamplingParams,
    modes: Sequence[Mode],
    *,
    repeat: int,
    on_run: Callable[[Mode, str], None] | None = None,
    warm: bool = False,
) -> tuple[list[PromptRuns], dict[Mode, int | None]]:
    """Warm up each mode (unless `warm`: done already), then `repeat` rounds; a round runs every prompt in every
    mode, the modes one after the other on each prompt (so a change of load hits them alike).

    Returns the rows (mode-major, in prompt order; each with `repeat` runs) and each mode's peak memory.
    """
    device = session_device(session)
    if not warm:
        warm_up(session, prompts[0][1], params, modes, on_run=on_run)
    rows: dict[tuple[Mode, str], PromptRuns] = {
        (mode, prompt_id): PromptRuns(prompt_id, mode, len(ids), []) for mode in modes for prompt_id, ids in prompts
    }
    peaks: dict[Mode, int | None] = {}
    for _ in range(repeat):
        for prompt_id, ids in prompts:
            for mode in modes:
                if on_run is not None:
                    on_run(mode, prompt_id)
                reset_peak_memory(device)
                rows[mode, prompt_id].runs.append(measure(session, ids, params, mode))
                peak = peak_memory(device)
                peaks[mode] = None if peak is None else max(peak, peaks.get(mode) or 0)
    return list(rows.values()), peaks
