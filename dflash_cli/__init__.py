"""dflash-cli: fast self-hosted LLM inference with lossless DFlash speculative decoding.

Python API (stable):

    from dflash_cli import load_drafter, speculative_generate

    drafter = load_drafter("z-lab/Qwen3-8B-DFlash-b16", target)
    result = speculative_generate(target, drafter, prompt_ids, max_new_tokens=256)
    result.token_ids, result.acceptance_lengths, result.stats.tau

Torch is imported on first use of these names, so `dflash --help` stays fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "load_drafter", "speculative_generate", "DFlashDrafter", "SamplingParams", "GenerationResult"]

_LAZY = {
    "load_drafter": "dflash_cli.loading.models",
    "DFlashDrafter": "dflash_cli.engine.drafter",
    "speculative_generate": "dflash_cli.engine",
    "SamplingParams": "dflash_cli.engine",
    "GenerationResult": "dflash_cli.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dflash_cli' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
