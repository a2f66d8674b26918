"""The agents' APIs, torch-free: Anthropic Messages and OpenAI Responses bodies read into the one request format
(the same checks as a chat body, errors named as each API names its fields), replies split into reasoning and
text, and rendered as each API's events and whole objects."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash_cli.errors import RequestError
from dflash_cli.protocol.anthropic import MessageEvents, read_messages_request
from dflash_cli.protocol.openai_responses import ResponseEvents, read_responses_request
from dflash_cli.protocol.replies import Ending, Part, Prompt, ReasoningSplit
from dflash_cli.protocol.requests import read_body
from dflash_cli.protocol.tools import ToolCall
from helpers.sdk_types import check_message, check_message_event, check_response, check_response_event

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def error_of(read, body) -> RequestError:  # type: ignore[no-untyped-def]
    with pytest.raises(RequestError) as raised:
        read(body)
    return raised.value


# -- reasoning ---------------------------------------------------------------------------------------------------


def split(reply: str, opened: bool = False, cuts: list[int] | None = None) -> tuple[str, str]:
    """A reply's (reasoning, text) as a ReasoningSplit streams them, the text fed in pieces cut at `cuts`; each
    piece it gives is non-empty."""
    splitter, pieces, at = ReasoningSplit(opened), [], 0
    for cut in [*(cuts or []), len(reply)]:
        pieces += splitter.feed(reply[at:cut])
        at = cut
    pieces += splitter.finish()
    assert all(text for _, text in pieces)
    return "".join(t for kind, t in pieces if kind == "reasoning"), "".join(t for kind, t in pieces if kind == "text")


@pytest.mark.parametrize(
    ("reply", "opened", "reasoning", "text"),
    [
        ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.", "Paris."),
        ("Let me see.\n</think>\n\nParis.", True, "Let me see.", "Paris."),  # the template opened it
        ("<think>\n\n</think>\n\nParis.", False, "", "Paris."),  # thinking off, as Qwen3 writes it
        ("  Paris <think> is", False, "", "  Paris <think> is"),  # a marker after text is text
        ("<think>cut off by max_tok", False, "cut off by max_tok", ""),
        ("<thi", False, "", "<thi"),
        ("\n\nHello", False, "", "\n\nHello"),
    ],
)
def test_a_reply_splits_into_reasoning_and_text(reply: str, opened: bool, reasoning: str, text: str) -> None:
    assert split(reply, opened) == (reasoning, text)


@given(
    st.lists(st.sampled_from(["<", "think", ">", "</", "\n", " ", "a", "Paris", "<think>", "</think>"]), max_size=12),
    st.data(),
)
def test_a_streamed_split_equals_the_whole_split_wherever_the_text_is_cut(
    words: list[str], data: st.DataObject
) -> None:
    reply = "".join(words)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=6)))
    assert split(reply, cuts=cuts) == split(reply)


# -- Anthropic Messages ------------------------------------------------------------------------------------------


def test_a_messages_body_becomes_the_chat_request_it_means() -> None:
    body = {
        "model": "demo",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "In Paris."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Call the tool.", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "24C"}]},
                    {"type": "text", "text": "And Rome?"},
                ],
            },
        ],
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_k": 5,
        "metadata": {"user_id": "u"},
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    read = read_messages_request(body)
    chat = read_body(
        {
            "model": "demo",
            "max_tokens": 64,
            "stop": ["END"],
            "temperature": 0.5,
            "top_k": 5,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?\nIn Paris."},
                {
                    "role": "assistant",
                    "content": "Checking.",
                    "reasoning_content": "Call the tool.",
                    "tool_calls": [
                        {
                            "id": "toolu_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "toolu_1", "content": "24C"},
                {"role": "user", "content": "And Rome?"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA, "description": "Weather"},
                }
            ],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "chat_template_kwargs": {"enable_thinking": True},
        },
        "/v1/chat/completions",
    )
    assert read.request == dataclasses.replace(chat, cut_at_window=True) and read.thinking  # (Anthropic's max_tokens)
    count = read_messages_request({k: body[k] for k in ("system", "messages", "tools")}, count_only=True)
    assert count.request.messages == chat.messages and count.request.sampling == {}


def test_an_image_a_tool_returned_is_left_out_by_name_and_one_the_user_sent_is_refused() -> None:
    """Claude Code's Read of an image returns it in a tool_result, and every later turn resends it: it becomes a
    line that says it was left out, not a 400 that would end the session."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.png:"}, image]}
    body = {
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "Look at a.png"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ],
    }
    (tool,) = [m for m in read_messages_request(body).request.messages if m["role"] == "tool"]
    assert tool["content"] == "a.png:\n[image omitted: this model reads text only]"
    error = error_of(read_messages_request, {**body, "messages": [{"role": "user", "content": [image]}]})
    assert error.param == "messages[0].content[0]" and "image blocks are not supported" in error.message


def test_an_image_of_an_earlier_turn_is_left_out_and_one_in_the_turn_answered_is_refused() -> None:
    """A pasted screenshot is refused in the turn the reply answers (the model would not see it) and, resent with
    every later turn (Claude Code and Codex resend the conversation), left out with a line that says so."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    asked = {"role": "user", "content": [{"type": "text", "text": "What is wrong here?"}, image]}
    error = error_of(read_messages_request, {"max_tokens": 8, "messages": [asked]})
    assert error.param == "messages[0].content[1]" and "image blocks are not supported" in error.message
    later = [asked, {"role": "assistant", "content": "I cannot see images."}, {"role": "user", "content": "OK: a 404."}]
    turns = read_messages_request({"max_tokens": 8, "messages": later}).request.messages
    assert turns[0] == {"role": "user", "content": "What is wrong here?\n[image omitted: this model reads text only]"}
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    refused = [{"role": "user", "content": [document]}, *later[1:2], {"role": "user", "content": [image]}]
    assert error_of(read_messages_request, {"max_tokens": 8, "messages": refused}).param == "messages[2].content[0]"

    picture = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    question = {"role": "user", "content": [{"type": "input_text", "text": "What is wrong here?"}, picture]}
    error = error_of(read_responses_request, {"input": [question]})
    assert error.param == "input[0].content[1]" and "input_image is not supported" in error.message
    output = {"type": "function_call_output", "call_id": "c1", "output": [picture]}
    call = {"type": "function_call", "call_id": "c1", "name": "view", "arguments": "{}"}
    items = [question, call, output, {"role": "user", "content": "OK: a 404."}]
    chat = read_responses_request({"input": items}).request.messages
    assert chat[0]["content"] == "What is wrong here?\n[image omitted: this model reads text only]"
    assert chat[2] == {"role": "tool", "tool_call_id": "c1", "content": "[image omitted: this model reads text only]"}
    attached = {"type": "function_call_output", "call_id": "c1", "output": "attached local image path"}
    viewed = read_responses_request({"input": [call, attached, {"role": "user", "content": [picture]}]})
    assert viewed.request.messages[-1] == {"role": "user", "content": "[image omitted: this model reads text only]"}


def test_claude_codes_billing_header_is_left_out_of_the_system_prompt() -> None:
    header = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.36.e1f; cch=93b1a;"}
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    read = read_messages_request({**body, "system": [header, {"type": "text", "text": "Be brief."}]})
    assert read.request.messages[0] == {"role": "system", "content": "Be brief."}
    alone = read_messages_request({**body, "system": [header]})
    assert [m["role"] for m in alone.request.messages] == ["user"]
    quoted = "x-anthropic-billing-header: is what Claude Code sends."  # a system prompt given as a string stays
    assert read_messages_request({**body, "system": quoted}).request.messages[0]["content"] == quoted


def test_a_message_without_thinking_turns_the_templates_thinking_off() -> None:
    """In Anthropic's API no `thinking` is no thinking: a template that thinks by default (Qwen3) is told not to,
    unless the request's own chat_template_kwargs say otherwise."""
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    kwargs = {
        name: read_messages_request({**body, **change}).request.chat_template_kwargs
        for name, change in {
            "absent": {},
            "disabled": {"thinking": {"type": "disabled"}},
            "enabled": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            "own": {"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "low"}},
        }.items()
    }
    assert kwargs == {
        "absent": {"enable_thinking": False},
        "disabled": {"enable_thinking": False},
        "enabled": {"enable_thinking": True},
        "own": {"enable_thinking": True, "reasoning_effort": "low"},
    }
    assert read_messages_request(body, count_only=True).request.chat_template_kwargs == {"enable_thinking": False}
    error = error_of(read_messages_request, {**body, "chat_template_kwargs": "on"})
    assert error.param == "chat_template_kwargs", error.message


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"max_tokens": None}, "max_tokens", "required"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),  # the chat body's own check, named as Messages names it
        ({"stop_sequences": [""]}, "stop_sequences", "empty stop string"),
        ({"temperature": "hot"}, "temperature", "a number"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
            "image blocks are not supported",
        ),
        ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role", "user, assistant or system"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages", "no user turn: system text alone goes in"),
        (  # two assistant turns: the last one is what to fix
            {"messages": [{"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "x"}]},
            "messages[1]",
            "a last assistant turn (a prefill to continue) is not supported",
        ),
        (
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]},
            "messages[1]",
            "prefill",
        ),
        ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "tools[0].name", "letters, digits"),
        ({"tools": [{"name": "f", "input_schema": []}]}, "tools[0].input_schema", 'JSON schema of "type": "object"'),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", "custom tools"),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "whatever"}}, "tool_choice", '"type": "auto"'),
        ({"thinking": {"type": "on"}}, "thinking", '"type": "enabled"'),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens", "must be an integer, got null"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens", "must be >= 1024"),
        ({"stop_sequences": "\n"}, "stop_sequences", "must be a list of strings"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"not": {}}}}},
            "output_config.format.schema.not",
            "not supported",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]},
                    {"role": "user", "content": "Go on"},
                ]
            },
            "messages[1].content[0].input",
            "JSON object",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "messages[0].content[0].tool_use_id",
            "tool_use",
        ),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "must not be empty"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content", "must not be empty"),
        *[
            (
                {
                    "messages": [
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", **given}]},
                        {"role": "user", "content": "Go on"},
                    ]
                },
                "messages[1].content[0].input",
                "must be a JSON object",
            )
            for given in ({"input": '{"city": "Paris"}'}, {"input": None}, {})  # (a string is not the object)
        ],
        ({"max_token": 5}, "max_token", "did you mean max_tokens?"),
        ({"stop": ["x"]}, "stop", "did you mean stop_sequences?"),
        ({"max_completion_tokens": 5}, "max_completion_tokens", "did you mean max_tokens?"),
        ({"seed": 7}, "seed", "/v1/chat/completions (Chat Completions) takes it"),
    ],
)
def test_a_bad_messages_body_is_refused_naming_its_field(change: dict, param: str, words: str) -> None:
    body = {"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **change}
    error = error_of(read_messages_request, {k: v for k, v in body.items() if v is not None})
    assert error.param == param and words in error.message and error.message.startswith(param), error.message


def test_message_events_add_up_to_the_whole_message() -> None:
    call = ToolCall("get_weather", '{"city": "Paris"}', "call_abc")
    events = MessageEvents(id="msg_1", model="demo", thinking=True)
    stream = events.render(Prompt(prompt_tokens=100, cached_tokens=90))
    for part in [
        Part("reasoning", "Hmm."),
        Part("reasoning", " Paris."),
        Part("text", "Let me check."),
        Part("call", call=call),
    ]:
        stream += events.part(part)
    stream += events.end(Ending("tool_calls", None, prompt_tokens=100, cached_tokens=90, output_tokens=12))
    names = [name for name, _ in stream]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in stream)
    assert events.message["content"] == [
        {"type": "thinking", "thinking": "Hmm. Paris.", "signature": ""},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert stream[9][1]["content_block"]["input"] == {}  # (the start of a tool_use block carries no input yet)
    assert events.message["stop_reason"] == "tool_use"
    assert events.message["usage"] == {
        "input_tokens": 10,
        "output_tokens": 12,
        "cache_read_input_tokens": 90,
        "cache_creation_input_tokens": 0,
    }
    started, ended = stream[0][1]["message"]["usage"], stream[-2][1]["usage"]  # (the same counts, but the output's)
    assert {**started, "output_tokens": 12} == ended == events.message["usage"]
    unasked = MessageEvents(id="msg_2", model="demo", thinking=False)
    assert unasked.part(Part("reasoning", "Hmm.")) == []  # reasoning not asked for is kept out
    stream += unasked.render(Prompt(5, 0)) + unasked.render(Ending("stop", "END", 5, 0, 3))
    assert unasked.message["stop_reason"] == "stop_sequence" and unasked.message["stop_sequence"] == "END"
    for _, data in stream:  # each event and each Message as the anthropic SDK's types have them, strictly
        check_message_event(data)
    for message in (events.message, unasked.message):
        check_message(message)


# -- OpenAI Responses --------------------------------------------------------------------------------------------


def test_a_responses_body_becomes_the_chat_request_it_means() -> None:
    body = {
        "model": "demo",
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Call it."}],
            },
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "24C"},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "max_output_tokens": 50,
        "text": {"format": {"type": "text"}},
        "reasoning": {"effort": "low"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    read = read_responses_request(body)
    chat = read_body(
        {
            "model": "demo",
            "max_tokens": 50,
            "messages": [
                {"role": "system", "content": "Be brief.\n\nUse tools."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "Call it.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "24C"},
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
        },
        "/v1/chat/completions",
    )
    # the same request, its errors naming the Responses fields (a later check's: the window's)
    names = {"prompt_field": "input", "sampling_keys": {**chat.sampling_keys, "max_new_tokens": "max_output_tokens"}}
    assert read.request == dataclasses.replace(chat, **names)
    schema = read_responses_request(
        {
            "input": "Hi",
            "text": {"format": {"type": "json_schema", "name": "r", "schema": WEATHER_SCHEMA, "strict": True}},
        }
    )
    assert json.loads(schema.request.sampling["grammar"].source) == WEATHER_SCHEMA
    assert read_responses_request({"input": "Hi"}).request.messages == ({"role": "user", "content": "Hi"},)


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
        ({"input": []}, "input", "non-empty list"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "stateless"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type", "not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
            "text only",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"top_p": 2}, "top_p", "in (0, 1]"),
        ({"tools": [{"type": "web_searcher"}]}, "tools[0].type", "function and custom tools"),
        ({"tools": [{"type": "namespace", "tools": []}]}, "tools[0].name", "non-empty string"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
            "tools[0].function",
            "is flat: its name, description and parameters sit beside its type",
        ),
        (  # a function in a namespace is named where it is
            {
                "tools": [
                    {"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f", "parameters": 3}]}
                ]
            },
            "tools[0].tools[0].parameters",
            'JSON schema of "type": "object"',
        ),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": 3}]},
            "tools[0].parameters",
            'JSON schema of "type": "object"',
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"text": {"format": {"type": "json_schema", "name": "r", "schema": {"if": {}}}}},
            "text.format.schema.if",
            "not supported",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format", '"type": "json_schema"'),
        ({"background": True}, "background", "not supported"),
        (
            {
                "input": [
                    {"role": "user", "content": "Hi"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"},
                ]
            },
            "input[1].arguments",
            "not valid JSON",
        ),
        (  # a call that joins the assistant message before it is named as its own item
            {
                "input": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Let me check."},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"},
                ]
            },
            "input[2].arguments",
            "not valid JSON",
        ),
        (  # an output answering no call (OpenAI: "No tool call found for function call output")
            {
                "input": [
                    {"role": "user", "content": "Hi"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "d", "output": "x"},
                ]
            },
            "input[2].call_id",
            'no function_call or custom_tool_call item before it has call_id "d"',
        ),
        # another API's name for a field, a near miss, a Chat Completions field: ignored, they would change nothing
        ({"max_tokens": 5}, "max_tokens", "did you mean max_output_tokens?"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "messages", "did you mean input?"),
        ({"max_output_token": 5}, "max_output_token", "did you mean max_output_tokens?"),
        ({"seed": 7}, "seed", "/v1/chat/completions (Chat Completions) takes it"),
    ],
)
def test_a_bad_responses_body_is_refused_naming_its_field(change: dict, param: str, words: str) -> None:
    error = error_of(read_responses_request, {"model": "demo", "input": "Hi", **change})
    assert error.param == param and words in error.message, (error.param, error.message)


def test_response_events_add_up_to_the_whole_response() -> None:
    call = ToolCall("get_weather", '{"city": "Paris"}', "call_abc")
    echo = read_responses_request({"input": "Hi", "tools": [{"type": "function", "name": "get_weather"}]}).echo
    events = ResponseEvents(id="resp_1", model="demo", created=1, echo=echo)
    stream = events.start()
    for part in [Part("reasoning", "Hmm."), Part("text", "Let me "), Part("text", "check."), Part("call", call=call)]:
        stream += events.part(part)
    ending = Ending("tool_calls", None, prompt_tokens=100, cached_tokens=90, output_tokens=12, reasoning_tokens=3)
    stream += events.end(ending)
    assert [name for name, _ in stream] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in stream] == list(range(len(stream)))
    response = stream[-1][1]["response"]
    assert response["status"] == "completed" and "output_text" not in response  # (the SDKs' property, not a field)
    assert check_response(response).output_text == "Let me check."
    reasoning, message, function_call = response["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Hmm."}]
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert function_call["call_id"] == "call_abc" and function_call["arguments"] == '{"city": "Paris"}'
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 90, "cache_write_tokens": 0}
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    assert stream[2][1]["item"]["content"] == []  # (an item's added event shows it as it was then)
    cut = ResponseEvents(id="resp_2", model="demo", created=1, echo=echo)
    stream += cut.start() + cut.part(Part("text", "Once"))
    last = cut.end(Ending("length", None, 5, 0, 8))[-1]
    assert last[0] == "response.incomplete" and last[1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    failed = ResponseEvents(id="resp_3", model="demo", created=1, echo=echo)
    stream += [last, *failed.start(), *failed.part(Part("text", "Once")), *failed.failed("generation failed: x")]
    for _, data in stream:  # each event and each Response as the openai SDK's types have them, strictly
        check_response_event(data)
    for whole in (events, cut, failed):
        check_response(whole.response)


def test_the_window_check_names_the_responses_fields() -> None:
    """The context window is checked after the body became a chat request: its errors still name `input` and
    `max_output_tokens`, as the client wrote them."""
    from dflash_cli.protocol.requests import check_context

    request = read_responses_request({"input": "Hi", "max_output_tokens": 100}).request
    with pytest.raises(RequestError) as asked:
        check_context(request, 10, 50)
    assert asked.value.param == "max_output_tokens" and asked.value.message.startswith("max_output_tokens is 100")
    with pytest.raises(RequestError) as long:
        check_context(request, 60, 50)
    assert long.value.param == "input"


APPLY_PATCH = {  # Codex's freeform apply_patch tool (a custom tool with a Lark grammar), as it sends it
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap the patch in JSON.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF'},
}  # fmt: skip
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"


def test_a_freeform_tool_is_offered_as_a_function_of_its_input_and_its_calls_come_back_as_custom_tool_calls() -> None:
    """Codex (0.131+) sends apply_patch only as a custom tool: offered to the model as a function whose one string
    argument is the raw input (its grammar in the description), its call goes back as a custom_tool_call item with
    that input, and custom_tool_call / custom_tool_call_output items of earlier turns are read as the call and its
    output."""
    body = {
        "input": [
            {"role": "user", "content": "Add a.txt"},
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": PATCH},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
        ],
        "tools": [APPLY_PATCH],
        "tool_choice": {"type": "custom", "name": "apply_patch"},
    }
    read = read_responses_request(body)
    (function,) = read.request.tools.functions
    assert function["function"]["name"] == "apply_patch" and "lark grammar" in function["function"]["description"]
    assert function["function"]["parameters"]["required"] == ["input"] and read.request.tools.choice == "apply_patch"
    user, called, output = read.request.messages
    (call,) = called["tool_calls"]
    arguments = call["function"]["arguments"]  # (read as chat reads them: the object)
    assert (json.loads(arguments) if isinstance(arguments, str) else arguments) == {"input": PATCH}
    assert call["id"] == "c1"
    assert output == {"role": "tool", "tool_call_id": "c1", "content": "Done!"}
    events = ResponseEvents(id="resp_1", model="demo", created=1, echo=read.echo)
    stream = events.start() + events.part(
        Part("call", call=ToolCall("apply_patch", json.dumps({"input": PATCH}), "c2"))
    )
    stream += events.end(Ending("tool_calls", None, prompt_tokens=10, cached_tokens=0, output_tokens=30))
    assert [name for name, _ in stream][2:-1] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    for _, data in stream:  # as the openai SDK's types have them, strictly
        check_response_event(data)
    (item,) = check_response(events.response).output
    assert (item.type, item.call_id, item.name, item.input) == ("custom_tool_call", "c2", "apply_patch", PATCH)
    assert set(events.response["output"][0]) <= set(type(item).model_fields)  # (strict checks types, not extras)


def test_custom_tools_in_a_namespace_a_resent_empty_input_and_a_picture_after_their_output() -> None:
    """A namespace may hold custom tools (offered, their calls named with it); a call whose input is empty comes
    back as Codex resends it; a picture right after a custom tool's output is left out as after a function's; a
    tool_choice names a tool of its own kind; a regex the grammar library may read differently is only described."""
    namespace = {"type": "namespace", "name": "edit", "tools": [APPLY_PATCH]}
    read = read_responses_request({"input": "Hi", "tools": [{"type": "web_search"}, namespace]})
    assert [f["function"]["name"] for f in read.request.tools.functions] == ["apply_patch"]
    events = ResponseEvents(id="resp_1", model="demo", created=1, echo=read.echo)
    events.part(Part("call", call=ToolCall("apply_patch", '{"input": ""}', "c1")))
    assert events.response["output"][0] | {"id": ""} == {
        "id": "", "type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "", "namespace": "edit"
    }  # fmt: skip
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    turn = [
        {"role": "user", "content": "Look"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": ""},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"},
        {"role": "user", "content": [image]},
    ]
    assert read_responses_request({"input": turn, "tools": [APPLY_PATCH]}).request.messages[-1]["role"] == "user"
    function = {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}}
    wrong = {"input": "Hi", "tools": [APPLY_PATCH, function], "tool_choice": {"type": "custom", "name": "shell"}}
    assert error_of(read_responses_request, wrong).param == "tool_choice"
    for regex, held in (
        ("(add|remove) [a-z]{1,8}\\.txt", True),
        ("\\p{L}+", False),
        ("(?s).*", False),
        ("a\\nb", False),
    ):
        tool = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "regex", "definition": regex}}
        (offered,) = read_responses_request({"input": "Hi", "tools": [tool]}).request.tools.functions
        text = offered["function"]["parameters"]["properties"]["input"]
        assert ("pattern" in text) == held and (held or regex in offered["function"]["description"])
