"""Tool calling (protocol.tools): each family's tool-call text parses back into the calls that made it.

The assistant turns below are rendered by the tool-call sections of the families' chat templates (Qwen3's hermes
blocks, Qwen3.5/3.6's XML parameters, Llama 3.1's JSON, Gemma 4's `call:NAME{...}`, gpt-oss's harmony messages),
written here as Jinja and rendered by transformers' own template engine, so quoting and JSON come from the same
filters (`tojson`) the real templates use. Replies that do not parse stay content; streams hold back only what may
open a call.
"""

from __future__ import annotations

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from dflash_cli.errors import RequestError
from dflash_cli.protocol.requests import read_body, read_line
from dflash_cli.protocol.tools import FORMATS, Tools, ToolStream, hermes_messages, parse_reply, read_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = Tools((WEATHER, TIME))
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris, FR", "days": 3, "metric": True}},
    {"name": "get_time", "arguments": {}},
]

# The tool-call section of each family's template: `message.tool_calls` -> the text the model writes.
SECTIONS = {
    "hermes": (
        "{%- for tool_call in message.tool_calls %}{%- if not loop.first %}{{ '\\n' }}{% endif %}"
        "{%- set tool_call = tool_call.function %}"
        '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
        "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    ),
    "qwen3_coder": (
        "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
        "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
        "{%- for name, value in tool_call.arguments | items %}{{- '<parameter=' + name + '>\\n' }}"
        "{%- set value = value | tojson if value is not string else value %}{{- value }}{{- '\\n</parameter>\\n' }}"
        "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
    ),
    "llama3_json": (
        "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
        "{%- if not loop.first %}{{ '; ' }}{% endif %}"
        "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
        "{{- '}' }}{%- endfor %}"
    ),
    "gemma4": (
        "{%- macro arg(v) -%}{%- if v is string -%}{{- '<|\"|>' + v + '<|\"|>' -}}"
        "{%- elif v is boolean -%}{{- 'true' if v else 'false' -}}"
        "{%- elif v is mapping -%}{{- '{' -}}{%- for k, x in v | dictsort -%}{{- k }}:{{ arg(x) -}}"
        "{%- if not loop.last %},{% endif -%}{%- endfor -%}{{- '}' -}}"
        "{%- elif v is sequence -%}{{- '[' -}}{%- for x in v -%}{{- arg(x) -}}{%- if not loop.last %},{% endif -%}"
        "{%- endfor -%}{{- ']' -}}{%- else -%}{{- v -}}{%- endif -%}{%- endmacro -%}"
        "{%- for tool_call in message.tool_calls -%}{%- set function = tool_call.function -%}"
        "{{- '<|tool_call>call:' + function.name + '{' -}}"
        "{%- for key, value in function.arguments | dictsort -%}{%- if not loop.first %},{% endif -%}"
        "{{- key -}}:{{- arg(value) -}}{%- endfor -%}{{- '}<tool_call|>' -}}{%- endfor -%}"
    ),
    "harmony": (
        "{%- for tool_call in message.tool_calls -%}{%- set tool_call = tool_call.function -%}"
        "{%- if not loop.first %}{{- '<|start|>assistant' }}{% endif -%}"
        "{{- ' to=functions.' + tool_call.name + '<|channel|>commentary json<|message|>' }}"
        "{{- tool_call.arguments | tojson }}{{- '<|call|>' }}{%- endfor -%}"
    ),
}


def render(fmt: str, calls: list[dict], content: str = "") -> str:
    message = {"role": "assistant", "tool_calls": [{"type": "function", "function": c} for c in calls]}
    template = "{%- for message in messages %}" + SECTIONS[fmt] + "{%- endfor %}"
    rendered, _ = render_jinja_template(conversations=[[message]], chat_template=template)
    return content + rendered[0]


def test_every_format_has_a_rendered_fixture() -> None:
    assert SECTIONS.keys() == FORMATS.keys()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("count", [1, 2])
def test_rendered_calls_parse_back_to_the_same_calls(fmt: str, count: int) -> None:
    text = render(fmt, CALLS[:count])
    content, calls = parse_reply(text, TOOLS, fmt)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c["name"], c["arguments"]) for c in CALLS[:count]]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == count


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "gemma4"])
def test_text_before_a_call_is_the_content(fmt: str) -> None:
    content, calls = parse_reply(render(fmt, CALLS[:1], "Let me check.\n"), TOOLS, fmt)
    assert content == "Let me check." and calls[0].name == "get_weather"


def test_harmony_keeps_the_final_channel_and_drops_the_analysis() -> None:
    text = "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant" + render(
        "harmony", CALLS[:1]
    )
    assert parse_reply(text, TOOLS, "harmony")[0] is None
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    assert parse_reply(answer, TOOLS, "harmony") == ("It is 4.", [])
    # the other header order gpt-oss also writes
    other = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>"
    assert [c.name for c in parse_reply(other, TOOLS, "harmony")[1]] == ["get_time"]


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'),
        ("hermes", "<tool_call>\n[1, 2]\n</tool_call>"),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and more text'),
        ("llama3_json", "The answer is 4."),
        ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>'),
        ("harmony", "<|channel|>commentary to=functions.get_time<|message|>{oops<|call|>"),
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n</tool_call>"),
    ],
)
def test_a_reply_that_does_not_parse_is_content(fmt: str, text: str) -> None:
    assert parse_reply(text, TOOLS, fmt) == (text, [])


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "harmony"])
def test_a_raw_newline_inside_an_argument_string_is_read_and_written_escaped(fmt: str) -> None:
    """A small model writes a file's lines into a JSON string as they are (raw newlines: not JSON); its call is
    read all the same, its arguments written again as JSON."""
    content = "line one\nline two\ttabbed"
    text = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>',
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "%s"}}',
        "harmony": '<|channel|>commentary to=functions.get_weather<|message|>{"city": "%s"}<|call|>',
    }[fmt] % content
    (call,) = parse_reply(text, TOOLS, fmt)[1]
    assert json.loads(call.arguments) == {"city": content} and "\n" not in call.arguments


def test_qwen3_coder_reads_values_by_the_schema() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    (call,) = parse_reply(text, TOOLS, "qwen3_coder")[1]
    assert json.loads(call.arguments) == {"city": "42", "days": 3}
    loose = read_tools({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": True, "days": {"type": "integer"}}}}}]})  # fmt: skip
    (call,) = parse_reply(text, loose, "qwen3_coder")[1]  # (a property's schema may be `true`: any value)
    assert json.loads(call.arguments) == {"city": 42, "days": 3}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_stream_sends_the_content_and_holds_back_the_calls(fmt: str) -> None:
    prefix = "" if FORMATS[fmt].whole else "Checking the weather. "
    text = render(fmt, CALLS, prefix)
    for cut in (1, 3, 7):
        stream = ToolStream(TOOLS, fmt)
        sent, calls, first_at = "", [], None
        for i in range(0, len(text), cut):
            sent += stream.feed(text[i : i + cut])
            ready = stream.ready()
            if ready and first_at is None:
                first_at = i + cut
            calls += ready
        rest, last = stream.finish()
        assert (sent + rest).strip() == prefix.strip()
        assert [c.name for c in calls + last] == ["get_weather", "get_time"]
        if FORMATS[fmt].close:  # the first call went out once it closed, before the reply ended
            assert first_at is not None and first_at < len(text)
            assert text[:first_at].count(FORMATS[fmt].close) == 1
    plain = "A plain < answer with <tool no call."
    stream = ToolStream(TOOLS, fmt)
    sent = "".join(stream.feed(ch) for ch in plain)
    assert sent + stream.finish()[0] == plain and stream.finish()[1] == [] and stream.ready() == []


def test_read_tools_checks_the_fields_by_name() -> None:
    tools = read_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert tools.choice == "get_weather" and tools.forced and tools.parallel
    assert read_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert read_tools({"tools": [WEATHER], "parallel_tool_calls": False}).parallel is False
    bad = [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]
    for body, param in bad:
        with pytest.raises(RequestError) as caught:
            read_tools(body)
        assert caught.value.param == param, body


def test_response_format_and_tools_in_bodies_and_lines() -> None:
    messages = [{"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "messages": messages,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    }
    request = read_body(body, "/v1/chat/completions")
    grammar = request.sampling["grammar"]
    assert grammar.kind == "json_schema" and json.loads(grammar.source) == schema
    assert grammar.field == "response_format.json_schema.schema"
    line = read_line({"custom_id": "a", "url": "/v1/chat/completions", "body": {**body, "tools": [WEATHER]}})
    assert line.tools.functions[0]["function"]["name"] == "get_weather"
    assert (
        read_line({"messages": messages, "response_format": {"type": "json_object"}}).sampling["grammar"].kind == "json"
    )
    assert (
        "grammar"
        not in read_body({"messages": messages, "response_format": {"type": "text"}}, "/v1/chat/completions").sampling
    )
    for wrong, param in [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ]:
        with pytest.raises(RequestError) as caught:
            read_body({"messages": messages, **wrong}, "/v1/chat/completions")
        assert caught.value.param == param
    with pytest.raises(RequestError) as caught:
        read_body({"prompt": "x", "tools": [WEATHER]}, "/v1/completions")
    assert caught.value.param == "tools"


def test_hermes_fallback_puts_tools_in_the_system_message_and_results_in_user_turns() -> None:
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALLS[0]}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "18C", "tool_call_id": "c2"},
    ]
    out = hermes_messages(history, TOOLS)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in out[0]["content"]
    assert parse_reply(out[2]["content"], TOOLS, "hermes")[1][0].name == "get_weather"
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n18C\n</tool_response>",
    }
    assert len(out) == 4


def test_a_last_call_cut_off_by_max_tokens_leaves_the_complete_ones() -> None:
    text = render("hermes", CALLS[:1]) + '\n<tool_call>\n{"name": "get_ti'
    assert [c.name for c in parse_reply(text, TOOLS, "hermes")[1]] == ["get_weather"]


def test_a_template_names_its_own_tool_call_format() -> None:
    from dflash_cli.protocol.tools import template_format

    for fmt, section in SECTIONS.items():
        if fmt != "llama3_json":  # (Llama 3.1's custom-tool JSON has no sign; its template's is the python tag)
            assert template_format("{% if tools %}...{% endif %}" + section) == fmt
    assert template_format("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert template_format("{% for message in messages %}{{ message.content }}{% endfor %}") is None


def test_a_stream_whose_later_call_breaks_keeps_the_calls_given_and_returns_the_rest_as_content() -> None:
    good = render("hermes", CALLS[:1])
    stream = ToolStream(TOOLS, "hermes")
    assert stream.feed(good) == "" and [c.name for c in stream.ready()] == ["get_weather"]
    stream.feed("\n<tool_call>\n{broken}\n</tool_call>")
    assert stream.ready() == []
    assert stream.finish() == ("<tool_call>\n{broken}\n</tool_call>", [])


@pytest.mark.parametrize("fmt", sorted(fmt for fmt in FORMATS if FORMATS[fmt].close and not FORMATS[fmt].whole))
def test_a_call_max_tokens_cut_off_is_neither_a_call_nor_content(fmt: str) -> None:
    """max_tokens inside a reply's call, the first or one after a whole call: the cut call is no call, and its
    markup is not sent as the reply's text (whole or streamed); the text and whole calls before it stay. A reply
    that ended by itself keeps text that mentions a tag; a call that closes but does not parse stays content."""
    prefix = "Checking the weather."
    for whole in ([], CALLS[1:]):
        text = render(fmt, whole + CALLS[:1], prefix + " ")
        start = len(render(fmt, whole, prefix + " ")) if whole else 0  # (where the cut call begins)
        at, marker = min((text.find(m, start), m) for m in FORMATS[fmt].markers if m in text[start:])
        for end in range(at + len(marker), len(text) - len(FORMATS[fmt].close), 7):
            content, calls = parse_reply(text[:end], TOOLS, fmt, cut=True)
            assert ((content or "").strip(), [c.name for c in calls]) == (prefix, ["get_time"] * len(whole)), text[:end]
            stream = ToolStream(TOOLS, fmt)
            sent, given = "", []
            for ch in text[:end]:
                sent += stream.feed(ch)
                given += stream.ready()
            rest, calls = stream.finish(cut=True)
            assert ((sent + rest).strip(), [c.name for c in given + calls]) == (prefix, ["get_time"] * len(whole))
    mention = f"Qwen3 wraps each call in a {FORMATS[fmt].markers[0]} tag and a JSON object; that is all."
    assert parse_reply(mention, TOOLS, fmt) == (mention, [])
    stream = ToolStream(TOOLS, fmt)
    assert "".join(stream.feed(ch) for ch in mention) + stream.finish()[0] == mention
    broken = f"{prefix} {FORMATS[fmt].markers[0]}\n{{broken}}\n{FORMATS[fmt].close}"
    assert parse_reply(broken, TOOLS, fmt, cut=True) == (broken, [])
