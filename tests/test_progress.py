"""What long work says while it runs: a spinner on a terminal, one plain line in a log or pipe."""

from __future__ import annotations

import io

from rich.console import Console

from dflash_cli.progress import working


def test_long_work_says_one_line_where_no_spinner_draws() -> None:
    piped = io.StringIO()
    with working(Console(file=piped, force_terminal=False, width=40), "Reading [model].gguf (once, about a minute)..."):
        pass
    assert piped.getvalue() == "Reading [model].gguf (once, about a minute)...\n"  # whole, unfolded, no markup read
    terminal = io.StringIO()
    with working(Console(file=terminal, force_terminal=True), "Reading model.gguf..."):
        pass
    assert "\x1b[?25l" in terminal.getvalue()  # a live spinner (the cursor hidden while it draws)
    with working(None, "nothing to say it on"), working(Console(file=piped), "loading (every start)", piped=False):
        pass
    assert piped.getvalue().count("\n") == 1
