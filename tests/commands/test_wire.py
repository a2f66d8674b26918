"""Server-sent events under silence: keepalive comments between the events of a slow reply, read by the real
`anthropic` and `openai` clients (the ASGI app over httpx, as the clients' own transport), and a reply that fails
mid-stream still ending in its API's error event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anthropic
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.routing import Route
from starlette.testclient import TestClient

from dflash_cli.commands.serve import wire
from dflash_cli.commands.serve.wire import APIError, event_stream, sse
from dflash_cli.protocol import anthropic as messages_api
from dflash_cli.protocol import openai_responses
from dflash_cli.protocol.replies import Ending, Part, Prompt

REPLY = [Prompt(5, 0), Part("text", "Hello"), Part("text", " there"), Ending("stop", None, 5, 0, 2)]


async def slowly(events: messages_api.MessageEvents | openai_responses.ResponseEvents) -> AsyncIterator[str]:
    """REPLY's events, each after a pause several keepalive intervals long."""
    for item in REPLY:
        await asyncio.sleep(0.05)
        for name, data in events.render(item):
            yield sse(data, name)


async def failing(events: messages_api.MessageEvents) -> AsyncIterator[str]:
    for item in REPLY[:2]:
        for name, data in events.render(item):
            yield sse(data, name)
    await asyncio.sleep(0.05)
    raise APIError(500, "the generation failed: out of memory")


def app(closed: list[str]) -> Starlette:
    async def messages(request: HTTPRequest) -> wire.EventStream:
        events = messages_api.MessageEvents(id="msg_1", model="m", thinking=False)
        source = failing(events) if (await request.json()).get("metadata") else slowly(events)
        failed = lambda error: [sse(messages_api.error(error.status, error.message)[1], "error")]  # noqa: E731
        return event_stream(source, failed, lambda: closed.append("messages"))

    async def responses(request: HTTPRequest) -> wire.EventStream:
        events = openai_responses.ResponseEvents(id="resp_1", model="m", created=0, echo={})
        return event_stream(slowly(events), lambda error: [], lambda: closed.append("responses"))

    return Starlette(
        routes=[Route("/v1/messages", messages, methods=["POST"]), Route("/v1/responses", responses, methods=["POST"])]
    )


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> tuple[TestClient, list[str]]:
    monkeypatch.setattr(wire, "KEEPALIVE_S", 0.01)
    closed: list[str] = []
    return TestClient(app(closed)), closed


def test_keepalives_between_slow_events_are_read_past_by_the_clients(served: tuple[TestClient, list[str]]) -> None:
    http, closed = served
    raw = http.post("/v1/messages", json={}).text
    assert raw.count(wire.KEEPALIVE) >= len(REPLY), raw  # (a pause of 5 intervals before each item)
    assert raw.index(wire.KEEPALIVE) < raw.index("event: message_start")  # the silence before the first step too
    claude = anthropic.Anthropic(base_url=str(http.base_url), api_key="k", http_client=http, max_retries=0)
    stream = claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi"}], stream=True)
    kinds = [event.type for event in stream]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    with claude.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) as stream:
        message = stream.get_final_message()
    assert message.content[0].text == "Hello there" and message.stop_reason == "end_turn"
    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k", http_client=http, max_retries=0)
    events = list(client.responses.create(model="m", input="Hi", stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Hello there"
    assert closed == ["messages", "messages", "messages", "responses"]  # each response closed once, its job cancelled


def test_a_failure_after_a_keepalive_is_the_streams_error_event(served: tuple[TestClient, list[str]]) -> None:
    http, _ = served
    claude = anthropic.Anthropic(base_url=str(http.base_url), api_key="k", http_client=http, max_retries=0)
    stream = claude.messages.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi"}], stream=True, metadata={"user_id": "x"}
    )
    with pytest.raises(anthropic.APIStatusError, match="out of memory"):
        list(stream)
    assert wire.KEEPALIVE in http.post("/v1/messages", json={"metadata": 1}).text


def test_a_client_gone_during_a_silence_ends_the_reply_and_its_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves while a reply is silent (keepalives only): the event being awaited is cancelled there and
    then (its generator's cleanup runs), and the job is cancelled (`on_close`)."""
    monkeypatch.setattr(wire, "KEEPALIVE_S", 0.01)
    closed: list[str] = []
    ended: list[str] = []

    async def silent() -> AsyncIterator[str]:
        try:
            yield sse({"type": "ping"}, "ping")
            await asyncio.sleep(60)  # (a long prefill)
            yield sse({"type": "never"}, "never")
        finally:
            ended.append("events")

    async def scenario() -> None:
        kept_alive = asyncio.Event()

        async def send(message: dict) -> None:
            if wire.KEEPALIVE.encode() in message.get("body", b""):
                kept_alive.set()

        async def receive() -> dict:
            await kept_alive.wait()
            return {"type": "http.disconnect"}

        stream = event_stream(silent(), lambda error: [], lambda: closed.append("job"))
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/v1/messages"}
        await asyncio.wait_for(stream(scope, receive, send), 5)
        await asyncio.sleep(0.05)
        assert ended == ["events"]  # (not left sleeping until the loop's shutdown cancels it)

    asyncio.run(scenario())
    assert closed == ["job"]
