"""The official SDKs' own types as a check of what the server sends: each stream event and each whole object,
validated strictly by the `openai` and `anthropic` packages' pydantic models (the SDKs' clients build them without
validation, so a missing field passes through a client and breaks a strict reader, such as codex-rs)."""

from __future__ import annotations

from typing import Any, get_args

import anthropic.types
import openai.types.responses
from pydantic import BaseModel


def _by_type(union: Any) -> dict[str, type[BaseModel]]:
    """The models of an SDK's event union (Annotated[Union[...], its discriminator]), by the `type` each names."""
    members = get_args(get_args(union)[0])
    return {get_args(model.model_fields["type"].annotation)[0]: model for model in members}


RESPONSE_EVENTS = _by_type(openai.types.responses.ResponseStreamEvent)
MESSAGE_EVENTS = _by_type(anthropic.types.RawMessageStreamEvent)


def check_response(data: dict[str, Any]) -> openai.types.responses.Response:
    return openai.types.responses.Response.model_validate(data, strict=True)


def check_response_event(data: dict[str, Any]) -> BaseModel:
    return RESPONSE_EVENTS[data["type"]].model_validate(data, strict=True)


def check_message(data: dict[str, Any]) -> anthropic.types.Message:
    return anthropic.types.Message.model_validate(data, strict=True)


def check_message_event(data: dict[str, Any]) -> None:
    """A Messages stream event (`ping` is not in the SDK's union: its stream reader skips it)."""
    if data["type"] == "ping":
        assert data == {"type": "ping"}
    else:
        MESSAGE_EVENTS[data["type"]].model_validate(data, strict=True)
