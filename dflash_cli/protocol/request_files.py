"""Files of requests, one JSON object a line: `dflash run`'s input (`read_jsonl`: every line read on its own, so one
bad line cannot stop the rest) and the prompt sets of `dflash bench --prompts` and `dflash train`
(`read_prompt_file`: every line must run, with the command's own settings). Each line is read by
`requests.read_line`."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflash_cli.errors import DflashError, RequestError, json_problem
from dflash_cli.protocol.params import FIELDS, show
from dflash_cli.protocol.requests import Request, read_line

BATCH_ID_PREFIX = "batch_req_"  # an OpenAI batch output line's own id


@dataclass(frozen=True)
class LineError:
    line: int
    code: str  # invalid_utf8, invalid_json, invalid_request, duplicate_id, context_length_exceeded, generation_failed
    message: str
    id: str | None = None
    batch: bool = False  # an OpenAI batch line's (custom_id, url, body)

    @classmethod
    def of(cls, request: Request, code: str, message: str) -> LineError:
        """The error of a line read as `request` (a batch line's request answers at an OpenAI endpoint)."""
        assert request.line is not None
        return cls(request.line, code, message, request.id, batch=request.endpoint is not None)

    def to_dict(self) -> dict[str, Any]:
        """The errors file's record; a batch line's takes the batch output's shape (OpenAI's error file: its
        custom_id, no response, the error), which batch readers parse, and keeps its line."""
        error = {"code": self.code, "message": self.message}
        if self.batch:
            return {"id": BATCH_ID_PREFIX + uuid.uuid4().hex, "custom_id": self.id, "response": None, "error": error,
                    "line": self.line}  # fmt: skip
        return {"line": self.line, "id": self.id, "error": error}


@dataclass(frozen=True)
class RequestFile:
    path: Path
    requests: list[Request]  # each with its `line` and `id`
    errors: list[LineError]

    @property
    def total(self) -> int:
        return len(self.requests) + len(self.errors)

    @property
    def name(self) -> str:
        """Where the requests came from, as a message names it."""
        return "standard input" if self.path == STDIN else str(self.path)


def parse_line(
    raw: bytes, number: int, default_id: Callable[[int, bytes], str], *, text_line: bool = False
) -> Request | LineError | None:
    """One line as read (bytes) -> a Request with its id, a LineError saying why not, or None for a blank line.
    `text_line`: the line is a user turn as it is (a .txt file's, as `dflash train --prompts` reads one)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return LineError(number, "invalid_utf8", f"not UTF-8: byte 0x{raw[error.start]:02x} at offset {error.start}")
    text = text.strip().lstrip("\ufeff")  # a byte order mark, as some editors write
    if not text:
        return None
    if text_line:
        return Request(messages=({"role": "user", "content": text},), line=number, id=default_id(number, raw))
    try:
        line = json.loads(text)
    except json.JSONDecodeError as error:
        return LineError(number, "invalid_json", f"not valid JSON: {json_problem(error)}")
    except RecursionError:
        return LineError(number, "invalid_json", "not valid JSON: nested too deeply")
    try:
        request = read_line(line)
    except RequestError as error:
        batch = isinstance(line, dict) and "custom_id" in line
        given = line.get("custom_id", line.get("id")) if isinstance(line, dict) else None
        return LineError(number, error.code, error.message, id=given if isinstance(given, str) else None, batch=batch)
    return replace(request, line=number, id=request.id if request.id is not None else default_id(number, raw))


STDIN = Path("<stdin>")  # read_jsonl's path for standard input (the command line's `-`; ./- names a file)


def read_jsonl(path: Path, default_id: Callable[[int, bytes], str], *, text_lines: bool | None = None) -> RequestFile:
    """Every line of `path` (`STDIN`: standard input, read to its end first), read as bytes so one bad line cannot
    stop the rest; a .txt file's lines are user turns as they are (`text_lines`: whatever its name). `default_id(number,
    raw)` names a line without an id. Every line that repeats an earlier line's id is an error (`duplicate_id`)."""
    if path == STDIN:
        if sys.stdin is None or sys.stdin.isatty():
            what = "closed" if sys.stdin is None else "a terminal, not a file or a pipe"
            raise DflashError(
                f"the requests come from standard input (-), but it is {what}",
                fix="pipe them in (cat prompts.jsonl | dflash run demo -), or pass the file's path",
            )
        return _read_lines(sys.stdin.buffer, path, default_id)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise DflashError(
            f"{path} {what}", fix="pass a JSONL file of requests, one a line (or a .txt file, one prompt a line)"
        )
    try:
        with path.open("rb") as lines:
            plain = path.suffix == ".txt" if text_lines is None else text_lines
            return _read_lines(lines, path, default_id, text_lines=plain)
    except OSError as error:
        raise DflashError(f"cannot read {path}: {error.strerror}", fix="check the file's permissions") from None


def _read_lines(
    lines: Iterable[bytes], path: Path, default_id: Callable[[int, bytes], str], *, text_lines: bool = False
) -> RequestFile:
    requests: list[Request] = []
    errors: list[LineError] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        parsed = parse_line(raw, number, default_id, text_line=text_lines)
        if isinstance(parsed, LineError):
            errors.append(parsed)
        elif parsed is not None and parsed.id in first_line:
            message = f"id {show(parsed.id)} is already used on line {first_line[parsed.id]}: ids must be unique"
            errors.append(LineError.of(parsed, "duplicate_id", message))
        elif parsed is not None:
            first_line[parsed.id] = number  # type: ignore[index]
            requests.append(parsed)
    return RequestFile(path, requests, errors)


def prompt_file_fix(token_ids: bool) -> str:
    """What a prompt file's lines look like (token ids where the command takes them)."""
    ids = ' or {"prompt_ids": [1, 2, 3]} (token ids: no tokenizer needed)' if token_ids else ""
    return (
        'one JSON object a line: {"prompt": "..."}, {"messages": [{"role": "user", "content": "..."}]}'
        f'{ids}, each optionally with an "id"'
    )


def read_prompt_file(
    path: str | Path, command: str, *, token_ids: bool = True, constraints: bool = False
) -> list[Request]:
    """A prompt set for a command that runs every prompt with its own flags (`bench --prompts`, `train`): the lines
    `dflash run` reads, a line without an id named FILE-N; a bad line, or one that sets its own sampling, is an
    error naming the line, since one result over the whole set is the point. Without `token_ids` (train renders
    text through the chat template) a prompt_ids line is one too. With `constraints` (train: what a client asks
    for shapes the answer it learns from) a line may carry tools and a response_format."""
    path = Path(path)
    if not path.exists():
        raise DflashError(f"prompt file {path} does not exist", fix=f"check the path given to `dflash {command}`")
    parsed = read_jsonl(path, lambda number, raw: f"{path.stem}-{number}")
    if parsed.errors:
        error = parsed.errors[0]
        more = f" (and {len(parsed.errors) - 1} more bad lines)" if len(parsed.errors) > 1 else ""
        raise DflashError(f"{path}:{error.line}: {error.message}{more}", fix=prompt_file_fix(token_ids))
    for prompt in parsed.requests:
        if prompt.prompt_ids is not None and not token_ids:
            raise DflashError(
                f"{path}:{prompt.line}: prompt_ids: `dflash {command}` renders text through the chat template",
                fix='give the prompt as text: {"prompt": "..."} or {"messages": [...]}',
            )
        sampling = {k for k in prompt.sampling if not (constraints and k == "grammar")}
        if sampling or prompt.endpoint is not None or (prompt.tools is not None and not constraints):
            keys = [field.key for field in FIELDS if field.attr in sampling]
            keys += ["response_format"] * ("grammar" in sampling)
            keys += ["tools"] * (prompt.tools is not None and not constraints)
            what = ", ".join(keys) or "an OpenAI batch line"
            raise DflashError(
                f"{path}:{prompt.line}: sets {what}, but `dflash {command}` runs every prompt with the same settings",
                fix="drop the field and pass it as a flag (--max-tokens, --temperature, ...)",
            )
    if not parsed.requests:
        raise DflashError(f"prompt file {path} holds no prompts", fix=prompt_file_fix(token_ids))
    return parsed.requests
