"""`dflash run`: generate for every line of a JSONL file, resumably."""

import dataclasses
from typing import Annotated

import typer

from dflash_cli.cli.flags import BatchSize, CacheRam, NoPrefixCache, with_run_flags
from dflash_cli.cli.output import console, emit, err_console, remember_json, show_summary
from dflash_cli.errors import DflashError
from dflash_cli.setup.options import RunOptions


@with_run_flags
def run(
    options: RunOptions,
    prompts: Annotated[
        str | None,
        typer.Argument(
            metavar="PROMPTS.jsonl",
            show_default=False,
            help="One request a line (see above), or a .txt file of one prompt a line; - reads them from standard "
            "input.",
        ),
    ] = None,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help="Results JSONL (default: PROMPTS.out.jsonl); - prints them on standard output (the default for "
            "requests piped in), failures on the terminal.",
        ),
    ] = None,
    errors: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="Failed lines, with line number and reason (default: PROMPTS.errors.jsonl; with -o NAME.jsonl, "
            "NAME.errors.jsonl beside it); - says them on the terminal.",
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", callback=remember_json, help="Print the summary as JSON on stdout.")
    ] = False,
    batch_size: BatchSize = None,
    no_prefix_cache: NoPrefixCache = False,
    cache_ram: CacheRam = None,
) -> None:
    """Generate for every line of a JSONL file, loading the model once. Resumable: re-run to finish.

    Lines: {"prompt": "..."} (plain completion), {"messages": [...]} (chat), {"prompt_ids": [...]} (token ids), or OpenAI batch lines (custom_id, method, url /v1/chat/completions or /v1/completions, body): the request format `dflash serve` takes; a .txt file's lines are user turns as they are (as `dflash train --prompts` reads them). max_tokens, temperature, top_p, top_k, min_p, seed and stop on a line override the flags. A result carries its line's id (or custom_id), else line-N-HASH (a resume finds it by the HASH of the line's text, wherever the line has moved); work starts shortest prompt first and each result is written when it finishes, so match them by id.

    Up to --batch-size requests decode together (continuous batching: a finished one makes room for the next at once); each gives exactly the tokens it gives alone. Each result is on disk the moment it completes. Re-running the same command skips the requests already in the output, so an interrupted or killed run loses at most the requests in flight; if a line or the command changed since (its prompt, sampling, model, dtype or quantization), the run refuses, naming the change, rather than keep the old result. Results in the output that match no line (another input's, a deleted line's) are kept, with a note. Lines that cannot run (bad JSON, bad fields, an id already used by an earlier line, a prompt too long) go to the errors file and the rest runs; the exit code is 1 when any request failed.

    In a pipeline, `-` reads the requests from standard input (to its end, before the first starts) and prints each result on standard output as it finishes, in that order too; nothing is kept to resume from unless -o FILE is given.

    Example: `dflash run qwen3-8b prompts.jsonl -o results.jsonl --max-tokens 256`; `cat prompts.jsonl | dflash run demo - > results.jsonl`
    """
    from dflash_cli.commands import run as jobs

    options = dataclasses.replace(
        options.overriding(batch_size=batch_size, cache_ram_mib=cache_ram), prefix_cache=not no_prefix_cache
    )
    options, prompts = jobs.split_positionals(options, prompts)
    options.resolve_recipe()  # a missing or unknown model fails before any file is touched
    printed = jobs.prints_results(prompts, output)  # the results take standard output
    if printed and json_output:
        raise DflashError(
            "--json prints the summary on standard output, where the results go here",
            fix="write the results to a file with -o results.jsonl",
        )
    summary = jobs.run_file(options, prompts, output, errors, err_console)
    emit(summary.to_dict(), json_output, lambda: show_summary(summary, err_console if printed else console))
    raise typer.Exit(summary.exit_code)
