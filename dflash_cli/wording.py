"""Counts as messages say them ("1 thread", "2 threads"), torch-free: every layer's messages use it."""

from __future__ import annotations


def plural(count: int, noun: str) -> str:
    """`count` and `noun`, with an s unless count is 1."""
    return f"{count} {noun}{'s' if count != 1 else ''}"
