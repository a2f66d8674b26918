"""The one request format (protocol.requests): what a malformed conversation is told."""

from __future__ import annotations

import pytest

from dflash_cli.errors import RequestError
from dflash_cli.protocol.requests import read_messages


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
