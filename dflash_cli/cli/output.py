"""Everything the CLI prints: the two consoles, errors as `error:` / `fix:` lines, and each command's result, as
JSON (`--json`) or for a person, through `emit`.

Commands return data; the views here turn it into tables and lines. Results go to stdout; progress, notes and
errors to stderr, so `--json` and piped output stay parseable.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from dflash_cli.errors import DflashError

if TYPE_CHECKING:
    from dflash_cli.commands.doctor import Check
    from dflash_cli.commands.run import Summary
    from dflash_cli.commands.train import TrainResult

console = Console()
err_console = Console(stderr=True)


def print_error(error: DflashError, label: str = "[bold red]error:[/]") -> None:
    """An error, or with `label` a warning, and its fix: the one place they are formatted."""
    err_console.print(f"{label} {escape(error.message)}")
    if error.fix:
        err_console.print(f"[yellow]fix:[/] {escape(error.fix)}")


JSON_ASKED = "dflash.json"  # ctx.meta: the command parsed --json (a failure then writes its error as JSON too)


def remember_json(ctx: typer.Context, value: bool) -> bool:
    """--json's callback: note it where the error handler (cli.app) looks, the contexts' shared meta."""
    if value:
        ctx.meta[JSON_ASKED] = True
    return value


def emit_error(message: str, fix: str | None, exit_code: int) -> None:
    """A failed command's error on stdout as JSON, where --json asked for data: a script reads
    `{"error": {"message", "fix", "exit_code"}}` instead of nothing (the `error:` / `fix:` lines still go to
    stderr for a person)."""
    typer.echo(json.dumps({"error": {"message": message, "fix": fix, "exit_code": exit_code}}, indent=2))


def emit(data: Any, as_json: bool, show: Callable[[], None]) -> None:
    """A command's result: `data` as indented JSON with --json, else `show()` prints it for a person. Every command
    prints its result here, so --json means the same thing everywhere."""
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        show()


def show_text(text: str) -> None:
    """Plain text as is: no markup, no wrapping (commands meant to be copied)."""
    typer.echo(text)


def show_fields(fields: Sequence[tuple[str, str]]) -> None:
    for key, value in fields:
        console.print(f"[bold]{key}[/]: {escape(value)}", soft_wrap=True)


def show_rows(header: Sequence[str], rows: Sequence[Sequence[str]], *, no_wrap: Sequence[str] = ()) -> None:
    """A table: on a terminal drawn and folded to its width; piped, whole values on aligned rows, nothing folded
    mid-word (for grep and cut). `no_wrap`: columns never folded on a terminal."""
    if not console.is_terminal:
        widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            typer.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        return
    table = Table()
    for column in header:
        table.add_column(column, overflow="fold", no_wrap=column in no_wrap)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def table_width(header: Sequence[str], rows: Sequence[Sequence[str]]) -> int:
    """The columns a terminal needs for `show_rows` to fold no value (its borders and padding counted)."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return sum(widths) + 3 * len(widths) + 1


STATUS_STYLE = {"pass": "[green]pass[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]fail[/]"}


def checks_table(checks: Sequence[Check]) -> Table:
    table = Table("check", "status", "detail", title="dflash doctor", title_justify="left")
    for check in checks:
        fix = f"\n[yellow]fix:[/] {escape(check.fix)}" if check.fix else ""
        table.add_row(check.name, STATUS_STYLE[check.status], escape(check.detail) + fix)
    return table


def summary_table(summary: Summary, width: int | None = None) -> Table:
    """The run's figures as one row under their headers; as a field and value a line where that row is wider than
    `width` (a narrow terminal folded the headers mid-word, "reque|sts")."""
    tau = f"{summary.tau:.2f}" if summary.tau is not None else "-"
    fields = {
        "requests": str(summary.total),
        "done": str(summary.done),
        "skipped": str(summary.skipped),
        "failed": f"[red]{summary.failed}[/]" if summary.failed else "0",
        "tokens": str(summary.completion_tokens),
        "reused prompt": f"{summary.cached_tokens}/{summary.prompt_tokens}",
        "time": f"{summary.wall_s:.1f}s",
        "tok/s": f"{summary.tokens_per_s:.1f}",
        "mean tau": tau,
    }
    table = Table(*fields)
    table.add_row(*fields.values())
    if width is not None and Measurement.get(console, console.options.update_width(10_000), table).maximum > width:
        table = Table("", "", show_header=False)
        for name, value in fields.items():
            table.add_row(name, value)
    return table


def show_summary(summary: Summary, to: Console = console) -> None:
    """The run's summary table, under the output's path and over the errors file's: whole lines, never folded to
    the table's width (a path broken mid-name cannot be copied)."""
    if not summary.total:  # an empty prompts file: nothing ran, nothing to tabulate
        return
    to.print(f"[bold]dflash run:[/] {escape(summary.output)}", soft_wrap=True)
    to.print(summary_table(summary, to.width))
    if summary.errors:
        to.print(f"failed requests: {escape(summary.errors)}", soft_wrap=True)
    if summary.unmatched:
        to.print(f"also in the output: {summary.unmatched} result(s) that match no line of this input", soft_wrap=True)
    if summary.empty_raw:
        to.print(
            f'note: {summary.empty_raw} "prompt" line(s) got no answer (the model ended its turn at once): "prompt" '
            'is raw text, sent without the chat template; for a user turn send "messages" (or a .txt file, a turn '
            "a line)",
            soft_wrap=True,
        )


def show_trained(result: TrainResult, next_steps: dict[str, str]) -> None:
    tau = "n/a" if result.eval_tau is None else f"{result.eval_tau:.2f}"
    if result.seen_tau is not None:
        tau += f" (on training answers {result.seen_tau:.2f})"
    console.print(
        f"[green]Drafter saved[/] in {escape(result.output)}: {result.steps} steps in {result.train_seconds:.0f}s, "
        f"loss {result.final_loss:.3f}, tau on {result.eval_prompts} held-out prompts {tau}"
    )
    console.print(f"Use it: {escape(next_steps['chat_command'])}", soft_wrap=True)
    console.print(f"Measure it: {escape(next_steps['bench_command'])}", soft_wrap=True)
