"""`dflash run`'s output and errors files: results appended one complete, fsync'd line at a time under a lock (one
run per output), read back to resume (`completed_ids`: what is done, the torn last line a killed run left cut
away), and the errors file each run rewrites with the lines still missing; or, with `-o -`, results printed on
standard output and failures on the console."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from rich.console import Console
from rich.markup import escape

from dflash_cli.errors import DflashError
from dflash_cli.protocol.request_files import LineError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; two runs on one output are then the user's to avoid
    fcntl = None  # type: ignore[assignment]


STDOUT, STDERR = Path("<stdout>"), Path("<stderr>")  # where `dflash run ... -o -` writes results and failures


def default_output_path(prompts: Path) -> Path:
    return prompts.with_name(prompts.stem + ".out.jsonl")


def default_errors_path(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".jsonl").removesuffix(".out") + ".errors.jsonl")


def record_line(record: dict[str, Any]) -> bytes:
    # backslashreplace: a lone surrogate (only an input's JSON escape can make one) goes back out as that escape
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")


def append_record(file: IO[bytes], record: dict[str, Any]) -> None:
    """One complete line in one write, on disk before returning: a kill can only ever tear the last line."""
    file.write(record_line(record))
    file.flush()
    os.fsync(file.fileno())


def _record_id(record: Any) -> str | None:
    """The id of a result record (ours: `id` and `text`; an OpenAI batch line: `custom_id` and `response`)."""
    if not isinstance(record, dict):
        return None
    value = record.get("custom_id") if "response" in record else record.get("id") if "text" in record else None
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class Done:
    """A result the output holds: its id, the request_hash it was made from and the settings it was made with
    (`made_with`); None where the record has none (written by an earlier version)."""

    id: str
    made_from: str | None
    made_with: dict[str, Any] | None


@dataclass(frozen=True)
class Resume:
    done: list[Done]  # the results the output already holds, in file order
    repaired_bytes: int  # size of the torn last line cut away (0: none)

    @property
    def ids(self) -> set[str]:
        return {result.id for result in self.done}


def completed_ids(path: Path) -> Resume:
    """The ids already in the output file. A torn last line (a killed run: no newline, or not JSON) is cut away.

    A torn line before the end, or a JSON line that is no result, means the file is not (only) ours:
    DflashError, and the file is left as it is."""
    if not path.exists():
        return Resume([], 0)

    def not_ours(number: int, why: str) -> DflashError:
        return DflashError(
            f"line {number} of {path} {why}", fix="move the file aside, or write the results elsewhere with -o"
        )

    done: list[Done] = []
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
                    raise not_ours(number, "is JSON but not a dflash result (no id with a text or response)")
                made_with = record.get("made_with")
                done.append(
                    Done(request_id, record.get("request_hash"), made_with if isinstance(made_with, dict) else None)
                )
            offset += len(raw)
    if torn is None:
        return Resume(done, 0)
    with path.open("r+b") as file:
        file.truncate(torn[0])
        file.flush()
        os.fsync(file.fileno())
    return Resume(done, offset - torn[0])


def _open_for_writing(path: Path, mode: str, what: str, flag: str) -> IO[bytes]:
    """Open the `what` file (given with `flag`), or say exactly why not and how to choose another."""
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise DflashError(
            f"the {what} file {path} cannot be created: {parent} is a file, not a directory",
            fix=f"pass a path in a directory with {flag}, e.g. {flag} {parent.with_suffix('')}.{what}.jsonl",
        )
    try:
        parent.mkdir(parents=True, exist_ok=True)  # as bench --output does: a new folder for the results is usual
    except OSError as error:
        raise DflashError(
            f"the {what} directory {parent} cannot be created ({error.strerror})", fix=f"pass another {flag}"
        ) from None
    try:
        return path.open(mode)
    except IsADirectoryError:
        raise DflashError(
            f"the {what} file {path} is a directory", fix=f"pass a file path: {flag} {path}/{what}.jsonl"
        ) from None
    except OSError as error:
        raise DflashError(
            f"cannot write the {what} file {path}: {error.strerror}",
            fix=f"choose a writable path with {flag}, or fix the file's permissions",
        ) from None


class Results(Protocol):
    """Where results go: the output file (ResultsFile) or standard output (PrintedResults)."""

    path: Path
    resume: Resume

    def append(self, record: dict[str, Any]) -> None: ...


class Errors(Protocol):
    """Where failed lines go: the errors file (ErrorsFile) or the console (PrintedErrors)."""

    def append(self, error: LineError) -> None: ...


class ResultsFile:
    """The output JSONL, opened for appending under an exclusive lock (two runs must not interleave)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = _open_for_writing(path, "ab", "output", "-o")
        if fcntl is not None:
            try:
                fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.file.close()
                raise DflashError(
                    f"another dflash run is writing {path}", fix="wait for it to finish, or pass another -o"
                ) from None
        try:
            self.resume = completed_ids(path)
        except BaseException:  # not a results file of ours: let go of it (and of its lock)
            self.file.close()
            raise

    def append(self, record: dict[str, Any]) -> None:
        append_record(self.file, record)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_errors_file(path: Path) -> None:
    """Refuse to rewrite a file that is not an errors file of an earlier run: it is someone's data."""
    if not path.is_file():
        return  # nothing there yet, or something _open_for_writing explains
    records = 0
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if isinstance(record, dict) and "line" in record and isinstance(record.get("error"), dict):
                records += 1
            elif not (records and not raw.endswith(b"\n")):  # (a last line after records: torn by a killed run)
                raise DflashError(
                    f"the errors file {path} holds something else (line {number} is not a dflash error record), "
                    "and each run rewrites it",
                    fix="pass another --errors, or move the file aside",
                )


class ErrorsFile:
    """Rewritten each run (it lists what is still missing); removed at the end when it stayed empty."""

    def __init__(self, path: Path) -> None:
        self.path = path
        _check_errors_file(path)
        self.made = [folder for folder in (path.parent, *path.parent.parents) if not folder.exists()]
        self.file = _open_for_writing(path, "wb", "errors", "--errors")
        self.count = 0

    def append(self, error: LineError) -> None:
        append_record(self.file, error.to_dict())
        self.count += 1

    def close(self) -> None:
        self.file.close()
        if self.count == 0:  # (and the folders made for it: nothing left behind)
            self.path.unlink(missing_ok=True)
            for folder in self.made:
                with contextlib.suppress(OSError):  # (not empty: the output's too)
                    folder.rmdir()

    def __enter__(self) -> ErrorsFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class PrintedResults:
    """Results on standard output (`-o -`, or requests piped in): a line each, flushed as it completes; nothing to
    resume from."""

    path = STDOUT
    resume = Resume([], 0)

    def __init__(self) -> None:
        self.written = 0

    def append(self, record: dict[str, Any]) -> None:
        try:
            sys.stdout.buffer.write(record_line(record))
            sys.stdout.buffer.flush()
        except BrokenPipeError:  # the reader stopped (`| head`): the rest has nowhere to go
            raise DflashError(
                f"standard output was closed after {self.written} result(s)",
                fix="write the results to a file with -o to keep them all (a re-run then resumes)",
            ) from None
        self.written += 1

    def __enter__(self) -> PrintedResults:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


class PrintedErrors:
    """Failed lines said on the console (or as JSON lines on standard error without one), when results go to
    standard output and no --errors file was given."""

    def __init__(self, console: Console | None) -> None:
        self.console = console
        self.count = 0

    def append(self, error: LineError) -> None:
        if self.console is None:
            sys.stderr.write(json.dumps(error.to_dict(), ensure_ascii=False) + "\n")
        else:
            named = f" ({error.id})" if error.id else ""
            self.console.print(f"[red]line {error.line}[/]{escape(named)}: {escape(error.message)}")
        self.count += 1

    def __enter__(self) -> PrintedErrors:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass
