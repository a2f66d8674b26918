"""`dflash bench`'s results: comparing each mode with the baseline (identity, speedup), the summaries, the report
schema (`dflash-bench/1`, written with --output), and rendering it as a table, terminal charts or a PNG."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from dflash_cli.bench.measure import BASELINE, CUDA_MEMORY, Mode, PromptRuns, histogram
from dflash_cli.errors import DflashError
from dflash_cli.wording import plural

SCHEMA = "dflash-bench/1"
# The default run is sized to finish in about a minute, like llama-bench's default (one 128-token generation
# test): from the warm-up's measured pace, as many prompts as fit; on a machine too slow for one prompt per mode,
# shorter generations. --full is the sweep docs/benchmarks.md describes: every prompt, 512 tokens, 3 rounds.
QUICK_MAX_TOKENS, FULL_MAX_TOKENS = 128, 512
QUICK_REPEAT, FULL_REPEAT = 1, 3
QUICK_BUDGET_S = 60.0  # warm-up and timed generations together
SHORTER_MAX_TOKENS = (64, 32)


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
            "identity_rate": self.identical_prompts / self.prompts if self.identical_prompts is not None else None,
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
                histogram=histogram(steps, mode.block_size) if mode.speculative else [],
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

    @property
    def greedy(self) -> bool:
        """Temperature 0: both modes pick the target's top token, so their outputs can be compared token for token."""
        return self.settings["temperature"] == 0

    @property
    def identity_expected(self) -> bool:
        """Whether every DFlash output must equal the baseline's: greedy, and float32 or a batch-invariant target
        (`exact`). Elsewhere the share of identical prompts is a rate, reported as measured."""
        return self.greedy and self.exact

    @property
    def mismatches(self) -> list[PromptRuns]:
        return [row for row in self.rows if row.identical is False]

    @property
    def exact(self) -> bool:
        """float32: a block verify rounds like one-token steps closely enough that any mismatch is a bug; a
        batch-invariant target (bf16 on a CPU with eager attention, engine.target.rounding_cause) rounds them
        alike. Elsewhere in bf16/fp16 the two round differently, and a near-tie between the top two tokens can go
        either way."""
        return self.metadata["plan"]["dtype"] == "float32" or bool(self.metadata.get("batch_invariant"))

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
            # exact identity is expected in float32 and on batch-invariant targets; elsewhere each mode's
            # identity_rate is what was measured
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


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise DflashError(
            "--png needs matplotlib, which is not installed",
            fix="pip install matplotlib, or drop --png (the terminal chart shows the same)",
        )


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
    if not report.greedy:
        return f"[dim]{cell} (sampled)[/]"
    if summary.identical_prompts == summary.prompts:
        return f"[green]{cell}[/]"
    return f"[bold red]{cell} ✗[/]" if report.exact else f"[yellow]{cell} ~[/]"


def render_table(report: BenchReport) -> Table:
    """llama-bench style: one row per mode."""
    settings = report.settings
    recipe, plan = report.metadata["recipe"]["name"], report.metadata["plan"]
    table = Table(
        title=f"dflash bench · {recipe} · {plan['device']} {plan['dtype']} · "
        f"{plural(settings['prompt_count'], 'prompt')} × {plural(settings['repeat'], 'round')} · "
        f"max {settings['max_new_tokens']} tokens · "
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
    if not report.greedy:
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
    mark, style = ("✗", "bold red") if report.exact else ("~", "yellow")
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
    if report.exact:
        where = "float32" if report.metadata["plan"]["dtype"] == "float32" else "batch-invariant bf16"
        lines.append(
            f"in {where} greedy DFlash must reproduce the baseline: this is a bug, please report it", style=style
        )
    else:
        dtype = report.metadata["plan"]["dtype"]
        rates = ", ".join(
            f"{s.mode.label} {s.identical_prompts}/{s.prompts}" for s in report.modes if s.identical_prompts is not None
        )
        lines.append(
            f"identity rate in {dtype} (exact identity is expected in float32, and in bf16 on a CPU with eager "
            f"attention and attention layers only): {rates}\n",
            style=style,
        )
        lines.append(
            f"here a block verify rounds differently from a one-token step ({report.metadata.get('rounding_cause')}), "
            "so where the "
            "target's top two tokens are nearly tied the two runs can part (each DFlash token is still the target's "
            "own choice in its verify); --dtype fp32 checks identity",
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
    table = render_table(report)
    # Piped (a file, `| tee`), the table is drawn at the width it needs: folded to the default 80 columns its
    # numbers would be cut short ("tau 1.…").
    narrow = console.width
    if not console.is_terminal:
        console.width = max(narrow, console.measure(table, options=console.options.update(width=1000)).maximum)
    try:
        console.print(table)
    finally:
        console.width = narrow
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
