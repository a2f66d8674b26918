"""`dflash bench`'s prompts: the built-in sets (math, code, chat; bench_prompts/ in the assets) and prompt files,
encoded as the session encodes a chat turn."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_cli.errors import DflashError, RequestError
from dflash_cli.protocol.request_files import read_prompt_file
from dflash_cli.protocol.requests import Request

if TYPE_CHECKING:
    from dflash_cli.loading.session import Session

PROMPT_SET_DIR = Path(__file__).resolve().parents[1] / "assets" / "bench_prompts"
PROMPT_SETS = ("math", "code", "chat")


def load_prompt_set(name: str) -> list[Request]:
    """A built-in set (`math`, `code`, `chat`) or all of them (`all`)."""
    if name != "all" and name not in PROMPT_SETS:
        close = difflib.get_close_matches(name, [*PROMPT_SETS, "all"], n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise DflashError(
            f"unknown prompt set {name!r}", fix=f"{hint}use --set math, code, chat or all, or --prompts FILE.jsonl"
        )
    names = PROMPT_SETS if name == "all" else (name,)
    sets = [load_prompt_file(PROMPT_SET_DIR / f"{set_name}.jsonl") for set_name in names]
    return [prompt for group in zip(*sets) for prompt in group]  # interleaved: the first N cover every set


def load_prompt_file(path: str | os.PathLike[str]) -> list[Request]:
    """Prompts from a JSONL file, read like `dflash run` reads its lines (request_files.read_prompt_file)."""
    return read_prompt_file(path, "bench")


def encode_prompt(session: Session, prompt: Request) -> list[int]:
    """Token ids for `prompt`: text goes through the chat template when the model has one."""
    if prompt.prompt_ids is None and session.tokenizer is None:
        raise DflashError(
            f"prompt {prompt.id!r} is text, but {session.recipe.target.id} has no tokenizer",
            fix='give token ids instead: --prompts FILE.jsonl with {"prompt_ids": [...]} lines',
        )
    try:
        return session.encode_request(prompt, prompt_as_chat=True)
    except RequestError as error:
        raise DflashError(f"prompt {prompt.id!r}: {error.message}", fix=error.fix) from None
