"""`dflash bench`: measure DFlash on this machine, against the baseline with --before-after."""

import dataclasses
import functools
import shlex
import sys
from typing import Annotated

import typer
from rich.markup import escape

from dflash_cli.cli.flags import BENCH, BenchMaxTokens, JsonFlag, check_prompt_set, existing_file, with_run_flags
from dflash_cli.cli.output import console, emit, err_console
from dflash_cli.setup.options import RunOptions


@functools.partial(with_run_flags, flag_types={"max_tokens": BenchMaxTokens})
def bench(
    options: RunOptions,
    ctx: typer.Context,
    before_after: Annotated[
        bool,
        typer.Option(
            "--before-after",
            help="Also run the baseline (the same loop without the drafter) on the same prompts: speedup and a token-identity check.",
            rich_help_panel=BENCH,
        ),
    ] = False,
    prompt_set: Annotated[
        str | None,
        typer.Option(
            "--set",
            metavar="math|code|chat|all",
            callback=check_prompt_set,
            help="Built-in prompt set, 8 prompts each (default: all).",
            rich_help_panel=BENCH,
        ),
    ] = None,
    prompts: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            metavar="FILE.jsonl",
            callback=existing_file,
            help='Your prompts, one JSON object a line: {"prompt": ...} (a user turn: bench measures chat replies; `dflash run` reads it as plain completion), {"messages": [...]} or {"prompt_ids": [...]} (token ids: no tokenizer needed); optional "id".',
            rich_help_panel=BENCH,
        ),
    ] = None,
    full: Annotated[
        bool,
        typer.Option(
            "--full",
            help="The full sweep: every prompt of the sets, up to 512 tokens, 3 rounds (minutes on a GPU, an hour or more on a CPU).",
            rich_help_panel=BENCH,
        ),
    ] = False,
    repeat: Annotated[
        int | None,
        typer.Option(
            min=1,
            show_default=False,
            help="Timed rounds of every prompt in every mode, after one untimed warm-up per mode (default: 1; 3 with --full).",
            rich_help_panel=BENCH,
        ),
    ] = None,
    block_sizes: Annotated[
        str | None,
        typer.Option(
            "--block-sizes",
            metavar="4,8,16",
            help="Sweep fixed block sizes: one DFlash run per size, with tau and speedup each, next to the adaptive default (unless --block-size fixes it).",
            rich_help_panel=BENCH,
        ),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(min=1, metavar="N", help="Use only the first N prompts (a quick look).", rich_help_panel=BENCH),
    ] = None,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE.json",
            help="Also save the JSON report (per-prompt rows, machine, plan, recipe, command).",
            rich_help_panel=BENCH,
        ),
    ] = None,
    png: Annotated[
        str | None,
        typer.Option(
            "--png", metavar="FILE.png", help="Also save the charts as a PNG (needs matplotlib).", rich_help_panel=BENCH
        ),
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Measure DFlash's speed and acceptance here; --before-after adds the baseline: the speedup, texts compared.

    By default a run takes about a minute: one warm-up generation per mode measures the pace here, then up to 128 tokens per prompt, 1 round, and as many prompts as fit the minute (shorter generations where not even one fits); it says what it will do and about how long before the timed part starts. --full is the sweep docs/benchmarks.md describes (24 prompts, 512 tokens, 3 rounds); --set, --limit, --repeat and --max-tokens change one thing at a time.

    Greedy by default, so DFlash must reproduce the baseline token for token: the report says whether it did. Method and results: docs/benchmarks.md.

    Examples: `dflash bench demo --before-after` · `dflash bench qwen3-8b --before-after --full --block-sizes 4,8,16 --output bench.json --png bench.png`
    """
    from dflash_cli import bench as bench_lib

    options.resolve_recipe()  # input mistakes fail here, before torch is imported
    default_tokens = getattr(ctx.get_parameter_source("max_tokens"), "name", "DEFAULT") == "DEFAULT"
    if default_tokens:  # bench's own default, not chat's 512
        max_tokens = bench_lib.FULL_MAX_TOKENS if full else bench_lib.QUICK_MAX_TOKENS
        options = dataclasses.replace(options, sampling=options.sampling_params(max_new_tokens=max_tokens))
    settings = bench_lib.BenchSettings(
        before_after=before_after,
        prompt_set=prompt_set,
        prompts_file=prompts,
        repeat=repeat,
        full=full,
        fit_tokens=default_tokens and not full,
        block_sizes=bench_lib.parse_block_sizes(block_sizes),
        limit=limit,
        output=output,
        png=png,
        command=shlex.join(["dflash", *sys.argv[1:]]),
    )
    report = bench_lib.benchmark(options, settings, err_console)
    # saved before the report is printed: a file that fails leaves stdout with one JSON document, the error
    saved = [bench_lib.write_json(report, output)] if output else []
    saved += [bench_lib.save_png(report, png)] if png else []
    emit(report.to_dict(), json_output, lambda: bench_lib.print_report(report, console))
    for path in saved:
        err_console.print(f"[dim]saved {escape(str(path))}[/]")
