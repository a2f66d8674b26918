"""OpenAI's Responses API (what Codex CLI speaks), stateless, torch-free: a request body read into the one request
format, and a reply rendered as a Response object and its stream events.

A Responses body becomes a chat completion body (instructions and input items as chat messages, function_call and
custom_tool_call items and their outputs as tool_calls and tool turns, custom (freeform) tools as functions of one
string, reasoning items as reasoning passed back, `text.format` as response_format) and is read by `requests.read_translated`, so it takes the same checks as
/v1/chat/completions; an error names the field as the Responses body has it. Nothing is stored: a client resends
the conversation each turn (Codex does), and the prefix reuse of the slots makes that cheap.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dflash_cli.errors import RequestError
from dflash_cli.protocol.replies import Ending, Part, Prompt
from dflash_cli.protocol.requests import CHAT_URL, OMITTED, Request, read_translated, refuse_misspelt, show
from dflash_cli.protocol.schemas import control_character
from dflash_cli.protocol.tools import ToolCall

RESPONSES_URL = "/v1/responses"

FIELD_NAMES = (
    (r"^max_tokens$", "max_output_tokens"),
    (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"^tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"^response_format\.json_schema\.schema", "text.format.schema"),
    (r"^response_format\.json_schema", "text.format"),
    (r"^response_format", "text.format"),
)
STATELESS = "this server keeps no responses (it is stateless): send the whole conversation in `input` each turn"
# Fields whose use needs what a stateless server without tools of its own has not: refused by name when set.
REFUSED = {
    "previous_response_id": STATELESS,
    "conversation": STATELESS,
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "background": "background responses are not supported: this server answers while the request waits",
}
# The Responses API's request fields (read, echoed, refused above or ignored: a client may send any of them)
FIELDS = frozenset({
    "background", "context_management", "conversation", "include", "input", "instructions", "max_output_tokens",
    "max_tool_calls", "metadata", "model", "parallel_tool_calls", "previous_response_id", "prompt",
    "prompt_cache_key", "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store",
    "stream", "stream_options", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation",
    "user",
})  # fmt: skip
# Other APIs' names for its fields, and Chat Completions fields it lacks: refused, naming what is meant
RENAMED = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "system": "instructions",
    "response_format": "text.format",
}
CHAT_ONLY = {key: f"{CHAT_URL} (Chat Completions)" for key in ("seed", "stop", "top_k", "min_p")}
ITEMS = (
    "message, function_call, function_call_output, custom_tool_call, custom_tool_call_output and reasoning items are"
)
# Tools OpenAI's servers run, or whose calls are not function calls: not offered to the model here (Codex sends
# web_search with every request), so a request that brings them is served with its function tools.
NOT_OFFERED = {
    "web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation", "mcp", "tool_search",
    "computer", "computer_use_preview", "local_shell", "shell", "apply_patch", "programmatic_tool_calling",
}  # fmt: skip


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request: the one request format, and the settings its Response object repeats. `fills_window`:
    no max_output_tokens, so the reply may take the room the context window leaves (OpenAI's default is
    unbounded, and Codex sends none and treats a reply cut short as an error)."""

    request: Request
    echo: Mapping[str, Any] = field(default_factory=dict)
    fills_window: bool = False


def read_responses_request(body: Any) -> ResponsesRequest:
    """A /v1/responses body."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {show(body)}")
    for key, why in REFUSED.items():
        if body.get(key) not in (None, False):
            raise RequestError(f"{key}: {why}", param=key)
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs are not supported", param="top_logprobs")
    refuse_misspelt(body, FIELDS, RENAMED, CHAT_ONLY)
    messages, names = _conversation(body)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    chat.update({key: body[key] for key in ("temperature", "top_p", "stream", "parallel_tool_calls") if key in body})
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    tools, tool_names = _tools(body)
    chat.update(tools)
    text_format = _text_format(body.get("text"))
    if text_format is not None:
        chat["response_format"] = text_format
    request = read_translated(chat, [*names, *tool_names, *FIELD_NAMES])
    keys = {**request.sampling_keys, **({"max_new_tokens": "max_output_tokens"} if "max_output_tokens" in body else {})}
    request = replace(request, prompt_field="input", sampling_keys=keys)  # (for the errors of a later check)
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "reasoning": body.get("reasoning"),
        "store": False,
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
    }
    return ResponsesRequest(request, echo, fills_window=body.get("max_output_tokens") is None)


def _text(value: Any, name: str, *, media: bool = False) -> str:
    """Content: a string, or a list of text parts (input_text, output_text). Images, files and audio are refused,
    or with `media` left out with a line saying so (an earlier turn's or a tool's, which a client resends every
    turn: a 400 would end the session)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(f"{name} must be a string or a list of content parts, got {show(value)}", param=name)
    texts = []
    for j, part in enumerate(value):
        at = f"{name}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            if media:
                texts.append(OMITTED.format(kind.removeprefix("input_")))
                continue
            raise RequestError(f"{at}: {kind} is not supported: the served model reads text only", param=at)
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise RequestError(f"{at} must be an input_text or output_text part, got {show(part)}", param=at)
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise RequestError(f"{at}.text must be a string, got {show(text)}", param=f"{at}.text")
        texts.append(text)
    return "\n".join(texts)


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{where}.{key} must be a non-empty string, got {show(value)}", param=f"{where}.{key}")
    return value


def _conversation(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The chat messages, and the names of their fields as the Responses body has them. System and developer
    messages before the conversation join the instructions in one system message (templates want one, first)."""
    out: list[dict[str, Any]] = []
    names: list[tuple[str, str]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError(f"instructions must be a string, got {show(instructions)}", param="instructions")
        if instructions:
            names.append((r"^messages\[0\]", "instructions"))
            out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif not isinstance(items, list) or not items:
        raise RequestError(
            f"input must be a string or a non-empty list of items ({ITEMS.removesuffix(' are')})",
            param="input",
        )
    reasoning: list[str] = []  # a reasoning item's text, for the assistant turn that follows it
    # The user turn the reply answers: the last one, unless a tool's output comes right before it (Codex's
    # view_image attached its picture as a user message after the call's output; refusing it ends the session)
    last_user = max(
        (i for i, item in enumerate(items) if isinstance(item, dict) and item.get("role") == "user"), default=-1
    )
    before = items[last_user - 1] if last_user > 0 else None
    if isinstance(before, dict) and before.get("type") in ("function_call_output", "custom_tool_call_output"):
        last_user = -1
    for i, item in enumerate(items):
        where = "input" if isinstance(body["input"], str) else f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an item object, got {show(item)}", param=where)
        kind = item.get("type", "message")
        last = out[-1] if out else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(
                    f"{where}.role must be user, assistant, system or developer, got {show(role)}",
                    param=f"{where}.role",
                )
            content = _text(item.get("content"), f"{where}.content", media=i != last_user)
            if role in ("system", "developer") and all(m["role"] == "system" for m in out):
                if out:
                    out[0]["content"] += "\n\n" + content
                    continue
                role = "system"
            turn: dict[str, Any] = {"role": role, "content": content}
            if role == "assistant" and reasoning:
                turn["reasoning_content"], reasoning = "\n".join(reasoning), []
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "function_call":
                arguments = item.get("arguments", "{}")
            else:  # a freeform tool's call: its function's, with the input as the one argument
                text = item.get("input")
                if not isinstance(text, str):
                    raise RequestError(f"{where}.input must be a string, got {show(text)}", param=f"{where}.input")
                arguments = json.dumps({FREEFORM_INPUT: text}, ensure_ascii=False)
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": arguments},
            }
            if last is not None and last["role"] == "assistant":  # (the calls of one turn join its text)
                calls = len(last.get("tool_calls", []))
                # (before the turn's own name, which matches its calls' fields too: the first match names them)
                names.insert(0, (rf"^messages\[{len(out) - 1}\]\.tool_calls\[{calls}\]\.function", where))
                last.setdefault("tool_calls", []).append(call)
                continue
            names.append((rf"^messages\[{len(out)}\]\.tool_calls\[0\]\.function", where))
            turn = {"role": "assistant", "content": "", "tool_calls": [call]}
            if reasoning:
                turn["reasoning_content"], reasoning = "\n".join(reasoning), []
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output, called = _text(item.get("output"), f"{where}.output", media=True), _string(item, "call_id", where)
            if not any(call["id"] == called for message in out for call in message.get("tool_calls", ())):
                raise RequestError(
                    f"{where}.call_id: no function_call or custom_tool_call item before it has call_id {show(called)}",
                    param=f"{where}.call_id",
                )
            turn = {"role": "tool", "tool_call_id": called, "content": output}
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise RequestError(f"{where}.content must be a list of reasoning_text parts", param=f"{where}.content")
            reasoning += [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
            continue
        elif kind == "item_reference":
            raise RequestError(f"{where}: item_reference: {STATELESS}", param=where)
        else:
            raise RequestError(f"{where}.type: {show(kind)} items are not supported ({ITEMS})", param=f"{where}.type")
        names.append((rf"^messages\[{len(out)}\]", where))
        out.append(turn)
    return out, names


def _tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """`tools` and `tool_choice` as a chat body has them, and the names their fields have in the Responses body (a
    tool's place there differs where a namespace holds it, or a tool before it is left out)."""
    chat: dict[str, Any] = {}
    names: list[tuple[str, str]] = []
    kinds: dict[str, str] = {}  # each offered tool's kind (function or custom), by name
    tools = body.get("tools")

    def offer(tool: Mapping[str, Any], where: str) -> None:
        at = rf"^tools\[{len(chat['tools'])}\]\.function"
        if tool["type"] == "custom":  # a freeform tool (Codex's apply_patch): a function of its input text
            _string(tool, "name", where)
            names.extend([(at + r"\.parameters", f"{where}.format"), (at + r"\.", f"{where}."), (at, where)])
            chat["tools"].append(_freeform(tool))
        else:
            names.extend([(at + r"\.", f"{where}."), (at, where)])
            chat["tools"].append(_function(tool, where))
        if isinstance(tool.get("name"), str):
            kinds[tool["name"]] = tool["type"]

    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError(f"tools must be a list of function tools, got {show(tools)}", param="tools")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind == "namespace":  # its tools, called by their names (namespaces() names their calls')
                _string(tool, "name", f"tools[{i}]")
                inner = tool.get("tools")
                if not isinstance(inner, list):
                    raise RequestError(f"tools[{i}].tools must be a list of tools", param=f"tools[{i}].tools")
                for k, member in enumerate(inner):
                    if isinstance(member, dict) and member.get("type") in ("function", "custom"):
                        offer(member, f"tools[{i}].tools[{k}]")
            elif kind in ("function", "custom"):
                offer(tool, f"tools[{i}]")
            elif kind not in NOT_OFFERED:
                raise RequestError(
                    f"tools[{i}].type: {show(kind)} tools are not supported (function and custom tools, which the "
                    "client runs, are, also in a namespace; tools OpenAI's servers run are not offered to the model)",
                    param=f"tools[{i}].type",
                )
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind, name = choice.get("type"), choice.get("name")
        if kind not in ("function", "custom") or not isinstance(name, str):
            raise RequestError(
                f'tool_choice must be "none", "auto", "required", {{"type": "function", "name": ...}} or '
                f'{{"type": "custom", "name": ...}}, got {show(choice)}',
                param="tool_choice",
            )
        if name in kinds and kinds[name] != kind:
            raise RequestError(
                f"tool_choice names the {kinds[name]} tool {show(name)} as a {kind} one", param="tool_choice"
            )
        choice = {"type": "function", "function": {"name": name}}
    if choice is not None:
        chat["tool_choice"] = choice
    return chat, names


def _function(tool: Mapping[str, Any], where: str) -> dict[str, Any]:
    if isinstance(tool.get("function"), dict) and "name" not in tool:  # (the chat route's shape, sent here)
        raise RequestError(
            f"{where}: a Responses function tool is flat: its name, description and parameters sit beside its "
            'type, not in "function" (the Chat Completions shape)',
            param=f"{where}.function",
            fix='send {"type": "function", "name": ..., "parameters": {...}}',
        )
    return {
        "type": "function",
        "function": {key: tool[key] for key in ("name", "description", "parameters") if key in tool},
    }


FREEFORM_INPUT = "input"  # the one argument a freeform tool's function takes: its raw input text


def _freeform(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A custom (freeform) tool as the function the model calls: one string argument, its raw input. A regex
    format is the string's pattern (a forced call is held to it); a Lark grammar (Codex's apply_patch) is said in
    the description. Its calls go back as custom_tool_call items (`freeform_names`)."""
    description = tool.get("description") if isinstance(tool.get("description"), str) else ""
    text: dict[str, Any] = {"type": "string", "description": "the tool's whole input, as raw text"}
    form = tool.get("format")
    if isinstance(form, dict) and form.get("type") == "grammar" and isinstance(form.get("definition"), str):
        if form.get("syntax") == "regex" and _plain_regex(form["definition"]):
            text["pattern"] = form["definition"]
        else:  # (a regex of the constructs the grammar library lacks, \p{L} or (?s), is only described too)
            description += f"\n\nThe input follows this {form.get('syntax', 'lark')} grammar:\n{form['definition']}"
    parameters = {"type": "object", "properties": {FREEFORM_INPUT: text}, "required": [FREEFORM_INPUT]}
    return {
        "type": "function",
        "function": {"name": tool["name"], "description": description, "parameters": parameters},
    }


def _plain_regex(pattern: str) -> bool:
    """Whether a custom tool's regex keeps to what every regex dialect and the grammar library read alike (no
    groups with flags or lookaround, no Unicode classes or backreferences), and the grammar can hold it in a JSON
    string (no control characters: a patch's newlines would be written raw, invalid JSON)."""
    try:
        re.compile(pattern)
    except re.error:
        return False
    return re.search(r"\(\?|\\[pPkKbBAzZ1-9]", pattern) is None and control_character(pattern) is None


def freeform_names(tools: Any) -> set[str]:
    """The custom (freeform) tools among `tools` (as the body has them, namespaces' too): their calls are
    custom_tool_call items."""
    listed = [t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
    for namespace in [t for t in listed if t.get("type") == "namespace" and isinstance(t.get("tools"), list)]:
        listed += [t for t in namespace["tools"] if isinstance(t, dict)]
    return {t["name"] for t in listed if t.get("type") == "custom" and isinstance(t.get("name"), str)}


def freeform_input(arguments: str) -> str:
    """A freeform call's raw input, from the arguments its function was called with."""
    try:
        value = json.loads(arguments)[FREEFORM_INPUT]
    except (ValueError, KeyError, TypeError):  # (not the object it was offered: its text as it came)
        return arguments
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def namespaces(tools: Any) -> dict[str, str]:
    """The namespace of each function offered inside one (`tools` as the body has them): its calls name it."""
    found = {}
    for tool in tools if isinstance(tools, list) else []:
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            found |= {t["name"]: tool["name"] for t in tool["tools"] if isinstance(t, dict) and "name" in t}
    return found


def _text_format(value: Any) -> dict[str, Any] | None:
    """`text.format` as a chat body's response_format."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f'text must be an object {{"format": {{...}}}}, got {show(value)}', param="text")
    spec = value.get("format")
    kind = spec.get("type") if isinstance(spec, dict) else None
    if spec is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(spec, dict)
        return {"type": "json_schema", "json_schema": {k: spec[k] for k in ("name", "schema", "strict") if k in spec}}
    raise RequestError(
        'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name": ..., '
        f'"schema": {{...}}}}, got {show(spec)}',
        param="text.format",
    )


# -- replies ----------------------------------------------------------------------------------------------------


def new_id() -> str:
    return "resp_" + uuid.uuid4().hex


def usage(ending: Ending) -> dict[str, Any]:
    """The Responses usage: `input_tokens` the whole prompt, `cached_tokens` its part reused (prefix reuse; the
    slots are written as a matter of course, not on request: no `cache_write_tokens`), `reasoning_tokens` the
    output's that a reasoning item holds."""
    return {
        "input_tokens": ending.prompt_tokens,
        "input_tokens_details": {"cached_tokens": ending.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": ending.output_tokens,
        "output_tokens_details": {"reasoning_tokens": ending.reasoning_tokens},
        "total_tokens": ending.prompt_tokens + ending.output_tokens,
    }


Event = tuple[str, dict[str, Any]]  # (SSE event name, data)


class ResponseEvents:
    """A reply as the Responses stream events, part by part; `response` is the Response object they add up to
    (what a request without stream gets). Reasoning becomes a reasoning item; text, a message item (the SDKs'
    `output_text` joins their text: it is not on the wire)."""

    def __init__(self, *, id: str, model: str, created: int, echo: Mapping[str, Any]) -> None:
        self.response: dict[str, Any] = {
            "id": id,
            "object": "response",
            "created_at": created,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "model": model,
            "output": [],
            "previous_response_id": None,
            **echo,
            "usage": None,
        }
        self.sequence = 0
        self.open: dict[str, Any] | None = None  # the message or reasoning item being streamed
        self.namespaces = namespaces(echo.get("tools"))
        self.freeform = freeform_names(echo.get("tools"))

    def _event(self, kind: str, **fields: Any) -> Event:
        data = {"type": kind, "sequence_number": self.sequence, **copy.deepcopy(fields)}
        self.sequence += 1
        return kind, data

    def render(self, item: Prompt | Part | Ending) -> list[Event]:
        """The events of a reply's next item (the Prompt starts the Response; its usage comes at the end)."""
        if isinstance(item, Prompt):
            return self.start()
        return self.end(item) if isinstance(item, Ending) else self.part(item)

    def start(self) -> list[Event]:
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]

    def _add(self, item: dict[str, Any]) -> Event:
        self.response["output"].append(item)
        return self._event("response.output_item.added", output_index=len(self.response["output"]) - 1, item=item)

    def part(self, part: Part) -> list[Event]:
        if part.kind == "call" and part.call is not None and part.call.name in self.freeform:
            return self._custom_call(part.call)
        if part.kind == "call":
            assert part.call is not None
            events = self._close()
            index = len(self.response["output"])
            item = {
                "id": "fc_" + uuid.uuid4().hex,
                "type": "function_call",
                "status": "in_progress",
                "call_id": part.call.id,
                "name": part.call.name,
                "arguments": "",
            }
            if part.call.name in self.namespaces:
                item["namespace"] = self.namespaces[part.call.name]
            events.append(self._add(item))
            ids = {"item_id": item["id"], "output_index": index}
            item.update(arguments=part.call.arguments, status="completed")
            return [
                *events,
                self._event("response.function_call_arguments.delta", **ids, delta=part.call.arguments),
                self._event(
                    "response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"]
                ),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        if not part.text:
            return []
        kind = "reasoning" if part.kind == "reasoning" else "message"
        events = []
        if self.open is None or self.open["type"] != kind:
            events = self._close()
            index = len(self.response["output"])  # (the new item's)
            if kind == "message":
                self.open = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress"}
                self.open.update(role="assistant", content=[])
                events.append(self._add(self.open))
                text_part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.open["content"].append(text_part)
                ids = {"item_id": self.open["id"], "output_index": index, "content_index": 0}
                events.append(self._event("response.content_part.added", **ids, part=text_part))
            else:
                self.open = {"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [], "content": []}
                events.append(self._add(self.open))
                self.open["content"].append({"type": "reasoning_text", "text": ""})
        index = len(self.response["output"]) - 1
        ids = {"item_id": self.open["id"], "output_index": index, "content_index": 0}
        self.open["content"][0]["text"] += part.text
        if kind == "message":
            return [*events, self._event("response.output_text.delta", **ids, delta=part.text, logprobs=[])]
        return [*events, self._event("response.reasoning_text.delta", **ids, delta=part.text)]

    def _custom_call(self, call: ToolCall) -> list[Event]:
        """A freeform tool's call: a custom_tool_call item holding its raw input (OpenAI's events for one)."""
        events = self._close()
        index = len(self.response["output"])
        item = {"id": "ctc_" + uuid.uuid4().hex, "type": "custom_tool_call", "call_id": call.id, "name": call.name}
        item["input"] = ""
        if call.name in self.namespaces:
            item["namespace"] = self.namespaces[call.name]
        events.append(self._add(item))
        ids = {"item_id": item["id"], "output_index": index}
        item["input"] = freeform_input(call.arguments)
        return [
            *events,
            self._event("response.custom_tool_call_input.delta", **ids, delta=item["input"]),
            self._event("response.custom_tool_call_input.done", **ids, input=item["input"]),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _close(self, status: str = "completed") -> list[Event]:
        """The open item's closing events; a message cut by max_output_tokens is "incomplete", as OpenAI marks it."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.response["output"]) - 1
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        text = item["content"][0]
        if item["type"] == "message":
            item["status"] = status
            events = [
                self._event("response.output_text.done", **ids, text=text["text"], logprobs=[]),
                self._event("response.content_part.done", **ids, part=text),
            ]
        else:
            events = [self._event("response.reasoning_text.done", **ids, text=text["text"])]
        return [*events, self._event("response.output_item.done", output_index=index, item=item)]

    def end(self, ending: Ending) -> list[Event]:
        events = self._close("incomplete" if ending.finish_reason == "length" else "completed")
        if ending.finish_reason == "length":
            self.response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        else:
            self.response["status"] = "completed"
        self.response["usage"] = usage(ending)
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.response)]

    def failed(self, message: str) -> list[Event]:
        """The last event of a stream whose generation failed after it began."""
        self.response.update(status="failed", error={"code": "server_error", "message": message})
        return [self._event("response.failed", response=self.response)]
