"""`dflash run PROMPTS.jsonl`: a file of generation jobs, run with the model loaded once, losing nothing.

Input lines are read by `request_files.read_jsonl`, each on its own (the one request format, shared with `serve` and
`bench`):
  {"prompt": "..."}                                      plain completion (no chat template)
  {"messages": [{"role": "user", "content": "..."}]}     chat (the model's chat template)
  {"prompt_ids": [1, 2, 3]}                              plain completion from token ids
  {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}
                                                         an OpenAI batch line; its result has the OpenAI shape
Sampling keys on a line (top level, or in an OpenAI body; params.FIELDS) override the command's flags. A line's
id is its `id` (or `custom_id`); without one it is `line-<N>-<hash of the line>`, and a resume finds that line's
result by the hash wherever the line has moved since (match_results). A line that repeats an earlier line's id is
an error; the first one runs. Blank lines are skipped.

Nothing is lost: every result is appended as one complete line and fsync'd as it completes; a re-run of the
same command skips the requests the output already holds a result for, after cutting away the torn last line a
killed run may have left; each result records what it was made from (a hash of the request, and the settings that
shape its tokens by name), and a run whose line or settings changed since refuses, naming the change, rather than
keep the old result. Results that match no line of the input are kept, with a note. Work runs shortest prompt
first, up to `--batch-size` requests decoding together (a finished one makes room for the next at once), so results
are not in input order: match them by id.
Lines that cannot run go to the errors file as {"line", "id", "error": {"code", "message"}}; each run
rewrites it (and removes it when there are none), so it always lists what is still missing.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dflash_cli.commands.run_output import (
    STDERR,
    STDOUT,
    Done,
    Errors,
    ErrorsFile,
    PrintedErrors,
    PrintedResults,
    Results,
    ResultsFile,
    default_errors_path,
    default_output_path,
)
from dflash_cli.errors import DflashError, RequestError
from dflash_cli.progress import format_duration
from dflash_cli.protocol import responses
from dflash_cli.protocol.params import sampling_settings
from dflash_cli.protocol.request_files import BATCH_ID_PREFIX, STDIN, LineError, RequestFile, read_jsonl
from dflash_cli.protocol.requests import Request
from dflash_cli.protocol.tools import ToolCall
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.recipes import Recipe

LOG_EVERY_S = 10.0  # a progress line this often where the console is not a terminal (a log, CI, nohup)
Reply = tuple[str | None, list[ToolCall]]  # a reply's content and tool calls
AUTO_ID = re.compile(r"line-\d+-([0-9a-f]{8})")  # auto_id's shape; its group: the hash of the line's text


def auto_id(number: int, raw: bytes) -> str:
    """The id of a line that has none: its line number, for people to find it, and a hash of its text, by which a
    resume finds its result after lines before it were deleted or inserted (match_results)."""
    return f"line-{number}-{hashlib.sha256(raw.strip()).hexdigest()[:8]}"


def read_requests(path: Path) -> RequestFile:
    """Every line of `path` (request_files.read_jsonl): requests with their ids, and the lines that cannot run."""
    return read_jsonl(path, auto_id)


# ---------------------------------------------------------------------------------------------------------------
# Result records


def format_openai_response(request: Request, result: Any, model: str, reply: Reply) -> dict[str, Any]:
    """A result as a line of an OpenAI batch output file."""
    endpoint = request.endpoint or ""
    content, calls = reply
    body = responses.completion(
        endpoint,
        id=responses.new_id(endpoint),
        model=model,
        text=content,
        finish_reason=result.finish_reason,
        stats=result.stats,
        tool_calls=calls,
    )
    stats = body.pop("dflash")  # beside the response, where it was before the server shared this shape
    return {
        "id": BATCH_ID_PREFIX + uuid.uuid4().hex,
        "custom_id": request.id,
        "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
        "error": None,
        "dflash": stats,
    }


@dataclass(frozen=True)
class MadeFrom:
    """What a result is made from: `hash` (request_hash: the request's input, its sampling and the target) and
    `settings`, what shapes its tokens by name (model_settings and the request's sampling; JSON values), so that a
    resume which changed one can say which."""

    hash: str
    settings: dict[str, Any]


def model_settings(options: RunOptions) -> dict[str, Any]:
    """The settings of the model that shape every result's tokens: the target, and the dtype and quantization the
    plan holds it in on this machine (a --dtype or --quant, or a plan that chose otherwise for lack of memory).
    The drafter, block size and batch size do not: decoding is lossless and batch-invariant."""
    recipe = _recipe(options)
    if recipe is None:  # no model named (only the library API allows that): nothing decodes
        return {"target": None}
    from dflash_cli.setup.hardware import detect_machine
    from dflash_cli.setup.planning import make_plan

    return plan_settings(recipe.target.id, make_plan(detect_machine(), recipe, options.overrides))


def plan_settings(target: str, plan: Any) -> dict[str, Any]:
    """model_settings of a plan: the one predicted before loading, or the one the loaded session holds."""
    quant = str(plan.weights) if plan.weights != plan.dtype else "none"  # (a checkpoint's own fp8 as stored too)
    return {"target": target, "dtype": plan.dtype, "quant": quant}


def request_hash(request: Request, options: RunOptions, model: dict[str, Any]) -> MadeFrom:
    """What a result of `request` is made from: its input, its sampling (the line's keys over the command's flags)
    and the `model` (model_settings). The hash covers the input, sampling and target (as results made before the
    settings were recorded have it); the settings name the rest. On resume, a result made from other ones is
    stale: its line or the command changed since."""
    try:
        params = options.sampling_params(**request.sampling)
        sampling: Any = dataclasses.asdict(params)
        named = sampling_settings(params)
    except (DflashError, RequestError, TypeError, ValueError):  # (such a line fails when it runs)
        sampling, named = dict(request.sampling), {}
    made_from = {
        "target": model["target"],
        "input": [
            request.messages,
            request.prompt,
            request.prompt_ids,
            dict(request.chat_template_kwargs),
            request.endpoint,
            request.tools,
        ],
        "sampling": sampling,
    }
    digest = hashlib.sha256(json.dumps(made_from, sort_keys=True, default=repr).encode()).hexdigest()[:16]
    return MadeFrom(digest, json.loads(json.dumps({**model, **named}, default=repr)))  # (as a record reads back)


def result_record(
    request: Request, result: Any, model: str, made_from: MadeFrom, reply: Reply | None = None
) -> dict[str, Any]:
    """The output line of one result; `made_from`: what it was made from (request_hash); `reply`: its content and
    tool calls (under tools; else the text)."""
    reply = reply or (result.text, [])
    made = {"request_hash": made_from.hash, "made_with": made_from.settings}
    if request.endpoint is not None:
        return {**format_openai_response(request, result, model, reply), **made}
    content, calls = reply
    tools = {"tool_calls": [call.to_dict() for call in calls]} if calls else {}
    return {
        "id": request.id,
        "text": content,
        **tools,
        "finish_reason": responses.finish_with_calls(result.finish_reason, bool(calls)),
        "prompt_tokens": result.stats.prompt_tokens,
        "completion_tokens": len(result.token_ids),
        "stats": responses.dflash_stats(result.stats),
        **made,
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
    unmatched: int = 0  # results the output already held that match no line of the input (kept)
    empty_raw: int = 0  # `prompt` lines (raw text, no chat template) a chat model ended at once
    errors: str | None = None  # the errors file, when some request failed
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a slot already held (prefix reuse): not prefilled
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
        self.cached_tokens += result.stats.cached_tokens
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


def run_jobs(
    session: Any,
    requests: list[Request],
    results: Results,
    errors: Errors,
    options: RunOptions,
    made_from: dict[str, MadeFrom],
    console: Console | None = None,
) -> Summary:
    """Generate every request, shortest prompt first, appending each result the moment it is complete.

    Up to `session.batch_size` requests decode together (engine.Batch); a finished one makes room for the next at
    once. A request that fails alone goes to the errors file; the rows of a batched step that failed (out of memory)
    run again one at a time after the rest, so a request too big to batch still gets its result."""
    import torch

    from dflash_cli.engine import GenerationResult, collect

    started = time.perf_counter()
    speculative = not options.no_spec and session.can_speculate
    summary = Summary(str(results.path), len(requests), speculative=speculative)
    work: deque[tuple[Request, list[int]]] = deque()
    for request in requests:
        try:
            prompt_ids = session.encode_request(request)
            session.request_params(options, request)  # a grammar this tokenizer cannot take fails here, by name
            work.append((request, prompt_ids))
        except DflashError as error:  # a request this model cannot take: too long, ids outside its vocabulary, ...
            code = error.code if isinstance(error, RequestError) else "invalid_request"
            errors.append(LineError.of(request, code, error.message))
            summary.failed += 1
    work = deque(sorted(work, key=lambda item: (len(item[1]), item[0].line)))
    failed_before = summary.failed  # (refused before any work: not progress)
    model = session.served_name  # as `dflash serve` names it: the recipe, or an ad-hoc target's id
    retry: list[tuple[Request, list[int]]] = []  # rows of a failed batched step: run again alone
    with _progress(console) as progress:
        task = progress.add_task("generating", total=len(work), rate="", tau="")
        in_flight: dict[Any, tuple[Request, list[int], list[int], list[str]]] = {}  # row -> request, prompt, ids, text

        logged = time.perf_counter()  # (a console that is not a terminal gets a line every LOG_EVERY_S instead)

        def show_rate() -> None:
            nonlocal logged
            tokens = summary.completion_tokens + sum(len(ids) for _, _, ids, _ in in_flight.values())
            tau = f"tau {summary.tau:.2f}" if summary.tau is not None else ""
            elapsed = time.perf_counter() - started
            progress.update(task, rate=f"{tokens / elapsed:.1f} tok/s", tau=tau)
            finished = summary.done + summary.failed - failed_before
            if console is None or console.is_terminal or not finished or time.perf_counter() - logged < LOG_EVERY_S:
                return
            logged = time.perf_counter()
            left = elapsed / finished * (len(work) + len(in_flight) + len(retry))
            console.print(
                f"generating: {finished}/{len(requests) - failed_before} done, {tokens / elapsed:.1f} tok/s"
                f"{', ' + tau if tau else ''}, {format_duration(elapsed)} elapsed, about {format_duration(left)} left",
                markup=False,
                highlight=False,
            )

        def failed(request: Request, error: BaseException) -> None:
            if not isinstance(error, Exception):  # (Ctrl-C: the run stops, resumable)
                raise error
            # A request that fails alone (too big for the device, or any failure of its own) is its error record;
            # the rest of the file goes on.
            if isinstance(error, torch.OutOfMemoryError):
                reason = f"out of memory: {error}"
            else:
                reason = getattr(error, "message", None) or f"{type(error).__name__}: {error}"
            errors.append(LineError.of(request, "generation_failed", reason.splitlines()[0]))
            summary.failed += 1
            progress.update(task, advance=1)

        # (a chat model given raw text often ends at once: said under the summary, with what to send instead)
        raw_on_chat_model = bool(getattr(session.tokenizer, "chat_template", None))
        ends = set(session.stop_token_ids)

        def done(request: Request, result: Any) -> None:
            reply = session.parse_reply(request, result.token_ids, result.text, result.finish_reason)
            results.append(result_record(request, result, model, made_from[request.id], reply))
            summary.add(result)
            raw = raw_on_chat_model and request.prompt is not None and request.endpoint is None
            if raw and len(result.token_ids) == 1 and result.token_ids[0] in ends:
                summary.empty_raw += 1  # (its end of turn first: not a stop string of the request)
            progress.update(task, advance=1)

        batch = session.batch(speculative=speculative)
        try:
            while work or not batch.idle:
                while work and batch.room > 0:
                    request, prompt_ids = work.popleft()
                    try:
                        params = session.request_params(options, request)
                        row = batch.add(prompt_ids, params)
                    except Exception as error:
                        failed(request, error)
                        continue
                    in_flight[row] = (request, prompt_ids, [], [])
                events = batch.step()
                shared = [event for _, event in events if isinstance(event, BaseException)]
                for row, event in events:
                    request, prompt_ids, ids, text = in_flight[row]
                    if isinstance(event, BaseException):
                        del in_flight[row]
                        if shared.count(event) > 1 and isinstance(event, torch.OutOfMemoryError):
                            retry.append((request, prompt_ids))  # its batch was too big, maybe not the request
                        else:
                            failed(request, event)
                        continue
                    ids += event.token_ids
                    text.append(event.text)
                    if event.finish_reason is not None:
                        del in_flight[row]
                        done(request, GenerationResult(ids, "".join(text), event.finish_reason, event.stats))
                show_rate()
        finally:
            batch.close()
        for request, prompt_ids in retry:
            try:
                params = session.request_params(options, request)
                result = collect(session.stream(prompt_ids, params, speculative=speculative))
            except Exception as error:
                failed(request, error)
                continue
            done(request, result)
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
    parsed = read_requests(STDIN if str(prompts) == "-" else Path(prompts).expanduser())
    piped = prints_results(str(prompts), None if output is None else str(output))
    output_path = STDOUT if piped else Path(output).expanduser() if output else default_output_path(parsed.path)
    if errors == "-" or (errors is None and piped):  # failures on the console
        errors_path = None
    else:
        errors_path = Path(errors).expanduser() if errors else default_errors_path(output_path)
    if not piped and output_path.resolve() in (parsed.path.resolve(), errors_path and errors_path.resolve()):
        raise DflashError(f"the output file {output_path} is also the input or errors file", fix="pass another -o")
    if errors_path is not None and errors_path.resolve() == parsed.path.resolve():  # rewritten each run
        raise DflashError(f"the errors file {errors_path} is also the input file", fix="pass another --errors")
    if not parsed.requests and parsed.errors and all(error.code == "invalid_json" for error in parsed.errors):
        raise DflashError(  # (a text file of prompts, most likely: refused before a model loads or a file is made)
            f"no line of {parsed.name} is JSON (line {parsed.errors[0].line}: {parsed.errors[0].message}): `dflash run` "
            "reads one JSON request a line",
            fix="name a file of one prompt a line *.txt, or write each prompt as "
            '{"messages": [{"role": "user", "content": "..."}]} (a chat turn) or {"prompt": "..."} (plain completion)',
        )
    say = console.print if console is not None else (lambda *args: None)
    if parsed.total == 0:
        say(f"{escape(parsed.name)} has no requests: nothing to do")
        return Summary(str(output_path), 0)
    recipe = _recipe(options)
    model = model_settings(options)
    made_from = {request.id: request_hash(request, options, model) for request in parsed.requests}
    with PrintedResults() if piped else ResultsFile(output_path) as results:
        matched, unmatched = match_results(parsed.requests, made_from, results.resume.done)
        _refuse_stale_results(results.path, matched, made_from)
        with ErrorsFile(errors_path) if errors_path else PrintedErrors(console) as error_log:
            # (the mode this run decodes in, true even when it has nothing left to decode)
            speculative = not options.no_spec and recipe is not None and recipe.drafter is not None
            summary = _resume_and_run(
                results, error_log, parsed, set(matched), unmatched, options, made_from, speculative, console, load
            )
        resume = results.resume
    summary.total, summary.skipped, summary.repaired_bytes = parsed.total, len(matched), resume.repaired_bytes
    summary.unmatched = len(unmatched)
    summary.failed += len(parsed.errors)
    summary.errors = str(errors_path or STDERR) if summary.failed else None
    summary.wall_s = time.perf_counter() - started
    return summary


def prints_results(prompts: str, output: str | None) -> bool:
    """Whether the results go to standard output: `-o -`, or requests read from standard input (`-`) without -o."""
    return output == "-" or (output is None and prompts == "-")


def match_results(
    requests: list[Request], made_from: dict[str, MadeFrom], done: list[Done]
) -> tuple[dict[str, Done], list[Done]]:
    """Each request's result among those the output holds (`done`), by request id, and the results no request has.

    A line with an id has the result of that id. A line without one finds its result by the hash of its text that
    its auto id ends in, wherever it has moved since (a line deleted or inserted above it renumbers it), one result
    to a line: n identical lines have n results. Where several could be a line's, the one with its id and
    request_hash is taken first, then one with its request_hash, then its id (refused as stale), then any."""
    candidates: dict[tuple[str, str], list[Done]] = defaultdict(list)
    for result in done:
        candidates[_result_key(result.id)].append(result)
    preferences: tuple[Callable[[Request, Done], bool], ...] = (
        lambda request, result: result.id == request.id and result.made_from == made_from[request.id].hash,
        lambda request, result: result.made_from == made_from[request.id].hash,
        lambda request, result: result.id == request.id,
        lambda request, result: True,
    )
    matched: dict[str, Done] = {}
    for prefer in preferences:
        for request in requests:
            left = candidates.get(_result_key(request.id), [])
            if request.id in matched or not left:
                continue
            index = next((i for i, result in enumerate(left) if prefer(request, result)), None)
            if index is not None:
                matched[request.id] = left.pop(index)
    taken = {id(result) for result in matched.values()}
    return matched, [result for result in done if id(result) not in taken]


def _result_key(request_id: str) -> tuple[str, str]:
    """What a result is found by: an auto id's hash of its line's text (the line may have moved), else the id."""
    auto = AUTO_ID.fullmatch(request_id)
    return ("text", auto[1]) if auto else ("id", request_id)


def _refuse_stale_results(path: Path, matched: dict[str, Done], made_from: dict[str, MadeFrom]) -> None:
    """A result the output holds for a request that has changed since (its line, or the command's settings that
    shape its tokens; `matched`: match_results, `made_from`: each request's) would be skipped as done: refuse,
    before anything is written, naming what changed as "max_tokens 64 -> 32"."""
    stale = [
        request_id
        for request_id, result in matched.items()
        if result.made_from not in (None, made_from[request_id].hash)
        or result.made_with not in (None, made_from[request_id].settings)
    ]
    if not stale:
        return
    changes: dict[str, None] = {}  # (ordered, each change once)
    lines = unknown = 0
    for request_id in stale:
        made_with = matched[request_id].made_with
        if made_with is None:  # (a result of an earlier version: its settings were not recorded)
            unknown += 1
            continue
        changed = _changed_settings(made_with, made_from[request_id].settings)
        changes.update(dict.fromkeys(changed))
        lines += not changed  # the same settings, another hash: its input changed
    reasons = [f"with other settings ({', '.join(changes)})"] * bool(changes)
    reasons += ["from another version of their line"] * bool(lines)
    reasons += ["from another line or other settings"] * bool(unknown)
    shown = ", ".join(str(request_id) for request_id in stale[:3]) + (", ..." if len(stale) > 3 else "")
    back = "run with the settings they were made with to finish it, or " if changes else ""
    raise DflashError(
        f"{len(stale)} result(s) in {path} were made {' and '.join(reasons)} (ids {shown}): resuming would mix "
        "them with this run's",
        fix=f"{back}write this run's results to another file with -o (or delete those results to run them again)",
    )


def _check_loaded_plan(session: Any, made_from: dict[str, MadeFrom], done: set[str], output: Path) -> None:
    """The plan predicted before loading (model_settings: what made_from records and the resume was checked
    against) is the one loaded, most likely; where it is not (a GPU whose free memory the loading itself took,
    so int8 where bf16 was predicted), the results to come record the loaded one, and a resume with results of the
    predicted one is refused rather than mix them in one file."""
    predicted = next(iter(made_from.values())).settings
    loaded = plan_settings(predicted["target"], session.plan)
    changed = _changed_settings({key: predicted.get(key) for key in loaded}, loaded)
    if not changed:
        return
    if done:
        raise DflashError(
            f"the model loaded in another plan than predicted ({', '.join(changed)}): the {len(done)} results in "
            f"{output} were made with the predicted one",
            fix="pass --dtype and --quant as the results have them (their made_with), or -o another file",
        )
    for request_id, made in made_from.items():
        made_from[request_id] = MadeFrom(made.hash, {**made.settings, **loaded})


def _changed_settings(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each setting that differs, as "name before -> now" (as `train --resume` names changed flags)."""

    def shown(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value)

    return [
        f"{name} {shown(before.get(name))} -> {shown(now.get(name))}"
        for name in dict.fromkeys([*before, *now])
        if before.get(name) != now.get(name)
    ]


def _resume_and_run(
    results: Results,
    error_log: Errors,
    parsed: RequestFile,
    done: set[str],
    unmatched: list[Done],
    options: RunOptions,
    made_from: dict[str, MadeFrom],
    speculative: bool,
    console: Console | None,
    load: Callable[[RunOptions, Console | None], Any] | None,
) -> Summary:
    """Say what the output already holds (`done`: the ids of requests with a result; `unmatched`: results of no
    request), then load the model and generate the rest, if any."""
    say = console.print if console is not None else (lambda *args: None)
    output_path = results.path
    resume = results.resume
    if resume.repaired_bytes:
        say(
            f"[yellow]repaired[/] {escape(str(output_path))}: cut a torn last line ({resume.repaired_bytes} "
            "bytes) left by an interrupted run; its request runs again"
        )
    if unmatched:  # (another input's results, most likely: -o named the wrong file; or lines deleted since)
        shown = ", ".join(result.id for result in unmatched[:3]) + (", ..." if len(unmatched) > 3 else "")
        say(
            f"[yellow]note:[/] {escape(str(output_path))} holds {len(unmatched)} result(s) that match no line of "
            f"{escape(parsed.name)} (ids {escape(shown)}): results of another input, of lines deleted since, or "
            "extra copies; they are kept, and this run's results are added beside them (-o another file to keep "
            "them apart)"
        )
    pending = [request for request in parsed.requests if request.id not in done]
    if done:
        say(f"resuming: {len(done)} of {len(parsed.requests)} requests are already in {escape(str(output_path))}")
    for error in parsed.errors:
        error_log.append(error)
    summary = Summary(str(output_path), 0, speculative=speculative)
    if pending:
        if load is None:
            from dflash_cli.loading.session import open_session

            load = functools.partial(open_session, batching=True, build_later=True)
        load_started = time.perf_counter()
        session = load(options, console)
        load_s = time.perf_counter() - load_started
        _check_loaded_plan(session, made_from, done, output_path)
        try:
            summary = run_jobs(session, pending, results, error_log, options, made_from, console)
        except KeyboardInterrupt:
            if output_path == STDOUT:
                say("interrupted: the results so far were printed; -o FILE keeps them, so that a re-run resumes")
            else:
                say(f"interrupted: the results so far are in {escape(str(output_path))}; re-run to finish")
            raise
        summary.load_s = load_s
    elif not parsed.errors:
        say("every request is already done: nothing to do")
    return summary


def _recipe(options: RunOptions) -> Recipe | None:
    try:
        return options.resolve_recipe()
    except DflashError:  # no model named (only the library API allows that): nothing was decoded either way
        return None


def split_positionals(options: RunOptions, prompts: str | None) -> tuple[RunOptions, str]:
    """`dflash run prompts.jsonl --target X`: the one positional lands in NAME (the recipe); move it over."""
    name = options.recipe_name
    if prompts is None and name is not None and not name.endswith(".toml"):
        if name == "-" or name.endswith((".jsonl", ".json")) or Path(name).expanduser().is_file():
            if options.target is None and options.recipe_file is None:
                raise DflashError(
                    "no model given: the recipe comes before the prompts file",
                    fix=f"dflash run demo {name} (any recipe of `dflash recipes list`), or --target X --drafter Y",
                )
            return dataclasses.replace(options, recipe_name=None), name
    if prompts is None:
        model = name or (f"--target {options.target}" if options.target else "demo")
        raise DflashError(
            "no prompts file given: `dflash run` answers a file of prompts",
            fix=f"dflash run {model} prompts.jsonl (one JSON request a line; `dflash run --help`; - reads them from "
            f"a pipe), or `dflash chat {model}` to talk to it (as `ollama run` does)",
        )
    return options, prompts
