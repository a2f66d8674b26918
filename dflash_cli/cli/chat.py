"""`dflash chat`: talk to a model in the terminal, or answer one prompt and exit."""

import dataclasses
import sys
from typing import Annotated

import typer

from dflash_cli.cli.flags import CacheRam, NoPrefixCache, with_run_flags
from dflash_cli.cli.output import console, err_console
from dflash_cli.errors import DflashError
from dflash_cli.setup.options import RunOptions


@with_run_flags
def chat(
    options: RunOptions,
    system: Annotated[
        str | None, typer.Option("--system", metavar="TEXT", help="System prompt (change it later with /set system).")
    ] = None,
    prompt: Annotated[
        str | None,
        typer.Option("--prompt", metavar="TEXT", help="Answer this message and exit (piped stdin is added after it)."),
    ] = None,
    no_history: Annotated[
        bool,
        typer.Option("--no-history", envvar="DFLASH_NOHISTORY", help="Neither read nor write the prompt history file."),
    ] = False,
    stats: Annotated[
        bool, typer.Option("--stats", help="A footer after each reply: tokens, tok/s, TTFT, tau (toggle: /stats).")
    ] = False,
    no_prefix_cache: NoPrefixCache = False,
    cache_ram: CacheRam = None,
) -> None:
    """Chat with a model in the terminal, accelerated by its DFlash drafter.

    Type a message and press Enter; the reply streams as it is decoded and Ctrl+C stops it. /help lists the commands: /set temperature 0.7, /stats, /spec off (the same chat without the drafter), /save FILE, /load FILE, /clear, /show, /bye. Start and end a block with \"\"\" (or press Alt+Enter) for several lines.

    With --prompt or piped stdin it answers once and exits, only the reply on stdout:
    `echo "Why is the sky blue?" | dflash chat demo`
    """
    options = dataclasses.replace(options.overriding(cache_ram_mib=cache_ram), prefix_cache=not no_prefix_cache)
    options.resolve_recipe()  # input mistakes fail here, in a fraction of a second, before torch is imported
    question = _one_shot_question(prompt)
    from dflash_cli.commands.chat import run_chat

    code = run_chat(
        options,
        system=system,
        question=question,
        history=not no_history,
        show_stats=stats,
        console=console,
        err_console=err_console,
    )
    if code:
        raise typer.Exit(code)


def _one_shot_question(prompt: str | None) -> str | None:
    """The message to answer once: --prompt, then piped stdin. None on a terminal without --prompt (the REPL).
    Read before the model loads, so an empty pipe fails at once."""
    if prompt is None and sys.stdin.isatty():
        return None
    piped = "" if sys.stdin.isatty() else sys.stdin.read().strip()
    question = "\n\n".join(part for part in (prompt, piped) if part)
    if not question:
        raise DflashError("nothing to answer: the prompt is empty", fix='pipe text in, or --prompt "..."', exit_code=2)
    return question
