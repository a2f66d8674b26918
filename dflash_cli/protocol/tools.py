"""Tool calling, torch-free: the request's tools, and each model family's tool-call text turned back into OpenAI
`tool_calls`.

A recipe names its model's format (`tool_parser`): `hermes` (Qwen3 and Hermes-style models: `<tool_call>` + JSON),
`qwen3_coder` (Qwen3.5/3.6 and Qwen3-Coder: `<tool_call><function=NAME><parameter=KEY>`), `llama3_json` (Llama 3.1:
a JSON object, maybe after `<|python_tag|>`), `gemma4` (`<|tool_call>call:NAME{key:value}<tool_call|>`) or
`harmony` (gpt-oss: a `commentary` message addressed `to=functions.NAME`). Each format parses a whole reply into
content and calls; a reply that does not parse is content, never an error. The text a format reads is decoded
with the special tokens kept (they delimit calls), without the end-of-turn token.

A model whose chat template renders no tools (the demo's SmolLM2) gets them in the hermes format, written into
the system message by `hermes_system_prompt`, and its replies are parsed as hermes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dflash_cli.errors import RequestError
from dflash_cli.protocol.params import show
from dflash_cli.protocol.schemas import read_parameters, read_schema


@dataclass(frozen=True)
class Tools:
    """The request's tools (as sent: `{"type": "function", "function": {...}}`), and how they may be used:
    `choice` is "auto", "required", or the name of the one function the reply must call."""

    functions: tuple[Mapping[str, Any], ...]
    choice: str = "auto"
    parallel: bool = True
    # the request field they came in, as the user wrote it (for errors; not what a result is made from)
    field: str = dataclasses.field(default="tools", repr=False, compare=False)

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def enforced(self) -> tuple[int, ...]:
        """The functions a forced call's grammar holds (their parameters followed exactly): every one under
        "required", the named one; none under "auto" (the model reads them, nothing enforces them)."""
        if not self.forced:
            return ()
        names = [tool["function"]["name"] for tool in self.functions]
        return tuple(range(len(names))) if self.choice == "required" else (names.index(self.choice),)

    def schema(self, name: str) -> Mapping[str, Any]:
        for tool in self.functions:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {}
        return {}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def read_tools(body: Mapping[str, Any], prefix: str = "") -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of an OpenAI request, checked. None: no tools (or
    tool_choice "none": the reply is text)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise RequestError(f"{prefix}tool_choice needs tools", param=prefix + "tool_choice")
        return None
    if not isinstance(tools, list):
        raise RequestError(f"{prefix}tools must be a list of function tools", param=prefix + "tools")
    names = []
    for i, tool in enumerate(tools):
        where = f"{prefix}tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", function["name"]):
            raise RequestError(
                f"{where}.function.name must be letters, digits, _ . - (at most 64), got {show(function['name'])}",
                param=f"{where}.function.name",
            )
        if function.get("parameters") is not None:
            read_parameters(function["parameters"], f"{where}.function.parameters")
        for key, kind, what in (("description", str, "a string"), ("strict", bool, "true or false")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                name = f"{where}.function.{key}"
                raise RequestError(f"{name} must be {what}, got {show(function[key])}", param=name)
        names.append(function["name"])
    if len(set(names)) < len(names):
        raise RequestError(f"{prefix}tools: function names must be unique", param=prefix + "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f"{prefix}parallel_tool_calls must be true or false", param=prefix + "parallel_tool_calls")
    if choice in (None, "auto"):
        mode = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        mode = "required"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        mode = choice["function"].get("name")
        if mode not in names:
            raise RequestError(
                f"{prefix}tool_choice names {show(mode)}, which is not among the tools", param=prefix + "tool_choice"
            )
    else:
        raise RequestError(
            f'{prefix}tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
            f'{{"name": ...}}}}, got {show(choice)}',
            param=prefix + "tool_choice",
        )
    # only what the template and the grammar read: a function's name, description and parameters
    functions = tuple(
        {"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}} for t in tools
    )
    read = Tools(functions, mode, parallel is not False, field=prefix + "tools")
    for i in read.enforced:  # (a grammar will follow these: what it cannot enforce is refused by name)
        if functions[i]["function"].get("parameters") is not None:
            read_schema(functions[i]["function"]["parameters"], f"{prefix}tools[{i}].function.parameters")
    return read


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _arguments(value: Any) -> str | None:
    """Arguments as JSON text of an object (a model may write the object or a string of it); None: not arguments."""
    if isinstance(value, str):
        try:
            value = json.loads(value, strict=False)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _json_call(value: Any, *keys: str) -> ToolCall | None:
    """A call written as a JSON object `{"name": ..., KEY: arguments}`, its arguments under the first of `keys` it
    has; None: not a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = _arguments(next((value[key] for key in keys if key in value), {}))
    return None if arguments is None else ToolCall(value["name"], arguments, call_id())


# -- the formats -----------------------------------------------------------------------------------------------


class ToolFormat:
    """A family's tool-call syntax. `markers`: text that opens a call (a stream holds back from there);
    `close`: what ends one call; `whole`: a reply is a call from its first character or not at all (stream
    nothing until it ends);
    `grammar`: xgrammar's name for the format, for tool_choice required / a named function (None: not offered)."""

    name = ""
    markers: tuple[str, ...] = ()
    close = ""  # what ends one call (a stream sends each call once it closes); "": the reply's end does
    whole = False
    grammar: str | None = None

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        """The reply's content (calls taken out) and its calls; no calls: the text as it is."""
        raise NotImplementedError

    def before_cut_call(self, text: str) -> str:
        """`text` of a reply max_tokens cut, less a call it opened and never closed (a format whose calls close):
        such markup is no call, and no client shows it as content. (A reply that ended by itself keeps its text:
        it may mention a tag.)"""
        if self.whole or not self.close:
            return text
        at = max((text.rfind(marker) for marker in self.markers), default=-1)
        return text[:at].rstrip() if at >= 0 and self.close not in text[at:] else text


class Hermes(ToolFormat):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call (Qwen3's template)."""

    name, markers, close, grammar = "hermes", ("<tool_call>",), "</tool_call>", "qwen_3"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        calls, blocks = [], list(self.BLOCK.finditer(text))
        for block in blocks:
            try:
                value = json.loads(block.group(1).strip(), strict=False)  # (raw newlines in strings: read)
            except ValueError:
                if block is blocks[-1] and calls and not block.group(0).endswith("</tool_call>"):
                    break  # a last call cut off (max_tokens): the complete ones stand
                return text, []
            call = _json_call(value, "arguments", "parameters")
            if call is None:
                return text, []
            calls.append(call)
        return (self.BLOCK.sub("", text).strip(), calls) if calls else (text, [])


class Qwen3Coder(ToolFormat):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`: a
    value is text, read as JSON where the function's schema says it is not a string (Qwen3.5/3.6's template)."""

    name, markers, close, grammar = "qwen3_coder", ("<tool_call>",), "</tool_call>", "qwen_3_coder"
    BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|$)", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        calls = []
        for block in self.BLOCK.finditer(text):
            name = block.group(1).strip()
            properties = tools.schema(name).get("properties", {})
            arguments = {}
            for key, value in self.PARAMETER.findall(block.group(2)):
                schema = properties.get(key) if isinstance(properties, dict) else None
                if isinstance(schema, dict) and schema.get("type") == "string":  # (a schema may be `true`)
                    arguments[key] = value
                    continue
                try:
                    arguments[key] = json.loads(value, strict=False)
                except ValueError:
                    arguments[key] = value
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False), call_id()))
        if not calls:
            return text, []
        return self.BLOCK.sub("", text).strip(), calls


class Llama3Json(ToolFormat):
    """Llama 3.1's custom tools: the whole reply is `{"name": ..., "parameters": {...}}` (several: separated by
    `;`), maybe after `<|python_tag|>`; built-in tools (`brave_search.call(...)`) stay text."""

    name, markers, whole, grammar = "llama3_json", ("<|python_tag|>", "{"), True, "llama"

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        decoder, calls, at = json.JSONDecoder(strict=False), [], 0
        while at < len(body):
            try:
                value, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _json_call(value, "parameters", "arguments")
            if call is None:
                return text, []
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return "", calls


class Gemma4(ToolFormat):
    """`<|tool_call>call:NAME{key:value,...}<tool_call|>` (Gemma 4's template): keys bare, strings between
    `<|"|>` marks, numbers, booleans and null bare, nested `{}` and `[]`."""

    name, markers, close, grammar = "gemma4", ("<|tool_call>",), "<tool_call|>", None
    BLOCK = re.compile(r"<\|tool_call>call:([\w.-]+)(\{.*?\})<tool_call\|>", re.DOTALL)
    QUOTE = '<|"|>'

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        calls = []
        for block in self.BLOCK.finditer(text):
            try:
                value, end = self._value(block.group(2), 0)
            except (ValueError, IndexError):
                return text, []
            if end != len(block.group(2)) or not isinstance(value, dict):
                return text, []
            calls.append(ToolCall(block.group(1), json.dumps(value, ensure_ascii=False), call_id()))
        return (self.BLOCK.sub("", text).strip(), calls) if calls else (text, [])

    def _value(self, s: str, i: int) -> tuple[Any, int]:
        if s.startswith(self.QUOTE, i):
            end = s.index(self.QUOTE, i + len(self.QUOTE))
            return s[i + len(self.QUOTE) : end], end + len(self.QUOTE)
        if s[i] in "{[":
            close, items, keyed = ("}" if s[i] == "{" else "]"), [], s[i] == "{"
            i += 1
            while s[i] != close:
                if keyed:
                    if s.startswith(self.QUOTE, i):
                        key, i = self._value(s, i)
                    else:
                        colon = s.index(":", i)
                        key, i = s[i:colon].strip(), colon
                    if s[i] != ":":
                        raise ValueError("expected ':'")
                    value, i = self._value(s, i + 1)
                    items.append((key, value))
                else:
                    value, i = self._value(s, i)
                    items.append(value)
                if s[i] == ",":
                    i += 1
                elif s[i] != close:
                    raise ValueError("expected ',' or a close")
            return (dict(items) if keyed else items), i + 1
        match = re.compile(r"[^,}\]]+").match(s, i)
        if match is None:
            raise ValueError("expected a value")
        word = match.group(0).strip()
        return json.loads(word) if word in ("true", "false", "null") or _is_number(word) else word, match.end()


def _is_number(word: str) -> bool:
    return re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", word) is not None


class Harmony(ToolFormat):
    """gpt-oss: messages `<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>BODY` ended by
    `<|end|>`, `<|call|>` or `<|return|>`, each after `<|start|>assistant` (the first one's is in the prompt). A
    call is a message addressed to=functions.NAME (its body the arguments); the content is the `final` channel's;
    `analysis` is reasoning, left out."""

    name, markers, whole, grammar = "harmony", ("<|channel|>", "to=functions."), True, "harmony"
    MESSAGE = re.compile(r"(.*?)<\|message\|>(.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.DOTALL)

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        if "<|message|>" not in text:
            return text, []
        content, calls = [], []
        for part in text.split("<|start|>"):
            part = part.removeprefix("assistant")
            for header, body in self.MESSAGE.findall(part):
                recipient = re.search(r"to=functions\.([\w.-]+)", header)
                if recipient:
                    arguments = _arguments(body.strip())
                    if arguments is None:
                        return text, []
                    calls.append(ToolCall(recipient.group(1), arguments, call_id()))
                elif "<|channel|>final" in header or "<|channel|>" not in header:
                    content.append(body)
        return "".join(content).strip(), calls


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Qwen3Coder(), Llama3Json(), Gemma4(), Harmony())}


# What a chat template writes for a tool call, most specific first: a template names its own format.
TEMPLATE_SIGNS = (
    ("to=functions.", "harmony"),
    ("<|tool_call>", "gemma4"),
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
)


def template_format(template: str) -> str | None:
    """The tool-call format a chat template renders calls in (for a model whose recipe names none); None: not
    one of ours."""
    return next((name for sign, name in TEMPLATE_SIGNS if sign in template), None)


def parse_reply(text: str, tools: Tools, format: str, *, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """A whole reply as (content, tool_calls): content None when the reply is only calls (OpenAI's shape). `cut`:
    max_tokens ended it (a call it left open is dropped)."""
    content, calls = FORMATS[format].parse(text, tools)
    if cut:
        content = FORMATS[format].before_cut_call(content)
    return (content or None) if calls else content, calls


class ToolStream:
    """A reply streamed under tools: `feed(text)` returns the content safe to send now (text before anything that
    may open a call); `ready()` the calls closed since it was last asked; `finish()` parses what was held back
    into (content, the calls not given out yet)."""

    def __init__(self, tools: Tools, format: str) -> None:
        self.tools, self.format = tools, FORMATS[format]
        self.text, self.sent, self.holding = "", 0, False
        self.given: list[ToolCall] = []  # calls handed out by ready()
        self.closed = 0  # the end of the last call given out

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        if self.format.whole:
            start = self.text.lstrip()
            if not start or any(m.startswith(start[: len(m)]) for m in self.format.markers):
                self.holding = bool(start) and any(start.startswith(m) for m in self.format.markers)
                return ""  # (a start that may still become a marker waits)
            self.format = _PlainText()  # the reply is text
            return self._release(len(self.text))
        at = min((i for m in self.format.markers if (i := self.text.find(m, self.sent)) >= 0), default=-1)
        if at >= 0:
            self.holding = True
            return self._release(at)
        keep = max((k for m in self.format.markers for k in range(1, len(m)) if self.text.endswith(m[:k])), default=0)
        return self._release(len(self.text) - keep)

    def _release(self, end: int) -> str:
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def ready(self) -> list[ToolCall]:
        """The calls that closed since the last time (each given out once, with its id)."""
        end = self.text.rfind(self.format.close) if self.holding and self.format.close else -1
        if end < 0 or end + len(self.format.close) <= self.closed:
            return []
        calls = self.format.parse(self.text[: end + len(self.format.close)], self.tools)[1]
        if len(calls) <= len(self.given):  # (a closed block that does not parse: it stays held)
            return []
        new, self.closed = calls[len(self.given) :], end + len(self.format.close)
        self.given += new
        return new

    def finish(self, *, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """The content not sent yet, and the calls not given out by `ready`. `cut`: max_tokens ended the reply (a
        call it left open is dropped, as `parse_reply` drops it)."""
        if not self.holding:
            return self._release(len(self.text)), []
        trim = self.format.before_cut_call if cut else (lambda text: text)
        content, calls = self.format.parse(self.text, self.tools)
        if len(calls) < len(self.given):  # what came after the calls given out does not parse: it is content
            return trim(self.text[self.closed :].strip()), []
        if not calls:  # the held text was no call after all: it is content
            return self._release(len(trim(self.text))), []
        sent = self.text[: self.sent]
        return (trim(content)[len(sent) :] if content.startswith(sent) else ""), calls[len(self.given) :]


class _PlainText(ToolFormat):
    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        return text, []


def hermes_system_prompt(tools: Tools) -> str:
    """The tools in the hermes format, for a system message (templates that render no tools)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools.functions)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def hermes_messages(messages: Sequence[Mapping[str, Any]], tools: Tools | None) -> list[dict[str, Any]]:
    """A conversation for a template without tools: the tools in the system message, assistant calls as
    `<tool_call>` text, tool results as user turns in `<tool_response>`."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False
                )
                + "\n</tool_call>"
                for c in message["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("tool_result"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_result": True})
        else:
            out.append({"role": role, "content": content})
    for message in out:
        message.pop("tool_result", None)
    if tools is not None:
        prompt = hermes_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
