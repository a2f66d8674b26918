"""What the responses of every `dflash serve` route share: an error in the shape of the API its route speaks
(OpenAI's for chat and legacy completions and Responses, Anthropic's for /v1/messages), and server-sent events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from dflash_cli.protocol import anthropic, responses


class APIError(Exception):
    """An HTTP error: its status, message and OpenAI's error type, param and code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self, path: str = "") -> JSONResponse:
        """The error's response on the route `path`."""
        if path.startswith(anthropic.MESSAGES_URL):
            status, body = anthropic.error(self.status, self.message)
            return JSONResponse(body, status_code=status, headers=self.headers)
        body = responses.error(self.message, self.type, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A comment line (every SSE reader skips it) after this many seconds without an event: a reply can be silent for
# minutes (a long queue or prompt, a tool call held back until it closes), and clients drop a stream that sends
# nothing for a while (Claude Code after 180 s, proxies sooner).
KEEPALIVE_S = 15.0
KEEPALIVE = ": keepalive\n\n"


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event: its data as JSON, named `event` where the API names them (Anthropic, Responses)."""
    named = f"event: {event}\n" if event is not None else ""
    return f"{named}data: {json.dumps(data, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events, and `on_close` once the response ends however it ends: sent whole, the client gone
    mid-stream, or gone before the first event (then the events' own cleanup never runs: they never started)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def event_stream(
    events: AsyncIterator[str], failed: Callable[[APIError], Iterable[str]], on_close: Callable[[], None]
) -> EventStream:
    """A reply streamed: `events`, a keepalive comment whenever none came for KEEPALIVE_S, and where its
    generation fails after the status was sent, `failed`'s events for the error (in the stream, as vLLM's);
    `on_close` (which cancels the job) once the response ends."""

    async def guarded() -> AsyncIterator[str]:
        # The next event is awaited in a task of its own, so that a keepalive leaves it waiting: cancelling the
        # wait (asyncio.wait_for) would end `events` mid-reply.
        waiting: asyncio.Future[str] | None = None
        try:
            while True:
                waiting = asyncio.ensure_future(anext(events))
                while not (await asyncio.wait({waiting}, timeout=KEEPALIVE_S))[0]:
                    yield KEEPALIVE
                try:
                    event = waiting.result()
                except StopAsyncIteration:
                    return
                yield event
        except APIError as error:
            for event in failed(error):
                yield event
        finally:
            if waiting is not None and not waiting.done():  # the client left while it waited
                waiting.cancel()
                # (what the cancelled reply raises on its way out, its job's end, is no one's to report)
                waiting.add_done_callback(lambda task: task.cancelled() or task.exception())

    return EventStream(guarded(), on_close)
