"""The flags commands share, declared once, and the validators that turn bad values into usage errors (exit 2).

Model selection is used by every command that names a model; the run flags by chat, run, serve and bench (through
`with_run_flags`), their defaults read from RunOptions, SamplingParams and PlanOverrides. A command declares only its own flags.
Validators run while typer parses, before any model or torch loads.
"""

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from dflash_cli.cli.output import remember_json
from dflash_cli.errors import DflashError
from dflash_cli.protocol.params import BY_KEY, FIELDS, SamplingParams, read_sampling
from dflash_cli.setup.choices import ATTN_IMPLEMENTATIONS, QUANTS, Quant, normalize_device, normalize_dtype
from dflash_cli.setup.options import COMPILE_SETTINGS, RunOptions
from dflash_cli.setup.planning import PlanOverrides

MODEL, SAMPLING, PLANNING, SERVER, BENCH = "Model", "Sampling", "Planning", "Server", "Benchmark"


def check_quant(value: str | None) -> Quant | None:
    if value is not None and value not in QUANTS:
        raise typer.BadParameter(f"use one of {', '.join(QUANTS)}")
    return None if value is None else Quant(value)


def check_attention(value: str | None) -> str | None:
    if value is not None and value not in ATTN_IMPLEMENTATIONS:
        raise typer.BadParameter(f"use one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    return value


def check_dtype(value: str | None) -> str | None:
    try:
        return normalize_dtype(value) if value is not None else None
    except DflashError as error:
        raise typer.BadParameter(f"{error.message}: {error.fix}") from None


def check_device(value: str | None) -> str | None:
    try:
        return normalize_device(value) if value is not None else None
    except DflashError as error:
        raise typer.BadParameter(f"{error.message}: {error.fix}") from None


def sampling_rule(key: str) -> Callable[[Any], Any]:
    """A flag's check by its request field's rule (params.FIELDS: the same one requests, lines and /set obey),
    before any model loads."""
    field = BY_KEY[key]

    def check(value: Any) -> Any:
        value = None if value is None else field.read(value)
        problem = None if value is None else field.problem(value)
        if problem is not None:
            raise typer.BadParameter(f"{value:.12g} {problem}")  # (1.0000001 stays itself, 0.0 is 0)
        return value

    return check


def existing_file(value: str | None) -> str | None:
    """A file the command reads: missing is a usage error (exit 2), found before any model or torch loads."""
    if value is not None and not Path(value).expanduser().is_file():
        what = "is a directory, not a file" if Path(value).expanduser().is_dir() else "does not exist"
        raise typer.BadParameter(f"{value} {what}")
    return value


def check_compile(value: str) -> str:
    if value not in COMPILE_SETTINGS:
        raise typer.BadParameter(f"use one of {', '.join(COMPILE_SETTINGS)}")
    return value


def check_prompt_set(value: str | None) -> str | None:
    from dflash_cli.bench import PROMPT_SETS  # torch-free

    if value is not None and value not in (*PROMPT_SETS, "all"):
        raise typer.BadParameter(
            f"unknown prompt set {value!r}: use {', '.join(PROMPT_SETS)} or all, or --prompts FILE.jsonl"
        )
    return value


def check_server(value: str) -> str:
    """An export server by name or alias (`llamacpp`), as the exporters name it."""
    from dflash_cli.commands.export import EXPORTERS, SERVER_ALIASES  # torch-free

    value = SERVER_ALIASES.get(value.lower(), value.lower())
    if value not in EXPORTERS:
        *others, last = EXPORTERS
        close = difflib.get_close_matches(value, [*EXPORTERS, *SERVER_ALIASES], n=1, cutoff=0.6)
        meant = f"did you mean {SERVER_ALIASES.get(close[0], close[0])}? " if close else ""
        raise typer.BadParameter(f"{meant}use {', '.join(others)} or {last}")
    return value


RecipeName = Annotated[
    str | None,
    typer.Argument(
        metavar="NAME", show_default=False, help="Recipe name or alias (`dflash recipes list`), or a recipe .toml file."
    ),
]
Target = Annotated[
    str | None,
    typer.Option(
        "--target", help="Target model: Hugging Face repo id or local directory (ad-hoc recipe).", rich_help_panel=MODEL
    ),
]
Drafter = Annotated[
    str | None,
    typer.Option("--drafter", help="DFlash drafter for --target: repo id or local directory.", rich_help_panel=MODEL),
]
RecipeFile = Annotated[
    str | None,
    typer.Option("--recipe", metavar="FILE.toml", help="Load a recipe from a TOML file.", rich_help_panel=MODEL),
]
JsonFlag = Annotated[bool, typer.Option("--json", callback=remember_json, help="Print the result as JSON.")]
BatchSize = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        min=1,
        show_default=False,
        rich_help_panel=PLANNING,
        help="Requests decoded together, sharing each forward (default: the plan's: as many as have room for a KV "
        "cache at 8k tokens, at most 16; 1 = one at a time). Hybrid targets decode one at a time.",
    ),
]
# chat, run and serve: bench times every prompt's whole prefill, always
NoPrefixCache = Annotated[
    bool,
    typer.Option(
        "--no-prefix-cache",
        rich_help_panel=PLANNING,
        help="Prefill every prompt from its first token. By default a request continues from what a slot already "
        "holds of its prompt (a conversation's earlier turns, a shared system prompt), exactly.",
    ),
]
CacheRam = Annotated[
    int | None,
    typer.Option(
        "--cache-ram",
        min=0,
        metavar="MiB",
        show_default=False,
        rich_help_panel=PLANNING,
        help="Host memory for prefixes beyond the slots (a request that shares more with one is copied back into a "
        "slot; least recently used out first). Default: the plan's (a quarter of the free RAM, at most 8192); 0 = none.",
    ),
]
# bench's --max-tokens: the same flag with bench's own default, which depends on --full (measure.QUICK_MAX_TOKENS)
BenchMaxTokens = Annotated[
    int,
    typer.Option(
        "--max-tokens",
        min=1,
        help="Most tokens to generate per prompt.",
        show_default="128; 512 with --full",
        rich_help_panel=SAMPLING,
    ),
]
Gpus = Annotated[int | None, typer.Option(min=1, help="GPUs on the serving machine (default: this machine's).")]
GpuMemory = Annotated[
    float | None,
    typer.Option("--gpu-memory", min=1.0, help="GB per GPU on the serving machine (default: this machine's, else 80)."),
]
Threads = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="CPU threads for torch (default: the cores other processes leave free; more threads than free "
        "cores stall on each other, decoding and training alike).",
        rich_help_panel=PLANNING,
    ),
]

# The run flags by parameter name: RunOptions' fields, for its `sampling` the keys of params.FIELDS, for its
# `overrides` PlanOverrides' fields.
RUN_FLAG_TYPES: dict[str, Any] = {
    "recipe_name": RecipeName,
    "target": Target,
    "drafter": Drafter,
    "recipe_file": RecipeFile,
    "max_tokens": Annotated[
        int, typer.Option("--max-tokens", min=1, help="Most tokens to generate per reply.", rich_help_panel=SAMPLING)
    ],
    "temperature": Annotated[
        float,
        typer.Option(
            callback=sampling_rule("temperature"),
            help=f"{BY_KEY['temperature'].rule.capitalize()}; 0 = greedy. Output follows the target's distribution at any temperature "
            "(speculative decoding is lossless).",
            rich_help_panel=SAMPLING,
        ),
    ],
    "top_p": Annotated[
        float,
        typer.Option(
            callback=sampling_rule("top_p"),
            help=f"Nucleus sampling: keep tokens up to this total probability, {BY_KEY['top_p'].rule} (1 = off).",
            rich_help_panel=SAMPLING,
        ),
    ],
    "top_k": Annotated[
        int,
        typer.Option(
            callback=sampling_rule("top_k"),
            help="Keep only the K most likely tokens (0 or -1 = off).",
            rich_help_panel=SAMPLING,
        ),
    ],
    "min_p": Annotated[
        float,
        typer.Option(
            callback=sampling_rule("min_p"),
            help=f"Drop tokens below this fraction of the top token's probability, {BY_KEY['min_p'].rule} (0 = off).",
            rich_help_panel=SAMPLING,
        ),
    ],
    "seed": Annotated[
        int | None, typer.Option(help="Random seed, for reproducible sampling.", rich_help_panel=SAMPLING)
    ],
    "block_size": Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Verify N tokens every step (default: adaptive, each step picks the size that decodes fastest here, "
            "1 = no drafting, up to the recipe's block, else the drafter config's).",
            rich_help_panel=PLANNING,
        ),
    ],
    "no_spec": Annotated[
        bool,
        typer.Option(
            "--no-spec",
            help="Baseline: decode with the target alone (the same loop, no drafter).",
            rich_help_panel=PLANNING,
        ),
    ],
    "device": Annotated[
        str | None,
        typer.Option(
            callback=check_device,
            help="cuda, cuda:N, mps or cpu (default: the best one here).",
            rich_help_panel=PLANNING,
        ),
    ],
    "dtype": Annotated[
        str | None,
        typer.Option(
            callback=check_dtype,
            help="bfloat16, float16 or float32 (default: bf16 on GPUs and CPUs that have it, "
            "fp16 on older GPUs and MPS, fp32 on other CPUs). fp32 makes greedy DFlash bit-identical to "
            "the baseline; in bf16/fp16 a near-tie can round differently in a block.",
            rich_help_panel=PLANNING,
        ),
    ],
    "quant": Annotated[
        str | None,
        typer.Option(
            callback=check_quant,
            help="none, nf4 (bitsandbytes 4-bit, CUDA), fp8 (the recipe's published FP8 checkpoint, `dflash pull "
            "--fp8`), or int4 / int8 (weight-only, the CPU's fast 4-/8-bit kernels; bf16 compute) "
            "(default: nf4 only where bf16 weights do not fit the GPU).",
            rich_help_panel=PLANNING,
        ),
    ],
    "attention": Annotated[
        str | None,
        typer.Option(
            callback=check_attention,
            metavar="sdpa|eager",
            help="The target's attention (default: eager on a CPU, where it makes each request's text independent "
            "of the requests beside it, streamed or not; sdpa elsewhere). On a CPU a bf16 or int4 Llama, Mistral, Qwen2 "
            "or Qwen3 target runs it on dflash's fused kernel, as fast as sdpa; other families' eager attention "
            "decodes about 1.2x slower than sdpa. With sdpa a near-tie can round by the batch.",
            rich_help_panel=PLANNING,
        ),
    ],
    "explain": Annotated[
        bool,
        typer.Option(
            "--explain",
            help="Print the plan (device, dtype, quantization, block size) and why.",
            rich_help_panel=PLANNING,
        ),
    ],
    "threads": Threads,
    "compile": Annotated[
        str,
        typer.Option(
            callback=check_compile,
            metavar="auto|on|off",
            help="Compile the decode steps. auto: CUDA graphs on a GPU; on a CPU, the target's and the drafter's "
            "steps compiled ahead of time where they are stored for this machine and model (Llama, Mistral, Qwen2, "
            "Qwen3 targets; every drafter format). on: on a CPU, build those stored steps first if missing (1-3 "
            "minutes once; every later start loads them in a second and decodes about 2.2x faster: the demo on 2 "
            "cores); what has none compiles at every start (minutes). off: eager.",
            rich_help_panel=PLANNING,
        ),
    ],
}


# `stop` is a request field, not a flag; `--batch-size` and `--cache-ram` flags of some commands only (they declare
# them and set them with RunOptions.overriding).
SAMPLING_FLAGS = [field for field in FIELDS if field.key in RUN_FLAG_TYPES]
OVERRIDE_FLAGS = [override.name for override in dataclasses.fields(PlanOverrides) if override.name in RUN_FLAG_TYPES]
OPTION_FLAGS = [option.name for option in dataclasses.fields(RunOptions) if option.name in RUN_FLAG_TYPES]


def _default(name: str) -> Any:
    """A run flag's default: its SamplingParams, PlanOverrides or RunOptions field's."""
    sampling = {field.key: getattr(SamplingParams(), field.attr) for field in SAMPLING_FLAGS}
    return (
        sampling[name]
        if name in sampling
        else getattr(PlanOverrides() if name in OVERRIDE_FLAGS else RunOptions(), name)
    )


# In RUN_FLAG_TYPES' order: the order --help lists them in.
RUN_FLAGS = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=_default(name), annotation=annotation)
    for name, annotation in RUN_FLAG_TYPES.items()
]


def run_options(flags: dict[str, Any]) -> RunOptions:
    """RunOptions from the run flags' values by parameter name; the sampling ones are read as a request's fields
    (the same checks and errors)."""
    sampling = read_sampling({field.key: flags[field.key] for field in SAMPLING_FLAGS})
    return RunOptions(
        **{name: flags[name] for name in OPTION_FLAGS},
        sampling=SamplingParams(**sampling),
        overrides=PlanOverrides(**{name: flags[name] for name in OVERRIDE_FLAGS}),
    )


def with_run_flags(command: Callable[..., Any], flag_types: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Give a command the shared run flags: it declares `options: RunOptions` first, plus any flags of its own.
    `flag_types` replaces shared flags' declarations for this command (the same flag, its own default)."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "options"]
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
    shared = [p.replace(annotation=(flag_types or {}).get(p.name, p.annotation)) for p in RUN_FLAGS]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        options = run_options({p.name: kwargs.pop(p.name) for p in RUN_FLAGS})
        return command(options, **kwargs)

    wrapper.__signature__ = inspect.Signature(shared + own)  # type: ignore[attr-defined]
    return wrapper
