"""The command line: typer wiring (`app`), the flags shared by commands (`flags`), one way to print (`output`)."""

from dflash_cli.cli.app import main

__all__ = ["main"]
