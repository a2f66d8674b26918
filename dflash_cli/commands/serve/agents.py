"""`dflash serve`'s routes for the agents' own APIs: Anthropic Messages (`POST /v1/messages` and
`/v1/messages/count_tokens`, what Claude Code sends) and OpenAI Responses (`POST /v1/responses`, stateless, what
Codex CLI sends).

One path under every route: a body is read into the one request format (protocol.anthropic,
protocol.openai_responses), prepared and submitted by the server as /v1/chat/completions is (the same worker,
batching, prefix reuse, grammars and speculation), and the reply's parts (http.Server.parts) are rendered in the
route's shapes, streamed or whole. This module only translates; the server does the work.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dflash_cli.commands.serve.wire import APIError, event_stream, sse
from dflash_cli.commands.serve.worker import Job, Update, Worker
from dflash_cli.protocol import anthropic, openai_responses
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.protocol.replies import Ending, Part, Prompt
from dflash_cli.protocol.requests import Request
from dflash_cli.protocol.responses import now

Running = tuple[Job, asyncio.Queue[Update]]  # a submitted job and the queue its updates arrive on
Events = anthropic.MessageEvents | openai_responses.ResponseEvents
Result = TypeVar("Result")  # what the work a client waits for returns (Backend.unless_gone)


class Backend(Protocol):
    """What these routes use of the server (http.Server)."""

    model: str
    context_window: int | None
    worker: Worker
    fill_window: bool  # a Responses request without max_output_tokens may fill the window (no --max-tokens given)

    def check_room(self) -> None: ...
    def check_model(self, name: str | None) -> None: ...
    async def prepare(self, request: Request) -> tuple[list[int], SamplingParams]: ...
    async def count_tokens(self, request: Request) -> int: ...
    def submit(self, prepared: list[tuple[list[int], SamplingParams]]) -> list[Running]: ...
    def parts(
        self, running: Running, request: Request, *, reasoning: bool = False, stop_sequence: bool = False
    ) -> AsyncIterator[Prompt | Part | Ending]: ...
    async def unless_gone(self, http: HTTPRequest, jobs: list[Running], work: Awaitable[Result]) -> Result | None: ...


class AgentRoutes:
    """The Messages and Responses routes over `backend`; `read_json` reads a request's body (its limits and
    errors are the server's)."""

    def __init__(self, backend: Backend, read_json: Callable[[HTTPRequest], Awaitable[Any]]) -> None:
        self.backend, self.read_json = backend, read_json

    def routes(self) -> list[Route]:
        return [
            Route(anthropic.MESSAGES_URL, self.messages, methods=["POST"]),
            Route(anthropic.COUNT_TOKENS_URL, self.count_tokens, methods=["POST"]),
            Route(openai_responses.RESPONSES_URL, self.responses, methods=["POST"]),
            # (a stored response's routes, and compaction, which Codex may probe: said why there is none)
            Route(openai_responses.RESPONSES_URL + "/{rest:path}", self.stored, methods=["GET", "POST", "DELETE"]),
        ]

    async def stored(self, http: HTTPRequest) -> Response:
        raise APIError(404, f"{http.url.path}: {openai_responses.STATELESS}", code="not_found")

    async def messages(self, http: HTTPRequest) -> Response:
        self.backend.check_room()
        read = anthropic.read_messages_request(await self.read_json(http))
        running, cut = await self._start(read.request)
        events = anthropic.MessageEvents(
            id=anthropic.new_id(), model=self.backend.model, thinking=read.thinking, window_cut=cut
        )

        def failed(error: APIError) -> list[tuple[str, dict[str, Any]]]:
            return [("error", anthropic.error(error.status, error.message)[1])]

        return await self._reply(http, running, read.request, events, failed, lambda: events.message)

    async def count_tokens(self, http: HTTPRequest) -> Response:
        read = anthropic.read_messages_request(await self.read_json(http), count_only=True)
        self.backend.check_model(read.request.model)
        return JSONResponse({"input_tokens": await self.backend.count_tokens(read.request)})

    async def responses(self, http: HTTPRequest) -> Response:
        self.backend.check_room()
        read = openai_responses.read_responses_request(await self.read_json(http))
        running, _ = await self._start(read.request, fill_window=read.fills_window and self.backend.fill_window)
        events = openai_responses.ResponseEvents(
            id=openai_responses.new_id(), model=self.backend.model, created=now(), echo=read.echo
        )
        return await self._reply(
            http, running, read.request, events, lambda error: events.failed(error.message), lambda: events.response
        )

    async def _start(self, request: Request, *, fill_window: bool = False) -> tuple[Running, bool]:
        """The request's job, submitted, and whether its max_tokens was cut to the room the context window leaves
        (`request.cut_at_window`); `fill_window`: it may generate until the window is full."""
        self.backend.check_model(request.model)
        prompt_ids, params = await self.backend.prepare(request)
        window, cut = self.backend.context_window, False
        if window is not None and (
            fill_window or (request.cut_at_window and params.max_new_tokens > window - len(prompt_ids))
        ):
            cut = not fill_window
            params = dataclasses.replace(params, max_new_tokens=window - len(prompt_ids))
        return self.backend.submit([(prompt_ids, params)])[0], cut

    async def _reply(
        self,
        http: HTTPRequest,
        running: Running,
        request: Request,
        events: Events,
        failed: Callable[[APIError], list[tuple[str, dict[str, Any]]]],
        whole: Callable[[], dict[str, Any]],
    ) -> Response:
        """The reply as `events` render it: streamed (a failure after the first event is `failed`'s events), or
        whole (`whole()` once every part is in; a failure is the route's error response)."""
        if request.stream:
            return event_stream(
                self._stream(running, request, events),
                lambda error: [sse(data, name) for name, data in failed(error)],
                lambda: self.backend.worker.cancel(running[0]),
            )

        async def gather() -> dict[str, Any]:
            async for item in self.backend.parts(running, request, reasoning=True, stop_sequence=True):
                events.render(item)
            return whole()

        body = await self.backend.unless_gone(http, [running], gather())
        return Response(status_code=499) if body is None else JSONResponse(body)

    async def _stream(self, running: Running, request: Request, events: Events) -> AsyncIterator[str]:
        """The reply's server-sent events, named as the API names them."""
        async for item in self.backend.parts(running, request, reasoning=True, stop_sequence=True):
            for name, data in events.render(item):
                yield sse(data, name)
