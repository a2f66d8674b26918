"""What the responses of every `dflash serve` route share: an error in the shape of the API its route speaks
(OpenAI's for chat and legacy completions and Responses, Anthropic's for /v1/messages), and server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, StreamingResponse

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


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event: its data as JSON, named `event` where the API names them (Anthropic, Responses)."""
    named = f"event: {event}\n" if event is not None else ""
    return f"{named}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
