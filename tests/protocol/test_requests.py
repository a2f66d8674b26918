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


@pytest.mark.parametrize("key", ["tool_calls", "function_call"])
def test_a_replayed_tool_call_names_the_missing_feature(key: str) -> None:
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    history = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, key: call}]
    with pytest.raises(RequestError, match="tool calling is not supported yet") as missing:
        read_messages(history)
    assert missing.value.param == f"messages[1].{key}"
    assert "must be a string" not in str(missing.value)
