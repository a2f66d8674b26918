"""`dflash serve NAME`'s HTTP app: the OpenAI- and Anthropic-compatible routes over one loaded model.

Shape (as mlx-lm's server): one worker thread owns the session and the engine and takes jobs from a bounded
queue (worker.py). The HTTP handlers here are thin: read the body (requests.read_body, the format `dflash run`
reads too), encode the prompt, submit a job, and turn its updates into an OpenAI response, whole or streamed as
server-sent events. A client that disconnects cancels its job; a full queue answers 429 at once; every error is
OpenAI's JSON error shape.

Starlette on uvicorn, the ASGI stack under vLLM's and SGLang's servers: HTTP/1.1 keep-alive, streaming,
disconnect detection and graceful shutdown are theirs, tested far beyond what we would write. launch.py binds the
socket, loads the model and runs this app until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dflash_cli.commands.serve.agents import AgentRoutes, Result, Running
from dflash_cli.commands.serve.metrics import CONTENT_TYPE, ServerMetrics
from dflash_cli.commands.serve.wire import APIError, event_stream, sse
from dflash_cli.commands.serve.worker import Job, QueueFull, ShuttingDown, Update, Worker
from dflash_cli.errors import DflashError, RequestError
from dflash_cli.protocol import responses
from dflash_cli.protocol.anthropic import COUNT_TOKENS_URL, MESSAGES_URL
from dflash_cli.protocol.openai_responses import RESPONSES_URL
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.protocol.replies import PROMPT_TAIL_TOKENS, Ending, Part, Prompt, ReasoningSplit, prompt_opens_reasoning
from dflash_cli.protocol.requests import CHAT_URL, COMPLETIONS_URL, Request, prompt_list, read_body, renamed
from dflash_cli.protocol.tools import ToolStream
from dflash_cli.setup.options import RunOptions

DONE = "data: [DONE]\n\n"  # the last event of an OpenAI stream
MAX_BODY_BYTES = 32 * 1024 * 1024  # Anthropic's limit: agents resend every image a tool read (left out here)
DRAIN_BYTES = 64 * 1024 * 1024  # an oversized body is read to its end up to this, so the client hears the 413
MODEL_URL = "/v1/models/{model:path}"  # one model's card (the openai client's models.retrieve)
# Browser pages that may call the API (CORS) without --allowed-origins: this machine's (a web UI on localhost), as
# ollama allows by default; another site's page could otherwise use the model through the user's browser.
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]+)?"
ROUTES = (
    "/health",
    "/metrics",
    "/v1/models",
    MODEL_URL,
    CHAT_URL,
    COMPLETIONS_URL,
    MESSAGES_URL,
    COUNT_TOKENS_URL,
    RESPONSES_URL,
)


def check_json_content_type(header: str | None) -> None:
    """A body's Content-Type must be application/json (charset utf-8, if one is named: JSON's own): else 415."""
    media, _, parameters = (header or "").partition(";")
    charset = next(
        (
            value.strip().strip('"').lower()
            for key, _, value in (p.partition("=") for p in parameters.split(";"))
            if key.strip().lower() == "charset"
        ),
        "utf-8",
    )
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        got = f"Content-Type {header!r}" if header else "no Content-Type"
        raise APIError(
            415,
            f"the request body must be JSON sent as Content-Type: application/json (got {got}; curl -d sends a "
            "form unless told -H 'Content-Type: application/json')",
            code="unsupported_media_type",
        )


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class Server:
    """The HTTP side: routes, the API key, body limits, and the bridge from worker updates to responses."""

    def __init__(
        self,
        session: Any,
        options: RunOptions,
        worker: Worker,
        metrics: ServerMetrics,
        api_key: str | None,
        *,
        fill_window: bool = True,
        allowed_origins: tuple[str, ...] = (),
    ):
        self.session, self.options, self.worker, self.metrics = session, options, worker, metrics
        self.fill_window = fill_window  # (launch.run_server)
        self.api_key = api_key or None
        self.allowed_origins = allowed_origins  # beyond LOCAL_ORIGINS ("*": any)
        self.model = session.served_name
        self.context_window: int | None = session.context_window
        recipe = session.recipe
        self.names = {self.model, recipe.name, recipe.target.id, *recipe.aliases} - {"ad-hoc"}
        self.created = responses.now()
        self.encode_lock = anyio.Lock()

    def app(self) -> Callable[..., Awaitable[None]]:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route(
                "/", self.health, methods=["GET"]
            ),  # (Claude Code's connectivity check is a HEAD /; Ollama answers /)
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route(MODEL_URL, self.model_card, methods=["GET"]),
            Route(CHAT_URL, self.chat_completions, methods=["POST"]),
            Route(COMPLETIONS_URL, self.completions, methods=["POST"]),
            *AgentRoutes(self, self._read_json).routes(),  # Anthropic Messages and OpenAI Responses
        ]
        handlers = {
            APIError: self._api_error,
            RequestError: self._request_error,
            HTTPException: self._http_error,
            Exception: self._server_error,
        }
        gated = self._gate(Starlette(routes=routes, exception_handlers=handlers))  # type: ignore[arg-type]
        # outside the gate: a browser's preflight (OPTIONS) carries no API key
        return CORSMiddleware(  # type: ignore[return-value]
            gated,  # type: ignore[arg-type]
            allow_origins=self.allowed_origins,
            allow_origin_regex=LOCAL_ORIGINS,
            allow_methods=["*"],
            allow_headers=["*"],
        )

    # -- errors and the gate ----------------------------------------------------------------------------------

    async def _api_error(self, request: HTTPRequest, error: Exception) -> Response:
        assert isinstance(error, APIError)
        return error.response(request.url.path)

    async def _request_error(self, request: HTTPRequest, error: Exception) -> Response:
        assert isinstance(error, RequestError)
        return APIError(400, error.message, param=error.param, code=error.code).response(request.url.path)

    async def _http_error(self, request: HTTPRequest, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        if error.status_code == 404:
            served = (
                f"this server has GET /v1/models, POST {CHAT_URL}, {COMPLETIONS_URL}, {RESPONSES_URL}, "
                f"{MESSAGES_URL} and {COUNT_TOKENS_URL}"
            )
            where = "" if request.url.path.startswith("/v1/") else ": the API is under /v1"
            message = f"no route {request.url.path}{where} ({served}; embeddings, images and audio are not served)"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path} (allowed: {error.headers.get('Allow')})"
        else:
            message = str(error.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return APIError(error.status_code, message, code=code, headers=error.headers).response(request.url.path)

    async def _server_error(self, request: HTTPRequest, error: Exception) -> Response:
        error = APIError(500, f"internal error: {type(error).__name__}: {error}", type="server_error")
        return error.response(request.url.path)

    def _gate(self, app: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        """ASGI middleware: the API key on /v1 routes (health and metrics stay open, as vLLM's), and a count of
        every response by route and status for /metrics."""

        async def gate(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            path = scope["path"]
            route = path if path in ROUTES else MODEL_URL if path.startswith("/v1/models/") else "other"

            async def counting_send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    self.metrics.answered(route, message["status"])
                await send(message)

            if path.startswith("/v1/") and not self._authorized(scope):
                error = APIError(
                    401,
                    "invalid or missing API key: send the header `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response(path)(scope, receive, counting_send)
                return
            await app(scope, receive, counting_send)

        return gate

    def _authorized(self, scope: dict[str, Any]) -> bool:
        """The key as OpenAI's clients send it (`Authorization: Bearer`), or as Anthropic's (`x-api-key`)."""
        if self.api_key is None:
            return True
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        key = self.api_key.encode()
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
        return bearer or hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), key)

    # -- simple routes ----------------------------------------------------------------------------------------

    async def health(self, request: HTTPRequest) -> Response:
        ok = self.worker.alive
        body = {
            "status": "ok" if ok else "unavailable",
            "model": self.model,
            "waiting": self.worker.waiting,
            "running": self.worker.running,
            "batch_size": self.worker.rows,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self, request: HTTPRequest) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def _card(self) -> dict[str, Any]:
        """The served model as OpenAI's clients read it, and Anthropic's (type, display_name, created_at)."""
        return {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "dflash",
            "root": self.session.recipe.target.id,
            "max_model_len": self.context_window,
            "type": "model",
            "display_name": self.model,
            "created_at": datetime.datetime.fromtimestamp(self.created, datetime.timezone.utc).isoformat(),
            "lifecycle": "active",
            # (a prompt and its reply share the window: each may take all of it but the other's one token)
            "max_input_tokens": None if self.context_window is None else self.context_window - 1,
            "max_tokens": None if self.context_window is None else self.context_window - 1,
        }

    async def models(self, request: HTTPRequest) -> Response:
        # (Anthropic's page fields beside OpenAI's list: one model, one page)
        page = {"has_more": False, "first_id": self.model, "last_id": self.model}
        return JSONResponse({"object": "list", "data": [self._card()], **page})

    async def model_card(self, request: HTTPRequest) -> Response:
        self.check_model(request.path_params["model"])
        return JSONResponse(self._card())

    # -- completions ------------------------------------------------------------------------------------------

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._complete(request, CHAT_URL)

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._complete(request, COMPLETIONS_URL)

    async def _read_json(self, http: HTTPRequest) -> Any:
        """The request's JSON body, for any route that takes one: 415 unless it is sent as application/json (a
        form, text or multipart body is not parsed as JSON by chance), 413 past MAX_BODY_BYTES, 400 when it is
        not JSON."""
        check_json_content_type(http.headers.get("content-type"))
        encoding = http.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise APIError(
                415,
                f"the request body is sent with Content-Encoding {encoding!r}: send it uncompressed",
                code="unsupported_media_type",
            )
        declared = http.headers.get("content-length", "")
        too_big = APIError(
            413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB", code="request_too_large"
        )
        if declared.isdigit() and int(declared) > DRAIN_BYTES:
            raise too_big
        body, received = bytearray(), 0
        async for chunk in http.stream():
            received += len(chunk)
            if received <= MAX_BODY_BYTES:
                body += chunk
            elif received > DRAIN_BYTES:
                raise too_big
        if received > MAX_BODY_BYTES:
            raise too_big
        if not body.strip():
            raise APIError(400, "the request body is empty: send a JSON object", code="invalid_json")
        try:
            return json.loads(body, parse_constant=_no_constants)
        except UnicodeDecodeError as error:
            raise APIError(400, f"the request body is not UTF-8: {error.reason}", code="invalid_json") from None
        except ValueError as error:
            raise APIError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body is not valid JSON: nested too deeply", code="invalid_json") from None

    def _encode(self, request: Request) -> list[int]:
        return self.session.encode_request(request)

    def _busy(self) -> APIError:
        return APIError(
            429,
            f"the server is busy: its queue is full ({self.worker.max_queue} waiting); retry shortly "
            "(or start the server with a larger --max-queue)",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )

    def check_room(self) -> None:
        """A 429 when the queue is full: a request is refused before it is read and encoded, when it is clear."""
        if self.worker.full:
            raise self._busy()

    def check_model(self, name: str | None) -> None:
        """A 404 for a model name this server does not serve (no name: the one it serves)."""
        if name is not None and name not in self.names:
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {self.model!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    async def prepare(self, request: Request) -> tuple[list[int], SamplingParams]:
        """A request's prompt ids and sampling params (its grammar compiled). Raises RequestError for a request
        this model cannot take."""
        try:
            async with self.encode_lock:  # tokenizers are not built for concurrent encodes
                prompt_ids = await anyio.to_thread.run_sync(self._encode, request)
                # (off the event loop: a new schema compiles in milliseconds, a first grammar reads the vocabulary)
                params = await anyio.to_thread.run_sync(self.session.request_params, self.options, request)
        except RequestError as error:  # (a Messages or Responses body's field as it has it)
            raise renamed(error, request.field_names) from None
        except DflashError as error:
            raise APIError(400, error.message) from None
        return prompt_ids, params

    async def count_tokens(self, request: Request) -> int:
        """The prompt's length in tokens, as the chat template renders it (however long: no window check)."""
        async with self.encode_lock:
            return len(await anyio.to_thread.run_sync(partial(self.session.encode_request, request, fit_window=False)))

    def submit(self, prepared: list[tuple[list[int], SamplingParams]]) -> list[Running]:
        """A job each, queued for the engine, with the queue its updates arrive on; all or none (429, 503)."""
        loop = asyncio.get_running_loop()
        jobs: list[Running] = []
        for prompt_ids, params in prepared:
            updates: asyncio.Queue[Update] = asyncio.Queue()

            def deliver(update: Update, updates: asyncio.Queue[Update] = updates) -> None:  # in the worker thread
                loop.call_soon_threadsafe(updates.put_nowait, update)

            job = Job(prompt_ids, params, deliver)
            try:
                self.worker.submit(job)
            except (QueueFull, ShuttingDown) as refused:
                for submitted, _ in jobs:
                    self.worker.cancel(submitted)
                if isinstance(refused, QueueFull):
                    raise self._busy() from None
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down") from None
            jobs.append((job, updates))
        return jobs

    async def _complete(self, http: HTTPRequest, endpoint: str) -> Response:
        self.check_room()
        body = await self._read_json(http)
        # Several prompts in one legacy completion (LangChain's batch sends them so): a job and a choice each.
        prompts = prompt_list(body) if endpoint == COMPLETIONS_URL else None
        if prompts is not None and len(prompts) > self.worker.max_queue + self.worker.rows:
            raise APIError(  # (it would get "busy, retry" forever)
                400,
                f"prompt: {len(prompts)} prompts, more than this server takes at once "
                f"({self.worker.rows} decoding + {self.worker.max_queue} waiting): send them in smaller lists "
                "(or start the server with a larger --max-queue)",
                param="prompt",
            )
        prepared = []
        for index, one in enumerate([body] if prompts is None else [{**body, "prompt": p} for p in prompts]):
            request = read_body(one, endpoint, prompt_index=None if prompts is None else index)
            self.check_model(request.model)
            if prompts is not None and request.stream:
                raise RequestError(
                    "prompt: several prompts are answered whole; to stream, send one prompt a request", param="prompt"
                )
            prepared.append((request, *await self.prepare(request)))
        jobs = self.submit([(prompt_ids, params) for _, prompt_ids, params in prepared])
        ids = {"id": responses.new_id(endpoint), "model": self.model, "created": responses.now()}
        request = prepared[0][0]
        if request.stream:

            def failed(error: APIError) -> list[str]:  # (as vLLM's: the error, then the stream's end)
                return [sse(responses.error(error.message, error.type, code=error.code)), DONE]

            return event_stream(self._stream(jobs[0], request, ids), failed, lambda: self.worker.cancel(jobs[0][0]))
        return await self._whole(http, jobs, request, ids)

    async def _whole(self, http: HTTPRequest, jobs: list[Running], request: Request, ids: dict[str, Any]) -> Response:
        """The reply, whole; with several prompts (legacy completions) one choice each, in their order."""

        async def collect(updates: asyncio.Queue[Update]) -> tuple[str, list[int], Update]:
            text: list[str] = []
            token_ids: list[int] = []
            while (update := await updates.get()).finish_reason is None:
                text.append(update.text)
                token_ids += update.token_ids
            return "".join([*text, update.text]), [*token_ids, *update.token_ids], update

        results = await self.unless_gone(http, jobs, asyncio.gather(*(collect(updates) for _, updates in jobs)))
        if results is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it, /metrics counts it
        bodies = []
        for text, token_ids, update in results:
            self._check_finished(update)
            content: str | None = text
            calls: list[Any] = []
            if request.tools is not None:
                async with self.encode_lock:
                    content, calls = self.session.parse_reply(request, token_ids, content, update.finish_reason)
            bodies.append(
                responses.completion(
                    request.endpoint or CHAT_URL,
                    text=content,
                    finish_reason=update.finish_reason,
                    stats=update.stats,
                    tool_calls=calls,
                    **ids,
                )
            )
        return JSONResponse(bodies[0] if len(bodies) == 1 else responses.choices_of(bodies))

    async def unless_gone(self, http: HTTPRequest, jobs: list[Running], work: Awaitable[Result]) -> Result | None:
        """What `work` (the jobs' replies, gathered) returns; None when the client disconnected first, which
        cancels the jobs."""
        gone = asyncio.Event()

        async def cancel_on_disconnect() -> None:
            while (await http.receive())["type"] != "http.disconnect":
                pass
            gone.set()
            for job, _ in jobs:
                self.worker.cancel(job)

        watcher = asyncio.create_task(cancel_on_disconnect())
        try:
            result = await work
        except APIError:
            if gone.is_set():  # (the cancelled jobs' end)
                return None
            raise
        finally:
            watcher.cancel()
            for job, _ in jobs:  # a no-op for a job that is done; stops one when this handler is cancelled
                self.worker.cancel(job)
        return None if gone.is_set() else result

    async def parts(
        self, running: Running, request: Request, *, reasoning: bool = False, stop_sequence: bool = False
    ) -> AsyncIterator[Prompt | Part | Ending]:
        """A job's reply as it comes: its Prompt once the first step is in, text, and under tools each call once it
        closes (the text read raw, special
        tokens kept, cut at the request's stop strings, and held back from where a call may start); with
        `reasoning`, the text split into reasoning and text first (read raw too, the reasoning markers kept where
        they are special tokens). Then its Ending, which names the stop string that ended the reply when
        `stop_sequence` asks; an APIError when the generation failed."""
        job, updates = running
        tools = ToolStream(request.tools, self.session.tool_format) if request.tools is not None else None
        raw = None
        if tools is not None or reasoning:
            stops = request.sampling.get("stop_strings") or ()
            raw = self.session.reply_text_stream(stops, only_markers=tools is None)
        stopped = False  # the raw text reached a stop string: nothing after it is the reply's
        split = None
        if reasoning:
            async with self.encode_lock:  # (the tokenizer, one call at a time)
                tail = self.session.reply_text(job.prompt_ids[-PROMPT_TAIL_TOKENS:])
            split = ReasoningSplit(prompt_opens_reasoning(tail))
        text: list[str] = []  # the reply's text as shown, for the stop sequence
        token_ids: list[int] = []
        reasoning_tokens, reasoning_ended = 0, False  # (the tokens up to the step that closed the reasoning)
        while True:
            update = await updates.get()
            if not text:  # the first update: the prompt is in
                yield Prompt(len(job.prompt_ids), update.cached_tokens)
            text.append(update.text)
            token_ids += update.token_ids
            fresh = update.text
            if raw is not None:
                fresh = ""
                async with self.encode_lock:
                    if not stopped:
                        fresh, cut = raw.push(list(update.token_ids))
                        stopped = cut is not None
                    if update.finish_reason is not None and not stopped:
                        fresh += raw.flush()
            pieces = split.feed(fresh) if split is not None else [("text", fresh)]
            if split is not None and update.finish_reason is not None:
                pieces += split.finish()
            if split is not None and not reasoning_ended:
                reasoning_tokens = len(token_ids) if split.reasoned else 0
                reasoning_ended = not split.reasoning
            for kind, piece in pieces:
                if kind == "text" and tools is not None:
                    piece = tools.feed(piece)
                if piece:
                    yield Part(kind, piece)
                for call in tools.ready() if tools is not None else ():
                    yield Part("call", call=call)
            if update.finish_reason is None:
                continue
            self._check_finished(update)
            finish_reason = update.finish_reason
            if tools is not None:
                rest, calls = tools.finish(cut=finish_reason == "length")
                if rest:
                    yield Part("text", rest)
                for call in calls:
                    yield Part("call", call=call)
                finish_reason = responses.finish_with_calls(finish_reason, bool(tools.given or calls))
            stats = update.stats
            stop = None
            if stop_sequence and finish_reason == "stop":
                stop = await self._stop_sequence(request, token_ids, "".join(text))
            yield Ending(
                finish_reason,
                stop,
                stats.prompt_tokens,
                stats.cached_tokens,
                stats.generated_tokens,
                stats,
                reasoning_tokens=min(reasoning_tokens, stats.generated_tokens),
            )
            return

    async def _stop_sequence(self, request: Request, token_ids: list[int], text: str) -> str | None:
        """The request's stop string that ended a reply (None: the model's end or a grammar's): the text the engine
        showed ends where one starts in the reply's tokens."""
        stops = request.sampling.get("stop_strings") or ()
        if not stops:
            return None
        async with self.encode_lock:
            decoded = self.session.require_tokenizer().decode(token_ids, skip_special_tokens=True)
        after = decoded[len(text) :] if decoded.startswith(text) else ""
        return next((stop for stop in stops if after.startswith(stop)), None)

    def _check_finished(self, update: Update) -> None:
        if update.finish_reason == "error":
            raise APIError(500, f"generation failed: {update.error}", type="server_error", code="generation_failed")
        if update.finish_reason == "cancelled":  # only shutdown cancels a job whose client is still there
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")

    async def _stream(self, running: Running, request: Request, ids: dict[str, Any]) -> AsyncIterator[str]:
        """The reply's server-sent events, as OpenAI's chunks."""
        endpoint, usage = request.endpoint or CHAT_URL, request.include_usage
        calls = 0
        if endpoint == CHAT_URL:
            yield sse(responses.chunk(endpoint, first=True, with_usage=usage, **ids))
        async for part in self.parts(running, request):
            if isinstance(part, Prompt):
                continue  # (the chat chunks carry no usage before the end)
            if isinstance(part, Ending):
                last = responses.chunk(endpoint, finish_reason=part.finish_reason, with_usage=usage, **ids)
                last["dflash"] = responses.dflash_stats(part.stats)
                yield sse(last)
                if usage:
                    yield sse(responses.usage_chunk(endpoint, stats=part.stats, **ids))
            elif part.call is not None:
                for chunk in responses.tool_call_chunks(endpoint, [part.call], calls, with_usage=usage, **ids):
                    yield sse(chunk)
                calls += 1
            else:
                yield sse(responses.chunk(endpoint, text=part.text, with_usage=usage, **ids))
        yield DONE
