"""`dflash recipes list` and `dflash recipes show`."""

from typing import Annotated

import typer

from dflash_cli.cli.flags import JsonFlag
from dflash_cli.cli.output import console, emit, print_error, show_fields, show_rows, table_width
from dflash_cli.setup.recipes import load_registry, resolve_recipe


def recipes_list(json_output: JsonFlag = False) -> None:
    """List the built-in and user recipes.

    status: in-process (dflash runs it; `dflash doctor` says whether it fits this machine) or export only (`dflash export` gives the vLLM / SGLang command). block: the most tokens a step verifies: the recipe's, else what its drafter's config.json sets (read where it is local or in the Hugging Face cache, never downloaded); `drafter's` where that config is not downloaded yet (`dflash pull NAME` fetches it). --json adds it as `drafter_block_size` (null: unknown)."""
    from dflash_cli.commands.recipes import COLUMNS, COMPACT_COLUMNS, compact_rows, recipe_listing, recipe_rows

    recipes, unreadable = load_registry()
    listings = [recipe_listing(recipe) for recipe in recipes.values()]
    for error in unreadable.values():  # (left out of the list; on stderr, so --json stays data)
        print_error(error, "[yellow]warning:[/]")

    def show() -> None:
        rows = recipe_rows(listings)
        if not console.is_terminal or table_width(COLUMNS, rows) <= console.width:
            show_rows(COLUMNS, rows, no_wrap=("name", "status"))
            return
        show_rows(COMPACT_COLUMNS, compact_rows(rows, listings), no_wrap=("weights", "block"))
        console.print("[dim]Each recipe's models and sizes: dflash recipes show NAME (or a wider terminal).[/]")

    emit(listings, json_output, show)


def recipes_show(
    name: Annotated[str, typer.Argument(help="Recipe name, alias, or .toml file.")], json_output: JsonFlag = False
) -> None:
    """Show everything a recipe says: models, block size, chat template options, sizes, GPU overrides."""
    from dflash_cli.commands.recipes import recipe_fields

    recipe = resolve_recipe(name, None, None, None)
    emit(recipe.to_dict(), json_output, lambda: show_fields(recipe_fields(recipe)))
