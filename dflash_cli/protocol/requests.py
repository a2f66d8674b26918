"""The one request format: how every frontend reads a generation request.

A request is a conversation (`messages`), a plain-completion text (`prompt`) or token ids (`prompt_ids`), plus
the sampling fields of `params.FIELDS` and `chat_template_kwargs`. It arrives in three shapes:

- an OpenAI request body (`dflash serve`; the `body` of an OpenAI batch line): `read_body(body, endpoint)`;
- a JSONL line (`dflash run`, `dflash bench --prompts`): `{"prompt"}`, `{"messages"}` or `{"prompt_ids"}` with
  sampling keys beside it and an optional `id`, or an OpenAI batch line (`custom_id`, `method`, `url`, `body`):
  `read_line(obj)`; a whole file of them: request_files.py;
- a conversation alone (chat's `/load`): `read_messages(value)`.

Errors are `RequestError`s that name the field as the user wrote it. Torch-free: everything is checked before a
model loads. Turning a request into token ids is `Session.encode_request`.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dflash_cli.errors import RequestError
from dflash_cli.protocol.params import BY_KEY, Grammar, read_number, read_sampling, sampling_keys, show
from dflash_cli.protocol.schemas import read_schema
from dflash_cli.protocol.tools import Tools, read_tools

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
OPENAI_BATCH_KEYS = frozenset({"custom_id", "method", "url", "body"})
PROMPT_KEYS = ("prompt", "messages", "prompt_ids")
# An image, file or audio of an earlier turn or a tool's output, in its place (the agents' APIs: a client resends
# them every turn, and refusing them there would end the session)
OMITTED = "[{} omitted: this model reads text only]"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# apply_chat_template's own arguments: a request's chat_template_kwargs must not replace them
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _number_is(default: float) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and value == default


def _is(default: Any) -> Callable[[Any], bool]:
    return lambda value: type(value) is type(default) and value == default


# Fields that would change the answer in ways we do not implement: a value other than the default (or null) is
# refused by name rather than silently ignored. Other fields we do not read (user, metadata, store, ...) are
# ignored, as OpenAI-compatible servers do.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_number_is(1), "n must be 1: one choice per request (send several requests for several answers)"),
    "best_of": (_number_is(1), "best_of must be 1: one candidate per request"),
    # (false only: a legacy completion's logprobs 0 still asks for the chosen tokens' log probabilities)
    "logprobs": (_is(False), "logprobs are not supported"),
    "top_logprobs": (_number_is(0), "top_logprobs are not supported"),
    "echo": (_is(False), "echo is not supported"),
    "suffix": (_is(""), "suffix (fill-in-the-middle) is not supported"),
    "functions": (_is([]), "functions (the deprecated function calling) are not supported: use tools"),
    "function_call": (
        lambda v: v in ("none", "auto"),
        "function_call (the deprecated function calling) is not supported: use tool_choice",
    ),
    "logit_bias": (_is({}), "logit_bias is not supported"),
    # Samplers and penalties, ours' and other servers' (vLLM's, llama-server's), at their neutral value
    **{
        key: (_number_is(neutral), f"{key} is not supported (it would change the distribution)")
        for key, neutral in {
            "presence_penalty": 0,
            "frequency_penalty": 0,
            "repetition_penalty": 1,
            "repeat_penalty": 1,
            "typical_p": 1,
            "tfs_z": 1,
            "mirostat": 0,
            "dry_multiplier": 0,
            "xtc_probability": 0,
            "dynatemp_range": 0,
        }.items()
    },
    # Other servers' fields that change the answer: a client moving here must not believe its output is
    # constrained or shaped when nothing reads them.
    "bad_words": (_is([]), "bad_words is not supported (it would change the distribution)"),
    "min_tokens": (_number_is(0), "min_tokens is not supported: the reply may end at the model's end of sequence"),
    "ignore_eos": (_is(False), "ignore_eos is not supported: the reply ends at the model's end of sequence"),
    "stop_token_ids": (_is([]), "stop_token_ids is not supported: use stop (strings)"),
    "n_probs": (_number_is(0), "n_probs (log probabilities) is not supported"),
    "use_beam_search": (_is(False), "use_beam_search is not supported: decoding samples one sequence"),
    "allowed_token_ids": (_is([]), "allowed_token_ids is not supported: use response_format"),
    # grammars by other names (vLLM's guided_* until 0.12, structured_outputs since; llama-server's grammar and
    # json_schema, whose "" and {} mean none)
    **{
        key: (is_none, f"{key} is not supported: use response_format (a JSON schema), or tools")
        for key, is_none in {
            "grammar": _is(""),
            "json_schema": _is({}),
            **dict.fromkeys(
                ("guided_json", "guided_choice", "guided_regex", "guided_grammar", "structured_outputs"),
                lambda value: False,
            ),
        }.items()
    },
}
# The numbers among them, checked against the API's own range first: a value no API takes is told so, not that
# it is unsupported. (integer?, low, high)
UNSUPPORTED_RANGES: dict[str, tuple[bool, float, float]] = {
    "n": (True, 1, 128),
    "best_of": (True, 1, 20),
    "top_logprobs": (True, 0, 20),
    "presence_penalty": (False, -2, 2),
    "frequency_penalty": (False, -2, 2),
    "repetition_penalty": (False, 0, 2),
}
# Fields read by nobody here but typed by the API: a value of another type is refused (a client bug said early).
IGNORED_TYPES: dict[str, tuple[type, str]] = {
    "user": (str, "a string"),
    "safety_identifier": (str, "a string"),
    "prompt_cache_key": (str, "a string"),
    "service_tier": (str, "a string"),
    "store": (bool, "true or false"),
    "metadata": (dict, "an object of strings"),
}


@dataclass(frozen=True)
class Request:
    """One generation request, whichever frontend it came through."""

    messages: tuple[dict[str, Any], ...] | None = None  # a conversation, rendered with the chat template
    prompt: str | None = None  # plain completion: the text as is
    prompt_ids: tuple[int, ...] | None = None  # token ids as they are
    prompt_field: str | None = None  # the field the prompt came in, where its name says otherwise (for errors)
    sampling: Mapping[str, Any] = field(default_factory=dict)  # the SamplingParams fields it sets, by attribute
    sampling_keys: Mapping[str, str] = field(default_factory=dict)  # the key each of them came under (for errors)
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # over the recipe's own
    tools: Tools | None = None  # function tools the reply may call (rendered by the chat template)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts
    model: str | None = None
    endpoint: str | None = None  # OpenAI's endpoint, whose response shape the result takes; None: dflash's own
    id: str | None = None  # a file line's id (or custom_id)
    line: int | None = None  # a file line's number
    cut_at_window: bool = False  # a max_tokens past what the context window leaves stops there, not refused
    # A translated body's (read_translated) field names as its own API has them: for errors raised after reading
    field_names: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def prompt_key(self) -> str:
        """The field the prompt came in, for errors about it."""
        if self.prompt_field is not None:
            return self.prompt_field
        return "messages" if self.is_chat else "prompt_ids" if self.prompt_ids is not None else "prompt"


def prompt_too_long(prompt_tokens: int, window: int) -> str:
    """What every route and the engine say of a prompt that leaves no room for a reply, in Anthropic's wording
    first (as its API says it), then why."""
    return (
        f"prompt is too long: {prompt_tokens} tokens > {window - 1} maximum (the model's context window is "
        f"{window} tokens, and the reply needs one)"
    )


def check_context(request: Request, prompt_tokens: int, window: int | None) -> None:
    """A prompt of `prompt_tokens` tokens and the max_tokens the request asks for (when it does: the default is cut
    at the window, and with `cut_at_window` so is any) against the model's context window; RequestError
    (context_length_exceeded) naming the field, with the most it can ask for. Every route checks its encoded prompt
    with this."""
    if window is None:
        return
    if prompt_tokens >= window:
        raise RequestError(
            prompt_too_long(prompt_tokens, window),
            param=request.prompt_key,
            code="context_length_exceeded",
            fix="shorten the prompt",
        )
    asked, left = request.sampling.get("max_new_tokens"), window - prompt_tokens
    if asked is not None and asked > left and not request.cut_at_window:
        key = request.sampling_keys.get("max_new_tokens", "max_tokens")
        raise RequestError(
            f"{key} is {asked}, but the model's context window of {window} tokens leaves {left} after the "
            f"prompt's {prompt_tokens}: ask for at most {left}",
            param=key,
            code="context_length_exceeded",
            fix=f"set {key} to {left} or less (or leave it out: the reply then stops at the window)",
        )


def read_text(value: Any, name: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {show(value)}", param=name)
    if not value and not allow_empty:
        raise RequestError(f"{name} is empty", param=name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(
            f"{name} holds an unpaired UTF-16 surrogate (a \\ud800-\\udfff escape)", param=name
        ) from None
    return value


def _content(value: Any, name: str) -> str:
    """A message's content: a string, or OpenAI content parts of type text (joined by newlines)."""
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                what = f"{kind} parts are" if isinstance(kind, str) else f"{show(part)} is"
                why = ": the served model reads text only" if kind in ("image_url", "input_audio", "file") else ""
                raise RequestError(f"{name}[{i}]: {what} not supported, only text parts{why}", param=f"{name}[{i}]")
        return "\n".join(
            read_text(part.get("text"), f"{name}[{i}].text", allow_empty=True) for i, part in enumerate(value)
        )
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string or a list of text parts, got {show(value)}", param=name)
    return read_text(value, name, allow_empty=True)


def _tool_calls(value: Any, name: str) -> list[dict[str, Any]]:
    """An assistant turn's tool_calls, as chat templates read them: arguments as an object."""
    if not isinstance(value, list) or not value:
        raise RequestError(f"{name} must be a non-empty list of tool calls", param=name)
    calls = []
    for i, call in enumerate(value):
        where = f"{name}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(
                f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', param=where
            )
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise RequestError(
                f"{where}.function.arguments is not valid JSON", param=f"{where}.function.arguments"
            ) from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{where}.function.arguments must be a JSON object", param=f"{where}.function.arguments")
        call_id = call.get("id")
        calls.append(
            {
                "id": call_id if isinstance(call_id, str) else f"call_{i}",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def read_messages(value: Any, name: str = "messages") -> tuple[dict[str, Any], ...]:
    """A conversation: a non-empty list of {"role": system|developer|user|assistant|tool, "content": text}; an
    assistant turn may carry tool_calls (its content null), a tool turn its tool_call_id."""
    if not isinstance(value, list) or not value:
        raise RequestError(f'{name} must be a non-empty list of {{"role", "content"}} objects', param=name)
    messages = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object, got {show(message)}", param=where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise RequestError(
                f"{where}.role must be {', '.join(ROLES)}, got {show(role)} (function messages are not supported: "
                "use tool)",
                param=f"{where}.role",
            )
        if message.get("function_call"):
            raise RequestError(
                f"{where}.function_call: the deprecated function calling is not supported: use tool_calls",
                param=f"{where}.function_call",
            )
        calls = message.get("tool_calls")
        if calls and role != "assistant":
            raise RequestError(f"{where}.tool_calls: only assistant turns call tools", param=f"{where}.tool_calls")
        content = message.get("content")
        turn: dict[str, Any] = {
            "role": ROLES[role],
            "content": "" if content is None and calls else _content(content, f"{where}.content"),
        }
        if calls:
            turn["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if role == "assistant" and message.get("reasoning_content"):  # passed back (templates that render it)
            turn["reasoning_content"] = read_text(message["reasoning_content"], f"{where}.reasoning_content")
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise RequestError(f"{where}.{key} must be a string, got {show(message[key])}", param=f"{where}.{key}")
            if role == "tool" and message.get(key) is not None:
                turn[key] = message[key]
        messages.append(turn)
    check_tool_answers(messages, name)
    return tuple(messages)


def check_tool_answers(messages: Sequence[Mapping[str, Any]], name: str = "messages") -> None:
    """Each tool message of a conversation (read_messages' form) answers a call: an assistant message before it
    calls tools, and its tool_call_id, when it has one, is one of their ids. RequestError names the message."""
    called: list[str] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            called += [call["id"] for call in message.get("tool_calls") or ()]
        elif message["role"] == "tool":
            where = f"{name}[{i}]"
            if not called:
                raise RequestError(
                    f"{where}: a tool message answers a tool call, but no assistant message before it calls a tool",
                    param=f"{where}.role",
                )
            answered = message.get("tool_call_id")
            if answered is not None and answered not in called:
                raise RequestError(
                    f"{where}.tool_call_id {show(answered)} answers no tool call of the conversation (the calls: "
                    f"{', '.join(show(call) for call in called[-8:])})",
                    param=f"{where}.tool_call_id",
                )


def read_prompt_ids(value: Any, name: str) -> tuple[int, ...]:
    ok = isinstance(value, list) and value and all(type(t) is int and 0 <= t < 2**31 for t in value)
    if not ok:
        raise RequestError(f"{name} must be a non-empty list of token ids (non-negative integers)", param=name)
    return tuple(value)


def prompt_list(body: Any) -> list[Any] | None:
    """A /v1/completions body's prompts when it sends several (a list of strings or of token-id lists, as
    LangChain's batch does); None for one prompt. (`dflash serve` answers each as its own choice.)"""
    value = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(value, list) and len(value) > 1 and all(isinstance(item, (str, list)) for item in value):
        return value
    return None


def _completion_prompt(value: Any, name: str) -> dict[str, Any]:
    """/v1/completions' prompt: a string or token ids, alone or in a list of one."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    elif isinstance(value, list) and value and all(isinstance(item, (str, list)) for item in value):
        raise RequestError(
            f"{name}: several prompts where one is expected (a `dflash run` line holds one; the server's "
            "/v1/completions takes a flat list of strings or of token-id lists)",
            param=name,
        )
    if isinstance(value, list):  # token ids, given as the prompt: errors about them name `prompt`
        return {"prompt_ids": read_prompt_ids(value, name), "prompt_field": name}
    return {"prompt": read_text(value, name)}


# The keys some request shape reads. An unknown key that is a typo of one of them (or another library's name for
# one) is refused: ignored, "max_token" would leave the default in force. Other unknown keys are ignored.
READ_KEYS = frozenset(
    {
        *BY_KEY,
        *PROMPT_KEYS,
        "model",
        "stream",
        "stream_options",
        "chat_template_kwargs",
        "id",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
FOREIGN_NAMES = {
    "max_new_tokens": "max_tokens",
    "n_predict": "max_tokens",
    "stop_sequences": "stop",
    "random_seed": "seed",
}


def check_supported(body: Mapping[str, Any], prefix: str = "") -> None:
    """Refuse a field we do not implement set to another value than its default (after its range: UNSUPPORTED),
    an ignored field of the wrong type, and a misspelt field (did you mean ...)."""
    for key, (is_default, why) in UNSUPPORTED.items():
        if body.get(key) is None:
            continue
        if key in UNSUPPORTED_RANGES:
            integer, low, high = UNSUPPORTED_RANGES[key]
            read_number(body[key], prefix + key, integer=integer, low=low, high=high)
        if not is_default(body[key]):
            raise RequestError(f"{prefix}{why}", param=prefix + key)
    for key, (kind, what) in IGNORED_TYPES.items():
        value = body.get(key)
        if value is not None and not (isinstance(value, kind) and (kind is not dict or _strings(value))):
            raise RequestError(f"{prefix}{key} must be {what}, got {show(value)}", param=prefix + key)
    refuse_misspelt(body, READ_KEYS | UNSUPPORTED.keys(), FOREIGN_NAMES, prefix=prefix)


def refuse_misspelt(
    body: Mapping[str, Any],
    fields: Collection[str],
    renamed: Mapping[str, str],
    elsewhere: Mapping[str, str] | None = None,
    prefix: str = "",
) -> None:
    """A key that is not one of an API's `fields` but another API's name for one (`renamed`: that name -> this
    API's), a near miss of one, or a field this API lacks that another route takes (`elsewhere`: name -> the
    route) is refused, naming what was meant: left alone it would change nothing (a max_tokens ignored runs to the
    window). Any other unknown key is ignored, as clients add fields of their own."""
    for key in sorted(body.keys() - set(fields)):
        meant = renamed.get(key) or next(iter(difflib.get_close_matches(key, fields, n=1, cutoff=0.85)), None)
        if meant is not None:
            raise RequestError(
                f"{prefix}{key} is not a request field: did you mean {prefix}{meant}?", param=prefix + key
            )
        if elsewhere and key in elsewhere:
            raise RequestError(
                f"{prefix}{key} is not a field of this API: {elsewhere[key]} takes it", param=prefix + key
            )


def _strings(value: Mapping[str, Any]) -> bool:
    return all(isinstance(item, str) for item in value.values())


def _template_kwargs(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"{name} must be an object, got {show(value)}", param=name)
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & value.keys())
    if reserved:
        raise RequestError(f"{name} cannot set {', '.join(reserved)}", param=name)
    return dict(value)


def read_response_format(value: Any, name: str = "response_format") -> Grammar | None:
    """OpenAI's response_format: text (None), json_object, or json_schema (its schema; strict or not, the output
    follows it)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json", field=name)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError(
                f'{name}.json_schema must be an object {{"name", "schema", "strict"}}', param=f"{name}.json_schema"
            )
        if spec.get("name") is not None and not isinstance(spec["name"], str):
            where = f"{name}.json_schema.name"
            raise RequestError(f"{where} must be a string, got {show(spec['name'])}", param=where)
        schema = read_schema(spec.get("schema", {}), f"{name}.json_schema.schema")
        return Grammar("json_schema", json.dumps(schema, ensure_ascii=False), field=f"{name}.json_schema.schema")
    raise RequestError(
        f'{name} must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": "json_schema", "json_schema": '
        f"{{...}}}}, got {show(value)}",
        param=name,
    )


def _constraints(source: Mapping[str, Any], prefix: str, chat: bool) -> dict[str, Any]:
    """The request's grammar and tools: Request fields (the grammar rides in `sampling`)."""
    grammar = read_response_format(source.get("response_format"), prefix + "response_format")
    tools = read_tools(source, prefix)
    if tools is not None and not chat:
        raise RequestError(f"{prefix}tools need a conversation (messages, {CHAT_URL})", param=prefix + "tools")
    if tools is not None and tools.forced and grammar is not None:
        raise RequestError(
            f"{prefix}response_format cannot be combined with a forced tool_choice: the reply is a tool call",
            param=prefix + "response_format",
        )
    sampling = read_sampling(source, prefix=prefix)
    return {
        "sampling": {**sampling, "grammar": grammar} if grammar is not None else sampling,
        "sampling_keys": sampling_keys(source, prefix=prefix),
        "tools": tools,
    }


def _flag(body: Mapping[str, Any], key: str, name: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {show(value)}", param=name)
    return bool(value)


def read_body(body: Any, endpoint: str, *, prefix: str = "", prompt_index: int | None = None) -> Request:
    """An OpenAI request body for `endpoint` (CHAT_URL or COMPLETIONS_URL). `prefix` goes before field names in
    errors ("body." for a batch line); `prompt_index`, the prompt's place in a list of prompts (errors name
    `prompt[i]`)."""
    if not isinstance(body, dict):
        raise RequestError(f"{prefix.rstrip('.') or 'the request body'} must be a JSON object, got {show(body)}")
    check_supported(body, prefix)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"{prefix}model must be a string, got {show(model)}", param=prefix + "model")
    if endpoint == CHAT_URL:
        prompt: dict[str, Any] = {"messages": read_messages(body.get("messages"), prefix + "messages")}
        for key in ("prompt", "prompt_ids"):
            if key in body:
                raise RequestError(f"{prefix}{key}: chat completions take messages", param=prefix + key)
    elif endpoint == COMPLETIONS_URL:
        if "messages" in body:
            raise RequestError(f"{prefix}messages: use {CHAT_URL} for conversations", param=prefix + "messages")
        if body.get("chat_template_kwargs") is not None:
            name = prefix + "chat_template_kwargs"
            raise RequestError(f"{name}: completions use no chat template (use {CHAT_URL})", param=name)
        index = "" if prompt_index is None else f"[{prompt_index}]"
        prompt = _completion_prompt(body.get("prompt"), f"{prefix}prompt{index}")
    else:
        raise RequestError(f"url {show(endpoint)} is not supported: use {CHAT_URL} or {COMPLETIONS_URL}", param="url")
    stream = _flag(body, "stream", prefix + "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError(
                f"{prefix}stream_options is only allowed with stream: true", param=prefix + "stream_options"
            )
        if not isinstance(options, dict):
            name = prefix + "stream_options"
            raise RequestError(f"{name} must be an object, got {show(options)}", param=name)
        include_usage = _flag(options, "include_usage", prefix + "stream_options.include_usage")
    return Request(
        **prompt,
        **_constraints(body, prefix, endpoint == CHAT_URL),
        chat_template_kwargs=_template_kwargs(body.get("chat_template_kwargs"), prefix + "chat_template_kwargs"),
        stream=stream,
        include_usage=include_usage,
        model=model,
        endpoint=endpoint,
    )


def read_translated(body: dict[str, Any], names: Sequence[tuple[str, str]]) -> Request:
    """A chat completion body made from another API's request (Anthropic Messages, OpenAI Responses), read as
    any chat body is, so both take the same checks. `names`: (pattern, replacement) pairs that turn a field's name
    in this body back into the other API's (the first pattern that matches renames it), so an error names the
    field as its user wrote it."""
    try:
        return replace(read_body(body, CHAT_URL), field_names=tuple(names))
    except RequestError as error:
        raise renamed(error, names) from None


def renamed(error: RequestError, names: Sequence[tuple[str, str]]) -> RequestError:
    """`error` naming its field by the first of `names` ((pattern, replacement) pairs) that matches it."""
    if error.param is None:
        return error
    param, message = error.param, error.message
    for pattern, replacement in names:
        param, matched = re.subn(pattern, replacement, param, count=1)
        if matched:  # the message names the field, or a part of its path: renamed the same way
            message = re.sub(pattern.removeprefix("^").removesuffix("$"), replacement, message, count=1)
            break
    return RequestError(message, param=param, code=error.code, fix=error.fix)


def _read_id(value: Any, name: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return read_text(value, name)


def read_line(line: Any) -> Request:
    """A JSONL line: {"prompt" | "messages" | "prompt_ids", sampling keys, "id"?} or an OpenAI batch line."""
    if not isinstance(line, dict):
        raise RequestError(f"expected a JSON object, got {show(line)}")
    if OPENAI_BATCH_KEYS & line.keys():
        missing = [key for key in ("custom_id", "url", "body") if key not in line]
        if missing:
            raise RequestError(f"OpenAI batch line without {', '.join(missing)}", param=missing[0])
        custom_id = _read_id(line["custom_id"], "custom_id")
        if line.get("method", "POST") != "POST":
            raise RequestError(f'method must be "POST", got {show(line["method"])}', param="method")
        url = line["url"]
        if url not in (CHAT_URL, COMPLETIONS_URL):
            raise RequestError(f"url {show(url)} is not supported: use {CHAT_URL} or {COMPLETIONS_URL}", param="url")
        if not isinstance(line["body"], dict):
            raise RequestError(f"body must be an object, got {show(line['body'])}", param="body")
        return replace(read_body(line["body"], url, prefix="body."), id=custom_id)
    check_supported(line)  # first: a misspelt "promt" gets its did-you-mean, not "found none"
    kinds = [key for key in PROMPT_KEYS if key in line]
    if len(kinds) != 1:
        found = f"found {', '.join(kinds)}" if kinds else "found none"
        raise RequestError(
            f'a line needs exactly one of "prompt", "messages" or "prompt_ids" ({found}), '
            "or is an OpenAI batch line (custom_id, method, url, body)"
        )
    kind = kinds[0]
    if kind == "messages":
        prompt: dict[str, Any] = {"messages": read_messages(line["messages"])}
    elif kind == "prompt":
        prompt = {"prompt": read_text(line["prompt"], "prompt")}
    else:
        prompt = {"prompt_ids": read_prompt_ids(line["prompt_ids"], "prompt_ids")}
    if line.get("chat_template_kwargs") is not None and kind != "messages":
        raise RequestError('chat_template_kwargs needs "messages"', param="chat_template_kwargs")
    return Request(
        **prompt,
        **_constraints(line, "", kind == "messages"),
        chat_template_kwargs=_template_kwargs(line.get("chat_template_kwargs"), "chat_template_kwargs"),
        id=_read_id(line["id"], "id") if line.get("id") is not None else None,
    )
