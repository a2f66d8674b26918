"""`dflash recipes list|show`: the recipes as table rows, one recipe as fields (the CLI prints them)."""

from __future__ import annotations

import json

from dflash_cli.setup.choices import gb
from dflash_cli.setup.recipes import Recipe, user_recipe_dir

COLUMNS = ("name", "target", "drafter", "block", "weights", "status", "notes")


def recipe_rows(recipes: list[Recipe]) -> list[tuple[str, ...]]:
    """One row of COLUMNS per recipe."""
    user_dir = str(user_recipe_dir())
    rows = []
    for recipe in recipes:
        flags = (
            ("gated", recipe.gated),
            ("MoE", bool(recipe.expert_bytes)),
            ("user", recipe.source.startswith(user_dir)),
        )
        # every precision listed: the published checkpoint(s) and NF4 (whose MoE sizes show what NF4 cannot save)
        sizes = ", ".join(f"{key} {gb(size)}" for key, size in recipe.weight_bytes.items()) or "?"
        rows.append(
            (
                recipe.name,
                recipe.target.id,
                recipe.drafter.id if recipe.drafter else "-",
                str(recipe.block_size or "config"),
                sizes,
                "runs" if recipe.runnable else "export only",
                ", ".join(note for note, on in flags if on),
            )
        )
    return rows


def recipe_fields(recipe: Recipe) -> list[tuple[str, str]]:
    """Everything the recipe says, as (key, value) in TOML's spelling (true, false) and "-" for an unset field,
    never Python's False / None."""
    return [
        (key, "-" if value in (None, "") else value if isinstance(value, str) else json.dumps(value))
        for key, value in recipe.to_dict().items()
    ]
