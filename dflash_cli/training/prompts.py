"""`dflash train`'s prompt files. No torch here: the CLI reads them before any model loads, so a bad file is
refused in a fraction of a second and leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

from dflash_cli.errors import DflashError
from dflash_cli.protocol.request_files import read_jsonl, read_prompt_file
from dflash_cli.protocol.requests import Request
from dflash_cli.wording import plural


def load_prompts(path: str | Path) -> list[Request]:
    """Requests to distil answers for: a .txt (one user prompt a line) or a .jsonl read like `dflash run`'s lines
    (`request_files.read_prompt_file`), where a `prompt` is a user turn, as in `dflash bench --prompts`; a line may ask
    for tools or a response_format, as a client would (the answer is then what the server gives it)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return read_prompt_file(path, "train", token_ids=False, constraints=True)
    if not path.is_file():
        raise DflashError(f"prompt file {path} does not exist", fix="pass --prompts FILE (.jsonl or .txt)")
    # (read as `dflash run` reads a .txt: the same lines, each a user turn)
    read = read_jsonl(path, lambda number, _raw: f"{path.stem}-{number}", text_lines=True)
    if read.errors:
        error = read.errors[0]
        raise DflashError(
            f"cannot read prompt file {path}: line {error.line}: {error.message}",
            fix="give a UTF-8 .txt or .jsonl file",
        )
    requests = read.requests
    if not requests:
        raise DflashError(
            f"prompt file {path} holds no prompts", fix="one prompt per line (.txt) or per JSON line (.jsonl)"
        )
    return requests


def split_prompts(
    prompts: str | Path, eval_file: str | Path | None, eval_prompts: int
) -> tuple[list[Request], list[Request]]:
    """(training, held-out) requests: the first `eval_prompts` of `eval_file`, else of `prompts` (then left out of
    training; a quarter of them where `eval_prompts` would leave none, as with a first try's few prompts)."""
    requests = load_prompts(prompts)
    if eval_file:
        return requests, load_prompts(eval_file)[:eval_prompts]
    if not eval_prompts:
        return requests, []
    if len(requests) < 2:
        raise DflashError(
            f"{prompts} has {plural(len(requests), 'prompt')}: one is held out to measure tau, which leaves none to "
            "train on",
            fix="pass more prompts, --eval-prompts 0, or held-out prompts with --eval-file FILE",
        )
    held = eval_prompts if len(requests) > eval_prompts else max(1, len(requests) // 4)
    return requests[held:], requests[:held]
