"""The command line: one module per command (`chat`, `run`, `serve`, ...) wired together by `app`, the flags they
share (`flags`), one way to print (`output`)."""

from dflash_cli.cli.app import main

__all__ = ["main"]
