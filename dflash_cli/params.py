"""Sampling parameters: plain data, importable without torch so input can be validated before models load."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_cli.errors import DflashError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise DflashError(f"invalid sampling parameter: {message}")
