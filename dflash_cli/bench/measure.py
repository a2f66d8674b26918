"""`dflash bench`: DFlash against the baseline on the same prompts, measured so the numbers can be trusted.

The method (docs/benchmarks.md has it with results):

- The baseline is the same decode loop with a block of 1 and no drafter: same recipe, plan, prompts, sampling
  and max tokens, so the comparison is like for like.
- One untimed warm-up generation per mode, then `repeat` rounds; each round runs every prompt in every mode,
  the modes back to back on each prompt, so load that drifts during the run (other processes, clocks,
  thermals) hits all modes alike.
- Times are the engine's clocks, read only after the device has finished (CUDA is synchronised).
- speedup = baseline time per output token / DFlash time per output token, in the decode phase (tokens after
  the first; TTFT is reported apart), over all prompts and rounds.
- tau = mean over prompts of the mean tokens committed per verify step (bonus included): the paper's convention.
- At temperature 0 both modes must produce the same tokens (the loop is lossless); a difference is reported with
  the prompt and the first differing position, not raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from dflash_cli.errors import DflashError, RequestError
from dflash_cli.protocol.params import sampling_settings
from dflash_cli.protocol.requests import Request, read_prompt_file

if TYPE_CHECKING:
    import torch

    from dflash_cli.loading.session import Session
    from dflash_cli.protocol.params import SamplingParams
    from dflash_cli.setup.options import RunOptions

PROMPT_SET_DIR = Path(__file__).resolve().parents[1] / "assets" / "bench_prompts"
PROMPT_SETS = ("math", "code", "chat")
SCHEMA = "dflash-bench/1"
WARMUP_MAX_TOKENS = 16  # warms kernels and the allocator and measures the pace; not part of the results
# The default run is sized to finish in about a minute, like llama-bench's default (one 128-token generation
# test): from the warm-up's measured pace, as many prompts as fit; on a machine too slow for one prompt per mode,
# shorter generations. --full is the sweep docs/benchmarks.md reports: every prompt, 512 tokens, 3 rounds.
QUICK_MAX_TOKENS, FULL_MAX_TOKENS = 128, 512
QUICK_REPEAT, FULL_REPEAT = 1, 3
QUICK_BUDGET_S = 60.0  # warm-up and timed generations together
SHORTER_MAX_TOKENS = (64, 32)


# ---------------------------------------------------------------------------------------------------------------
# Prompts


def load_prompt_set(name: str) -> list[Request]:
    """A built-in set (`math`, `code`, `chat`) or all of them (`all`)."""
    if name != "all" and name not in PROMPT_SETS:
        close = difflib.get_close_matches(name, [*PROMPT_SETS, "all"], n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise DflashError(
            f"unknown prompt set {name!r}", fix=f"{hint}use --set math, code, chat or all, or --prompts FILE.jsonl"
        )
    names = PROMPT_SETS if name == "all" else (name,)
    sets = [load_prompt_file(PROMPT_SET_DIR / f"{set_name}.jsonl") for set_name in names]
    return [prompt for group in zip(*sets) for prompt in group]  # interleaved: the first N cover every set


def load_prompt_file(path: str | os.PathLike[str]) -> list[Request]:
    """Prompts from a JSONL file, read like `dflash run` reads its lines (requests.read_prompt_file)."""
    return read_prompt_file(path, "bench")


def encode_prompt(session: Session, prompt: Request) -> list[int]:
    """Token ids for `prompt`: text goes through the chat template when the model has one."""
    if prompt.prompt_ids is None and session.tokenizer is None:
        raise DflashError(
            f"prompt {prompt.id!r} is text, but {session.recipe.target.id} has no tokenizer",
            fix='give token ids instead: --prompts FILE.jsonl with {"prompt_ids": [...]} lines',
        )
    try:
        return session.encode_request(prompt, prompt_as_chat=True)
    except RequestError as error:
        raise DflashError(f"prompt {prompt.id!r}: {error.message}", fix=error.fix) from None


# ---------------------------------------------------------------------------------------------------------------
# Measuring


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


def _device(session: Session) -> torch.device:
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

    device = _device(session)
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
        return _histogram(self.acceptance_lengths, self.mode.block_size)

    @property
    def time_per_output_token_s(self) -> float | None:
        tokens = sum(run.decode_tokens for run in self.runs)
        return sum(run.decode_s for run in self.runs) / tokens if tokens else None


def _histogram(lengths: Sequence[int], block_size: int) -> list[int]:
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
    device = _device(session)
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


# ---------------------------------------------------------------------------------------------------------------
# Comparing and summarizing


@dataclass(frozen=True)
class Comparison:
    identical: bool
    first_mismatch: int | None  # the first position that differs (the shorter length when one is a prefix)


def compare(reference: Sequence[int], candidate: Sequence[int]) -> Comparison:
    """Are two generations token-identical, and if not, where do they first differ?"""
    for position, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return Comparison(False, position)
    if len(reference) != len(candidate):
        return Comparison(False, min(len(reference), len(candidate)))
    return Comparison(True, None)


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (None from a single value)."""

    mean: float
    std: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat | None:
        if not values:
            return None
        return cls(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None)

    def format(self) -> str:
        return f"{self.mean:.1f}" + (f"±{self.std:.1f}" if self.std is not None else "")

    def to_dict(self) -> dict[str, float | None]:
        return {"mean": self.mean, "std": self.std}


@dataclass
class ModeSummary:
    mode: Mode
    prompts: int
    generated_tokens: int  # in one round (the first run of each prompt)
    ttft_s: Stat | None  # over every run
    decode_tokens_per_s: Stat | None  # per round: all prompts' decode tokens / their decode time
    time_per_output_token_s: float | None  # decode time / decode tokens, over all prompts and rounds
    speedup: float | None  # baseline time per output token / this mode's (None: no baseline)
    tau: float | None  # mean over prompts of each prompt's mean acceptance length
    tokens_per_step: float | None  # all committed tokens / all verify steps, pooled over prompts
    histogram: list[int]  # verify steps committing 1..block_size tokens, over all prompts and rounds
    identical_prompts: int | None  # prompts whose output equals the baseline's (None: not compared)
    peak_memory_bytes: int | None
    size_histogram: dict[int, int] = dataclasses.field(default_factory=dict)  # verify steps per block size
    # gpt-fast's "bandwidth achieved": bytes a plain step reads (at the mode's mean context) per output token,
    # times output tokens per second (for DFlash an effective figure, above the floor when drafts pay), and that
    # over the read bandwidth measured in the same run (the floor)
    bandwidth_gb_s: float | None = None
    floor_share: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.label,
            "speculative": self.mode.speculative,
            "block_size": self.mode.block_size,
            "prompts": self.prompts,
            "generated_tokens": self.generated_tokens,
            "ttft_s": self.ttft_s.to_dict() if self.ttft_s else None,
            "decode_tokens_per_s": self.decode_tokens_per_s.to_dict() if self.decode_tokens_per_s else None,
            "time_per_output_token_s": self.time_per_output_token_s,
            "speedup": self.speedup,
            "tau": self.tau,
            "tokens_per_step": self.tokens_per_step,
            "histogram": self.histogram,
            "adaptive": self.mode.adaptive,
            "size_histogram": {str(size): count for size, count in self.size_histogram.items()},
            "identical_prompts": self.identical_prompts,
            "peak_memory_bytes": self.peak_memory_bytes,
            "bandwidth_gb_s": self.bandwidth_gb_s,
            "floor_share": self.floor_share,
        }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def compare_with_baseline(rows: Sequence[PromptRuns]) -> None:
    """Fill each DFlash row's identical / first_mismatch / speedup from the baseline row of the same prompt."""
    baseline = {row.prompt_id: row for row in rows if row.mode == BASELINE}
    for row in rows:
        reference = baseline.get(row.prompt_id)
        if row.mode == BASELINE or reference is None:
            continue
        comparison = compare(reference.token_ids, row.token_ids)
        row.identical, row.first_mismatch = comparison.identical, comparison.first_mismatch
        row.speedup = _ratio(reference.time_per_output_token_s, row.time_per_output_token_s)


def summarize(rows: Sequence[PromptRuns], peaks: dict[Mode, int | None]) -> list[ModeSummary]:
    """One summary per mode (in the order the rows came), after comparing every row with the baseline."""
    compare_with_baseline(rows)
    by_mode: dict[Mode, list[PromptRuns]] = {}
    for row in rows:
        by_mode.setdefault(row.mode, []).append(row)
    summaries = []
    for mode, mode_rows in by_mode.items():
        runs = [run for row in mode_rows for run in row.runs]
        rounds = min(len(row.runs) for row in mode_rows)
        per_round = [
            _ratio(sum(row.runs[r].decode_tokens for row in mode_rows), sum(row.runs[r].decode_s for row in mode_rows))
            for r in range(rounds)
        ]
        decode_tokens = sum(run.decode_tokens for run in runs)
        steps = [length for row in mode_rows for length in row.acceptance_lengths]
        taus = [row.tau for row in mode_rows if row.tau is not None]
        compared = [row for row in mode_rows if row.identical is not None]
        summaries.append(
            ModeSummary(
                mode=mode,
                prompts=len(mode_rows),
                generated_tokens=sum(len(row.token_ids) for row in mode_rows),
                ttft_s=Stat.of([run.ttft_s for run in runs]),
                decode_tokens_per_s=Stat.of([v for v in per_round if v is not None]),
                time_per_output_token_s=_ratio(sum(run.decode_s for run in runs), decode_tokens),
                speedup=None,
                tau=statistics.fmean(taus) if taus else None,
                tokens_per_step=sum(steps) / len(steps) if mode.speculative and steps else None,
                histogram=_histogram(steps, mode.block_size) if mode.speculative else [],
                identical_prompts=sum(bool(row.identical) for row in compared) if compared else None,
                peak_memory_bytes=peaks.get(mode),
                size_histogram=dict(
                    sorted(Counter(size for row in mode_rows for run in row.runs for size in run.block_sizes).items())
                )
                if mode.speculative
                else {},
            )
        )
    baseline = next((s for s in summaries if s.mode == BASELINE), None)
    for summary in summaries:
        if baseline is not None and summary.mode.speculative:
            summary.speedup = _ratio(baseline.time_per_output_token_s, summary.time_per_output_token_s)
    return summaries


def add_bandwidth(
    summaries: Sequence[ModeSummary], rows: Sequence[PromptRuns], target: Any, read_bytes_per_s: float
) -> None:
    """Fill each summary's bandwidth achieved and its share of the measured read bandwidth."""
    from dflash_cli.setup.sizes import step_bytes

    for summary in summaries:
        mode_rows = [row for row in rows if row.mode == summary.mode]
        context = statistics.fmean(row.prompt_tokens + len(row.token_ids) / 2 for row in mode_rows)
        per_token = summary.time_per_output_token_s
        if per_token:
            achieved = step_bytes(target, round(context)).total / per_token
            summary.bandwidth_gb_s, summary.floor_share = achieved / 1e9, achieved / read_bytes_per_s


# ---------------------------------------------------------------------------------------------------------------
# The whole benchmark


@dataclass(frozen=True)
class BenchSettings:
    """`dflash bench`'s own flags (the shared run flags arrive as RunOptions)."""

    before_after: bool = False
    prompt_set: str | None = None  # None: all built-in sets, unless prompts_file is given
    prompts_file: str | None = None
    repeat: int | None = None  # None: QUICK_REPEAT, or FULL_REPEAT with full
    full: bool = False  # every prompt of the sets and FULL_REPEAT rounds; else sized to about a minute here
    fit_tokens: bool = False  # the default run may shorten generations to fit the minute (--max-tokens not given)
    block_sizes: tuple[int, ...] = ()  # a sweep; empty: the plan's block size
    limit: int | None = None  # use only the first N prompts
    output: str | None = None  # JSON report file
    png: str | None = None
    command: str = ""  # the command line, for the report's metadata

    @property
    def rounds(self) -> int:
        return self.repeat if self.repeat is not None else FULL_REPEAT if self.full else QUICK_REPEAT

    @property
    def sized_here(self) -> bool:
        """The prompt count is this machine's choice: built-in sets, no --limit, no --full."""
        return not (self.full or self.limit or self.prompts_file)


@dataclass
class BenchReport:
    modes: list[ModeSummary]
    rows: list[PromptRuns]
    settings: dict[str, Any]
    metadata: dict[str, Any]
    memory_kind: str
    identity_expected: bool  # greedy decoding: DFlash must reproduce the baseline's tokens

    @property
    def mismatches(self) -> list[PromptRuns]:
        return [row for row in self.rows if row.identical is False]

    @property
    def bit_exact(self) -> bool:
        """float32: a block verify rounds like one-token steps closely enough that any mismatch is a bug. In
        bf16/fp16 the two round differently, and a near-tie between the top two tokens can go either way."""
        return self.metadata["plan"]["dtype"] == "float32"

    @property
    def identical(self) -> bool | None:
        compared = [row for row in self.rows if row.identical is not None]
        return all(row.identical for row in compared) if compared else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "metadata": self.metadata,
            "settings": self.settings,
            "memory": {"kind": self.memory_kind, "unit": "bytes"},
            "identity_expected": self.identity_expected,
            "identical": self.identical,
            "modes": [summary.to_dict() for summary in self.modes],
            "rows": [_row_dict(row) for row in self.rows],
        }


def _row_dict(row: PromptRuns) -> dict[str, Any]:
    return {
        "prompt_id": row.prompt_id,
        "mode": row.mode.label,
        "speculative": row.mode.speculative,
        "block_size": row.mode.block_size,
        "prompt_tokens": row.prompt_tokens,
        "generated_tokens": len(row.token_ids),
        "finish_reason": row.runs[0].finish_reason,
        "ttft_s": [run.ttft_s for run in row.runs],
        "decode_s": [run.decode_s for run in row.runs],
        "draft_s": [run.draft_s for run in row.runs],
        "verify_s": [run.verify_s for run in row.runs],
        "total_s": [run.total_s for run in row.runs],
        "decode_tokens_per_s": [run.decode_tokens_per_s for run in row.runs],
        "time_per_output_token_s": row.time_per_output_token_s,
        "speedup": row.speedup,
        "tau": row.tau,
        "histogram": row.histogram if row.mode.speculative else [],
        "acceptance_lengths": row.runs[0].acceptance_lengths,
        "block_sizes": row.runs[0].block_sizes,
        "identical": row.identical,
        "first_mismatch": row.first_mismatch,
        "token_ids": row.token_ids,
    }


def parse_block_sizes(text: str | None) -> tuple[int, ...]:
    """`--block-sizes 4,8,16` -> (4, 8, 16)."""
    if not text:
        return ()
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(size < 2 for size in sizes):
        raise DflashError(
            f"--block-sizes {text!r}: expected a comma-separated list of integers >= 2",
            fix="for example --block-sizes 4,8,16 (a block of 1 is the baseline: --before-after runs it)",
        )
    return tuple(dict.fromkeys(sizes))  # drop repeats, keep the order given


def load_prompts(settings: BenchSettings) -> list[Request]:
    if settings.prompt_set and settings.prompts_file:
        raise DflashError("give --set or --prompts, not both", fix="--set math|code|chat|all, or --prompts FILE.jsonl")
    if settings.prompts_file:
        prompts = load_prompt_file(settings.prompts_file)
    else:
        prompts = load_prompt_set(settings.prompt_set or "all")
    return prompts[: settings.limit] if settings.limit else prompts


def plan_modes(session: Session, options: RunOptions, settings: BenchSettings) -> list[Mode]:
    """Baseline (with --before-after, or when there is no drafter) and DFlash: adaptive (the default, unless
    --block-size fixes the size), then each size of a --block-sizes sweep."""
    if options.block_size is not None and settings.block_sizes:
        raise DflashError(
            "give --block-size or --block-sizes, not both", fix="--block-sizes 4,8,16 sweeps; --block-size 8 runs one"
        )
    if not session.can_speculate or options.no_spec:
        if settings.before_after or settings.block_sizes:
            why = "--no-spec was given" if options.no_spec else f"recipe '{session.recipe.name}' has no drafter"
            raise DflashError(
                f"--before-after and --block-sizes compare DFlash with the baseline, but {why}",
                fix="drop --no-spec, or pass --drafter DIR (a DFlash drafter for this target)",
            )
        return [BASELINE]
    adaptive = [Mode(True, session.block_size, adaptive=True)] if session.plan.adaptive_block else []
    sizes = settings.block_sizes or (() if adaptive else (session.block_size,))
    return ([BASELINE] if settings.before_after else []) + adaptive + [Mode(True, size) for size in sizes]


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise DflashError(
            "--png needs matplotlib, which is not installed",
            fix="pip install matplotlib, or drop --png (the terminal chart shows the same)",
        )


def check_outputs(settings: BenchSettings) -> None:
    """Refuse before measuring anything when a result could not be saved at the end."""
    if settings.png:
        require_matplotlib()
    for flag, name in (("--output", settings.output), ("--png", settings.png)):
        if name is None:
            continue
        path = Path(name).expanduser()
        if path.is_dir():
            example = path / ("bench.png" if flag == "--png" else "bench.json")
            raise DflashError(f"{flag} {name} is a directory", fix=f"name a file, e.g. {flag} {example}")
        parent = path.resolve().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DflashError(f"{flag} {name}: cannot create {parent} ({exc})", fix="choose another path") from None
        if not os.access(parent, os.W_OK):
            raise DflashError(f"{flag} {name}: {parent} is not writable", fix="choose another path")


def collect_metadata(session: Session, command: str) -> dict[str, Any]:
    """What a reader needs to reproduce or judge the numbers: machine, software, plan, recipe, command."""
    import torch
    import transformers

    from dflash_cli import __version__
    from dflash_cli.setup.hardware import detect_machine

    drafter = session.drafter
    return {
        "command": command,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "dflash": __version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "machine": {
            **detect_machine().to_dict(),
            "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            # other processes' load makes CPU timings noisy: the 1/5/15-minute averages as the run ended
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "plan": session.plan.to_dict(),
        "recipe": session.recipe.to_dict(),
        "drafter_block_size": drafter.block_size if drafter is not None else None,
    }


@dataclass(frozen=True)
class Pace:
    """How long a generation takes in one mode here, read from its warm-up: time to the first token, then per
    token (the warm-up is the run's first generation, so this errs on the slow side)."""

    ttft_s: float
    per_token_s: float

    @classmethod
    def of(cls, run: Run) -> Pace:
        per_token = run.decode_s / run.decode_tokens if run.decode_tokens else run.total_s / max(len(run.token_ids), 1)
        return cls(run.ttft_s, per_token)

    def seconds(self, tokens: int) -> float:
        return self.ttft_s + max(tokens - 1, 0) * self.per_token_s

    @property
    def tokens_per_s(self) -> float:
        return 1 / self.per_token_s if self.per_token_s > 0 else float("inf")


def size_quick_run(
    paces: Sequence[Pace], budget_s: float, available: int, sets: int, max_tokens: int, repeat: int, shorten: bool
) -> tuple[int, int]:
    """(prompts, max tokens) that fit `budget_s` at the measured `paces` (one per mode): the most prompts, in
    counts that keep the sets balanced (1 .. sets - 1, then sets x 1, 2, 4, 8); where not even one prompt fits,
    shorter generations (SHORTER_MAX_TOKENS) when `shorten` (--max-tokens not given), else one prompt."""
    counts = [c for c in sorted({*range(1, sets), *(sets * 2**k for k in range(4))}) if c <= available] or [1]
    lengths = [max_tokens, *(n for n in SHORTER_MAX_TOKENS if shorten and n < max_tokens)]
    for tokens in lengths:
        per_prompt = repeat * sum(pace.seconds(tokens) for pace in paces)
        fitting = [count for count in counts if count * per_prompt <= budget_s]
        if fitting:
            return fitting[-1], tokens
    return 1, lengths[-1]


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60:02d} min"


def describe_run(
    modes: Sequence[Mode],
    paces: Sequence[Pace],
    prompts: int,
    max_tokens: int,
    repeat: int,
    *,
    asked_tokens: int,
    full_prompts: int | None,
) -> str:
    """What the timed part will do and about how long it takes, from the warm-up's pace; with `full_prompts`,
    what --full would cost here."""
    count = f"{prompts} prompt{'s' if prompts != 1 else ''}"
    tokens = f"{max_tokens} token{'s' if max_tokens != 1 else ''}"
    rounds = f"{repeat} round{'s' if repeat != 1 else ''}"
    shorter = f" ({asked_tokens} would not fit a minute here)" if max_tokens < asked_tokens else ""
    seconds = prompts * repeat * sum(pace.seconds(max_tokens) for pace in paces)
    measured = ", ".join(f"{mode.label} {pace.tokens_per_s:.1f} tok/s" for mode, pace in zip(modes, paces))
    text = (
        f"bench: {count} × up to {tokens}{shorter} × {rounds}, {' and '.join(m.label for m in modes)}: "
        f"about {format_duration(seconds)} (warm-up here: {measured})"
    )
    if full_prompts is not None:
        full = full_prompts * FULL_REPEAT * sum(pace.seconds(FULL_MAX_TOKENS) for pace in paces)
        text += (
            f". The full sweep: --full ({full_prompts} prompts × {FULL_MAX_TOKENS} tokens × {FULL_REPEAT} rounds, "
            f"about {format_duration(full)} here)"
        )
    return text


class ProgressLines:
    """Progress on a console that is not a terminal (a log, CI): one line as each generation starts; in the timed
    part with the time left, from the tokens budgeted so far. (A terminal gets rich's live bar instead.)"""

    def __init__(self, console: Console) -> None:
        self.console, self.count, self.total = console, 0, 0.0
        self.started = time.perf_counter()

    def start(self, total: float) -> None:
        """The timed part begins: `total` budgeted tokens."""
        self.total, self.started = total, time.perf_counter()

    def update(self, description: str, done: float = 0.0) -> None:
        self.count += 1
        elapsed = time.perf_counter() - self.started
        left = f", about {format_duration(elapsed / done * (self.total - done))} left" if done else ""
        self.console.print(
            f"bench {self.count}: {description} ({format_duration(elapsed)} elapsed{left})",
            highlight=False,
            markup=False,
        )


def benchmark(options: RunOptions, settings: BenchSettings, console: Console | None = None) -> BenchReport:
    """Load the prompts and the recipe, warm up every mode, size the run from the warm-up's pace (the default:
    about a minute), run it, and summarize. The plan, its estimate and progress go to `console` (live on a
    terminal, one line per generation elsewhere)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    check_outputs(settings)
    prompts = load_prompts(settings)  # bad input fails before torch and the models load
    from dflash_cli.bench.roofline import read_bandwidth
    from dflash_cli.loading.session import open_session

    session = open_session(options, console)
    started = time.perf_counter()
    modes = plan_modes(session, options, settings)
    params = session.sampling_params(options)
    repeat = settings.rounds
    encoded = [(prompt.id, encode_prompt(session, prompt)) for prompt in prompts]
    interactive = console is not None and console.is_terminal
    lines = ProgressLines(console) if console is not None and not interactive else None
    status = console.status("warming up") if interactive and console is not None else contextlib.nullcontext()
    with status:

        def on_warm_up(mode: Mode, prompt_id: str) -> None:
            if lines is not None:
                lines.update(f"{mode.label} · warm-up")
            elif interactive:
                status.update(f"warming up: {mode.label}")  # type: ignore[union-attr]

        warm = warm_up(session, encoded[0][1], params, modes, on_run=on_warm_up)
    paces = [Pace.of(warm[mode]) for mode in modes]
    asked = params.max_new_tokens
    if settings.sized_here:
        sets = 1 if settings.prompt_set not in (None, "all") else len(PROMPT_SETS)
        budget = max(QUICK_BUDGET_S - (time.perf_counter() - started), QUICK_BUDGET_S / 4)
        count, tokens = size_quick_run(paces, budget, len(encoded), sets, asked, repeat, settings.fit_tokens)
        encoded, params = encoded[:count], dataclasses.replace(params, max_new_tokens=tokens)
    if console is not None:
        full = len(prompts) if settings.sized_here else None
        text = describe_run(
            modes, paces, len(encoded), params.max_new_tokens, repeat, asked_tokens=asked, full_prompts=full
        )
        console.print(text, highlight=False, markup=False, soft_wrap=True)
    # Progress counts budgeted tokens: an answer that ends early moves it on by its whole budget.
    total = len(modes) * len(encoded) * repeat * params.max_new_tokens
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=console,
        disable=not interactive,
        transient=True,
    )
    if lines is not None:
        lines.start(total)
    with progress:
        task = progress.add_task("bench", total=total)
        done = -params.max_new_tokens

        def on_run(mode: Mode, prompt_id: str) -> None:  # called as each generation starts
            nonlocal done
            done += params.max_new_tokens
            progress.update(task, description=f"{mode.label} · {prompt_id}", completed=done)
            if lines is not None:
                lines.update(f"{mode.label} · {prompt_id}", done)

        # The floor: how fast this run reads the target's weights, before and after (the best of the two)
        bandwidth = read_bandwidth(session.target)
        rows, peaks = run_bench(session, encoded, params, modes, repeat=repeat, on_run=on_run, warm=True)
        bandwidth = max(bandwidth, read_bandwidth(session.target))
    device = _device(session)
    summaries = summarize(rows, peaks)
    add_bandwidth(summaries, rows, session.target, bandwidth)
    metadata = collect_metadata(session, settings.command)
    metadata["read_bandwidth_gb_s"] = bandwidth / 1e9
    return BenchReport(
        modes=summaries,
        rows=rows,
        settings={
            "prompts": settings.prompts_file or f"set:{settings.prompt_set or 'all'}",
            "prompt_count": len(encoded),
            "repeat": repeat,
            "warmup": {"generations_per_mode": 1, "max_new_tokens": min(asked, WARMUP_MAX_TOKENS)},
            # the default run: prompt count (and, with --max-tokens not given, length) chosen to fit this budget
            "sized_to_s": QUICK_BUDGET_S if settings.sized_here else None,
            "max_new_tokens": params.max_new_tokens,  # the report's name for max_tokens
            **{key: value for key, value in sampling_settings(params).items() if key != "max_tokens"},
            "stop_token_ids": list(params.stop_token_ids),
            "modes": [mode.label for mode in modes],
            "speedup": "baseline time per output token / DFlash time per output token (decode phase)",
        },
        metadata=metadata,
        memory_kind=memory_kind(device),
        identity_expected=params.temperature == 0,
    )


# ---------------------------------------------------------------------------------------------------------------
# Reporting

_EIGHTHS = " ▏▎▍▌▋▊▉"
_SPARKS = "▁▂▃▄▅▆▇█"


def bar(value: float, scale: float, width: int = 30) -> str:
    """A horizontal bar of `value / scale` of `width` cells, in eighths of a cell."""
    eighths = round(max(0.0, min(value / scale, 1.0)) * width * 8) if scale > 0 else 0
    full, rest = divmod(eighths, 8)
    return "█" * full + (_EIGHTHS[rest] if rest else "")


def sparkline(counts: Sequence[int]) -> str:
    top = max(counts, default=0)
    return "".join(_SPARKS[round(c / top * (len(_SPARKS) - 1))] if top else _SPARKS[0] for c in counts)


def _format_bytes(value: int | None) -> str:
    return f"{value / 2**20:,.0f} MiB" if value is not None else "n/a"


def _identity_cell(report: BenchReport, summary: ModeSummary) -> str:
    if summary.mode == BASELINE:
        return "ref"
    if summary.identical_prompts is None:
        return "-"
    cell = f"{summary.identical_prompts}/{summary.prompts}"
    if not report.identity_expected:
        return f"[dim]{cell} (sampled)[/]"
    if summary.identical_prompts == summary.prompts:
        return f"[green]{cell}[/]"
    return f"[bold red]{cell} ✗[/]" if report.bit_exact else f"[yellow]{cell} ~[/]"


def render_table(report: BenchReport) -> Table:
    """llama-bench style: one row per mode."""
    settings = report.settings
    recipe, plan = report.metadata["recipe"]["name"], report.metadata["plan"]
    table = Table(
        title=f"dflash bench · {recipe} · {plan['device']} {plan['dtype']} · {settings['prompt_count']} "
        f"prompt{'s' if settings['prompt_count'] != 1 else ''} × {settings['repeat']} "
        f"round{'s' if settings['repeat'] != 1 else ''} · max {settings['max_new_tokens']} tokens · "
        f"temperature {settings['temperature']:g}",
        title_justify="left",
        caption="decode tok/s: mean ± std over rounds · speedup: baseline time per output token / DFlash's · "
        "tau: tokens committed per verify step, averaged per prompt then over prompts (JSON: tau; "
        "tokens_per_step pools every step instead) · accept: histogram of tokens per step, 1..B · same: prompts "
        "whose output is token-identical to the baseline's · GB/s: bandwidth achieved (bytes a plain step reads x "
        "output tokens/s; effective for DFlash) and its share of the read bandwidth measured in this run "
        f"({report.metadata.get('read_bandwidth_gb_s', 0):.1f} GB/s)",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    # A process's peak RSS covers every mode (it cannot be reset), so on CPU it is one number under the table.
    per_mode_memory = report.memory_kind == CUDA_MEMORY
    columns = ["mode", "TTFT ms", "decode tok/s", "speedup", "tau", "accept", "same", "GB/s"]
    for name in columns + (["peak mem"] if per_mode_memory else []):
        table.add_column(name, justify="left" if name in ("mode", "accept") else "right", no_wrap=True)
    for summary in report.modes:
        ttft = f"{summary.ttft_s.mean * 1e3:.1f}" if summary.ttft_s else "n/a"
        tps = summary.decode_tokens_per_s.format() if summary.decode_tokens_per_s else "n/a"
        table.add_row(
            summary.mode.label,
            ttft,
            tps,
            f"{summary.speedup:.2f}x" if summary.speedup is not None else "-",
            f"{summary.tau:.2f}" if summary.tau is not None else "-",
            sparkline(summary.histogram) if summary.histogram else "-",
            _identity_cell(report, summary),
            f"{summary.bandwidth_gb_s:.1f} ({summary.floor_share:.0%})"
            if summary.bandwidth_gb_s is not None
            else "n/a",
            *([_format_bytes(summary.peak_memory_bytes)] if per_mode_memory else []),
        )
    return table


def render_identity(report: BenchReport) -> Text:
    """Whether DFlash reproduced the baseline's tokens, with the first differing position of every mismatch."""
    if report.identical is None:
        return Text("token identity: not checked (run with --before-after to compare with the baseline)", style="dim")
    if not report.identity_expected:
        return Text(
            "token identity: not expected at temperature > 0 (both modes sample from the target's distribution, "
            "with different random draws)",
            style="dim",
        )
    if report.identical:
        prompts = len({row.prompt_id for row in report.rows})
        which = f"all {prompts} prompts" if prompts != 1 else "the 1 prompt"
        return Text(f"✓ greedy outputs are token-identical to the baseline on {which}", style="green")
    lines = Text()
    baseline = {row.prompt_id: row for row in report.rows if row.mode == BASELINE}
    mark, style = ("✗", "bold red") if report.bit_exact else ("~", "yellow")
    for row in report.mismatches:
        position = row.first_mismatch or 0
        reference = baseline[row.prompt_id].token_ids
        expected = reference[position] if position < len(reference) else "end"
        got = row.token_ids[position] if position < len(row.token_ids) else "end"
        lines.append(
            f"{mark} prompt {row.prompt_id}, {row.mode.label}: differs from the baseline at generated token {position} "
            f"(baseline {expected}, dflash {got})\n",
            style=style,
        )
    if report.bit_exact:
        lines.append(
            "in float32 greedy DFlash must reproduce the baseline: this is a bug, please report it", style=style
        )
    else:
        dtype = report.metadata["plan"]["dtype"]
        lines.append(
            f"in {dtype} a block verify rounds differently from a one-token step, so where the target's top two "
            "tokens are nearly tied the two runs can part (each DFlash token is still the target's own choice in "
            "its verify); --dtype fp32 checks bit-exact identity",
            style=style,
        )
    return lines


def render_chart(report: BenchReport, width: int = 30) -> Group:
    """Terminal bars: the acceptance-length histogram of each DFlash mode and the speedup of each prompt."""
    parts: list[RenderableType] = []
    for summary in report.modes:
        if not summary.mode.speculative or not summary.histogram:
            continue
        steps = sum(summary.histogram)
        tau = f" · tau {summary.tau:.2f}" if summary.tau is not None else ""
        parts.append(
            Text(f"acceptance length, {summary.mode.label}{tau} (share of {steps} verify steps)", style="bold")
        )
        for length, count in enumerate(summary.histogram, 1):
            share = count / steps if steps else 0.0
            parts.append(Text(f"  {length:>3} {bar(share, 1.0, width):<{width}} {share:6.1%}"))
        if summary.mode.adaptive and summary.size_histogram:
            parts.append(
                Text(f"block sizes chosen, {summary.mode.label} (share of verify steps; 1 = no drafting)", style="bold")
            )
            for size, count in summary.size_histogram.items():
                share = count / steps if steps else 0.0
                parts.append(Text(f"  {size:>3} {bar(share, 1.0, width):<{width}} {share:6.1%}"))
    speeds = [row for row in report.rows if row.speedup is not None]
    if speeds:
        scale = max(row.speedup or 0.0 for row in speeds)
        name_width = max(len(row.prompt_id) for row in speeds)
        mode_width = max(len(row.mode.label) for row in speeds)
        parts.append(Text("speedup per prompt (baseline time per output token / DFlash's)", style="bold"))
        for row in speeds:
            speedup = row.speedup or 0.0
            line = Text(f"  {row.prompt_id:<{name_width}} {row.mode.label:<{mode_width}} ")
            line.append(f"{bar(speedup, scale, width):<{width}}", style="green" if speedup >= 1 else "red")
            line.append(f" {speedup:5.2f}x")
            parts.append(line)
    return Group(*parts)


def print_report(report: BenchReport, console: Console) -> None:
    console.print(render_table(report))
    if report.memory_kind != CUDA_MEMORY:
        peak = max((s.peak_memory_bytes or 0 for s in report.modes), default=0) or None
        console.print(f"peak memory: {_format_bytes(peak)} ({report.memory_kind})")
    console.print(render_identity(report))
    chart = render_chart(report)
    if chart.renderables:
        console.print()
        console.print(chart)


def write_json(report: BenchReport, path: str | os.PathLike[str]) -> Path:
    path = Path(path).expanduser()
    path.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def save_png(report: BenchReport, path: str | os.PathLike[str]) -> Path:
    """The same two pictures as the terminal chart, as a PNG (needs matplotlib)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    spec = [s for s in report.modes if s.mode.speculative and s.histogram]
    speeds = [row for row in report.rows if row.speedup is not None]
    panels = int(bool(spec)) + int(bool(speeds))
    if panels == 0:
        raise DflashError("--png: nothing to draw (no DFlash mode ran)", fix="drop --no-spec or pass --drafter")
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    panel = iter(axes[0])
    if spec:
        ax = next(panel)
        width = 0.8 / len(spec)
        for i, summary in enumerate(spec):
            steps = sum(summary.histogram) or 1
            lengths = range(1, len(summary.histogram) + 1)
            shares = [count / steps for count in summary.histogram]
            tau = f" (tau {summary.tau:.2f})" if summary.tau is not None else ""
            ax.bar(
                [x + (i - (len(spec) - 1) / 2) * width for x in lengths], shares, width, label=summary.mode.label + tau
            )
        ax.set_xlabel("tokens committed per verify step")
        ax.set_ylabel("share of verify steps")
        ax.set_title("acceptance length")
        ax.legend()
    if speeds:
        ax = next(panel)
        labels = [s.mode.label for s in spec]
        prompt_ids = list(dict.fromkeys(row.prompt_id for row in speeds))
        width = 0.8 / max(len(labels), 1)
        for i, label in enumerate(labels):
            by_prompt = {row.prompt_id: row.speedup for row in speeds if row.mode.label == label}
            xs = [p + (i - (len(labels) - 1) / 2) * width for p in range(len(prompt_ids))]
            ax.bar(xs, [by_prompt.get(pid) or 0.0 for pid in prompt_ids], width, label=label)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(prompt_ids)), prompt_ids, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("speedup (baseline / DFlash time per token)")
        ax.set_title("speedup per prompt")
        ax.legend()
    settings, plan = report.settings, report.metadata["plan"]
    figure.suptitle(
        f"dflash bench · {report.metadata['recipe']['name']} · {plan['device']} {plan['dtype']} · "
        f"max {settings['max_new_tokens']} tokens · temperature {settings['temperature']:g}"
    )
    figure.tight_layout()
    path = Path(path).expanduser()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
