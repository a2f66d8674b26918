"""`dflash bench`: DFlash against the baseline on the same prompts, measured so the numbers can be trusted.

The method (docs/benchmarks.md section 6 sums it up; benchmarks/results/history.md has it whole):

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
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from dflash_cli.errors import DflashError
from dflash_cli.progress import format_duration
from dflash_cli.protocol.params import sampling_settings
from dflash_cli.protocol.requests import Request

if TYPE_CHECKING:
    from dflash_cli.loading.session import Session
    from dflash_cli.setup.options import RunOptions
from dflash_cli.bench.measure import (
    BASELINE,
    WARMUP_MAX_TOKENS,
    Mode,
    Run,
    memory_kind,
    run_bench,
    session_device,
    warm_up,
)
from dflash_cli.bench.prompts import PROMPT_SETS, encode_prompt, load_prompt_file, load_prompt_set
from dflash_cli.bench.report import (
    FULL_MAX_TOKENS,
    FULL_REPEAT,
    QUICK_BUDGET_S,
    SHORTER_MAX_TOKENS,
    BenchReport,
    BenchSettings,
    add_bandwidth,
    require_matplotlib,
    summarize,
)
from dflash_cli.wording import plural


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
    if options.overrides.block_size is not None and settings.block_sizes:
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
    from dflash_cli.engine.target import rounding_cause
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
        # greedy identity is expected where no rounding cause is (bench.report): float32 aside
        "batch_invariant": (cause := rounding_cause(session.target, session.compiled)) is None,
        "rounding_cause": cause,
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
    count = plural(prompts, "prompt")
    tokens = plural(max_tokens, "token")
    rounds = plural(repeat, "round")
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

    session = open_session(dataclasses.replace(options, prefix_cache=False), console)  # each prefill timed whole
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
    device = session_device(session)
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
    )
