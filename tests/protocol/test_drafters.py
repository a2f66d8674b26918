"""Where a drafter's config.json keeps its block size, read without torch (the engine's full reader agrees:
tests/engine/test_drafter_formats.py)."""

from __future__ import annotations

import pytest

from dflash_cli.protocol.drafters import DEFAULT_BLOCK_SIZE, config_block_size


@pytest.mark.parametrize(
    ("raw", "block"),
    [
        ({"block_size": 8}, 8),  # legacy: top level
        ({"dflash_config": {"block_size": 12}}, 12),  # nested (2026) and DFlash2
        ({"block_size": 8, "dflash_config": {"block_size": 12}}, 12),  # dflash_config first, as the reference
        ({"dflash_config": {"mask_token_id": 5}}, DEFAULT_BLOCK_SIZE),  # neither: the reference's default
        ({"dflash_config": None, "block_size": 4}, 4),
        ({"block_size": 0}, None),  # what loading would refuse is unknown, not a number
        ({"block_size": "8"}, None),
        ({"dflash_config": {"block_size": True}}, None),
    ],
)
def test_block_size_from_dflash_config_then_top_level_then_default(raw: dict, block: int | None) -> None:
    assert config_block_size(raw) == block
