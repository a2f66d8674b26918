"""`dflash doctor`: check this machine and list the recipes that fit."""

import typer

from dflash_cli.cli.flags import JsonFlag
from dflash_cli.cli.output import checks_table, console, emit


def doctor(json_output: JsonFlag = False) -> None:
    """Check this machine: torch and GPU kernels, driver, bitsandbytes, Hugging Face, and which recipes fit.

    Exits with 1 when a check fails."""
    from dflash_cli.commands import doctor as checks

    results = checks.run_checks()
    emit(checks.report(results), json_output, lambda: console.print(checks_table(results)))
    raise typer.Exit(checks.exit_code(results))
