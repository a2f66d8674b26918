"""Anthropic's Messages API (what Claude Code and the `anthropic` SDK speak), torch-free: a request body read
into the one request format, and a reply rendered as Anthropic's Message, stream events and errors.

A Messages body becomes a chat completion body (system and content blocks as chat messages, tool_use and
tool_result as tool_calls and tool turns, thinking blocks as reasoning passed back, tools and tool_choice as
OpenAI's) and is read by `requests.read_translated`, so it takes the same checks as /v1/chat/completions; an error
names the field as the Messages body has it.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dflash_cli.errors import RequestError
from dflash_cli.protocol.params import read_number
from dflash_cli.protocol.replies import Ending, Part, Prompt
from dflash_cli.protocol.requests import CHAT_URL, OMITTED, Request, read_translated, refuse_misspelt, show
from dflash_cli.protocol.tools import ToolCall

MESSAGES_URL, COUNT_TOKENS_URL = "/v1/messages", "/v1/messages/count_tokens"

# a chat body's field names, as a Messages body has them (requests.read_translated)
FIELD_NAMES = (
    (r"^stop$", "stop_sequences"),
    (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"^tools\[(\d+)\]\.function\.name", r"tools[\1].name"),
    (r"^tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"^parallel_tool_calls$", "tool_choice.disable_parallel_tool_use"),
    (r"^chat_template_kwargs", "thinking"),
    (r"^response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"^response_format", "output_config.format"),
)
# The Messages API's request fields (read, refused by name or ignored: a client may send any of them), and
# chat_template_kwargs (dflash's, as the chat route takes it)
FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream", "temperature", "top_p",
    "top_k", "tools", "tool_choice", "thinking", "service_tier", "container", "mcp_servers", "context_management",
    "output_config", "output_format", "inference_geo", "chat_template_kwargs",
})  # fmt: skip
# Other APIs' names for its fields, and Chat Completions fields it lacks: refused, naming what is meant
RENAMED = {
    "max_completion_tokens": "max_tokens",
    "max_output_tokens": "max_tokens",
    "max_new_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "instructions": "system",
}
CHAT_ONLY = {key: f"{CHAT_URL} (Chat Completions)" for key in ("seed", "min_p")}
# Claude Code's first system block (2.1.36+): `x-anthropic-billing-header: cc_version=...; cch=<nonce>;`, a nonce new
# each request at the very start of the prompt, where it would defeat prefix reuse; it says nothing to the model
BILLING_HEADER = "x-anthropic-billing-header:"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


@dataclass(frozen=True)
class MessagesRequest:
    """A Messages request: the one request format, and whether it asked for thinking blocks."""

    request: Request
    thinking: bool = False


def read_messages_request(body: Any, *, count_only: bool = False) -> MessagesRequest:
    """A /v1/messages body (`count_only`: a /v1/messages/count_tokens body, which sets no sampling)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {show(body)}")
    refuse_misspelt(body, FIELDS, RENAMED, CHAT_ONLY)
    if body.get("max_tokens") is None and not count_only:
        raise RequestError("max_tokens is required: the most tokens to generate", param="max_tokens")
    if body.get("mcp_servers"):
        raise RequestError("mcp_servers are not supported: this server runs no tools itself", param="mcp_servers")
    messages, names = _conversation(body)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if not count_only:
        keys = ("max_tokens", "temperature", "top_p", "top_k", "stream")
        chat.update({key: body[key] for key in keys if key in body})
        if "stop_sequences" in body:
            stops = body["stop_sequences"]
            if stops is not None and not isinstance(stops, list):  # (Anthropic's rule: a string is a 400 there)
                raise RequestError(
                    f"stop_sequences must be a list of strings, got {show(stops)}",
                    param="stop_sequences",
                    fix=f"send [{show(stops)}]" if isinstance(stops, str) else None,
                )
            chat["stop"] = stops
        output = _output_format(body)
        if output is not None:
            chat["response_format"] = output
    chat.update(_tools(body))
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if thinking is not None and kind not in ("enabled", "adaptive", "disabled"):
        raise RequestError(
            f'thinking must be {{"type": "enabled", "budget_tokens": N}} or {{"type": "disabled"}}, got '
            f"{show(thinking)}",
            param="thinking",
        )
    if kind == "enabled":  # (Anthropic's rule; the budget itself bounds nothing here: max_tokens does)
        read_number(thinking.get("budget_tokens"), "thinking.budget_tokens", integer=True, low=1024)
    # No `thinking` is no thinking in Anthropic's API, whatever the template's default (Qwen3 thinks unless told
    # not to, and its unseen reasoning would spend max_tokens); the request's own chat_template_kwargs (as the
    # chat route takes them) say otherwise where they set it.
    thinks = {"enable_thinking": kind in ("enabled", "adaptive")}  # (Qwen3's templates read it)
    own = body.get("chat_template_kwargs")
    if own is None:
        chat["chat_template_kwargs"] = thinks
    else:
        names.insert(0, (r"^chat_template_kwargs", "chat_template_kwargs"))  # (its errors are its own)
        chat["chat_template_kwargs"] = {**thinks, **own} if isinstance(own, dict) else own
    # A max_tokens past what the window leaves generates until the window is full, as Anthropic's API does since
    # Claude Sonnet 4.5 (stop_reason model_context_window_exceeded): Claude Code asks for 32,000 whatever the model.
    request = replace(read_translated(chat, [*names, *FIELD_NAMES]), cut_at_window=True)
    return MessagesRequest(request, thinking=kind in ("enabled", "adaptive"))


def _blocks(value: Any, name: str) -> list[dict[str, Any]]:
    """Content: a string (one text block) or a list of blocks, each an object with a type."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise RequestError(f"{name} must be a string or a list of content blocks, got {show(value)}", param=name)
    for j, block in enumerate(value):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(
                f'{name}[{j}] must be a content block {{"type": ...}}, got {show(block)}', param=f"{name}[{j}]"
            )
    return value


def _is_media(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") in ("image", "document")


def _refused(kind: str, where: str, allowed: str) -> RequestError:
    if kind in ("image", "document"):
        why = f"{kind} blocks are not supported: the served model reads text only"
    else:
        why = f"{kind} blocks are not supported here ({allowed})"
    return RequestError(f"{where}: {why}", param=where)


def _text(block: Mapping[str, Any], where: str, key: str = "text") -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key} must be a string, got {show(value)}", param=f"{where}.{key}")
    return value


def _text_of(value: Any, name: str, *, dropping: str | None = None) -> str:
    """Text given as a string or as text blocks (system, a tool_result's content), joined by newlines; text blocks
    that start with `dropping` are left out."""
    parts = []
    for j, block in enumerate(_blocks(value, name)):
        if block["type"] != "text":
            raise _refused(block["type"], f"{name}[{j}]", "text blocks are")
        text = _text(block, f"{name}[{j}]")
        if dropping is None or not text.startswith(dropping):
            parts.append(text)
    return "\n".join(parts)


def _conversation(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The chat messages, and the names of their fields as the Messages body has them."""
    out: list[dict[str, Any]] = []
    names: list[tuple[str, str]] = []
    if body.get("system") is not None:
        header = BILLING_HEADER if isinstance(body["system"], list) else None  # (a block of its own, as Claude Code's)
        system = _text_of(body["system"], "system", dropping=header)
        if system:
            names.append((r"^messages\[0\]", "system"))
            out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError('messages must be a non-empty list of {"role", "content"} objects', param="messages")
    last_user = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), default=-1)
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object, got {show(message)}", param=where)
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise RequestError(
                f"{where}.role must be user, assistant or system, got {show(role)}", param=f"{where}.role"
            )
        if message.get("content") in ("", []):  # (Anthropic's API refuses them too)
            raise RequestError(f"{where}.content must not be empty", param=f"{where}.content")
        if role == "system":  # mid-conversation system text (Claude Code's beta mid-conversation-system-2026-04-07)
            names.append((rf"^messages\[{len(out)}\]", where))
            out.append({"role": "system", "content": _text_of(message["content"], f"{where}.content")})
            continue
        blocks = _blocks(message.get("content"), f"{where}.content")
        if role == "user":
            turns = _user_turns(blocks, where, last=i == last_user)
        else:
            turns = [_assistant_turn(blocks, where, names, len(out))]
        for turn in turns:
            names.append((rf"^messages\[{len(out)}\]", where))
            out.append(turn)
    if out[-1]["role"] == "assistant":
        where = f"messages[{len(messages) - 1}]"
        raise RequestError(
            f"{where}: a last assistant turn (a prefill to continue) is not supported: end with a user turn",
            param=where,
        )
    if not any(message["role"] in ("user", "tool") for message in out):
        system = any(isinstance(m, dict) and m.get("role") == "system" for m in messages)
        why = ": system text alone goes in `system`" if system else ""
        raise RequestError(f"messages has no user turn{why}", param="messages")
    return out, names


def _user_turns(blocks: list[dict[str, Any]], where: str, *, last: bool) -> list[dict[str, Any]]:
    """A user message's blocks: text as a user turn, each tool_result as a tool turn, in their order. An image or
    document is refused in the `last` user message (the one the reply answers) and left out, with a line saying
    so, in earlier ones: agents resend the whole conversation, and a 400 there would end the session."""
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            if texts:
                turns.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            turns.append(_tool_result(block, at))
        elif kind in ("tool_use", "thinking", "redacted_thinking"):
            raise RequestError(f"{at}: {kind} blocks belong in assistant turns", param=at)
        elif _is_media(block) and not last:
            texts.append(OMITTED.format(kind))
        else:
            raise _refused(kind, at, "text and tool_result are, in a user turn")
    if texts or not turns:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _tool_result(block: Mapping[str, Any], at: str) -> dict[str, Any]:
    """A tool turn. An image or document the tool returned (Claude Code's Read of one) becomes a line saying it was
    left out: refused, it would end the session, as the client resends it with every turn that follows."""
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise RequestError(f"{at}.tool_use_id must be the id of a tool_use block", param=f"{at}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = [
            {"type": "text", "text": OMITTED.format(part["type"])} if _is_media(part) else part for part in content
        ]
    content = _text_of(content, f"{at}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise RequestError(f"{at}.is_error must be true or false, got {show(is_error)}", param=f"{at}.is_error")
    return {"role": "tool", "tool_call_id": tool_use_id, "content": f"Error: {content}" if is_error else content}


def _assistant_turn(
    blocks: list[dict[str, Any]], where: str, names: list[tuple[str, str]], index: int
) -> dict[str, Any]:
    """An assistant message's blocks as one turn: its text, its tool_use blocks as tool_calls, its thinking as
    reasoning_content (a template that renders it gets it back); `names` gets each call's input's name."""
    texts, calls, reasoning = [], [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            for key in ("id", "name"):
                if not isinstance(block.get(key), str) or not block[key]:
                    raise RequestError(f"{at}.{key} must be a non-empty string", param=f"{at}.{key}")
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise RequestError(f"{at}.input must be a JSON object, got {show(arguments)}", param=f"{at}.input")
            names.append((rf"^messages\[{index}\]\.tool_calls\[{len(calls)}\]\.function\.arguments", f"{at}.input"))
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind == "thinking":
            reasoning.append(_text(block, at, "thinking"))
        elif kind == "redacted_thinking":
            continue  # (encrypted by Anthropic: nothing a local model can read)
        elif kind == "tool_result":
            raise RequestError(f"{at}: tool_result blocks belong in user turns", param=at)
        else:
            raise _refused(kind, at, "text, tool_use and thinking are, in an assistant turn")
    turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    if any(reasoning):
        turn["reasoning_content"] = "\n".join(reasoning)
    return turn


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """`tools` and `tool_choice` as a chat body has them."""
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError(f"tools must be a list of tools, got {show(tools)}", param="tools")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise RequestError(f"tools[{i}] must be an object, got {show(tool)}", param=f"tools[{i}]")
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise RequestError(
                    f"tools[{i}].type: {show(kind)} is a tool Anthropic's servers define or run; this server takes custom "
                    "tools ({name, description, input_schema}) that the client runs",
                    param=f"tools[{i}].type",
                )
            function = {"name": tool.get("name")}  # (in OpenAI's order: the template renders the tool as given)
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            function["parameters"] = tool.get("input_schema")
            chat["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise RequestError(
                'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or '
                f'{{"type": "none"}}, got {show(choice)}',
                param="tool_choice",
            )
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise RequestError("tool_choice.name must name one of the tools", param="tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        disable = choice.get("disable_parallel_tool_use")
        if disable is not None:
            if not isinstance(disable, bool):
                raise RequestError(
                    f"tool_choice.disable_parallel_tool_use must be true or false, got {show(disable)}",
                    param="tool_choice.disable_parallel_tool_use",
                )
            chat["parallel_tool_calls"] = not disable
    return chat


def _output_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """Structured output (`output_config.format`, or the beta's `output_format`): a JSON schema, as a chat body's
    response_format."""
    config = body.get("output_config")
    value = config.get("format") if isinstance(config, dict) else body.get("output_format")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise RequestError(
            f'output_config.format must be {{"type": "json_schema", "schema": {{...}}}}, got {show(value)}',
            param="output_config.format",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": value.get("schema", {})}}


# -- replies ----------------------------------------------------------------------------------------------------


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def usage(prompt: Prompt | Ending, output_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` counts the prompt tokens not read from the cache (prefix reuse), as
    Anthropic's does; the whole prompt is input_tokens + cache_read_input_tokens."""
    return {
        "input_tokens": prompt.prompt_tokens - prompt.cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": prompt.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


Event = tuple[str, dict[str, Any]]  # (SSE event name, data)


class MessageEvents:
    """A reply as Anthropic's stream events, item by item (`render`); `message` is the whole Message they add up to
    (what a request without stream gets). Reasoning becomes thinking blocks when the request asked for them, and
    is left out otherwise. message_start waits for the Prompt: its usage is the final one's, cache reads known."""

    def __init__(self, *, id: str, model: str, thinking: bool, window_cut: bool = False) -> None:
        self.thinking = thinking
        self.window_cut = window_cut  # max_tokens was cut to the room the window left: a "length" end is the window
        self.message: dict[str, Any] = {
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": None,
        }
        self.open: str | None = None  # the type of the block being streamed

    def render(self, item: Prompt | Part | Ending) -> list[Event]:
        """The events of a reply's next item."""
        if isinstance(item, Prompt):
            return self.start(item)
        return self.end(item) if isinstance(item, Ending) else self.part(item)

    def start(self, prompt: Prompt) -> list[Event]:
        self.message["usage"] = usage(prompt)
        return [
            ("message_start", {"type": "message_start", "message": copy.deepcopy(self.message)}),
            ("ping", {"type": "ping"}),
        ]

    def part(self, part: Part) -> list[Event]:
        if part.kind == "call":
            assert part.call is not None
            block = {"type": "tool_use", "id": tool_use_id(part.call), "name": part.call.name, "input": {}}
            events = self._close() + self._open(block)
            block["input"] = json.loads(part.call.arguments)
            delta = {"type": "input_json_delta", "partial_json": part.call.arguments}
            return [*events, self._delta(delta), *self._close()]
        if not part.text or (part.kind == "reasoning" and not self.thinking):
            return []
        kind, key = ("thinking", "thinking") if part.kind == "reasoning" else ("text", "text")
        events = [] if self.open == kind else self._close() + self._open({"type": kind, key: "", **self._signed(kind)})
        self.message["content"][-1][key] += part.text
        return [*events, self._delta({"type": f"{kind}_delta", key: part.text})]

    @staticmethod
    def _signed(kind: str) -> dict[str, str]:
        return {"signature": ""} if kind == "thinking" else {}  # (no signature: nothing here is Anthropic's)

    def _open(self, block: dict[str, Any]) -> list[Event]:
        self.message["content"].append(block)
        self.open = block["type"]
        start = {"type": "content_block_start", "index": len(self.message["content"]) - 1, "content_block": block}
        return [("content_block_start", copy.deepcopy(start))]

    def _delta(self, delta: dict[str, Any]) -> Event:
        index = len(self.message["content"]) - 1
        return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.message["content"]) - 1})]

    def end(self, ending: Ending) -> list[Event]:
        reason = "stop_sequence" if ending.stop_sequence is not None else STOP_REASONS[ending.finish_reason]
        if reason == "max_tokens" and self.window_cut:
            reason = "model_context_window_exceeded"
        final = usage(ending, ending.output_tokens)
        self.message.update(stop_reason=reason, stop_sequence=ending.stop_sequence, usage=final)
        delta = {"stop_reason": reason, "stop_sequence": ending.stop_sequence}
        return [
            *self._close(),
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": final}),
            ("message_stop", {"type": "message_stop"}),
        ]


def error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """The status and body of an error in Anthropic's shape. The server's own load (a full queue, shutting down)
    is Anthropic's 529 overloaded_error, which its clients retry."""
    if status in (429, 503):
        status = 529
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}
