"""Which CPU kernels a test runs: dflash's own (engine.kernels.native; skipped where this CPU cannot run them, as
they need AVX512-BF16 and AVX512-VNNI) or torch's, for the layers a test then makes."""

from __future__ import annotations

import pytest

from dflash_cli.engine.kernels import native


def use_kernels(ours: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if ours and not native.available():
        pytest.skip(f"dflash's CPU kernels: {native.unavailable()}")
    if not ours:
        monkeypatch.setattr(native, "available", lambda: False)
