"""The one request format (protocol.requests): what a malformed conversation is told."""

from __future__ import annotations

import time

import pytest

from dflash_cli.errors import RequestError
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.protocol.requests import CHAT_URL, check_context, read_body, read_line, read_messages
from dflash_cli.protocol.schemas import admits_finite_value, check_schema, control_character


def test_a_bad_role_lists_every_role_accepted() -> None:
    with pytest.raises(RequestError, match=r"messages\[1\]\.role must be system, developer, user, assistant") as bad:
        read_messages([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}])
    assert bad.value.param == "messages[1].role"
    assert read_messages([{"role": "developer", "content": "be brief"}])[0]["role"] == "system"


def test_a_replayed_tool_call_is_read_for_the_template_and_function_call_is_refused() -> None:
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": call},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    messages = read_messages(history)
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    with pytest.raises(RequestError, match="use tool_calls") as old:
        read_messages([history[0], {"role": "assistant", "content": None, "function_call": call[0]["function"]}])
    assert old.value.param == "messages[1].function_call"
    bad = [history[0], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]
    with pytest.raises(RequestError, match="not valid JSON") as broken:
        read_messages(bad)
    assert broken.value.param == "messages[1].tool_calls[0].function.arguments"


# ---------------------------------------------------------------------------------------------------------------
# Every field checked before a request is queued (issue 48)

USER = [{"role": "user", "content": "hi"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def tool(parameters: object) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def schema_format(value: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}


BAD_BODIES = [  # (fields over a valid chat body, the param the error names, words of its message)
    ({"temperature": 10**30}, "temperature", "temperature must be in [0, 2]"),
    ({"temperature": 1e9}, "temperature", "must be in [0, 2]"),
    ({"temperature": 2.01}, "temperature", "must be in [0, 2]"),
    ({"top_k": 10**30}, "top_k", "top_k must be at most 2147483647"),
    ({"top_k": -7}, "top_k", "top_k must be >= -1 (0 or -1 = off), got -7"),  # (-1 is taken: the rule says so)
    ({"max_tokens": 10**30}, "max_tokens", "max_tokens must be at most 2147483647"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1"),
    ({"seed": 2**64}, "seed", "seed must be a 64-bit integer"),
    ({"n": 0}, "n", "n must be in [1, 128]"),
    ({"n": 10**30}, "n", "n must be in [1, 128]"),
    ({"n": 3}, "n", "n must be 1"),
    ({"presence_penalty": 5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": "x"}, "frequency_penalty", "frequency_penalty must be a number"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    # other servers' fields that change the answer: refused by name, not ignored (vLLM's, llama-server's)
    ({"ignore_eos": True}, "ignore_eos", "ignore_eos is not supported"),
    ({"min_tokens": 30}, "min_tokens", "min_tokens is not supported"),
    ({"stop_token_ids": [2]}, "stop_token_ids", "use stop"),
    ({"guided_json": {"type": "object"}}, "guided_json", "use response_format"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice", "use response_format"),
    ({"json_schema": {"type": "object"}}, "json_schema", "use response_format"),
    ({"grammar": "root ::= x"}, "grammar", "use response_format"),
    ({"repeat_penalty": 1.3}, "repeat_penalty", "not supported"),
    ({"typical_p": 0.5}, "typical_p", "not supported"),
    ({"mirostat": 2}, "mirostat", "not supported"),
    ({"n_predict": 3}, "n_predict", "did you mean max_tokens?"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs", "use response_format"),
    ({"use_beam_search": True}, "use_beam_search", "not supported"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids", "not supported"),
    ({"dry_multiplier": 0.8}, "dry_multiplier", "not supported"),
    ({"top_logprobs": 50}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    ({"user": 5}, "user", "user must be a string"),
    ({"metadata": {"a": 1}}, "metadata", "metadata must be an object of strings"),
    ({"store": "yes"}, "store", "store must be true or false"),
    (
        {"response_format": schema_format({"$ref": "#"})},
        "response_format.json_schema.schema",
        "admits no finite JSON value",
    ),
    (
        {"response_format": schema_format({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})},
        "response_format.json_schema.schema",
        "admits no finite JSON value",
    ),
    (
        {
            "response_format": schema_format(
                {"$defs": {"x": {"items": {"$ref": "#/$defs/x"}, "minItems": 1}}, "$ref": "#/$defs/x"}
            )
        },
        "response_format.json_schema.schema",
        "admits no finite JSON value",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": 5}}},
        "response_format.json_schema.name",
        "a string",
    ),
    ({"tools": tool({"type": "string"})}, "tools[0].function.parameters.type", '"type": "object"'),
    (
        {"tools": tool({"type": "object", "properties": "a"})},
        "tools[0].function.parameters.properties",
        "an object of schemas",
    ),
    (
        {"tools": tool({"type": "object", "required": "a"})},
        "tools[0].function.parameters.required",
        "a list of argument names",
    ),
    ({"tools": tool([])}, "tools[0].function.parameters", '"type": "object"'),
    (
        {
            "tools": tool({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            "tool_choice": "required",  # (a grammar follows it: unless forced, the model only reads it)
        },
        "tools[0].function.parameters",
        "admits no finite JSON value",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
        "tools[0].function.description",
        "a string",
    ),
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c9", "content": "x"},
            ]
        },
        "messages[2].tool_call_id",
        '"c9" answers no tool call of the conversation (the calls: "c1")',
    ),
    (
        {"messages": [*USER, {"role": "tool", "tool_call_id": "c1", "content": "x"}]},
        "messages[1].role",
        "no assistant message before it calls a tool",
    ),
    ({"messages": [{"role": "user", "content": "hi", "name": 7}]}, "messages[0].name", "must be a string"),
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": 1, "content": "x"},
            ]
        },
        "messages[2].tool_call_id",
        "must be a string",
    ),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_BODIES)
def test_a_bad_field_is_refused_by_name_in_a_body_and_in_a_run_line(fields, param, words) -> None:
    with pytest.raises(RequestError) as bad:
        read_body({"messages": USER, **fields}, CHAT_URL)
    assert bad.value.param == param and words in bad.value.message, bad.value.message
    with pytest.raises(RequestError) as in_batch:  # an OpenAI batch line of `dflash run`: the same, under body.
        read_line({"custom_id": "a", "method": "POST", "url": CHAT_URL, "body": {"messages": USER, **fields}})
    assert in_batch.value.param == "body." + param
    with pytest.raises(RequestError) as in_line:  # a plain `dflash run` line
        read_line({"messages": USER, **fields})
    assert in_line.value.param == param


def test_what_the_api_takes_is_still_taken() -> None:
    call = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ]
    fine = [
        {"temperature": 2, "top_p": 1, "top_k": -1, "max_tokens": 2**31 - 1, "n": 1, "presence_penalty": 0},
        {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
        {"ignore_eos": False, "min_tokens": 0, "stop_token_ids": [], "repeat_penalty": 1, "typical_p": 1.0},
        {"grammar": "", "json_schema": {}, "mirostat": 0, "tfs_z": 1, "n_probs": 0, "use_beam_search": False},
        {"allowed_token_ids": [], "bad_words": [], "dry_multiplier": 0, "xtc_probability": 0, "dynatemp_range": 0},
        {"tools": tool({})},  # a function without arguments
        {"tools": tool({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})},
        {"response_format": schema_format({"anyOf": [{"$ref": "#"}, {"type": "string"}]})},  # recursion with a way out
        {"response_format": schema_format({"type": "object", "properties": {"child": {"$ref": "#"}}})},  # (optional)
        {"messages": call},
        {"messages": [*call[:2], {"role": "tool", "content": "x"}]},  # no tool_call_id: the call before it
    ]
    for fields in fine:
        read_body({"messages": USER, **fields}, CHAT_URL)
    assert SamplingParams(top_k=-1).top_k == 0  # the Python API takes what the rule says, as every frontend does


def test_max_tokens_is_checked_against_the_context_left_after_the_prompt() -> None:
    request = read_body({"messages": USER, "max_completion_tokens": 100}, CHAT_URL)
    check_context(request, 1948, 2048)  # exactly what is left
    with pytest.raises(RequestError) as bad:
        check_context(request, 1949, 2048)
    assert bad.value.param == "max_completion_tokens" and bad.value.code == "context_length_exceeded"
    assert bad.value.message == (
        "max_completion_tokens is 100, but the model's context window of 2048 tokens leaves 99 after the prompt's "
        "1949: ask for at most 99"
    )
    check_context(read_body({"messages": USER}, CHAT_URL), 2047, 2048)  # the default is cut at the window
    with pytest.raises(RequestError, match="prompt is too long: 2048 tokens > 2047 maximum") as full:
        check_context(read_body({"messages": USER}, CHAT_URL), 2048, 2048)
    assert full.value.param == "messages"
    line = read_line({"custom_id": "a", "url": CHAT_URL, "body": {"messages": USER, "max_tokens": 10}})
    with pytest.raises(RequestError) as in_batch:
        check_context(line, 2040, 2048)
    assert in_batch.value.param == "body.max_tokens"


def test_property_names_are_names_not_keywords() -> None:
    """A property (or $defs entry) called "if" or "not" is a name, not a keyword the grammar would ignore; one
    called "default" or "enum" holds a schema, checked like any other (both were read as keywords)."""
    check_schema({"type": "object", "properties": {"if": {"type": "string"}, "not": {"type": "integer"}}}, "p")
    check_schema({"$defs": {"then": {"type": "string"}}, "$ref": "#/$defs/then"}, "p")
    for name in ("default", "enum"):
        with pytest.raises(RequestError) as caught:
            check_schema({"type": "object", "properties": {name: {"not": {}}}}, "p")
        assert caught.value.param == f"p.properties.{name}.not"
    check_schema({"default": {"not": {}}, "enum": [{"if": 1}]}, "p")  # (data there, not schemas)


def test_a_schema_admits_a_finite_value_unless_every_way_recurses() -> None:
    cyclic = [
        {"$ref": "#"},
        {"anyOf": [{"$ref": "#"}]},
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # (an object, as the grammar reads it)
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"anyOf": [{"$ref": "#"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 2}]},
        {"type": "object", "required": ["x"], "additionalProperties": False},  # a required key it cannot have
        {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
        False,
    ]
    finite = [
        {},
        True,
        {"type": "string"},
        {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"type": "object", "properties": {"a": {"$ref": "#"}}},  # a is optional
        {
            "$defs": {
                "tree": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}},
                    "required": ["kids"],
                }
            },
            "$ref": "#/$defs/tree",
        },
        {"$ref": "#/nowhere"},  # (the compiler names a reference to nothing)
        {"enum": [1, 2]},
    ]
    assert [admits_finite_value(s) for s in cyclic] == [False] * len(cyclic)
    assert [admits_finite_value(s) for s in finite] == [True] * len(finite)
    # A schema too large to decide within SCHEMA_STEPS nodes (it has no finite value) is left to the compiler,
    # quickly: an exponential walk would hang the request's handler.
    wide = {
        "anyOf": [{"$ref": "#"}] * 50 + [{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}] * 50
    }
    started = time.perf_counter()
    assert admits_finite_value({"$defs": {"w": wide}, "anyOf": [{"$ref": "#/$defs/w"}] * 50})
    assert time.perf_counter() - started < 10


def chain(length: int) -> dict:
    """$defs a0 -> a1 -> ... -> a{length}: a string at the end, reached from a property."""
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(length)} | {f"a{length}": {"type": "string"}}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "$defs": defs}


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "minItems": 1, "items": schema}
    return schema


def test_a_tools_schema_is_held_to_the_grammars_rules_only_where_a_call_is_forced() -> None:
    """An agent's tool whose schema no grammar enforces (`not`, `dependentRequired`, a cycle) is read unless a
    forced call's grammar must follow it: auto and another tool named, it is offered; required or named, it is
    refused by its field."""
    odd = {"type": "object", "properties": {"a": {"not": {}}}, "dependentRequired": {"a": ["b"]}}
    tools = [*tool(odd), {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
    for choice in ("auto", "none", {"type": "function", "function": {"name": "g"}}):
        read_body({"messages": USER, "tools": tools, "tool_choice": choice}, CHAT_URL)
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(RequestError, match="'dependentRequired' is not supported") as refused:
            read_body({"messages": USER, "tools": tools, "tool_choice": choice}, CHAT_URL)
        assert refused.value.param == "tools[0].function.parameters.dependentRequired"


def test_a_pattern_naming_a_control_character_is_refused_where_a_grammar_follows_it() -> None:
    """The grammar library writes a pattern's control characters into a JSON string raw (invalid JSON): such a
    pattern is refused by its field, in a response_format and a forced tool's parameters; one that leaves them out
    (a negated class, a backslash escaped) is taken."""
    for pattern, named in [
        (r"^a\nb$", "U+000A"), (r"^[a\t]$", "U+0009"), (r"^\x0a$", "U+000A"), (r"^\u001f$", "U+001F"),
        (r"^\cJ$", "U+000A"), ("^a\nb$", "U+000A"), (r"^[\x00-\x1f]$", "U+0000"), (r"^[^\n]+\r$", "U+000D"),
        (r"^[\b]$", "U+0008"), ("^a\\\nb$", "U+000A"), (r"^\bword\b$", None),
        (r"^[^\n]*$", None), (r"^\\n$", None), (r"^[^\x00-\x1f]+$", None), (r"^\d\s\w.$", None),
    ]:  # fmt: skip
        assert control_character(pattern) == named, pattern
    string = {"type": "object", "properties": {"s": {"type": "string", "pattern": r"^ab\ncd$"}}}
    with pytest.raises(RequestError, match="matches the control character U[+]000A") as refused:
        read_body({"messages": USER, "response_format": schema_format(string)}, CHAT_URL)
    assert refused.value.param == "response_format.json_schema.schema.properties.s.pattern" and refused.value.fix
    with pytest.raises(RequestError, match="U[+]0009") as refused:
        keyed = {"type": "object", "patternProperties": {"^a\tb$": {"type": "string"}}}
        read_body({"messages": USER, "tools": tool(keyed), "tool_choice": "required"}, CHAT_URL)
    assert refused.value.param == "tools[0].function.parameters.patternProperties"
    read_body({"messages": USER, "tools": tool(string)}, CHAT_URL)  # (auto: offered, not enforced)
    odd = {"type": "object", "patternProperties": 5}  # (not an object: no patterns; the compiler says the rest)
    read_body({"messages": USER, "response_format": schema_format(odd)}, CHAT_URL)
    string["properties"]["s"]["pattern"] = r"^[^\n]*$"
    read_body({"messages": USER, "response_format": schema_format(string)}, CHAT_URL)


def test_a_schema_nested_too_deep_is_refused_before_any_walk_recurses() -> None:
    """A chain of 20,000 references segfaulted xgrammar's compiler (the server with it), and 300 nested arrays
    overflowed Python's recursion in the checks (a 500): both are a 400 naming the field, found in linear time."""
    for schema in (chain(20_000), chain(200), nested(300), nested(2000)):
        started = time.perf_counter()
        with pytest.raises(RequestError, match="nests schemas more than 128 deep") as deep:
            read_body({"messages": USER, "response_format": schema_format(schema)}, CHAT_URL)
        assert deep.value.param == "response_format.json_schema.schema" and time.perf_counter() - started < 10
    with pytest.raises(RequestError, match="more than 128 deep") as in_tool:
        read_body({"messages": USER, "tools": tool({"type": "object", "properties": {"a": nested(300)}})}, CHAT_URL)
    assert in_tool.value.param == "tools[0].function.parameters"
    for schema in (chain(100), nested(60)):  # deep, but not too deep
        read_body({"messages": USER, "response_format": schema_format(schema)}, CHAT_URL)
