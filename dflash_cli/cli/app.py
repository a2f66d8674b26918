"""The `dflash` command line: typer wiring only. Each command parses its flags (cli/flags.py), calls its
`dflash_cli.commands` module, and hands the result to cli/output.py, which prints it as JSON or for a person.

Startup stays fast: torch, transformers and the engine are imported inside the commands that need them, so
`dflash --help` and `dflash recipes list` never load them.
"""

import dataclasses
import functools
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from typer.core import TyperGroup, TyperOption

from dflash_cli import __version__
from dflash_cli.cli.flags import (
    BENCH,
    MODEL,
    SERVER,
    BatchSize,
    BenchMaxTokens,
    CacheRam,
    Drafter,
    GpuMemory,
    Gpus,
    JsonFlag,
    NoPrefixCache,
    RecipeFile,
    RecipeName,
    Target,
    Threads,
    check_device,
    check_dtype,
    check_prompt_set,
    check_server,
    existing_file,
    with_run_flags,
)
from dflash_cli.cli.output import (
    checks_table,
    console,
    emit,
    err_console,
    print_error,
    show_fields,
    show_rows,
    show_summary,
    show_text,
    show_trained,
)
from dflash_cli.errors import DflashError
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.recipes import load_registry, resolve_recipe
from dflash_cli.setup.threads import start_load_window


def _flag_type(option: TyperOption, ctx: Any, shown: Any = TyperOption.display_type_rich) -> str | None:
    """A flag takes no value, so --help shows no type beside it (typer 0.29 prints `<bool>` beside every flag)."""
    return None if option.is_flag and option.metavar is None else shown(option, ctx)


TyperOption.display_type_rich = _flag_type  # type: ignore[method-assign]


class DflashGroup(TyperGroup):
    """Every DflashError raised below becomes `error:` / `fix:` lines and its exit code, never a traceback.
    (Ctrl-C already exits with 130 in typer.)"""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except DflashError as error:
            print_error(error)
            raise typer.Exit(error.exit_code) from None


app = typer.Typer(
    name="dflash",
    cls=DflashGroup,
    help="Fast self-hosted LLM inference in one command, with lossless DFlash speculative decoding.\n\n"
    "Start with `dflash doctor` to see what this machine can run, then `dflash chat demo` (any CPU) or a recipe it "
    "lists as fitting (`dflash chat qwen3-8b` on a GPU).",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # locals can hold tokens and whole tensors
    context_settings={"help_option_names": ["-h", "--help"]},
)
recipes_app = typer.Typer(help="List and inspect recipes (a target model + its DFlash drafter).", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes", rich_help_panel="Models")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflash {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    # Other processes' CPU load is measured from here on, so that the thread plan, made after torch and the model
    # are loaded, needs no wait of its own.
    start_load_window()


# ---------------------------------------------------------------------------------------------------------------
# chat


@app.command(rich_help_panel="Run")
@with_run_flags
def chat(
    options: RunOptions,
    system: Annotated[
        str | None, typer.Option("--system", metavar="TEXT", help="System prompt (change it later with /set system).")
    ] = None,
    prompt: Annotated[
        str | None,
        typer.Option("--prompt", metavar="TEXT", help="Answer this message and exit (piped stdin is added after it)."),
    ] = None,
    no_history: Annotated[
        bool,
        typer.Option("--no-history", envvar="DFLASH_NOHISTORY", help="Neither read nor write the prompt history file."),
    ] = False,
    stats: Annotated[
        bool, typer.Option("--stats", help="A footer after each reply: tokens, tok/s, TTFT, tau (toggle: /stats).")
    ] = False,
    no_prefix_cache: NoPrefixCache = False,
    cache_ram: CacheRam = None,
) -> None:
    """Chat with a model in the terminal, accelerated by its DFlash drafter.

    Type a message and press Enter; the reply streams as it is decoded and Ctrl+C stops it. /help lists the commands: /set temperature 0.7, /stats, /spec off (the same chat without the drafter), /save FILE, /load FILE, /clear, /show, /bye. Start and end a block with \"\"\" (or press Alt+Enter) for several lines.

    With --prompt or piped stdin it answers once and exits, only the reply on stdout:
    `echo "Why is the sky blue?" | dflash chat demo`
    """
    options = dataclasses.replace(options, prefix_cache=not no_prefix_cache, cache_ram_mib=cache_ram)
    options.resolve_recipe()  # input mistakes fail here, in a fraction of a second, before torch is imported
    question = _one_shot_question(prompt)
    from dflash_cli.commands.chat import run_chat

    code = run_chat(
        options,
        system=system,
        question=question,
        history=not no_history,
        show_stats=stats,
        console=console,
        err_console=err_console,
    )
    if code:
        raise typer.Exit(code)


def _one_shot_question(prompt: str | None) -> str | None:
    """The message to answer once: --prompt, then piped stdin. None on a terminal without --prompt (the REPL).
    Read before the model loads, so an empty pipe fails at once."""
    if prompt is None and sys.stdin.isatty():
        return None
    piped = "" if sys.stdin.isatty() else sys.stdin.read().strip()
    question = "\n\n".join(part for part in (prompt, piped) if part)
    if not question:
        raise DflashError("nothing to answer: the prompt is empty", fix='pipe text in, or --prompt "..."', exit_code=2)
    return question


# ---------------------------------------------------------------------------------------------------------------
# run


@app.command(rich_help_panel="Run")
@with_run_flags
def run(
    options: RunOptions,
    prompts: Annotated[
        str | None,
        typer.Argument(metavar="PROMPTS.jsonl", show_default=False, help="One request a line (see above)."),
    ] = None,
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", metavar="FILE", help="Results JSONL (default: PROMPTS.out.jsonl)."),
    ] = None,
    errors: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="Failed lines, with line number and reason (default: PROMPTS.errors.jsonl; with -o NAME.jsonl, "
            "NAME.errors.jsonl beside it).",
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    batch_size: BatchSize = None,
    no_prefix_cache: NoPrefixCache = False,
    cache_ram: CacheRam = None,
) -> None:
    """Generate for every line of a JSONL file, loading the model once. Resumable: re-run to finish.

    Lines: {"prompt": "..."} (plain completion), {"messages": [...]} (chat), {"prompt_ids": [...]} (token ids), or OpenAI batch lines (custom_id, method, url /v1/chat/completions or /v1/completions, body): the request format `dflash serve` takes. max_tokens, temperature, top_p, top_k, min_p, seed and stop on a line override the flags. A result carries its line's id (or custom_id), else line-N-HASH; work starts shortest prompt first and each result is written when it finishes, so match them by id.

    Up to --batch-size requests decode together (continuous batching: a finished one makes room for the next at once); each gives exactly the tokens it gives alone. Each result is on disk the moment it completes. Re-running the same command skips the ids already in the output, so an interrupted or killed run loses at most the requests in flight; if a line or the command changed since (its prompt, sampling or model), the run refuses rather than keep the old result. Lines that cannot run (bad JSON, bad fields, an id already used by an earlier line, a prompt too long) go to the errors file and the rest runs; the exit code is 1 when any request failed.

    Example: `dflash run qwen3-8b prompts.jsonl -o results.jsonl --max-tokens 256`
    """
    from dflash_cli.commands import run as jobs

    options = dataclasses.replace(
        options, batch_size=batch_size, prefix_cache=not no_prefix_cache, cache_ram_mib=cache_ram
    )
    options, prompts = jobs.split_positionals(options, prompts)
    options.resolve_recipe()  # a missing or unknown model fails before any file is touched
    summary = jobs.run_file(options, prompts, output, errors, err_console)
    emit(summary.to_dict(), json_output, lambda: show_summary(summary))
    raise typer.Exit(summary.exit_code)


# ---------------------------------------------------------------------------------------------------------------
# serve


@app.command(rich_help_panel="Run")
@with_run_flags
def serve(
    options: RunOptions,
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on (0.0.0.0: every interface; then set --api-key).", rich_help_panel=SERVER
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free one).", rich_help_panel=SERVER)
    ] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="DFLASH_API_KEY",
            show_default=False,
            help="Require `Authorization: Bearer KEY` on /v1 routes (default: $DFLASH_API_KEY, else open).",
            rich_help_panel=SERVER,
        ),
    ] = None,
    max_queue: Annotated[
        int,
        typer.Option(
            min=0,
            help="Requests that may wait while the batch is full; more get HTTP 429 at once.",
            rich_help_panel=SERVER,
        ),
    ] = 64,
    batch_size: BatchSize = None,
    no_prefix_cache: NoPrefixCache = False,
    cache_ram: CacheRam = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API, for Open WebUI, editors, agents and the `openai` client.

    POST /v1/chat/completions and /v1/completions (streaming with "stream": true), GET /v1/models, /health, /metrics (Prometheus). The model loads once and one engine thread decodes the queued requests, up to --batch-size at once (continuous batching); a client that disconnects stops its generation. Request fields override the sampling flags, which are the defaults (greedy unless --temperature); replies carry usage plus a "dflash" object (tau, acceptance histogram, decode tok/s).

    Example: `dflash serve demo`, then `curl http://127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'`
    """
    options = dataclasses.replace(
        options, batch_size=batch_size, prefix_cache=not no_prefix_cache, cache_ram_mib=cache_ram
    )
    options.resolve_recipe()  # input mistakes fail here, before torch is imported
    from dflash_cli.commands.serve.http import run_server

    run_server(options, host=host, port=port, api_key=api_key, max_queue=max_queue, console=err_console)


# ---------------------------------------------------------------------------------------------------------------
# bench


@app.command(rich_help_panel="Run")
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
    """Measure speed and acceptance: DFlash against the baseline on the same prompts.

    By default a run takes about a minute: one warm-up generation per mode measures the pace here, then up to 128 tokens per prompt, 1 round, and as many prompts as fit the minute (shorter generations where not even one fits); it says what it will do and about how long before the timed part starts. --full is the sweep docs/benchmarks.md reports (24 prompts, 512 tokens, 3 rounds); --set, --limit, --repeat and --max-tokens change one thing at a time.

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
    emit(report.to_dict(), json_output, lambda: bench_lib.print_report(report, console))
    if output:
        err_console.print(f"[dim]saved {escape(str(bench_lib.write_json(report, output)))}[/]")
    if png:
        err_console.print(f"[dim]saved {escape(str(bench_lib.save_png(report, png)))}[/]")


# ---------------------------------------------------------------------------------------------------------------
# pull


@app.command(rich_help_panel="Models")
def pull(
    name: RecipeName = None,
    target: Target = None,
    drafter: Drafter = None,
    recipe_file: RecipeFile = None,
    revision: Annotated[
        str | None,
        typer.Option(help="Pin the target to a branch, tag or commit (with --target).", rich_help_panel=MODEL),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be downloaded and its size; fetch nothing.")
    ] = False,
    fp8: Annotated[
        bool,
        typer.Option(
            "--fp8",
            help="Fetch the recipe's published FP8 copy of the target (what --quant fp8 loads).",
            rich_help_panel=MODEL,
        ),
    ] = False,
    compile: Annotated[
        bool,
        typer.Option(
            "--compile/--no-compile",
            help="Also build this machine's compiled target and draft steps (a CPU plan; Llama, Mistral, Qwen2 "
            "and Qwen3 targets): 1-3 minutes once, then every start loads them in a second and decodes about 2.5x "
            "faster (the demo on 2 cores). Without pull, the first chat, run or serve builds them in the background.",
        ),
    ] = True,
    json_output: JsonFlag = False,
) -> None:
    """Download a recipe's target and drafter into the Hugging Face cache, showing sizes first.

    Only safetensors weights, configs and tokenizer files are fetched. Interrupted downloads keep finished files: run the same command again. Also happens on first use of a recipe; `pull` is for doing it ahead of time, with this machine's compiled target and draft steps (which the first chat, run or serve otherwise builds in the background; `--no-compile` skips them).
    """
    from dflash_cli.commands.pull import compile_recipe, pull_recipe

    recipe = resolve_recipe(name, recipe_file, target, drafter)
    if fp8:
        if "fp8" not in recipe.checkpoints:
            raise DflashError(f"recipe {recipe.name} names no published FP8 checkpoint", fix="drop --fp8")
        recipe = dataclasses.replace(recipe, target=recipe.checkpoints["fp8"])
    if revision is not None:
        recipe = dataclasses.replace(recipe, target=dataclasses.replace(recipe.target, revision=revision))
    parts = pull_recipe(recipe, console, dry_run=dry_run, json=json_output)
    if compile and not dry_run:
        parts.extend(compile_recipe(recipe, console, json=json_output))
    emit([part.data for part in parts], json_output, lambda: [console.print(part.line) for part in parts if part.line])


# ---------------------------------------------------------------------------------------------------------------
# train


@app.command(rich_help_panel="Models")
def train(
    target: Annotated[
        str, typer.Option("--target", help="Model to draft for: recipe name, Hugging Face repo id or local directory.")
    ],
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts",
            metavar="FILE",
            callback=existing_file,
            help='Prompts: .txt (one a line) or .jsonl as `dflash run` reads it: {"prompt": ...} (a user turn, where `dflash run` reads plain completion) or {"messages": [...]}, optionally with "tools", "tool_choice" or "response_format" (answered as the server answers them) and an "id".',
        ),
    ],
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            metavar="DIR",
            help="Where the drafter, checkpoints, the target's cached answers and features, and metrics.json go.",
        ),
    ],
    layers: Annotated[
        int,
        typer.Option(min=1, help="Drafter decoder layers (published drafters use 5; 1-2 is enough for small targets)."),
    ] = 1,
    feature_layers: Annotated[
        int, typer.Option(min=1, help="Target layers whose hidden states the drafter reads (evenly spaced).")
    ] = 5,
    block_size: Annotated[
        int,
        typer.Option(
            min=2,
            help="Tokens per draft block. 8 suits CPUs and small targets (verify cost grows with B); 16 suits GPUs.",
        ),
    ] = 8,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps.")] = 2000,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per step.")] = 8,
    lr: Annotated[float, typer.Option(min=0.0, help="Peak learning rate (linear warmup, cosine decay).")] = 6e-4,
    anchors: Annotated[
        int, typer.Option(min=1, help="Draft blocks per sequence per step (random anchors in the response).")
    ] = 16,
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens",
            "--max-new-tokens",
            min=2,
            help="Longest answer the target writes per prompt while distilling (--max-new-tokens: the older name).",
        ),
    ] = 128,
    eval_prompts: Annotated[
        int,
        typer.Option(
            min=0, help="Prompts held out to measure tau at the end: the first N of --eval-file, else of --prompts."
        ),
    ] = 32,
    eval_every: Annotated[
        int,
        typer.Option(
            min=0,
            help="Also measure held-out tau every N steps (a curve in metrics.json's history, with the CPU seconds so "
            "far); 0: at the end only.",
        ),
    ] = 0,
    eval_file: Annotated[
        str | None,
        typer.Option(
            "--eval-file",
            metavar="FILE",
            callback=existing_file,
            help="Held-out prompts for tau (same formats as --prompts).",
        ),
    ] = None,
    follow_ups: Annotated[
        int,
        typer.Option(
            min=0,
            max=8,
            help="Also distill N follow-up turns per prompt (one of 8 questions after the target's answer, answered by "
            "the target): multi-turn training data, N+1 answers per prompt.",
        ),
    ] = 0,
    distill_batch_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            show_default=False,
            help="Prompts the target answers at once while it writes the training answers, as `dflash run "
            "--batch-size` (default: the plan's; on a GPU try 256).",
        ),
    ] = None,
    train_minutes: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            show_default=False,
            help="Stop training after this many minutes, before --steps if need be (checkpointed where it stops). "
            "The learning rate's decay then ends where the time runs out, at the pace measured so far.",
        ),
    ] = None,
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Save a resumable checkpoint every N steps.")] = 200,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Continue the checkpoint in --output (from the learning rate it stopped at, never higher)."
        ),
    ] = False,
    device: Annotated[str, typer.Option(callback=check_device, help="cpu, cuda or cuda:N.")] = "cpu",
    dtype: Annotated[
        str | None,
        typer.Option(
            callback=check_dtype,
            show_default=False,
            help="Target dtype while it writes answers and features and tau is measured (default: the one dflash serves it in here: "
            "bf16 on GPUs and CPUs with AVX512-BF16/AMX, where it is 2-5x faster; fp32 on other CPUs).",
        ),
    ] = None,
    threads: Threads = None,
    json_output: JsonFlag = False,
) -> None:
    """Train a DFlash drafter for a target model (self-distillation: the target writes the training answers).

    The target answers every prompt as `dflash run` would (the plan, quantization and compiled steps dflash serves it with here; greedy), and its features of every answer are computed once; both are cached in DIR, so an interrupted run keeps its data and a later run adds to it. Training saves a checkpoint every --checkpoint-every steps and where Ctrl-C stops it (--resume continues it, with a note if its data or objective flags changed; a run that reached --steps asks for more). Prompts are rendered with the chat template options of the target's recipe (Qwen3: thinking off), as chat serves them. The drafter lands in DIR/drafter in the z-lab format that dflash, vLLM and SGLang load; the closing message prints the command that uses it, e.g. `dflash chat demo --drafter runs/demo/drafter`.

    Example (the shipped demo drafter): `dflash train --target demo --prompts prompts.jsonl --output runs/demo --steps 1500`
    """
    from dflash_cli.training.prompts import split_prompts

    resolve_recipe(None, None, target, None)  # input mistakes fail here, before torch is imported
    split_prompts(prompts, eval_file, eval_prompts)
    from dflash_cli.commands.train import TrainOptions, interrupted_training_state, next_steps
    from dflash_cli.commands.train import train as run_training

    options = TrainOptions(
        target=target,
        prompts=prompts,
        output=output,
        layers=layers,
        feature_layers=feature_layers,
        block_size=block_size,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        anchors_per_sequence=anchors,
        max_new_tokens=max_new_tokens,
        distill_batch_size=distill_batch_size,
        follow_ups=follow_ups,
        train_minutes=train_minutes,
        eval_prompts=eval_prompts,
        eval_every=eval_every,
        eval_prompts_file=eval_file,
        checkpoint_every=checkpoint_every,
        resume=resume,
        device=device,
        dtype=dtype,
        threads=threads,
    )
    try:
        result = run_training(options, err_console)
    except KeyboardInterrupt:
        err_console.print(f"interrupted: {escape(interrupted_training_state(Path(output)))}")
        raise
    steps = next_steps(target, result.output)
    summary = {**{k: v for k, v in result.to_dict().items() if k != "history"}, "chat_command": steps["chat_command"]}
    emit(summary, json_output, lambda: show_trained(result, steps))


# ---------------------------------------------------------------------------------------------------------------
# doctor


@app.command(rich_help_panel="Machine")
def doctor(json_output: JsonFlag = False) -> None:
    """Check this machine: torch and GPU kernels, driver, bitsandbytes, Hugging Face, and which recipes fit.

    Exits with 1 when a check fails."""
    from dflash_cli.commands import doctor as checks

    results = checks.run_checks()
    emit(checks.report(results), json_output, lambda: console.print(checks_table(results)))
    raise typer.Exit(checks.exit_code(results))


# ---------------------------------------------------------------------------------------------------------------
# recipes


@recipes_app.command("list")
def recipes_list(json_output: JsonFlag = False) -> None:
    """List the built-in and user recipes.

    block: the most tokens a step verifies: the recipe's, else what its drafter's config.json sets (read where it is local or in the Hugging Face cache, never downloaded); `drafter's` where that config is not downloaded yet (`dflash pull NAME` fetches it). --json adds it as `drafter_block_size` (null: unknown)."""
    from dflash_cli.commands.recipes import COLUMNS, recipe_listing, recipe_rows

    recipes, unreadable = load_registry()
    listings = [recipe_listing(recipe) for recipe in recipes.values()]
    for error in unreadable.values():  # (left out of the list; on stderr, so --json stays data)
        print_error(error, "[yellow]warning:[/]")
    emit(listings, json_output, lambda: show_rows(COLUMNS, recipe_rows(listings), no_wrap=("name", "status")))


@recipes_app.command("show")
def recipes_show(
    name: Annotated[str, typer.Argument(help="Recipe name, alias, or .toml file.")], json_output: JsonFlag = False
) -> None:
    """Show everything a recipe says: models, block size, chat template options, sizes, GPU overrides."""
    from dflash_cli.commands.recipes import recipe_fields

    recipe = resolve_recipe(name, None, None, None)
    emit(recipe.to_dict(), json_output, lambda: show_fields(recipe_fields(recipe)))


# ---------------------------------------------------------------------------------------------------------------
# export


@app.command(rich_help_panel="Scale out")
def export(
    server: Annotated[str, typer.Argument(metavar="SERVER", callback=check_server, help="vllm, sglang or llama.cpp.")],
    name: RecipeName = None,
    target: Target = None,
    drafter: Drafter = None,
    recipe_file: RecipeFile = None,
    gpus: Gpus = None,
    gpu_memory: GpuMemory = None,
    json_output: JsonFlag = False,
) -> None:
    """Print the command that serves a recipe with DFlash on vLLM (`vllm serve ... --speculative-config`), SGLang (`python -m sglang.launch_server ... --speculative-algorithm DFLASH`) or llama.cpp (`llama-server -m TARGET.gguf -md DRAFTER.gguf --spec-type draft-dflash`, with the GGUF conversion steps)."""
    from dflash_cli.commands.export import export_command

    command = export_command(server, resolve_recipe(name, recipe_file, target, drafter), gpus, gpu_memory)
    emit(command.to_dict(), json_output, lambda: show_text(command.text()))


def main() -> None:
    """Console-script entry point (`dflash`, `python -m dflash_cli`)."""
    app(prog_name="dflash")
