"""`dflash run PROMPTS.jsonl`: a batch job that loads the model once and loses nothing.

Input lines, each detected on its own:
  {"prompt": "..."}                                      plain completion (no chat template)
  {"messages": [{"role": "user", "content": "..."}]}     chat (the model's chat template)
  {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}
                                                         an OpenAI batch line; its result has the OpenAI shape
Sampling keys on a line (top level, or in an OpenAI body) override the command's flags: max_tokens
(or max_completion_tokens), temperature, top_p, top_k, min_p, seed, stop (a string or a list). Other keys
are ignored. A line's id is its `id` (or `custom_id`); without one it is `line-<N>-<hash of the line>`,
stable as long as the line keeps its place. Blank lines are skipped.

Nothing is lost: every result is appended as one complete line and fsync'd as it completes; a re-run of the
same command skips the ids the output already holds, after cutting away the torn last line a killed run may
have left. Work runs shortest prompt first, so results are not in input order: match them by id.
Lines that cannot run go to the errors file as {"line", "id", "error": {"code", "message"}}; each run
rewrites it (and removes it when there are none), so it always lists what is still missing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from dflash_cli.errors import DflashError, json_problem
from dflash_cli.options import RunOptions

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; two runs on one output are then the user's to avoid
    fcntl = None  # type: ignore[assignment]

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
OPENAI_KEYS = {"custom_id", "method", "url", "body"}
# line key -> engine.SamplingParams field; max_completion_tokens is OpenAI's newer name for max_tokens
SAMPLING_KEYS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop_strings",
}
INTEGER_FIELDS = {"max_new_tokens", "top_k", "seed"}


# ---------------------------------------------------------------------------------------------------------------
# Reading the input


@dataclass(frozen=True)
class Request:
    id: str
    line: int
    prompt: str | list[dict[str, str]]  # plain text, or chat messages
    params: dict[str, Any]  # the engine.SamplingParams fields this line overrides
    openai_url: str | None = None  # set for OpenAI batch lines: the result takes the OpenAI shape

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass(frozen=True)
class LineError:
    line: int
    code: str  # invalid_utf8, invalid_json, invalid_request, context_length_exceeded, generation_failed
    message: str
    id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "id": self.id, "error": {"code": self.code, "message": self.message}}


@dataclass(frozen=True)
class ParsedInput:
    path: Path
    requests: list[Request]
    errors: list[LineError]

    @property
    def total(self) -> int:
        return len(self.requests) + len(self.errors)


class _Invalid(Exception):
    """A line that parses as JSON but is not a request we can run; the message says why."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(value: Any, what: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{what} must be a string, got {_show(value)}")
    if not value and not allow_empty:
        raise _Invalid(f"{what} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Invalid(f"{what} holds an unpaired UTF-16 surrogate (a \\ud800-\\udfff escape)") from None
    return value


def _id(value: Any, key: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _text(value, key)


def _content(value: Any, what: str) -> str:
    """A message's content: a string, or OpenAI content parts of type text (joined by newlines)."""
    if isinstance(value, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in value):
            raise _Invalid(f"{what}: only text content parts are supported")
        return "\n".join(_text(part.get("text"), f"{what} text", allow_empty=True) for part in value)
    return _text(value, what, allow_empty=True)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _Invalid('"messages" must be a non-empty list of {"role", "content"} objects')
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _Invalid(f"messages[{i}] must be an object, got {_show(message)}")
        role = _text(message.get("role"), f"messages[{i}].role")
        messages.append({"role": role, "content": _content(message.get("content"), f"messages[{i}].content")})
    return messages


def _sampling(source: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams fields a line sets; JSON null means "use the default" (OpenAI clients send nulls)."""
    from dflash_cli.params import SamplingParams

    params: dict[str, Any] = {}
    for key, field in SAMPLING_KEYS.items():
        value = source.get(key)
        if value is None:
            continue
        if field == "stop_strings":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list):
                raise _Invalid(f"stop must be a string or a list of strings, got {_show(value)}")
            params[field] = tuple(_text(stop, "stop") for stop in stops)
        elif isinstance(value, bool) or not isinstance(value, int if field in INTEGER_FIELDS else (int, float)):
            kind = "an integer" if field in INTEGER_FIELDS else "a number"
            raise _Invalid(f"{key} must be {kind}, got {_show(value)}")
        else:
            params[field] = value
    if params.get("top_k") == -1:  # vLLM's spelling of "off"
        params["top_k"] = 0
    try:
        SamplingParams(**params)
    except DflashError as error:
        raise _Invalid(error.message) from None
    return params


def _openai_request(line: dict[str, Any], number: int) -> Request:
    missing = [key for key in ("custom_id", "url", "body") if key not in line]
    if missing:
        raise _Invalid(f"OpenAI batch line without {', '.join(missing)}")
    custom_id = _id(line["custom_id"], "custom_id")
    if line.get("method", "POST") != "POST":
        raise _Invalid(f'method must be "POST", got {_show(line["method"])}')
    url, body = line["url"], line["body"]
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise _Invalid(f"url {_show(url)} is not supported: use {CHAT_URL} or {COMPLETIONS_URL}")
    if not isinstance(body, dict):
        raise _Invalid(f"body must be an object, got {_show(body)}")
    if body.get("n", 1) != 1:
        raise _Invalid("n > 1 is not supported: one choice per request (repeat the line with another custom_id)")
    prompt = _messages(body.get("messages")) if url == CHAT_URL else _text(body.get("prompt"), "body.prompt")
    return Request(custom_id, number, prompt, _sampling(body), openai_url=url)


def auto_id(number: int, raw: bytes) -> str:
    return f"line-{number}-{hashlib.sha256(raw.strip()).hexdigest()[:8]}"


def _request(line: Any, number: int, raw: bytes) -> Request:
    if not isinstance(line, dict):
        raise _Invalid(f"expected a JSON object, got {_show(line)}")
    if OPENAI_KEYS & line.keys():
        return _openai_request(line, number)
    if "messages" in line and "prompt" in line:
        raise _Invalid('a line has "prompt" or "messages", not both')
    if "messages" in line:
        prompt: str | list[dict[str, str]] = _messages(line["messages"])
    elif "prompt" in line:
        prompt = _text(line["prompt"], "prompt")
    else:
        raise _Invalid(
            'unknown line shape: expected {"prompt": ...}, {"messages": [...]} '
            "or an OpenAI batch line (custom_id, method, url, body)"
        )
    request_id = _id(line["id"], "id") if line.get("id") is not None else auto_id(number, raw)
    return Request(request_id, number, prompt, _sampling(line))


def parse_line(raw: bytes, number: int) -> Request | LineError | None:
    """One input line (bytes, as read) -> a Request, a LineError saying why not, or None for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return LineError(number, "invalid_utf8", f"not UTF-8: byte 0x{raw[error.start]:02x} at offset {error.start}")
    text = text.strip().lstrip("\ufeff")  # a byte order mark, as some editors write
    if not text:
        return None
    try:
        line = json.loads(text)
    except json.JSONDecodeError as error:
        return LineError(number, "invalid_json", f"not valid JSON: {json_problem(error)}")
    except RecursionError:
        return LineError(number, "invalid_json", "not valid JSON: nested too deeply")
    try:
        return _request(line, number, raw)
    except _Invalid as error:
        given = line.get("custom_id", line.get("id")) if isinstance(line, dict) else None
        return LineError(number, error.code, str(error), id=given if isinstance(given, str) else None)


def reject_duplicate_ids(requests: list[Request], path: Path) -> None:
    lines: dict[str, list[int]] = defaultdict(list)
    for request in requests:
        lines[request.id].append(request.line)
    duplicates = [(request_id, numbers) for request_id, numbers in lines.items() if len(numbers) > 1]
    if duplicates:
        shown = "; ".join(f"{_show(i)} on lines {', '.join(map(str, n))}" for i, n in duplicates[:5])
        more = f" (and {len(duplicates) - 5} more)" if len(duplicates) > 5 else ""
        raise DflashError(
            f"duplicate ids in {path}: {shown}{more}",
            fix="give every line its own id (custom_id): results are matched to requests by id, and a re-run "
            "skips the ids already done",
        )


def read_requests(path: Path) -> ParsedInput:
    """Parse every line of `path` (bytes in, so one bad line cannot stop the rest). Raises on duplicate ids."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise DflashError(f"{path} {what}", fix="pass a JSONL file of prompts, one request per line")
    requests: list[Request] = []
    errors: list[LineError] = []
    try:
        with path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                parsed = parse_line(raw, number)
                if isinstance(parsed, Request):
                    requests.append(parsed)
                elif parsed is not None:
                    errors.append(parsed)
    except OSError as error:
        raise DflashError(f"cannot read {path}: {error.strerror}", fix="check the file's permissions") from None
    reject_duplicate_ids(requests, path)
    return ParsedInput(path, requests, errors)


# ---------------------------------------------------------------------------------------------------------------
# The output and errors files


def default_output_path(prompts: Path) -> Path:
    return prompts.with_name(prompts.stem + ".out.jsonl")


def default_errors_path(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".jsonl").removesuffix(".out") + ".errors.jsonl")


def append_record(file: IO[bytes], record: dict[str, Any]) -> None:
    """One complete line in one write, on disk before returning: a kill can only ever tear the last line."""
    # backslashreplace: a lone surrogate (only an input's JSON escape can make one) goes back out as that escape
    file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace"))
    file.flush()
    os.fsync(file.fileno())


def _record_id(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    value = record.get("custom_id", record.get("id"))
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class Resume:
    ids: set[str]  # the ids the output already holds
    repaired_bytes: int  # size of the torn last line cut away (0: none)


def completed_ids(path: Path) -> Resume:
    """The ids already in the output file. A torn last line (a killed run: no newline, or not JSON) is cut away.

    A torn line before the end, or a JSON line that is no result, means the file is not (only) ours:
    DflashError, and the file is left as it is."""
    if not path.exists():
        return Resume(set(), 0)

    def not_ours(number: int, why: str) -> DflashError:
        return DflashError(
            f"line {number} of {path} {why}", fix="move the file aside, or write the results elsewhere with -o"
        )

    ids: set[str] = set()
    offset, torn = 0, None  # torn: (offset, line number) of an unreadable line
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if torn is not None:
                raise not_ours(torn[1], "is not JSON, and more lines follow it")
            try:
                record = json.loads(raw) if raw.endswith(b"\n") else None
            except ValueError:  # not JSON, or not UTF-8
                record = None
            if record is None and raw.strip():
                torn = (offset, number)
            elif record is not None:
                request_id = _record_id(record)
                if request_id is None:
                    raise not_ours(number, "is JSON but not a dflash result (no id)")
                ids.add(request_id)
            offset += len(raw)
    if torn is None:
        return Resume(ids, 0)
    with path.open("r+b") as file:
        file.truncate(torn[0])
        file.flush()
        os.fsync(file.fileno())
    return Resume(ids, offset - torn[0])


def _open_for_writing(path: Path, mode: str, what: str) -> IO[bytes]:
    if not path.parent.is_dir():
        raise DflashError(f"the {what} directory {path.parent} does not exist", fix=f"mkdir -p {path.parent}")
    try:
        return path.open(mode)
    except IsADirectoryError:
        raise DflashError(f"the {what} file {path} is a directory", fix=f"pass a file path: -o {path}/out.jsonl")
    except OSError as error:
        raise DflashError(
            f"cannot write the {what} file {path}: {error.strerror}",
            fix="choose a writable path with -o, or fix the file's permissions",
        ) from None


class ResultsFile:
    """The output JSONL, opened for appending under an exclusive lock (two runs must not interleave)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = _open_for_writing(path, "ab", "output")
        if fcntl is not None:
            try:
                fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.file.close()
                raise DflashError(
                    f"another dflash run is writing {path}", fix="wait for it to finish, or pass another -o"
                ) from None
        self.resume = completed_ids(path)

    def append(self, record: dict[str, Any]) -> None:
        append_record(self.file, record)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ErrorsFile:
    """Rewritten each run (it lists what is still missing); removed at the end when it stayed empty."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = _open_for_writing(path, "wb", "errors")
        self.count = 0

    def append(self, error: LineError) -> None:
        append_record(self.file, error.to_dict())
        self.count += 1

    def close(self) -> None:
        self.file.close()
        if self.count == 0:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> ErrorsFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------------
# Result records


def speculation_stats(stats: Any) -> dict[str, Any]:
    """The per-request numbers from engine.GenerationStats worth keeping next to the text."""
    return {
        "speculative": stats.speculative,
        "block_size": stats.block_size,
        "tau": round(stats.tau, 4),
        "acceptance_histogram": {str(k): v for k, v in stats.histogram.items()},
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
        "ttft_s": round(stats.ttft_s, 4),
    }


def format_openai_response(request: Request, result: Any, model: str, created: int | None = None) -> dict[str, Any]:
    """A result as a line of an OpenAI batch output file (our stats ride along under "dflash")."""
    prompt_tokens, completion_tokens = result.stats.prompt_tokens, len(result.token_ids)
    if request.is_chat:
        kind, choice = "chat.completion", {"message": {"role": "assistant", "content": result.text}}
    else:
        kind, choice = "text_completion", {"text": result.text}
    body = {
        "id": ("chatcmpl-" if request.is_chat else "cmpl-") + uuid.uuid4().hex,
        "object": kind,
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": result.finish_reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    return {
        "id": "batch_req_" + uuid.uuid4().hex,
        "custom_id": request.id,
        "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
        "error": None,
        "dflash": speculation_stats(result.stats),
    }


def result_record(request: Request, result: Any, model: str) -> dict[str, Any]:
    if request.openai_url is not None:
        return format_openai_response(request, result, model)
    return {
        "id": request.id,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.stats.prompt_tokens,
        "completion_tokens": len(result.token_ids),
        "stats": speculation_stats(result.stats),
    }


# ---------------------------------------------------------------------------------------------------------------
# Running


@dataclass
class Summary:
    output: str
    total: int  # requests in the input (blank lines aside)
    done: int = 0  # generated by this run
    skipped: int = 0  # already in the output
    failed: int = 0  # in the errors file
    errors: str | None = None  # the errors file, when some request failed
    prompt_tokens: int = 0
    completion_tokens: int = 0
    accepted_tokens: int = 0  # tokens committed by verify steps (each reply's first token is not)
    verify_steps: int = 0
    speculative: bool = False
    repaired_bytes: int = 0  # a torn last line cut from the output
    load_s: float = 0.0
    generate_s: float = 0.0
    wall_s: float = 0.0

    def add(self, result: Any) -> None:
        self.done += 1
        self.prompt_tokens += result.stats.prompt_tokens
        self.completion_tokens += len(result.token_ids)
        self.accepted_tokens += sum(result.stats.acceptance_lengths)
        self.verify_steps += len(result.stats.acceptance_lengths)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.generate_s if self.generate_s > 0 else 0.0

    @property
    def tau(self) -> float | None:
        """Mean tokens per verify step over the whole run; None for the baseline."""
        return self.accepted_tokens / self.verify_steps if self.speculative and self.verify_steps else None

    @property
    def exit_code(self) -> int:
        """1 when some request has no result (see the errors file), so scripts notice."""
        return 1 if self.failed else 0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tokens_per_s": self.tokens_per_s, "tau": self.tau}


def summary_table(summary: Summary) -> Table:
    table = Table("requests", "done", "skipped", "failed", "tokens", "time", "tok/s", "mean tau", title_justify="left")
    table.title = f"dflash run: {escape(summary.output)}"
    tau = f"{summary.tau:.2f}" if summary.tau is not None else "-"
    failed = f"[red]{summary.failed}[/]" if summary.failed else "0"
    table.add_row(
        str(summary.total), str(summary.done), str(summary.skipped), failed, str(summary.completion_tokens),
        f"{summary.wall_s:.1f}s", f"{summary.tokens_per_s:.1f}", tau,
    )  # fmt: skip
    if summary.errors:
        table.caption = f"failed requests: {escape(summary.errors)}"
    return table


def _encode(session: Any, request: Request, window: int | None) -> list[int]:
    """Prompt ids; raises _Invalid for a prompt the model cannot take."""
    try:
        ids = session.encode_chat(request.prompt) if request.is_chat else session.encode_prompt(request.prompt)
    except DflashError as error:  # a template that rejects the conversation, a target with no tokenizer
        raise _Invalid(error.message) from None
    if not ids:
        raise _Invalid("the prompt encodes to no tokens")
    if window is not None and len(ids) >= window:
        message = f"the prompt is {len(ids)} tokens, but the model's context window is {window}"
        raise _Invalid(message, code="context_length_exceeded")
    return ids


def _counting(steps: Iterator[Any], on_tokens: Callable[[int], None]) -> Iterator[Any]:
    """Pass the steps through, reporting the request's tokens so far (the live tokens/s)."""
    count = 0
    for step in steps:
        count += len(step.token_ids)
        on_tokens(count)
        yield step


def _progress(console: Console | None) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TextColumn("{task.fields[tau]}"),
        TimeRemainingColumn(),
        console=console,
        disable=console is None,
    )


def run_batch(
    session: Any,
    requests: list[Request],
    results: ResultsFile,
    errors: ErrorsFile,
    options: RunOptions,
    console: Console | None = None,
) -> Summary:
    """Generate every request, shortest prompt first, appending each result the moment it is complete.

    The order only changes when results appear (short ones early); the engine decodes one request at a time."""
    import torch

    from dflash_cli.engine import collect, context_window

    started = time.perf_counter()
    speculative = not options.no_spec and session.can_speculate
    summary = Summary(str(results.path), len(requests), speculative=speculative)
    window = context_window(session.target)
    work = []
    for request in requests:
        try:
            work.append((request, _encode(session, request, window)))
        except _Invalid as error:
            errors.append(LineError(request.line, error.code, str(error), request.id))
            summary.failed += 1
    work.sort(key=lambda item: (len(item[1]), item[0].line))
    model = session.recipe.target.id
    with _progress(console) as progress:
        task = progress.add_task("generating", total=len(work), rate="", tau="")

        def on_tokens(in_flight: int) -> None:
            rate = (summary.completion_tokens + in_flight) / (time.perf_counter() - started)
            tau = f"tau {summary.tau:.2f}" if summary.tau is not None else ""
            progress.update(task, rate=f"{rate:.1f} tok/s", tau=tau)

        for request, prompt_ids in work:
            params = session.sampling_params(options, **request.params)
            try:
                result = collect(_counting(session.stream(prompt_ids, params, speculative=speculative), on_tokens))
            except (DflashError, torch.OutOfMemoryError) as error:
                # One request too big for the device fails alone; the rest of the batch goes on.
                if isinstance(error, torch.OutOfMemoryError) and torch.cuda.is_available():
                    torch.cuda.empty_cache()
                reason = getattr(error, "message", None) or f"out of memory: {error}".splitlines()[0]
                errors.append(LineError(request.line, "generation_failed", reason, request.id))
                summary.failed += 1
                progress.update(task, advance=1)
                continue
            results.append(result_record(request, result, model))
            summary.add(result)
            progress.update(task, advance=1)
    summary.generate_s = time.perf_counter() - started
    return summary


def run_file(
    options: RunOptions,
    prompts: str | Path,
    output: str | Path | None = None,
    errors: str | Path | None = None,
    console: Console | None = None,
    load: Callable[[RunOptions, Console | None], Any] | None = None,
) -> Summary:
    """The whole job: parse every line (no model yet), open the output (resume), load once, generate.

    `load` opens the session (default: session.open_session); it is called only when there is work to do."""
    started = time.perf_counter()
    parsed = read_requests(Path(prompts).expanduser())
    output_path = Path(output).expanduser() if output else default_output_path(parsed.path)
    errors_path = Path(errors).expanduser() if errors else default_errors_path(output_path)
    if output_path.resolve() in (parsed.path.resolve(), errors_path.resolve()):
        raise DflashError(f"the output file {output_path} is also the input or errors file", fix="pass another -o")
    say = console.print if console is not None else (lambda *args: None)
    if parsed.total == 0:
        say(f"{escape(str(parsed.path))} has no requests: nothing to do")
        return Summary(str(output_path), 0)
    with ResultsFile(output_path) as results, ErrorsFile(errors_path) as error_log:
        resume = results.resume
        if resume.repaired_bytes:
            say(
                f"[yellow]repaired[/] {escape(str(output_path))}: cut a torn last line ({resume.repaired_bytes} "
                "bytes) left by an interrupted run; its request runs again"
            )
        pending = [request for request in parsed.requests if request.id not in resume.ids]
        skipped = len(parsed.requests) - len(pending)
        if skipped:
            say(f"resuming: {skipped} of {len(parsed.requests)} requests are already in {escape(str(output_path))}")
        for error in parsed.errors:
            error_log.append(error)
        summary = Summary(str(output_path), 0)
        if pending:
            if load is None:
                from dflash_cli.session import open_session as load
            load_started = time.perf_counter()
            session = load(options, console)
            load_s = time.perf_counter() - load_started
            try:
                summary = run_batch(session, pending, results, error_log, options, console)
            except KeyboardInterrupt:
                say(f"interrupted: the results so far are in {escape(str(output_path))}; re-run to finish")
                raise
            summary.load_s = load_s
        elif not parsed.errors:
            say("every request is already done: nothing to do")
    summary.total, summary.skipped, summary.repaired_bytes = parsed.total, skipped, resume.repaired_bytes
    summary.failed += len(parsed.errors)
    summary.errors = str(errors_path) if summary.failed else None
    summary.wall_s = time.perf_counter() - started
    return summary


def split_positionals(options: RunOptions, prompts: str | None) -> tuple[RunOptions, str]:
    """`dflash run prompts.jsonl --target X`: the one positional lands in NAME (the recipe); move it over."""
    name = options.recipe_name
    if prompts is None and name is not None and not name.endswith(".toml"):
        if name.endswith((".jsonl", ".json")) or Path(name).expanduser().is_file():
            return dataclasses.replace(options, recipe_name=None), name
    if prompts is None:
        raise DflashError(
            "no prompts file given",
            fix="dflash run qwen3-8b prompts.jsonl (one JSON request a line; see `dflash run --help`)",
        )
    return options, prompts
