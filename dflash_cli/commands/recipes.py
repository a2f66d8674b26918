"""`dflash recipes list|show`: the recipes as table rows, one recipe as fields (the CLI prints them)."""

from __future__ import annotations

import json
from typing import Any

from dflash_cli.setup.choices import gb
from dflash_cli.setup.recipes import Recipe, drafter_block_size, user_recipe_dir

COLUMNS = ("name", "target", "drafter", "block", "weights", "status", "notes", "aliases")
# A terminal too narrow for COLUMNS (80 wide: ids and sizes folded into 6-letter pieces): a line per recipe, as
# `ollama list` has it; its models and sizes by precision are `recipes show NAME`'s
COMPACT_COLUMNS = ("name", "weights", "block", "status")
# The block column where the recipe leaves the block size to a drafter whose config is not on this machine yet.
UNKNOWN_BLOCK = "drafter's"


def recipe_listing(recipe: Recipe) -> dict[str, Any]:
    """A recipe as `recipes list --json` shows it: everything it says, and its drafter config's own block size
    (`drafter_block_size`, null where that config is not on this machine)."""
    return {**recipe.to_dict(), "drafter_block_size": drafter_block_size(recipe)}


def recipe_rows(listings: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row of COLUMNS per `recipe_listing`: the block is the recipe's, else its drafter config's."""
    user_dir = str(user_recipe_dir())
    rows = []
    for listing in listings:
        flags = (
            ("gated", listing["gated"]),
            ("MoE", bool(listing["expert_bytes"])),
            ("user", listing["source"].startswith(user_dir)),
        )
        # every precision listed: the published checkpoint(s) and NF4 (whose MoE sizes show what NF4 cannot save)
        sizes = ", ".join(f"{key} {gb(size)}" for key, size in listing["weight_bytes"].items()) or "?"
        drafter = listing["drafter"]
        block = listing["block_size"] or listing["drafter_block_size"] or (UNKNOWN_BLOCK if drafter else "-")
        rows.append(
            (
                listing["name"],
                listing["target"]["id"],
                drafter["id"] if drafter else "-",
                str(block),
                sizes,
                "in-process" if listing["runnable"] else "export only",  # (whether it fits here: dflash doctor)
                ", ".join(note for note, on in flags if on),
                ", ".join(listing["aliases"]),
            )
        )
    return rows


def compact_rows(rows: list[tuple[str, ...]], listings: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """`recipe_rows` as COMPACT_COLUMNS (rich markup): the aliases under the name, the smallest and largest
    weights, the notes beside the status."""
    compact = []
    for row, listing in zip(rows, listings, strict=True):
        name, _, _, block, _, status, notes, aliases = row
        sizes = sorted(listing["weight_bytes"].values())
        weights = "?" if not sizes else gb(sizes[0]) if len(sizes) == 1 else f"{gb(sizes[0])} - {gb(sizes[-1])}"
        also = f"\n[dim]{aliases}[/]" if aliases else ""
        compact.append((name + also, weights, block, ", ".join(filter(None, (status, notes)))))
    return compact


def recipe_fields(recipe: Recipe) -> list[tuple[str, str]]:
    """Everything the recipe says, as (key, value) in TOML's spelling (true, false) and "-" for an unset field,
    never Python's False / None; an unset block size says what it comes from (the list's block column)."""
    fields = [
        (key, "-" if value in (None, "") else value if isinstance(value, str) else json.dumps(value))
        for key, value in recipe.to_dict().items()
    ]
    if recipe.block_size is None and recipe.drafter is not None:
        block = drafter_block_size(recipe)
        said = f"- (the drafter's: {block})" if block else "- (the drafter's, read once it is downloaded)"
        fields = [(key, said if key == "block_size" else value) for key, value in fields]
    return fields
