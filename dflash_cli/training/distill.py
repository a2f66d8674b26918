"""Self-distillation through the engine we serve: the target answers every training prompt exactly as `dflash run`
and `dflash serve` would answer it (the plan users get: on this CPU int4 from the GGUF, stored compiled steps when
there are some, continuous batching, greedy; a prompt's tools and response_format as a client sends them), so the
drafter learns the very tokens it will be asked to predict.

Answers go to one cache file, a line each, with what produced them (`producer`): a run reads the answers its plan
would give and adds the ones missing, so several runs (and sessions) add up.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.progress import Progress

from dflash_cli.errors import DflashError, RequestError
from dflash_cli.protocol.requests import Request

ANSWERS_FILE = "answers.jsonl"
# What a user asks after the target's answer (`--follow-ups`): the second turn of a conversation, answered by the
# target like the first, so the drafter also learns how the target answers with a conversation behind it.
FOLLOW_UPS = (
    "Can you explain that more simply?",
    "Give me a concrete example.",
    "Summarize that in two sentences.",
    "What is a common mistake here?",
    "Why does that matter?",
    "Go on.",
    "How would you say that to a beginner?",
    "What should I read or try next?",
)


@dataclass
class Sample:
    """One training sequence: a prompt as the server renders it and the target's answer (its stop token
    included: the drafter learns to end answers). `features`: the target's, from `features.FeatureStore`."""

    key: str
    prompt_ids: list[int]
    response_ids: list[int]
    features: Any = None  # torch.Tensor [len(ids) - 1, n*H] bf16, a read-only mapping: clone it to change it

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def producer(session: Any) -> dict[str, str]:
    """What wrote an answer: the target and its numerics (weights, compute dtype, device kind). An answer cached by
    another producer is kept but not used (greedy answers differ at near-ties between numerics)."""
    plan = session.plan
    return {
        "target": session.recipe.target.id,
        "weights": plan.weights,
        "dtype": plan.dtype,
        "device": plan.device.split(":")[0],
    }


def answer_key(prompt_ids: Sequence[int], constraint: Any) -> str:
    """One cached answer per rendered prompt and output constraint (a response_format or forced tool call)."""
    spec = None if constraint is None else [constraint.kind, constraint.source]
    return hashlib.sha1(json.dumps({"prompt_ids": list(prompt_ids), "constraint": spec}).encode()).hexdigest()


def read_answers(path: Path, made_by: dict[str, str], max_new_tokens: int) -> dict[str, list[int]]:
    """The cached answers `made_by` wrote, by key, cut to `max_new_tokens`; an answer cut shorter than that by an
    earlier run's smaller limit does not count (it is written again)."""
    answers: dict[str, list[int]] = {}
    if not path.is_file():
        return answers
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by an interrupted run: written again
            continue
        if record.get("made_by") != made_by:
            continue
        ids = record["response_ids"]
        if record["finish_reason"] == "stop" or record["max_new_tokens"] >= max_new_tokens:
            answers[record["key"]] = ids[:max_new_tokens]
    return answers


def encode(session: Any, options: Any, requests: Sequence[Request]) -> list[tuple[Request, list[int], Any]]:
    """Each request as the server takes it: (request, prompt ids, sampling params with its grammar). A request this
    model cannot take stops the run, named by its line."""
    encoded = []
    for request in requests:
        try:
            encoded.append(
                (
                    request,
                    session.encode_request(request, prompt_as_chat=True),
                    session.request_params(options, request),
                )
            )
        except RequestError as error:
            where = f"line {request.line}" if request.line is not None else request.id or "a prompt"
            raise DflashError(f"{where} of the prompts: {error.message}", fix=error.fix) from None
    return encoded


def distill(
    session: Any,
    options: Any,
    requests: Sequence[Request],
    directory: Path,
    progress: Progress,
    what: str = "self-distillation",
) -> list[Sample]:
    """The target's greedy answers to `requests` (engine.Batch, plain steps: greedy output is the same with a
    drafter), cached in `directory/answers.jsonl` as each finishes; `options` (a RunOptions) gives the sampling
    (greedy, --max-tokens). Returns a Sample per request, in order."""
    max_new = options.sampling.max_new_tokens
    made_by = producer(session)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ANSWERS_FILE
    done = read_answers(path, made_by, max_new)
    encoded = [(answer_key(ids, params.grammar), ids, params) for _, ids, params in encode(session, options, requests)]
    todo = deque(
        sorted(
            {key: (ids, params) for key, ids, params in encoded if key not in done}.items(),
            key=lambda item: len(item[1][0]),
        )
    )
    task = progress.add_task(what, total=len(encoded), completed=len(encoded) - len(todo), info="")
    started, tokens = time.perf_counter(), 0
    batch = session.batch(speculative=False)
    in_flight: dict[Any, tuple[str, list[int], list[int]]] = {}
    try:
        with path.open("a") as out:
            while todo or not batch.idle:
                while todo and batch.room > 0:
                    key, (ids, params) = todo.popleft()
                    in_flight[batch.add(ids, params)] = (key, ids, [])
                for row, event in batch.step():
                    key, ids, answer = in_flight[row]
                    if isinstance(event, BaseException):
                        raise event
                    answer += event.token_ids
                    tokens += len(event.token_ids)
                    if event.finish_reason is None:
                        continue
                    del in_flight[row]
                    done[key] = answer
                    record = {
                        "key": key,
                        "prompt_ids": ids,
                        "response_ids": answer,
                        "max_new_tokens": max_new,
                        "finish_reason": event.finish_reason,
                        "made_by": made_by,
                    }
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                    progress.advance(task)
                rate = tokens / max(time.perf_counter() - started, 1e-9)
                progress.update(task, info=f"{rate:.0f} tok/s")
    finally:
        batch.close()
    return [Sample(key, ids, done[key]) for key, ids, _ in encoded]


def follow_ups(requests: Sequence[Request], samples: Sequence[Sample], tokenizer: Any, count: int) -> list[Request]:
    """`count` second turns per answered chat request without tools or a response format: the conversation, the
    target's answer, then a follow-up question (FOLLOW_UPS, a different one for each turn, rotated from one
    conversation to the next)."""
    out = []
    for i, (request, sample) in enumerate(zip(requests, samples)):
        answer = tokenizer.decode(sample.response_ids, skip_special_tokens=True).strip()
        if not answer or request.tools is not None or request.sampling:
            continue
        messages = request.messages or ({"role": "user", "content": request.prompt or ""},)
        for j in range(count):
            question = FOLLOW_UPS[(i + j) % len(FOLLOW_UPS)]
            turns = (*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question})
            out.append(replace(request, messages=turns, prompt=None, id=f"{request.id}+{j + 1}"))
    return out
