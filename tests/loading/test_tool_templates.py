"""Tools through a chat template that renders them itself: `Session.encode_chat` hands `tools=` and the tool turns
to the template (transformers' `apply_chat_template`), the tool-call format is read from the template when the
recipe names none, and a forced call decodes under the function's schema and parses back."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from dflash_cli.engine import collect
from dflash_cli.loading.session import open_session
from dflash_cli.protocol.requests import read_body
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import PlanOverrides
from helpers.tiny_models import make_tiny_qwen3

# ChatML with Qwen3's tool sections (tools in the system turn, calls as <tool_call> JSON, results in
# <tool_response> inside a user turn).
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set tool_call = tool_call.function %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"key": {"enum": ["a", "b"]}},
            "required": ["key"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory):
    directory = make_tiny_qwen3(tmp_path_factory.mktemp("tools") / "qwen3", seed=0)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    for stale in Path(directory).glob("chat_template.jinja"):
        stale.unlink()
    options = RunOptions(target=str(directory), overrides=PlanOverrides(dtype="float32"))
    return open_session(options), options


def test_the_template_renders_the_tools_and_names_the_format(session) -> None:
    session, options = session
    assert session.renders_tools and session.tool_format == "hermes" and session.recipe.tool_parser is None
    history = [
        {"role": "user", "content": "find a"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "a"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "found"},
    ]
    request = read_body({"messages": history, "tools": [TOOL]}, "/v1/chat/completions")
    text = session.tokenizer.decode(session.encode_request(request))
    assert json.dumps(TOOL) in text  # the template's own rendering of `tools=`
    assert '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>' in text
    assert "<tool_response>\nfound\n</tool_response>" in text


def test_a_forced_call_decodes_under_the_schema_and_parses_back(session) -> None:
    session, options = session
    body = {
        "messages": [{"role": "user", "content": "find"}],
        "tools": [TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 120,
    }
    request = read_body(body, "/v1/chat/completions")
    params = session.request_params(options, request)
    result = collect(session.stream(session.encode_request(request), params, speculative=False))
    content, calls = session.parse_reply(request, result.token_ids, result.text)
    assert result.finish_reason == "stop" and content is None
    (call,) = calls
    assert call.name == "lookup"
    jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])
