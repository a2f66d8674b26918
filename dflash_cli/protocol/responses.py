"""OpenAI response shapes, shared by `dflash serve` and the OpenAI batch output of `dflash run`.

Our own numbers ride along in a `dflash` object (tau, acceptance histogram, decode tok/s): OpenAI clients ignore
fields they do not know.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from dflash_cli.protocol.requests import CHAT_URL
from dflash_cli.protocol.tools import ToolCall


def new_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == CHAT_URL else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def usage(stats: Any) -> dict[str, Any]:
    """OpenAI's usage of one generation (an engine GenerationStats): `cached_tokens`, the prompt tokens its slot
    already held (prefix reuse), as OpenAI reports its prompt cache."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def dflash_stats(stats: Any) -> dict[str, Any]:
    """The numbers of one generation (an engine GenerationStats) worth keeping next to its text."""
    return {
        "speculative": stats.speculative,
        "block_size": stats.block_size,  # the largest (adaptive) or the fixed size
        "adaptive": stats.adaptive,
        "tau": round(stats.tau, 4),
        "acceptance_histogram": {str(k): v for k, v in stats.histogram.items()},
        "block_size_histogram": {str(k): v for k, v in stats.size_histogram.items()},  # verify steps per block size
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
        "ttft_s": round(stats.ttft_s, 4),
        "cached_tokens": stats.cached_tokens,  # prompt tokens reused from a slot (prefix reuse), not prefilled
        "unreused_tokens": stats.unreused_tokens,  # prompt tokens a slot held but could not continue from
        "draft_s": round(stats.draft_s, 4),  # the decode steps' drafting and verifying time (a batch's: its steps')
        "verify_s": round(stats.verify_s, 4),
        "compile_s": round(stats.compile_s, 4),  # steps that compiled (kept out of the rates and times above)
    }


def finish_with_calls(finish_reason: str, calls: bool) -> str:
    """A reply's finish reason: "tool_calls" when it carries calls and the model ended it, but "length" when
    max_tokens cut it, calls or not: a call may have been cut off with it, and only "length" tells the client so
    (OpenAI's meaning of the two)."""
    return "tool_calls" if calls and finish_reason != "length" else finish_reason


def completion(
    endpoint: str,
    *,
    id: str,
    model: str,
    text: str | None,
    finish_reason: str,
    stats: Any,
    created: int | None = None,
    tool_calls: Sequence[ToolCall] = (),
) -> dict[str, Any]:
    """A whole (not streamed) chat.completion or text_completion. With `tool_calls` the message carries them (its
    content None when the reply is only calls) and the finish reason says so (finish_with_calls)."""
    if endpoint == CHAT_URL:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = [call.to_dict() for call in tool_calls]
            finish_reason = finish_with_calls(finish_reason, True)
        kind, choice = "chat.completion", {"message": message}
    else:
        kind, choice = "text_completion", {"text": text}
    return {
        "id": id,
        "object": kind,
        "created": now() if created is None else created,
        "model": model,
        "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(stats),
        "dflash": dflash_stats(stats),
    }


def choices_of(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One text_completion answering several prompts: each body's choice at its prompt's index, with that
    generation's numbers ("dflash") inside it; the usage summed (as vLLM answers a list of prompts)."""
    merged = {key: value for key, value in bodies[0].items() if key != "dflash"}
    merged["choices"] = [
        {**body["choices"][0], "index": index, "dflash": body["dflash"]} for index, body in enumerate(bodies)
    ]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    merged["usage"] = {key: sum(body["usage"][key] for body in bodies) for key in counts}
    merged["usage"]["prompt_tokens_details"] = {
        "cached_tokens": sum(body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in bodies)
    }
    return merged


def chunk(
    endpoint: str,
    *,
    id: str,
    model: str,
    created: int,
    text: str = "",
    first: bool = False,
    finish_reason: str | None = None,
    with_usage: bool = False,
    tool_call: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk: text, a tool call's delta (`{"index", "id"?, "type"?, "function": {"name"?,
    "arguments"}}`), or the first (the assistant role) or last (finish_reason) one."""
    if endpoint == CHAT_URL:
        kind = "chat.completion.chunk"
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
        if tool_call is not None:
            delta["tool_calls"] = [tool_call]
        choice: dict[str, Any] = {"delta": delta}
    else:
        kind, choice = "text_completion", {"text": text}
    body: dict[str, Any] = {
        "id": id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage:  # OpenAI: with stream_options.include_usage every chunk has "usage", null until the last
        body["usage"] = None
    return body


def tool_call_chunks(endpoint: str, calls: Sequence[ToolCall], start: int = 0, **ids: Any) -> list[dict[str, Any]]:
    """A reply's tool calls as OpenAI streams them: per call, one chunk with its index (from `start`), id, type
    and name (arguments empty), then one with its arguments."""
    out = []
    for index, call in enumerate(calls, start):
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        out.append(chunk(endpoint, tool_call=head, **ids))
        out.append(chunk(endpoint, tool_call={"index": index, "function": {"arguments": call.arguments}}, **ids))
    return out


def usage_chunk(endpoint: str, *, id: str, model: str, created: int, stats: Any) -> dict[str, Any]:
    """The last chunk with stream_options.include_usage: no choices, the token counts (and our numbers)."""
    return {
        "id": id,
        "object": "chat.completion.chunk" if endpoint == CHAT_URL else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(stats),
        "dflash": dflash_stats(stats),
    }


def error(message: str, type: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
