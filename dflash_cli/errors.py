"""User-facing errors: what went wrong and how to fix it, never a traceback."""

from __future__ import annotations

import json


class DflashError(Exception):
    """An error the user can act on. The CLI prints `message` and `fix` and exits with `exit_code`."""

    def __init__(self, message: str, *, fix: str | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\nfix: {self.fix}"


def json_problem(error: json.JSONDecodeError) -> str:
    """`Expecting ',' delimiter at column 12`; json's own messages may end in "at" ("Unterminated string
    starting at"), which must not read "at at column"."""
    where = "column" if error.msg.endswith(" at") else "at column"
    return f"{error.msg} {where} {error.colno}"


class RequestError(DflashError):
    """A request (a server request body, a `dflash run` line, a prompt file line) that cannot run.

    `param` names the field as the user wrote it (OpenAI's error `param`); `code` says what kind of problem it
    is (`invalid_request`, `context_length_exceeded`, ...), for errors files and OpenAI error bodies."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str = "invalid_request", fix: str | None = None
    ) -> None:
        super().__init__(message, fix=fix)
        self.param = param
        self.code = code
