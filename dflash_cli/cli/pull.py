"""`dflash pull`: download a recipe's models (and build this machine's compiled steps) ahead of time."""

import dataclasses
from typing import Annotated

import typer

from dflash_cli.cli.flags import MODEL, Drafter, JsonFlag, RecipeFile, RecipeName, Target
from dflash_cli.cli.output import console, emit
from dflash_cli.errors import DflashError
from dflash_cli.setup.recipes import resolve_recipe


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
            "and Qwen3 targets): 1-3 minutes once, then every start loads them in a second and decodes about 2.2x "
            "faster (the demo on 2 cores). Without pull, the first chat, run or serve builds them in the background.",
        ),
    ] = True,
    json_output: JsonFlag = False,
) -> None:
    """Download a recipe's target and drafter into the Hugging Face cache, showing sizes first.

    Only safetensors weights, configs and tokenizer files are fetched. Interrupted downloads keep finished files: run the same command again. Also happens on first use of a recipe; `pull` is for doing it ahead of time, with this machine's compiled target and draft steps (which the first chat, run or serve otherwise builds in the background; `--no-compile` skips them).
    """
    from dflash_cli.commands.pull import compile_recipe, no_drafter_note, pin_revision, pull_recipe

    recipe = resolve_recipe(name, recipe_file, target, drafter)
    if fp8:
        if "fp8" not in recipe.checkpoints:
            raise DflashError(f"recipe {recipe.name} names no published FP8 checkpoint", fix="drop --fp8")
        recipe = dataclasses.replace(recipe, target=recipe.checkpoints["fp8"])
    if revision is not None:
        recipe = pin_revision(recipe, revision, by_target=target is not None)
    parts = pull_recipe(recipe, console, dry_run=dry_run, json=json_output)
    if compile and not dry_run:
        parts.extend(compile_recipe(recipe, console, json=json_output))
    note = no_drafter_note(recipe)
    lines = [part.line for part in parts if part.line] + ([note] if note else [])
    emit([part.data for part in parts], json_output, lambda: [console.print(line) for line in lines])
