"""What long work says while it runs: a spinner on a terminal, one plain line elsewhere (logs, pipes, CI), where
a spinner draws nothing and a first start would sit silent for half a minute."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

from rich.console import Console
from rich.text import Text


def working(console: Console | None, message: str, *, piped: bool = True) -> AbstractContextManager[Any]:
    """A context for the work `message` names: a spinner on a terminal, else the message printed once (unless not
    `piped`: work every start does, whose plan line says it next)."""
    if console is None or not (piped or console.is_terminal):
        return contextlib.nullcontext()
    if console.is_terminal:
        return console.status(Text(message))  # (a path's brackets are not markup)
    console.print(message, markup=False, highlight=False, soft_wrap=True)
    return contextlib.nullcontext()


def format_duration(seconds: float) -> str:
    """A duration as a person reads it in a progress line: 45 s, 12 min, 2 h 05 min."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60:02d} min"
