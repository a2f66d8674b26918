"""Where a published DFlash drafter's config.json keeps its own fields, torch-free.

The reference (`dflash==0.1.0`) reads each DFlash field from `dflash_config` first (the nested schema, and
DFlash2), then from the top level (the legacy schema), then its default. The engine's `DrafterConfig.from_dict`
validates a whole config with this rule; `dflash recipes list` reads a drafter's block size with it, without
loading torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Our extension: the tokens a drafter may propose, a JSON list of target ids, ascending, beside its weights (its
# config's dflash_config.draft_vocab_size says how many; the safetensors stay the published format).
DRAFT_VOCAB_FILE = "draft_vocab.json"
DEFAULT_BLOCK_SIZE = 16  # the reference's default when neither dflash_config nor the top level sets it
# DFlash fields the reference looks up in dflash_config first, then at the top level.
DFLASH_FIELDS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
)


def dflash_field(raw: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """A DFlash field of a drafter's config.json as the reference reads it: dflash_config, then the top level,
    then `default`."""
    nested = raw.get("dflash_config")
    nested = nested if isinstance(nested, Mapping) else {}
    return nested.get(name, raw.get(name, default))


def config_block_size(raw: Mapping[str, Any]) -> int | None:
    """The block size a drafter's config.json sets (the default when it sets none); None when what it sets is not
    a positive integer (loading that drafter fails with the field named)."""
    got = dflash_field(raw, "block_size", DEFAULT_BLOCK_SIZE)
    return got if isinstance(got, int) and not isinstance(got, bool) and got >= 1 else None
