"""The DFlash drafter: `config` (the z-lab checkpoint formats), `layers`, `model` (bound to a target; one API for a
single sequence and for the rows of a batch) and `cache` (its context K/V, a slot per sequence)."""

from dflash_cli.engine.drafter.cache import DraftCache
from dflash_cli.engine.drafter.config import DrafterConfig, default_target_layer_ids
from dflash_cli.engine.drafter.model import DFlash2Drafter, DFlashDrafter, check_compatible, make_drafter

__all__ = [
    "DFlash2Drafter",
    "DFlashDrafter",
    "DraftCache",
    "DrafterConfig",
    "check_compatible",
    "default_target_layer_ids",
    "make_drafter",
]
