"""`dflash serve`'s agent APIs, on the real server of helpers/served.py (a tiny Qwen3 with a random drafter): Anthropic
Messages driven by the official `anthropic` SDK and LangChain's ChatAnthropic, OpenAI Responses by the official
`openai` SDK, and raw HTTP. Each route runs the path /v1/chat/completions runs, so its answers are checked against
that route's answers to the same conversation."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from dflash_cli.commands.serve.http import Server
from dflash_cli.commands.serve.metrics import ServerMetrics
from dflash_cli.commands.serve.worker import EngineThread, Worker
from dflash_cli.engine import collect
from dflash_cli.loading.session import Session
from dflash_cli.protocol.replies import Ending, Part
from dflash_cli.protocol.requests import CHAT_URL, read_body
from helpers.sdk_types import check_message, check_message_event, check_response, check_response_event
from helpers.served import (  # the fixtures (a server and its models, once per module), and their helpers
    BUSY,
    KEY,
    MAX_TOKENS,
    RECORD,
    WEATHER,
    WINDOW,
    RunningServer,
    client,
    expected_chat,
    local_options,
    long_prompt,
    model_flags,
    models,
    raw_request,
    running_server,
    server,
    session,
    user,
)
from helpers.tiny_models import CHAT_TEMPLATE, MODEL_VOCAB

__all__ = ["client", "long_prompt", "models", "server", "session"]  # (fixtures, imported to be used here)
pytestmark = pytest.mark.slow  # real servers in subprocesses

TOOL = {  # WEATHER, as Anthropic's tools are written
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
FUNCTION = {"type": "function", **{k: v for k, v in WEATHER["function"].items()}}  # as Responses' tools are


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def chat_reply(client: openai.OpenAI, server: RunningServer, messages: list[dict[str, Any]], **fields: Any) -> Any:
    return client.chat.completions.create(model=server.target, messages=messages, **fields)


NO_THINKING = {"enable_thinking": False}  # the template's kwargs for a Messages request without `thinking`


def chat_as_message(client: openai.OpenAI, server: RunningServer, messages: list[dict[str, Any]], **fields: Any) -> Any:
    """The chat completion of a Messages request's conversation (thinking off, as a request without it has)."""
    return chat_reply(client, server, messages, extra_body={"chat_template_kwargs": NO_THINKING}, **fields)


def sse_events(port: int, path: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed reply's events as sent: (event name, data)."""
    headers = {"x-api-key": KEY, "Content-Type": "application/json", "anthropic-version": "2023-06-01"}
    status, _, raw = raw_request(port, "POST", path, json.dumps(body).encode(), headers)
    assert status == 200, raw
    events = []
    for block in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


@contextlib.contextmanager
def serving(session: Session, models: tuple[Path, Path], *, fill_window: bool = True) -> Iterator[Server]:
    """The server's side of a route, in this process, over a worker of its own (the routes call its `parts`);
    `fill_window`: as `dflash serve` without --max-tokens."""
    engine = EngineThread()
    worker = Worker(session, engine, speculative=True, max_queue=4)
    metrics = ServerMetrics(model=session.served_name, speculative=True, block_size=session.block_size,
                            waiting=lambda: worker.waiting, running=lambda: worker.running)  # fmt: skip
    worker.start()
    try:
        yield Server(session, local_options(models), worker, metrics, None, fill_window=fill_window)
    finally:
        worker.stop()
        worker.join(30)
        engine.close()


@pytest.fixture
def backend(session: Session, models: tuple[Path, Path]) -> Iterator[Server]:
    with serving(session, models) as server:
        yield server


def parts_of(backend: Server, body: dict[str, Any], **how: bool) -> list[Part | Ending]:
    """A chat body's reply as `Server.parts` gives it to a route (`how`: its keywords)."""

    async def reply() -> list[Part | Ending]:
        request = read_body(body, CHAT_URL)
        running = backend.submit([await backend.prepare(request)])[0]
        return [part async for part in backend.parts(running, request, **how)]

    return asyncio.run(reply())


def test_the_stop_string_that_ended_a_reply_is_found_only_when_asked(
    backend: Server, session: Session, models: tuple[Path, Path]
) -> None:
    """Naming it decodes the whole reply (under the tokenizer's lock): Messages asks, the chat route does not."""
    full = expected_chat(session, models, user("Tell me a story.")).text
    at = next(k for k in range(3, len(full) - 2) if full.find(full[k : k + 2]) == k and full[k : k + 2].isalnum())
    body = {"messages": user("Tell me a story."), "stop": [full[at : at + 2]]}
    *texts, asked = parts_of(backend, body, stop_sequence=True)
    assert isinstance(asked, Ending) and (asked.finish_reason, asked.stop_sequence) == ("stop", full[at : at + 2])
    assert "".join(part.text for part in texts if isinstance(part, Part)) == full[:at]
    unasked = parts_of(backend, body)[-1]
    assert isinstance(unasked, Ending) and (unasked.finish_reason, unasked.stop_sequence) == ("stop", None)


# ---------------------------------------------------------------------------------------------------------------
# Anthropic Messages


def test_a_message_whole_and_streamed_is_the_chat_completion_of_its_conversation(
    server: RunningServer, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    system, messages = "You are terse.", user("Tell me a story.")
    chat = chat_as_message(client, server, [{"role": "system", "content": system}, *messages], max_tokens=12)
    reply = claude.messages.create(model=server.target, system=system, messages=messages, max_tokens=12)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert text_of(reply) == chat.choices[0].message.content and reply.model == server.target
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    usage = reply.usage  # Anthropic's input_tokens are the prompt's tokens not read from the cache
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.cache_read_input_tokens == chat.usage.prompt_tokens - 1  # the same prompt again: all but its last

    with claude.messages.stream(model=server.target, system=system, messages=messages, max_tokens=12) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(deltas) > 1 and "".join(deltas) == text_of(reply)
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in reply.content]
    assert final.stop_reason == reply.stop_reason
    assert (
        final.usage.output_tokens == usage.output_tokens
        and final.usage.cache_read_input_tokens == usage.cache_read_input_tokens
    )

    body = {"model": server.target, "max_tokens": 12, "messages": messages, "stream": True}
    events = sse_events(server.port, "/v1/messages?beta=true", body)  # (Claude Code's URL)
    names = [name for name, _ in events]
    started, ended = events[0][1]["message"]["usage"], events[-2][1]["usage"]  # both know the cache's part
    assert {**started, "output_tokens": ended["output_tokens"]} == ended and ended["cache_read_input_tokens"] > 0
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_claude_codes_request_shape_runs_to_the_window_with_its_system_message_in_place(
    server: RunningServer, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """Claude Code 2.1 (run against `dflash serve demo`) asks for max_tokens 32,000 whatever the model and sends a
    system message mid-conversation (beta mid-conversation-system-2026-04-07), with thinking adaptive, an effort
    and context_management: served as Anthropic's API serves them, the reply running until the context window is
    full (stop_reason model_context_window_exceeded) with the system message rendered where it was sent."""
    room = 6
    for word in ("lorem ", "tell me more ", "story time ", "x "):

        def conversation(n: int, word: str = word) -> list[dict[str, Any]]:
            return [*user(word * n), {"role": "system", "content": "Answer at length."}]

        def length(n: int) -> int:
            return claude.messages.count_tokens(model=server.target, messages=conversation(n)).input_tokens

        low, high = 1, WINDOW  # the most repeats that leave at least `room` tokens
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if length(middle) <= WINDOW - room else (low, middle - 1)
        messages, left = conversation(low), WINDOW - length(low)
        chat = chat_as_message(client, server, messages, max_tokens=left)
        if chat.choices[0].finish_reason == "length":  # a reply that fills the window
            break
    else:
        raise AssertionError("no filler keeps the tiny model talking to the end of its window")
    body = {
        "model": server.target, "max_tokens": 32000, "messages": messages, "stream": True,
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }  # fmt: skip
    events = sse_events(server.port, "/v1/messages?beta=true", body)
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "model_context_window_exceeded", events[-2:]
    usage = delta["usage"]  # (thinking on: the template renders a shorter prompt, so the room is larger)
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"] == WINDOW
    whole = claude.messages.create(model=server.target, messages=messages, max_tokens=32000)
    assert whole.stop_reason == "model_context_window_exceeded" and text_of(whole) == chat.choices[0].message.content
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens + whole.usage.output_tokens == WINDOW
    enough = claude.messages.create(model=server.target, messages=messages, max_tokens=left)  # room enough: as before
    assert enough.stop_reason == "max_tokens" and text_of(enough) == text_of(whole)


def test_stop_sequences_end_a_message_and_are_named(
    server: RunningServer, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    full = chat_as_message(client, server, user("Tell me a story."), max_tokens=16).choices[0].message.content
    at = next(k for k in range(3, len(full) - 2) if full.find(full[k : k + 2]) == k and full[k : k + 2].strip())
    stop = full[at : at + 2]
    fields = {"model": server.target, "messages": user("Tell me a story."), "max_tokens": 16, "stop_sequences": [stop]}
    reply = claude.messages.create(**fields)
    assert (text_of(reply), reply.stop_reason, reply.stop_sequence) == (full[:at], "stop_sequence", stop)
    with claude.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    assert (text_of(final), final.stop_reason, final.stop_sequence) == (full[:at], "stop_sequence", stop)


def test_stop_sequences_cut_replies_under_tools_whole_and_streamed_on_every_route(
    server: RunningServer, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """With tools the reply is read raw (special tokens kept, for the calls): that text is cut at the stop string
    as the engine's is, whole and streamed, on the chat and the Messages routes."""
    messages = user("Tell me a story.")
    full = chat_as_message(client, server, messages, tools=[WEATHER], max_tokens=16).choices[0].message.content
    at = next(  # (a random model writes broken characters too: the stop string is two plain ones)
        k for k in range(3, len(full) - 2) if full.find(full[k : k + 2]) == k and full[k : k + 2].isalnum()
    )
    stop = full[at : at + 2]
    chat = chat_as_message(client, server, messages, tools=[WEATHER], max_tokens=16, stop=[stop])
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (full[:at], "stop")
    chunks = list(chat_as_message(client, server, messages, tools=[WEATHER], max_tokens=16, stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full[:at]
    fields = {"model": server.target, "messages": messages, "max_tokens": 16, "stop_sequences": [stop], "tools": [TOOL]}
    reply = claude.messages.create(**fields)
    assert (text_of(reply), reply.stop_reason, reply.stop_sequence) == (full[:at], "stop_sequence", stop)
    with claude.messages.stream(**fields) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(deltas) == text_of(final) == full[:at] and final.stop_sequence == stop


def test_a_forced_tool_call_and_its_result_turn(
    server: RunningServer, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """tool_choice any: the call is constrained by the tool's schema (even a random model's input is valid), comes
    back as a tool_use block with its input parsed, whole and streamed; its tool_result turn is answered."""
    fields = {
        "model": server.target,
        "messages": user("Weather in Paris?"),
        "tools": [TOOL],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "max_tokens": 200,
    }
    reply = claude.messages.create(**fields)
    (call,) = reply.content
    assert reply.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, TOOL["input_schema"])
    assert call.id.startswith("toolu_")
    chat = chat_as_message(client, server, user("Weather in Paris?"), tools=[WEATHER], tool_choice="required",
                      parallel_tool_calls=False, max_tokens=200)  # fmt: skip
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == call.input

    with claude.messages.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", call.input)]
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(partial)) == call.input and final.stop_reason == "tool_use"

    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny, 24C"}]}
    history = [
        *user("Weather in Paris?"),
        {"role": "assistant", "content": reply.content},
        {"role": "user", "content": [result]},
    ]
    answer = claude.messages.create(model=server.target, messages=history, tools=[TOOL], max_tokens=8)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    assert answer.usage.cache_read_input_tokens > 0  # the call's conversation, continued


def test_an_image_a_tool_returned_does_not_end_the_session(server: RunningServer, claude: anthropic.Anthropic) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    history = [
        *user("What is in a.png?"),
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "a.png"}}],
        },  # fmt: skip
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]},
    ]
    reply = claude.messages.create(model=server.target, messages=history, tools=[TOOL], max_tokens=4)
    assert reply.usage.output_tokens > 0
    history += [{"role": "assistant", "content": "It is a picture."}, *user("Thanks.")]  # (the next turn resends it)
    assert claude.messages.count_tokens(model=server.target, messages=history, tools=[TOOL]).input_tokens > 0


def test_count_tokens_counts_the_prompt_the_template_renders(
    server: RunningServer, client: openai.OpenAI, claude: anthropic.Anthropic, session: Session
) -> None:
    system, messages = "Be brief.", user("Weather in Rome?")
    with_tools = claude.messages.count_tokens(model=server.target, system=system, messages=messages, tools=[TOOL])
    chat = chat_as_message(client, server, [{"role": "system", "content": system}, *messages], tools=[WEATHER],
                           max_tokens=1)  # fmt: skip
    assert with_tools.input_tokens == chat.usage.prompt_tokens
    alone = claude.messages.count_tokens(model=server.target, system=system, messages=messages)
    assert alone.input_tokens == len(
        session.encode_chat([{"role": "system", "content": system}, *messages], NO_THINKING)
    )
    assert alone.input_tokens < with_tools.input_tokens
    # thinking reaches the template as enable_thinking (the tiny template, like Qwen3's, writes an empty
    # reasoning block when it is off)
    off = claude.messages.count_tokens(model=server.target, messages=messages, thinking={"type": "disabled"})
    on = claude.messages.count_tokens(
        model=server.target, messages=messages, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    absent = claude.messages.count_tokens(model=server.target, messages=messages)  # (no thinking: none)
    assert absent.input_tokens == off.input_tokens > on.input_tokens


def test_count_tokens_counts_a_prompt_longer_than_the_window(
    server: RunningServer, claude: anthropic.Anthropic, session: Session
) -> None:
    """A count is not a generation: a prompt over the context window is counted (Claude Code counts to compact),
    and only generating from it is refused."""
    messages = user("Lorem ipsum dolor sit amet. " * 400)
    length = len(session.encode_chat(messages, NO_THINKING))
    assert length > WINDOW
    assert claude.messages.count_tokens(model=server.target, messages=messages).input_tokens == length
    with pytest.raises(anthropic.BadRequestError, match=f"prompt is too long: {length} tokens > {WINDOW - 1} maximum"):
        claude.messages.create(model=server.target, messages=messages, max_tokens=4)


def test_structured_output_through_the_same_grammar(server: RunningServer, claude: anthropic.Anthropic) -> None:
    body = {"model": server.target, "max_tokens": 40, "messages": user("Describe it"),
            "output_config": {"format": {"type": "json_schema", "schema": RECORD}}}  # fmt: skip
    status, _, raw = raw_request(
        server.port,
        "POST",
        "/v1/messages",
        json.dumps(body).encode(),
        {"x-api-key": KEY, "anthropic-version": "1", "Content-Type": "application/json"},
    )
    reply = json.loads(raw)
    assert status == 200 and reply["stop_reason"] == "end_turn", reply
    jsonschema.validate(json.loads(reply["content"][0]["text"]), RECORD)


def test_bad_messages_get_anthropics_errors(server: RunningServer, claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=server.target, messages=user("Hi"), max_tokens=0)
    assert bad.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens must be >= 1, got 0"},
    }
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
        claude.messages.create(model=server.target, messages=[{"role": "user", "content": [image]}], max_tokens=4)
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-opus-4-1", messages=user("Hi"), max_tokens=4)
    assert missing.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model=server.target, messages=user("Hi"), max_tokens=4)
    assert denied.value.body["error"]["type"] == "authentication_error"
    headers = {"x-api-key": KEY, "Content-Type": "application/json"}
    status, _, raw = raw_request(
        server.port, "POST", "/v1/messages", json.dumps({"messages": user("Hi")}).encode(), headers
    )
    assert status == 400 and json.loads(raw)["error"]["message"].startswith("max_tokens is required")
    status, _, raw = raw_request(server.port, "POST", "/v1/messages", b" " * (33 * 2**20), headers)
    assert status == 413 and json.loads(raw)["error"]["type"] == "request_too_large"
    status, _, raw = raw_request(server.port, "GET", "/v1/messages", None, headers)
    assert status == 405 and json.loads(raw)["type"] == "error"


def test_the_anthropic_client_lists_the_served_model(server: RunningServer, claude: anthropic.Anthropic) -> None:
    """GET /v1/models answers both clients: Anthropic's page and card fields beside OpenAI's."""
    page = claude.models.list()
    (card,) = page.data
    assert (card.id, card.type, card.display_name) == (server.target, "model", server.target)
    assert card.created_at.tzinfo is not None and not page.has_more and page.first_id == page.last_id == card.id
    assert claude.models.retrieve(server.target) == card
    assert (card.max_input_tokens, card.max_tokens, card.lifecycle) == (WINDOW - 1, WINDOW - 1, "active")
    anthropic.types.ModelInfo.model_validate(card.model_dump())  # (strictly: the SDK builds it unchecked)


def test_langchain_chat_anthropic(server: RunningServer, client: openai.OpenAI) -> None:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=server.target, base_url=server.url, api_key=KEY, max_tokens=10, max_retries=0)
    reply = llm.invoke("Name a color.")
    assert (
        reply.text == chat_as_message(client, server, user("Name a color."), max_tokens=10).choices[0].message.content
    )
    assert reply.usage_metadata["output_tokens"] > 0
    forced = llm.bind_tools([TOOL], tool_choice="get_weather", parallel_tool_calls=False)
    called = forced.invoke("Weather in Paris?", max_tokens=200)
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and called.response_metadata["stop_reason"] == "tool_use"
    jsonschema.validate(call["args"], TOOL["input_schema"])


def test_a_long_system_prompt_is_reused_turn_after_turn_as_chat_completions_answer(
    server: RunningServer, client: openai.OpenAI, claude: anthropic.Anthropic, session: Session, models: Any
) -> None:
    """An agent's loop: each turn resends the conversation; from the second on, the slot that answered the last
    turn holds its prompt and reply, so all of the system prompt and more is read from the cache; the answers are
    those of /v1/chat/completions and of a session that prefills everything."""
    system = "You are a coding agent. Follow the rules. " * 20
    history: list[dict[str, Any]] = []
    for turn, question in enumerate(["List the files.", "Open the first.", "Fix the bug."]):
        history.append({"role": "user", "content": question})
        reply = claude.messages.create(model=server.target, system=system, messages=history, max_tokens=6)
        chat = chat_as_message(client, server, [{"role": "system", "content": system}, *history], max_tokens=6)
        assert text_of(reply) == chat.choices[0].message.content
        if turn:
            system_tokens = len(session.encode_chat([{"role": "system", "content": system}]))
            assert reply.usage.cache_read_input_tokens > system_tokens
        history.append({"role": "assistant", "content": text_of(reply)})
    session.prefix_cache = False
    try:
        params = session.sampling_params(local_options(models), max_new_tokens=6)
        fresh = collect(
            session.stream(
                session.encode_chat([{"role": "system", "content": system}, *history[:-1]], NO_THINKING), params
            )
        )
    finally:
        session.prefix_cache = True
    assert fresh.text == history[-1]["content"]


def test_claude_codes_billing_header_does_not_defeat_prefix_reuse(
    server: RunningServer, claude: anthropic.Anthropic, session: Session
) -> None:
    """Claude Code's first system block carries a nonce new each request (cch=): it is left out of the prompt, so
    two requests that differ only there share the whole system prompt in the cache."""
    rules = "You are a coding agent. Read before you edit. " * 20
    replies = []
    for nonce in ("5f1e2", "a9c03"):
        header = f"x-anthropic-billing-header: cc_version=2.1.36.e1f; cc_entrypoint=cli; cch={nonce};"
        system = [{"type": "text", "text": header}, {"type": "text", "text": rules}]
        replies.append(claude.messages.create(model=server.target, system=system, messages=user("Hi"), max_tokens=2))
    system_tokens = len(session.encode_chat([{"role": "system", "content": rules}]))
    assert replies[1].usage.cache_read_input_tokens > system_tokens
    assert replies[1].usage.input_tokens + replies[1].usage.cache_read_input_tokens == len(
        session.encode_chat([{"role": "system", "content": rules}, *user("Hi")], NO_THINKING)
    )


# ---------------------------------------------------------------------------------------------------------------
# OpenAI Responses


def test_a_response_whole_and_streamed_is_the_chat_completion_of_its_input(
    server: RunningServer, client: openai.OpenAI
) -> None:
    chat = chat_reply(client, server, [{"role": "system", "content": "Be terse."}, *user("Hello!")], max_tokens=10)
    reply = client.responses.create(model=server.target, instructions="Be terse.", input="Hello!", max_output_tokens=10)
    assert (
        reply.object == "response"
        and reply.id.startswith("resp_")
        and reply.output_text == chat.choices[0].message.content
    )
    cut = chat.choices[0].finish_reason == "length"
    assert reply.status == ("incomplete" if cut else "completed")
    assert (reply.incomplete_details.reason if cut else reply.incomplete_details) == (
        "max_output_tokens" if cut else None
    )
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.input_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1
    events = list(client.responses.create(model=server.target, instructions="Be terse.", input="Hello!",
                                          max_output_tokens=10, stream=True))  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if cut else "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    assert events[-1].response.output_text == reply.output_text
    item = "incomplete" if cut else "completed"  # (a message cut by max_output_tokens is marked so, as OpenAI does)
    assert reply.output[-1].status == events[-2].item.status == events[-1].response.output[-1].status == item


def test_a_response_without_max_output_tokens_may_fill_the_context_window(
    session: Session, models: tuple[Path, Path], long_prompt: str
) -> None:
    """OpenAI's default is unbounded, and Codex sends no max_output_tokens: served without --max-tokens, the reply
    is not cut at the default (MAX_TOKENS here) but may run until the window is full (the openai client through
    the server's own app, in this process)."""
    import httpx

    async def replies() -> tuple[Any, Any]:
        with serving(session, models) as backend:
            transport = httpx.ASGITransport(app=backend.app())
            async with httpx.AsyncClient(transport=transport, base_url="http://dflash") as http:
                client = openai.AsyncOpenAI(base_url="http://dflash/v1", api_key="-", http_client=http)
                whole = await client.responses.create(model=backend.model, input=long_prompt)
                bounded = await client.responses.create(
                    model=backend.model, input=long_prompt, max_output_tokens=MAX_TOKENS + 1
                )
                return whole, bounded

    reply, bounded = asyncio.run(replies())
    assert reply.max_output_tokens is None and reply.usage.output_tokens > MAX_TOKENS
    assert reply.status == "completed" or reply.usage.input_tokens + reply.usage.output_tokens == WINDOW
    assert bounded.status == "incomplete" and bounded.usage.output_tokens == MAX_TOKENS + 1


def test_the_operators_max_tokens_caps_a_response_asked_without_max_output_tokens(
    server: RunningServer, client: openai.OpenAI, long_prompt: str
) -> None:
    """Served with --max-tokens (the suite's server: MAX_TOKENS), that is the default of a reply asked without
    max_output_tokens, as of every route's: the operator's bound holds (a looping reply holds no slot for minutes)."""
    reply = client.responses.create(model=server.target, input=long_prompt)
    assert reply.status == "incomplete" and reply.usage.output_tokens == MAX_TOKENS


def test_a_forced_function_call_and_its_output_turn(server: RunningServer, client: openai.OpenAI) -> None:
    fields = {"model": server.target, "tools": [FUNCTION], "tool_choice": "required", "parallel_tool_calls": False,
              "max_output_tokens": 200}  # fmt: skip
    reply = client.responses.create(input="Weather in Paris?", **fields)
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    assert reply.status == "completed"
    events = list(client.responses.create(input="Weather in Paris?", stream=True, **fields))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == json.loads(call.arguments)
    turn = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24C"},
    ]
    answer = client.responses.create(model=server.target, input=turn, tools=[FUNCTION], max_output_tokens=6)
    assert answer.status in ("completed", "incomplete") and answer.usage.input_tokens_details.cached_tokens > 0


def test_codexs_freeform_apply_patch_is_called_and_its_output_read(
    server: RunningServer, client: openai.OpenAI
) -> None:
    """Codex 0.131+ sends apply_patch only as a custom (freeform) tool, which was left out (no tool to edit files
    with): it is offered, a forced call of it comes back as a custom_tool_call with its raw input, whole and
    streamed, and that call and its custom_tool_call_output are read on the next turn. (A regex format holds the
    random model's input to a short one: a Lark grammar is only described.)"""
    form = {"type": "grammar", "syntax": "regex", "definition": "(add|remove) [a-z]{1,8}\\.txt"}
    patch_tool = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.", "format": form}
    fields = {"model": server.target, "tools": [patch_tool], "tool_choice": "required", "parallel_tool_calls": False,
              "max_output_tokens": 200}  # fmt: skip
    reply = client.responses.create(input="Add a file a.txt", **fields)
    (call,) = reply.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    assert re.fullmatch(form["definition"], call.input), call.input
    events = list(client.responses.create(input="Add a file a.txt", stream=True, **fields))
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == call.input
    turn = [
        {"role": "user", "content": "Add a file a.txt"},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": call.name, "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"},
    ]
    answer = client.responses.create(model=server.target, input=turn, tools=[patch_tool], max_output_tokens=6)
    assert answer.status in ("completed", "incomplete") and answer.usage.input_tokens_details.cached_tokens > 0


def test_codexs_tools_namespaced_functions_are_offered_and_hosted_ones_left_out(
    server: RunningServer, client: openai.OpenAI
) -> None:
    """Codex 0.171 (run against `dflash serve demo`) sends web_search and a namespace of functions beside its
    function tools (both were a 400): the namespace's functions are offered by name and a call of one names its
    namespace; tools OpenAI's servers run are not offered, and the reply is the one without them."""
    namespace = {"type": "namespace", "name": "weather_v1", "description": "Weather tools", "tools": [FUNCTION]}
    fields = {"model": server.target, "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 200}
    plain = client.responses.create(input="Weather in Paris?", tools=[FUNCTION], **fields)
    codex = client.responses.create(
        input="Weather in Paris?", tools=[{"type": "web_search", "external_web_access": False}, namespace], **fields
    )
    (call,), (plain_call,) = codex.output, plain.output
    assert call.type == "function_call" and call.name == "get_weather" and call.namespace == "weather_v1"
    assert call.arguments == plain_call.arguments and plain_call.namespace is None
    assert [tool.type for tool in codex.tools] == ["web_search", "namespace"]  # (echoed as sent)
    events = list(client.responses.create(input="Weather in Paris?", stream=True, tools=[namespace], **fields))
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.namespace == "weather_v1" and done.item.arguments == call.arguments


def test_json_schema_text_format_validates_and_is_the_chat_routes(server: RunningServer, client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "record", "schema": RECORD, "strict": True}
    reply = client.responses.create(
        model=server.target, input="Describe it", text={"format": fmt}, max_output_tokens=40
    )
    jsonschema.validate(json.loads(reply.output_text), RECORD)
    chat = chat_reply(client, server, user("Describe it"), max_tokens=40,
                      response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}})  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content and reply.status == "completed"
    with client.responses.stream(model=server.target, input=[{"role": "user", "content": "Describe it"}],
                                 text={"format": fmt}, max_output_tokens=40) as stream:  # fmt: skip
        final = stream.get_final_response()  # (the SDK's own event parser)
    assert final.output_text == reply.output_text and final.usage.input_tokens_details.cached_tokens > 0


def test_bad_responses_get_openais_errors(server: RunningServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="send the whole conversation in `input`") as stateless:
        client.responses.create(model=server.target, input="Hi", previous_response_id="resp_123")
    assert stateless.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError, match="max_output_tokens must be >= 1") as bad:
        client.responses.create(model=server.target, input="Hi", max_output_tokens=0)
    assert bad.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="Hi")
    for call in (  # a stored response's routes, and compaction: a 404 that says why
        lambda: client.responses.retrieve("resp_123"),
        lambda: client.responses.delete("resp_123"),
        lambda: client.post("/responses/compact", body={"input": "Hi"}, cast_to=object),
    ):
        with pytest.raises(openai.NotFoundError, match="this server keeps no responses"):
            call()


def test_a_schema_the_grammar_library_refuses_is_named_as_each_api_has_it(
    server: RunningServer, client: openai.OpenAI
) -> None:
    """Refused when the request is admitted (the grammar compiled), after it was read as a chat body: the error
    names the field as the Responses or Messages body has it, not as the chat body it was read as."""
    bad = {"type": "object", "properties": {"a": {"type": "strnig"}}}
    tool = {"type": "function", "name": "f", "parameters": bad}
    cases = [
        ({"text": {"format": {"type": "json_schema", "name": "r", "schema": bad}}}, "text.format.schema"),
        (  # (web_search: not offered; a forced call's grammar follows the tool's parameters)
            {"tools": [{"type": "web_search"}, tool], "tool_choice": {"type": "function", "name": "f"}},
            "tools[1].parameters",
        ),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.responses.create(model=server.target, input="Hi", max_output_tokens=4, **fields)
        error = raised.value.body
        assert error["param"] == param and error["message"].startswith(f"{param}: the grammar library"), error
        assert 'Unsupported type "strnig"' in error["message"] and "function" not in error["message"], error
    headers = {"x-api-key": KEY, "Content-Type": "application/json", "anthropic-version": "2023-06-01"}
    cases = [
        ({"output_config": {"format": {"type": "json_schema", "schema": bad}}}, "output_config.format.schema"),
        ({"tools": [{"name": "f", "input_schema": bad}], "tool_choice": {"type": "any"}}, "tools[0].input_schema"),
    ]
    for fields, field in cases:
        body = {"model": server.target, "max_tokens": 4, "messages": user("Hi"), **fields}
        status, _, raw = raw_request(server.port, "POST", "/v1/messages", json.dumps(body).encode(), headers)
        error = json.loads(raw)["error"]
        assert status == 400 and error["message"].startswith(f"{field}: the grammar library"), error
        body["tool_choice"] = {"type": "auto"}  # (offered, not enforced: an agent's odd tool ends no turn)
        if "tools" in body:
            status, _, raw = raw_request(server.port, "POST", "/v1/messages", json.dumps(body).encode(), headers)
            assert status == 200, raw


def test_metrics_count_each_route(server: RunningServer, claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    claude.messages.count_tokens(model=server.target, messages=user("Hi"))
    claude.messages.create(model=server.target, messages=user("Hi"), max_tokens=2)
    client.responses.create(model=server.target, input="Hi", max_output_tokens=2)
    metrics = server.get("/metrics")[1]
    for route in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses"):
        assert f'dflash_http_requests_total{{route="{route}",status="200"}}' in metrics


def test_every_event_and_object_sent_passes_the_sdks_strict_types(server: RunningServer) -> None:
    """What the server sends, as sent (the SDKs' clients build their objects without validation): text cut by
    the token limit and a forced call, whole and streamed, on both APIs."""
    headers = {"x-api-key": KEY, "Content-Type": "application/json", "anthropic-version": "2023-06-01"}
    forced = {"tools": [TOOL], "tool_choice": {"type": "any"}, "max_tokens": 200}
    for fields in ({"max_tokens": 4}, forced):
        body = {"model": server.target, "messages": user("Weather in Paris?"), **fields}
        status, _, raw = raw_request(server.port, "POST", "/v1/messages", json.dumps(body).encode(), headers)
        assert status == 200 and check_message(json.loads(raw)).stop_reason in ("max_tokens", "tool_use")
        for _, data in sse_events(server.port, "/v1/messages", {**body, "stream": True}):
            check_message_event(data)
    forced = {"tools": [FUNCTION], "tool_choice": "required", "max_output_tokens": 200}
    for fields in ({"max_output_tokens": 4}, forced):
        body = {"model": server.target, "input": "Weather in Paris?", **fields}
        status, _, raw = raw_request(server.port, "POST", "/v1/responses", json.dumps(body).encode(), headers)
        assert status == 200 and check_response(json.loads(raw)).status in ("incomplete", "completed")
        events = sse_events(server.port, "/v1/responses", {**body, "stream": True})
        for _, data in events:
            check_response_event(data)
        assert check_response(events[-1][1]["response"]).usage.input_tokens_details.cache_write_tokens == 0


def test_a_stream_whose_client_is_gone_before_it_starts_is_cancelled(server: RunningServer, long_prompt: str) -> None:
    """A client that sends a streaming request and goes away at once, on every streaming route: its job is
    cancelled, not decoded to max_tokens for nobody (the stream's own cleanup never runs when it never starts)."""
    bodies = {
        "/v1/chat/completions": {"messages": user(long_prompt), "max_tokens": BUSY},
        "/v1/messages": {"messages": user(long_prompt), "max_tokens": BUSY},
        "/v1/responses": {"input": long_prompt, "max_output_tokens": BUSY},
    }
    for path, body in bodies.items():
        finished = {reason: server.metric(f'dflash_requests_finished_total{{finish_reason="{reason}"}}')
                    for reason in ("cancelled", "length")}  # fmt: skip
        payload = json.dumps({**body, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            raw.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
        deadline = time.monotonic() + 60
        while sum(server.metric(f'dflash_requests_finished_total{{finish_reason="{r}"}}') for r in finished) <= sum(
            finished.values()
        ):
            assert time.monotonic() < deadline, path
            time.sleep(0.05)
        now = {
            reason: server.metric(f'dflash_requests_finished_total{{finish_reason="{reason}"}}') for reason in finished
        }
        assert now == {"cancelled": finished["cancelled"] + 1, "length": finished["length"]}, path


def test_an_event_stream_closes_however_it_ends() -> None:
    """The job's cancel runs when the response ends: sent whole, or the client gone before the first event, when
    the events never start (a server that raises on a closed socket: ASGI 2.4), so their own cleanup never runs."""
    from starlette.requests import ClientDisconnect

    from dflash_cli.commands.serve.wire import event_stream

    async def answer(send: Any) -> tuple[list[str], list[bool]]:
        began, closed = [], []

        async def events() -> Any:
            began.append(True)
            yield "data: 1\n\n"

        async def receive() -> dict[str, str]:
            return {"type": "http.disconnect"}

        response = event_stream(events(), lambda error: [], lambda: closed.append(True))
        try:
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        except ClientDisconnect:
            pass
        return began, closed

    async def gone(message: Any) -> None:
        raise OSError("the client closed the connection")

    async def there(message: Any) -> None:
        pass

    assert asyncio.run(answer(gone)) == ([], [True])
    assert asyncio.run(answer(there)) == ([True], [True])


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing: 1,000 bad bodies get a 4xx in their API's shape; the requests beside them lose nothing


def bad_bodies(rng: random.Random, count: int) -> Iterator[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers) of Messages and Responses requests that are wrong in one way."""
    messages_headers = {"x-api-key": KEY, "Content-Type": "application/json", "anthropic-version": "2023-06-01"}
    responses_headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    message = {"max_tokens": 4, "messages": user("Hi")}
    response = {"input": "Hi", "max_output_tokens": 4}
    bad_messages: dict[str, list[Any]] = {
        "messages": [None, [], "Hi", [1], [{}], [{"role": "system", "content": "x"}], [{"role": "user", "content": 5}],
                     [{"role": "user", "content": []}],
                     [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                     [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"text": "x"}]}],
                     [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
                     [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5}]}],
                     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Prefill"}],
                     [{"role": "user", "content": "\ud800"}]],
        "max_tokens": [None, 0, -1, 2.5, "10", True, []],
        "temperature": [-0.5, "hot", True, [1]],
        "top_p": [0, 1.5, "1"],
        "top_k": [-2, 1.5, "k"],
        "stop_sequences": [[""], 5, [5]],
        "system": [5, [{"type": "image"}], [{"type": "text", "text": 3}]],
        "tools": ["x", [1], [{"name": "bad name!"}], [{"type": "bash_20250124", "name": "bash"}],
                  [{"name": "f", "input_schema": 3}], [{"name": "f"}, {"name": "f"}]],
        "tool_choice": [{"type": "any"}, "auto", {"type": "tool"}, {"type": "nope"}],
        "thinking": ["on", {"type": "sometimes"}],
        "stream": ["yes", 1],
        "model": [5, "claude-sonnet-4-5"],
        "mcp_servers": [[{"type": "url", "url": "http://x"}]],
        "output_config": [{"format": {"type": "yaml"}}, {"format": {"type": "json_schema", "schema": {"not": {}}}}],
    }  # fmt: skip
    bad_responses: dict[str, list[Any]] = {
        "input": [None, [], 5, [1], [{"role": "robot", "content": "x"}], [{"type": "web_search_call"}],
                  [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
                  [{"type": "function_call", "name": "f", "arguments": "{}"}],
                  [{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}],
                  [{"type": "function_call_output", "output": "x"}], [{"type": "item_reference", "id": "msg_1"}]],
        "instructions": [5, ["x"]],
        "max_output_tokens": [0, -3, "5", 1.5],
        "temperature": [-1, "x"],
        "top_p": [0, 3],
        "tools": [[{"type": "web_searcher"}], [{"type": "function"}], "x", [{"type": "function", "name": "a b"}]],
        "tool_choice": ["required", {"type": "allowed_tools"}, 5],
        "text": ["json", {"format": {"type": "yaml"}}, {"format": {"type": "json_schema", "schema": {"if": {}}}}],
        "previous_response_id": ["resp_1"],
        "conversation": ["conv_1"],
        "background": [True],
        "prompt": [{"id": "pmpt_1"}],
        "top_logprobs": [3],
        "stream": ["yes"],
        "model": ["gpt-5", 5],
    }  # fmt: skip
    for i in range(count):
        messages_api = i % 2 == 0
        path = "/v1/messages" if messages_api else "/v1/responses"
        headers = messages_headers if messages_api else responses_headers
        base, bad = (message, bad_messages) if messages_api else (response, bad_responses)
        kind = rng.choice(["field", "field", "field", "json", "auth"])
        if kind == "field":
            key = rng.choice(sorted(bad))
            value = rng.choice(bad[key])
            body = {k: v for k, v in {**base, key: value}.items() if v is not None}
            yield path, json.dumps(body).encode(), headers
        elif kind == "json":
            text = json.dumps(base).encode()
            yield path, rng.choice([text[: rng.randrange(0, len(text) - 1)], b"[]", b"5", b"\xff{", b"NaN"]), headers
        else:
            wrong = rng.choice([{}, {"x-api-key": "nope"}, {"Authorization": "Bearer nope"}])
            yield path, json.dumps(base).encode(), {"Content-Type": "application/json", **wrong}


def test_1000_fuzzed_bad_bodies_get_4xx_in_their_apis_shape_and_lose_nothing(
    server: RunningServer, claude: anthropic.Anthropic, client: openai.OpenAI
) -> None:
    def settled(tokens: float) -> float:  # (a generation is counted just after its last update is delivered)
        deadline = time.monotonic() + 10
        while server.metric("dflash_generation_tokens_total") < tokens and time.monotonic() < deadline:
            time.sleep(0.05)
        return server.metric("dflash_generation_tokens_total")

    before = server.metric("dflash_generation_tokens_total")
    message = claude.messages.create(model=server.target, messages=user("Count."), max_tokens=40)
    response = client.responses.create(model=server.target, input="Count.", max_output_tokens=40)
    decoded = message.usage.output_tokens + response.usage.output_tokens
    generated = settled(before + decoded)
    beside: dict[str, str] = {}

    def good_requests() -> None:  # streamed, while the bad ones arrive
        with claude.messages.stream(model=server.target, messages=user("Count."), max_tokens=40) as stream:
            beside["message"] = "".join(stream.text_stream)
        events = client.responses.create(model=server.target, input="Count.", max_output_tokens=40, stream=True)
        beside["response"] = "".join(e.delta for e in events if e.type == "response.output_text.delta")

    worker = threading.Thread(target=good_requests)
    worker.start()
    statuses: dict[int, int] = {}
    for path, body, headers in bad_bodies(random.Random(50), 1000):
        status, _, raw = raw_request(server.port, "POST", path, body, headers)
        assert 400 <= status < 500, (path, body[:200], status, raw[:300])
        error = json.loads(raw)
        if path == "/v1/messages":
            assert error["type"] == "error" and error["error"]["type"] in ("invalid_request_error", "not_found_error",
                                                                           "authentication_error"), raw  # fmt: skip
        else:
            assert error["error"]["type"] and "param" in error["error"], raw
        assert error["error"]["message"]
        statuses[status] = statuses.get(status, 0) + 1
    worker.join(120)
    assert set(statuses) == {400, 401, 404}, statuses
    assert beside == {"message": text_of(message), "response": response.output_text}
    assert settled(generated + decoded) == generated + decoded  # only the two good requests decoded
    assert server.get("/health")[1]["status"] == "ok"


# ---------------------------------------------------------------------------------------------------------------
# A template that thinks


THINKING_TEMPLATE = CHAT_TEMPLATE.replace(  # Qwen3.5's way: the reply's reasoning opened after the header
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}",
    "{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}",
)


def test_reasoning_markers_that_are_special_tokens_split_the_reply(session: Session, models: tuple[Path, Path]) -> None:
    """A tokenizer may make `<think>` and `</think>` special tokens, which the shown text skips: the reply is read
    raw to split it. The tiny model writes ids its tokenizer has no text for (320 and up): one of them, written
    after some text and before more, is made `</think>` (the reply's ids do not change)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    def marked(markers: dict[str, int]) -> Session:
        spec = json.loads(session.tokenizer.backend_tokenizer.to_str())
        spec["added_tokens"] += [{"id": i, "content": m, "single_word": False, "lstrip": False, "rstrip": False,
                                  "normalized": False, "special": True} for m, i in markers.items()]  # fmt: skip
        spec["model"]["vocab"].update(markers)  # (an added token keeps its id only where the vocabulary has it)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                            eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                            chat_template=THINKING_TEMPLATE)  # fmt: skip
        return dataclasses.replace(session, models=dataclasses.replace(session.models, tokenizer=tokenizer))

    opened = marked({"<think>": MODEL_VOCAB - 1})
    prompt = opened.encode_chat(user("Tell me a story."))
    assert prompt[-2] == MODEL_VOCAB - 1  # the template's `<think>` is the special token
    params = opened.sampling_params(local_options(models), max_new_tokens=40)
    reply = collect(opened.stream(prompt, params)).token_ids

    def shown(ids: list[int]) -> str:
        return opened.tokenizer.decode(ids, skip_special_tokens=True)

    close = next(  # (an id with no text, first written here, with text before and after it)
        k
        for k, token in enumerate(reply)
        if token >= len(session.tokenizer) and token not in reply[:k] and shown(reply[:k]).strip()
        and shown(reply[k:]).strip()
    )  # fmt: skip
    with serving(marked({"<think>": MODEL_VOCAB - 1, "</think>": reply[close]}), models) as backend:
        parts = parts_of(backend, {"messages": user("Tell me a story."), "max_tokens": 40}, reasoning=True)
    *pieces, ending = parts
    assert isinstance(ending, Ending) and ending.output_tokens == len(reply)
    split = {
        kind: "".join(p.text for p in pieces if isinstance(p, Part) and p.kind == kind)
        for kind in ("reasoning", "text")
    }
    assert split == {"reasoning": shown(reply[:close]).strip(), "text": shown(reply[close + 1 :]).lstrip()}
    assert 0 < ending.reasoning_tokens <= close + 1


@pytest.fixture(scope="module")
def thinking_server(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The tiny model under a template that opens its reply's reasoning (`<think>\\n` after the assistant's header,
    as Qwen3.5's does) unless enable_thinking is false: all of a random reply is reasoning then."""
    from transformers import AutoTokenizer

    target = Path(shutil.copytree(models[0], tmp_path_factory.mktemp("thinking") / "target"))
    assert THINKING_TEMPLATE != CHAT_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(target)
    with running_server([*model_flags((target, models[1])), "--batch-size", "2"]) as running:
        yield running


def test_a_thinking_template_gives_thinking_blocks_when_asked_and_keeps_reasoning_out_of_text(
    thinking_server: RunningServer,
) -> None:
    server, oai = thinking_server, thinking_server.client()
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    messages = user("Tell me a story.")
    raw = chat_reply(oai, server, messages, max_tokens=16).choices[0].message.content  # (chat: the reply as written)
    reasoning = raw.strip()
    assert reasoning and "</think>" not in raw
    fields = {"model": server.target, "messages": messages, "max_tokens": 16}
    asked = claude.messages.create(**fields, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [(b.type, b.thinking) for b in asked.content] == [("thinking", reasoning)]
    with claude.messages.stream(**fields, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        deltas = [event.thinking for event in stream if event.type == "thinking"]  # the SDK's thinking_delta events
        final = stream.get_final_message()
    assert "".join(deltas) == reasoning and [b.thinking for b in final.content] == [reasoning]
    off = claude.messages.create(**fields, thinking={"type": "disabled"})  # the template closes it: text
    plain = chat_reply(
        oai, server, messages, max_tokens=16, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert text_of(off) == plain.choices[0].message.content and text_of(off)
    unasked = claude.messages.create(**fields)  # no thinking is none, as in Anthropic's API (not the template's)
    assert [(b.type, b.text) for b in unasked.content] == [(b.type, b.text) for b in off.content]
    hidden = claude.messages.create(**fields, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert hidden.content == [] and hidden.stop_reason == "max_tokens"  # all reasoning, none of it asked for
    response = oai.responses.create(model=server.target, input="Tell me a story.", max_output_tokens=16)
    (item,) = response.output
    assert item.type == "reasoning" and item.content[0].text == reasoning and response.output_text == ""
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 16
    events = list(
        oai.responses.create(model=server.target, input="Tell me a story.", max_output_tokens=16, stream=True)
    )
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
