"""`dflash serve`: a real server (`python -m dflash_cli serve` in a subprocess, on 127.0.0.1, a free port) on a
tiny Qwen3 with a random drafter, driven by the official `openai` client and by raw HTTP.

One server for the whole module (it loads in seconds); expected answers come from the same models loaded in
this process and decoded through the session, the way `dflash chat` and `dflash run` decode."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from typer.testing import CliRunner

from dflash_cli.cli.app import app
from dflash_cli.engine import collect
from dflash_cli.loading.session import Session
from dflash_cli.protocol.requests import CHAT_URL, COMPLETIONS_URL
from helpers.served import (  # the fixtures (a server and its models, once per module), and their helpers
    BATCH,
    BUSY,
    KEY,
    MAX_QUEUE,
    MAX_TOKENS,
    RECORD,
    WEATHER,
    WINDOW,
    RunningServer,
    client,
    expected_chat,
    expected_completion,
    local_options,
    long_prompt,
    model_flags,
    models,
    raw_request,
    running_server,
    server,
    session,
    subprocess_env,
    user,
)

__all__ = ["client", "long_prompt", "models", "server", "session"]  # (fixtures, imported to be used here)
pytestmark = pytest.mark.slow  # a real server in a subprocess, started once for the module


# ---------------------------------------------------------------------------------------------------------------
# The API, through the openai client


def test_health_models_and_metrics(server: RunningServer, client: openai.OpenAI) -> None:
    status, health = server.get("/health")  # open without the key, for load balancers
    assert status == 200 and health["status"] == "ok" and health["model"] == server.target
    assert server.get("/") == (200, health)  # (and `HEAD /`, Claude Code's connectivity check)
    assert raw_request(server.port, "HEAD", "/", None, {})[0] == 200
    (card,) = client.models.list().data
    assert card.id == server.target and card.owned_by == "dflash"
    assert client.models.retrieve(server.target) == card  # GET /v1/models/{id}, ids with a slash included
    with pytest.raises(openai.NotFoundError, match="'no-such-model' is not served here") as unknown:
        client.models.retrieve("no-such-model")
    assert unknown.value.code == "model_not_found"
    status, metrics = server.get("/metrics")
    assert status == 200
    for name in (
        "dflash_queue_depth",
        "dflash_requests_running",
        "dflash_tau_bucket",
        "dflash_acceptance_length_bucket",
        "dflash_time_per_output_token_seconds_bucket",
        "dflash_generation_tokens_total",
    ):
        assert name in metrics
    assert 'dflash_model_info{batch_size="4",block_size="4",model="' in metrics and 'speculative="true"' in metrics


def test_chat_completion_whole_and_streamed(
    server: RunningServer, client: openai.OpenAI, session: Session, models: tuple[Path, Path]
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! How are you?"}]
    expected = expected_chat(session, models, messages, max_new_tokens=12)
    reply = client.chat.completions.create(model=server.target, messages=messages, max_tokens=12)
    assert reply.object == "chat.completion" and reply.model == server.target and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", expected.text)
    assert choice.finish_reason == expected.finish_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(session.encode_chat(messages)),
        len(expected.token_ids),
    )
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    stats = reply.model_extra["dflash"]
    assert stats["speculative"] is True and stats["block_size"] == 4
    assert sum(int(k) * v for k, v in stats["acceptance_histogram"].items()) == len(expected.token_ids) - 1
    assert stats["tau"] >= 1 and stats["decode_tokens_per_s"] > 0

    stream = client.chat.completions.create(
        model=server.target,
        messages=messages,
        max_completion_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_a_shared_system_prompt_is_reused_and_reported(
    server: RunningServer, client: openai.OpenAI, session: Session, models: tuple[Path, Path]
) -> None:
    """Requests that share a system prompt continue from the slot that holds it: `cached_tokens` in the usage (whole
    and streamed), the /metrics counters, and the same answers as a prefill from the first token."""
    system = {"role": "system", "content": "You answer questions about the weather. " * 12}
    hits, reused = (
        server.metric("dflash_prefix_cache_hits_total"),
        server.metric("dflash_prefix_cache_reused_tokens_total"),
    )
    client.chat.completions.create(model=server.target, messages=[system, *user("Is it sunny?")], max_tokens=4)
    messages = [system, *user("Will it rain tomorrow?")]
    session.prefix_cache = False
    try:
        expected = expected_chat(session, models, messages, max_new_tokens=6)
    finally:
        session.prefix_cache = True
    reply = client.chat.completions.create(model=server.target, messages=messages, max_tokens=6)
    assert reply.choices[0].message.content == expected.text
    shared = common_prefix_length(session.encode_chat([system, *user("Is it sunny?")]), session.encode_chat(messages))
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert shared > 20 and cached == shared == reply.model_extra["dflash"]["cached_tokens"]
    stream = client.chat.completions.create(
        model=server.target, messages=messages, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    usage = list(stream)[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # all of it but its last token
    assert server.metric("dflash_prefix_cache_hits_total") >= hits + 2
    assert server.metric("dflash_prefix_cache_reused_tokens_total") >= reused + cached + usage.prompt_tokens - 1


def common_prefix_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_completions_whole_and_streamed(
    server: RunningServer, client: openai.OpenAI, session: Session, models: tuple[Path, Path]
) -> None:
    prompt = "The quick brown fox"
    expected = expected_completion(session, models, prompt)  # no max_tokens: the server's --max-tokens
    reply = client.completions.create(model=server.target, prompt=prompt)
    assert reply.object == "text_completion" and reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids) == MAX_TOKENS  # a random model: no early stop
    assert reply.choices[0].finish_reason == "length"
    ids = session.encode_prompt(prompt)
    from_ids = client.completions.create(model=server.target, prompt=ids)  # token ids are a prompt too
    assert from_ids.choices[0].text == expected.text and from_ids.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model=server.target, prompt=[prompt], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary") as outside:
        client.completions.create(model=server.target, prompt=[ids[0], 10**6])
    assert outside.value.body["param"] == "prompt"  # the field the client sent, not our name for token ids


def test_several_prompts_in_one_completion_get_a_choice_each(
    server: RunningServer, client: openai.OpenAI, session: Session, models: tuple[Path, Path]
) -> None:
    """A list of prompts (LangChain's legacy OpenAI.batch sends one): each answered as alone, in order, with the
    usage summed; streamed, several prompts are refused by name."""
    prompts = ["The quick brown fox", "Once upon a time", "def add(a, b):"]
    expected = [expected_completion(session, models, prompt) for prompt in prompts]
    reply = client.completions.create(model=server.target, prompt=prompts)
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    assert [choice.text for choice in reply.choices] == [e.text for e in expected]
    assert reply.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    assert reply.usage.prompt_tokens == sum(len(session.encode_prompt(prompt)) for prompt in prompts)
    ids = [session.encode_prompt(prompt) for prompt in prompts[:2]]
    assert [c.text for c in client.completions.create(model=server.target, prompt=ids).choices] == [
        e.text for e in expected[:2]
    ]
    with pytest.raises(openai.BadRequestError, match="several prompts are answered whole") as streamed:
        client.completions.create(model=server.target, prompt=prompts, stream=True)
    assert streamed.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\] is empty") as empty:  # which one is bad
        client.completions.create(model=server.target, prompt=["a", ""])
    assert empty.value.body["param"] == "prompt[1]"
    too_many = ["a"] * (MAX_QUEUE + BATCH + 1)  # could never all be taken: a 400 naming the limit, not "retry"
    with pytest.raises(openai.BadRequestError, match=f"{MAX_QUEUE + BATCH + 1} prompts, more than this server"):
        client.completions.create(model=server.target, prompt=too_many)


def test_stop_strings_cut_the_reply(
    server: RunningServer, client: openai.OpenAI, session: Session, models: tuple[Path, Path]
) -> None:
    messages = user("What is 2 + 2?")
    free = expected_chat(session, models, messages)
    stop = free.text[3:5]
    assert len(stop) == 2 and stop in free.text
    cut = free.text[: free.text.find(stop)]
    reply = client.chat.completions.create(model=server.target, messages=messages, stop=[stop, "never appears"])
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (cut, "stop")
    chunks = list(client.chat.completions.create(model=server.target, messages=messages, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_fields_reach_the_engine(
    server: RunningServer, client: openai.OpenAI, session: Session, models: tuple[Path, Path]
) -> None:
    fields = {"temperature": 1.3, "top_p": 0.9, "seed": 1234}
    extra = {"top_k": 50, "min_p": 0.01}  # not OpenAI fields: sent as extra body, as vLLM's clients do
    expected = expected_chat(session, models, user("Tell me a story"), top_k=50, min_p=0.01, **fields)
    replies = [
        client.chat.completions.create(
            model=server.target, messages=user("Tell me a story"), extra_body=extra, **fields
        )
        for _ in range(2)
    ]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content == expected.text


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, server: RunningServer) -> None:
    # the tiny template writes an empty think block when enable_thinking is false: one more prompt token or more
    on = client.chat.completions.create(model=server.target, messages=user("Hi"), max_tokens=1)
    off = client.chat.completions.create(
        model=server.target,
        messages=user("Hi"),
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_errors_name_the_field_in_openai_shape(server: RunningServer, client: openai.OpenAI) -> None:
    cases = [
        ({"temperature": -1}, "temperature", "temperature must be in [0, 2]"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
        ({"max_completion_tokens": 2.5}, "max_completion_tokens", "max_completion_tokens must be an integer"),
        ({"n": 2}, "n", "n must be 1"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
        ({"stop": [""]}, "stop", "stop must be a string or a list of non-empty strings"),
        ({"logprobs": True}, "logprobs", "logprobs are not supported"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream: true"),
    ]
    for fields, param, message in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=server.target, messages=user("Hi"), **fields)
        error = raised.value.body
        assert raised.value.status_code == 400 and error["param"] == param and message in error["message"], error
        assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="messages\\[0\\].role must be system, developer, user, assistant"):
        client.chat.completions.create(
            model=server.target, messages=[{"role": "function", "content": "x", "name": "f"}]
        )
    schemas = [
        ({"type": "strnig"}, "response_format.json_schema.schema", 'Unsupported type "strnig"'),
        (
            {"type": "object", "properties": {"a": {"not": {}}}},
            "response_format.json_schema.schema.properties.a.not",
            "'not'",
        ),
    ]
    for schema, param, message in schemas:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(
                model=server.target,
                messages=user("Hi"),
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            )
        assert raised.value.body["param"] == param and message in raised.value.body["message"], raised.value.body
    with pytest.raises(openai.BadRequestError, match=f"context window is {WINDOW}") as raised:
        client.completions.create(model=server.target, prompt="word " * (WINDOW + 100))
    assert raised.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError, match="this server serves") as raised:
        client.chat.completions.create(model="gpt-4o", messages=user("Hi"))
    assert raised.value.body["code"] == "model_not_found"


def test_the_bodies_that_reached_the_engine_are_refused_by_field(
    server: RunningServer, client: openai.OpenAI, session: Session, models: tuple[Path, Path]
) -> None:
    """Issue 48's trial: each of these reached the engine (a 500 with a traceback, or garbage at 200); each is now
    a 400 naming its field, streamed or not, before anything is queued."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    answered = [*user("Weather?"), {"role": "assistant", "content": None, "tool_calls": [call]}]
    tools = [WEATHER]
    cases = [
        ({"temperature": 10**30}, "temperature", "temperature must be in [0, 2]"),
        ({"temperature": 1e9}, "temperature", "temperature must be in [0, 2]"),
        ({"top_k": 10**30}, "top_k", "top_k must be at most 2147483647"),
        ({"max_tokens": 10**30}, "max_tokens", "max_tokens must be at most 2147483647"),
        (
            {"max_tokens": 1_000_000, "tools": tools},
            "max_tokens",
            f"max_tokens is 1000000, but the model's context window of {WINDOW} tokens leaves",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
            "response_format.json_schema.schema",
            "admits no finite JSON value",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters.type",
            'must be a JSON schema of "type": "object"',
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": "a"}}}
                ]
            },
            "tools[0].function.parameters.properties",
            "must be an object of schemas",
        ),
        (
            {"messages": [*answered, {"role": "tool", "tool_call_id": "nope", "content": "sunny"}], "tools": tools},
            "messages[2].tool_call_id",
            '"nope" answers no tool call of the conversation',
        ),
        ({"user": 12345}, "user", "user must be a string"),
    ]
    for stream in (False, True):
        for fields, param, message in cases:
            body = {"messages": user("Hi"), **fields}
            messages = body.pop("messages")
            with pytest.raises(openai.BadRequestError) as raised:  # (extra_body: as sent, top_k too)
                client.chat.completions.create(model=server.target, messages=messages, stream=stream, extra_body=body)
            error = raised.value.body
            assert error["param"] == param and message in error["message"], (fields, error)
    left = WINDOW - len(session.encode_prompt("Hi"))
    with pytest.raises(openai.BadRequestError, match=f"ask for at most {left}") as raised:
        client.completions.create(model=server.target, prompt="Hi", max_tokens=left + 1)
    assert raised.value.body["code"] == "context_length_exceeded"
    reply = client.chat.completions.create(model=server.target, messages=user("Hi"), max_tokens=3)
    assert reply.choices[0].message.content == expected_chat(session, models, user("Hi"), max_new_tokens=3).text


def test_wrong_or_missing_api_key_is_401(server: RunningServer) -> None:
    with pytest.raises(openai.AuthenticationError) as raised:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert raised.value.status_code == 401 and raised.value.body["code"] == "invalid_api_key"
    status, headers, body = raw_request(server.port, "POST", "/v1/completions", b'{"prompt": "x"}')
    assert status == 401 and headers["www-authenticate"] == "Bearer" and json.loads(body)["error"]["message"]


def test_pages_on_this_machine_may_call_it_from_a_browser_and_other_sites_may_not(server: RunningServer) -> None:
    """CORS: a web UI on localhost gets its preflight (which carries no API key) and its answers; a page of
    another site does not (without --allowed-origins), so it cannot use the model through a visitor's browser."""
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "https://localhost"):
        status, headers, _ = raw_request(server.port, "OPTIONS", CHAT_URL, None, {"Origin": origin, **ask})
        assert status == 200 and headers["access-control-allow-origin"] == origin, (origin, status, headers)
        assert "authorization" in headers["access-control-allow-headers"].lower()
        status, headers, _ = raw_request(
            server.port, "GET", "/v1/models", None, {"Origin": origin, "Authorization": f"Bearer {KEY}"}
        )
        assert status == 200 and headers["access-control-allow-origin"] == origin
    for origin in ("https://evil.example", "http://localhost.evil.example", "http://127.0.0.1.example"):
        status, headers, _ = raw_request(server.port, "OPTIONS", CHAT_URL, None, {"Origin": origin, **ask})
        assert status == 400 and "access-control-allow-origin" not in headers, (origin, headers)
        _, headers, _ = raw_request(server.port, "GET", "/v1/models", None, {"Origin": origin})
        assert "access-control-allow-origin" not in headers


def test_allowed_origins_add_sites(models: tuple[Path, Path]) -> None:
    """--allowed-origins: the sites named (as browsers write them) get answers beside this machine's pages."""
    ask = {"Access-Control-Request-Method": "POST"}
    with running_server([*model_flags(models), "--allowed-origins", "HTTPS://Chat.Example.com:443/"]) as running:
        for origin, allowed in [
            ("https://chat.example.com", True),
            ("http://localhost:3000", True),
            ("https://other.example.com", False),
        ]:
            status, headers, _ = raw_request(running.port, "OPTIONS", CHAT_URL, None, {"Origin": origin, **ask})
            assert (status == 200) == allowed and (headers.get("access-control-allow-origin") == origin) == allowed


# ---------------------------------------------------------------------------------------------------------------
# Many clients, gone clients, a full queue


def test_16_concurrent_clients_get_complete_greedy_answers(
    server: RunningServer, session: Session, models: tuple[Path, Path]
) -> None:
    questions = [f"Question {i}: what is {i} + {i}?" for i in range(16)]
    expected = {q: expected_chat(session, models, user(q)).text for q in questions}

    def ask(question: str) -> tuple[str, str]:
        client = server.client()
        if questions.index(question) % 2:
            stream = client.chat.completions.create(model=server.target, messages=user(question), stream=True)
            return question, "".join(c.choices[0].delta.content or "" for c in stream)
        return question, client.chat.completions.create(model=server.target, messages=user(question)).choices[
            0
        ].message.content

    def rows_per_step() -> tuple[float, float, float]:  # verify steps: all, with one row, with at most BATCH - 1
        count = server.metric("dflash_batch_rows_count")
        return (
            count,
            server.metric('dflash_batch_rows_bucket{le="1.0"}'),
            server.metric(f'dflash_batch_rows_bucket{{le="{BATCH - 1}.0"}}'),
        )

    before = rows_per_step()
    with ThreadPoolExecutor(16) as pool:
        answers = dict(pool.map(ask, questions))
    assert answers == expected  # each row of a batch answers exactly as it does alone
    # and the rows did share their steps: the server's histogram of rows per verify step
    steps, single, partial = (after - was for after, was in zip(rows_per_step(), before))
    assert steps > 0 and single < steps / 2 and partial < steps, (steps, single, partial)
    assert server.get("/health")[1]["batch_size"] == BATCH
    # and `dflash chat --prompt` (the real command, in this process) answers the same
    for question in questions[:2]:
        chat = CliRunner().invoke(app, ["chat", *model_flags(models), "--prompt", question, "--no-history"], input="")
        assert chat.exit_code == 0, chat.output
        assert chat.stdout == answers[question] + "\n"


def test_bf16_answers_do_not_depend_on_the_requests_beside_them(models: tuple[Path, Path]) -> None:
    """Issue 33's trial on a bf16 server (the default dtype of a bf16-capable CPU, with the CPU plan's eager
    attention): each request alone, then beside 1-3 others (streamed and not), gives one text, greedy and seeded at
    temperature 0.9. With SDPA's shape-dependent rounding some of these texts part (tests/engine/test_invariance.py
    asserts it on tiny models; here 1 in 8 prompts of 100 tokens did)."""
    flags = [*model_flags(models), "--batch-size", "4"]
    flags[flags.index("--dtype") + 1] = "bfloat16"
    with running_server(flags) as bf16:
        assert any("cpu bfloat16" in line and "eager" in line for line in bf16.log), bf16.log
        client = bf16.client()
        questions = [user(f"Tell me about the sea, part {i}.") for i in range(6)]
        seeded = dict(temperature=0.9, seed=123)

        def ask(which: int, stream: bool = False, sampled: bool = False) -> str:
            sampling = seeded if sampled else {}
            messages = questions[which]
            if stream:
                chunks = client.chat.completions.create(
                    model=bf16.target, messages=messages, max_tokens=100, stream=True, **sampling
                )
                return "".join(c.choices[0].delta.content or "" for c in chunks)
            reply = client.chat.completions.create(model=bf16.target, messages=messages, max_tokens=100, **sampling)
            return reply.choices[0].message.content

        asks = [(which, sampled) for which in range(len(questions)) for sampled in (False, True)]
        alone = {key: ask(*key[:1], sampled=key[1]) for key in asks}
        with ThreadPoolExecutor(4) as pool:  # 12 requests, 4 rows a step: each beside 1-3 others
            together = {key: pool.submit(ask, key[0], i % 3 == 0, key[1]) for i, key in enumerate(asks)}
            assert {key: future.result() for key, future in together.items()} == alone
        steps = bf16.metric("dflash_batch_rows_count") - bf16.metric('dflash_batch_rows_bucket{le="1.0"}')
        assert steps > 0  # steps did verify several rows together


def test_a_killed_client_stops_its_generation_and_the_server_serves_on(
    server: RunningServer, client: openai.OpenAI, session: Session, models: tuple[Path, Path], long_prompt: str
) -> None:
    prompt = long_prompt
    cancelled_before = server.metric('dflash_requests_finished_total{finish_reason="cancelled"}')
    script = (
        "import sys, openai\n"
        f"client = openai.OpenAI(base_url={server.url + '/v1'!r}, api_key={KEY!r}, max_retries=0)\n"
        f"for chunk in client.chat.completions.create(model={server.target!r}, max_tokens={BUSY}, stream=True,\n"
        f"        messages=[{{'role': 'user', 'content': {prompt!r}}}]):\n"
        "    print('chunk', flush=True)\n"
    )
    streaming = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    assert streaming.stdout is not None and streaming.stdout.readline() == "chunk\n"  # it is streaming
    streaming.kill()  # SIGKILL: the socket closes under the server's feet
    streaming.wait()
    streaming.stdout.close()
    # a non-streaming client that hangs up is stopped too
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        body = json.dumps({"messages": user(prompt), "max_tokens": BUSY}).encode()
        raw.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        time.sleep(0.3)
    deadline = time.monotonic() + 60
    while server.metric('dflash_requests_finished_total{finish_reason="cancelled"}') < cancelled_before + 2:
        assert time.monotonic() < deadline, "\n".join(server.log[-10:])
        time.sleep(0.1)
    hung_up = 'dflash_http_requests_total{route="/v1/chat/completions",status="499"}'
    while server.metric(hung_up) < 1:  # the non-streaming one is counted as "client closed request"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    generated = [
        int(m.group(1)) for m in re.finditer(r"cancelled: \d+ prompt \+ (\d+) generated", "\n".join(server.log))
    ]
    assert len(generated) >= 2 and all(n < BUSY for n in generated[-2:])  # stopped well before max_tokens
    reply = client.chat.completions.create(model=server.target, messages=user("Still there?"))
    assert reply.choices[0].message.content == expected_chat(session, models, user("Still there?")).text


def test_a_full_queue_answers_429_at_once(server: RunningServer, long_prompt: str) -> None:
    prompt = long_prompt
    body = json.dumps({"messages": user(prompt), "max_tokens": BUSY, "stream": True}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    busy: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while True:  # fill the engine and every queue slot with long streams we do not read
            health = server.get("/health")[1]
            if health["waiting"] == MAX_QUEUE and health["running"] == BATCH:
                break
            assert time.monotonic() < deadline, health
            if health["waiting"] + health["running"] < MAX_QUEUE + BATCH and len(busy) < 3 * MAX_QUEUE:
                connection = socket.create_connection(("127.0.0.1", server.port))
                connection.sendall(request)
                busy.append(connection)
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as raised:
            server.client().chat.completions.create(model=server.target, messages=user("Me too?"))
        assert time.monotonic() - started < 5  # refused at once, not after waiting
        assert raised.value.status_code == 429 and raised.value.body["code"] == "queue_full"
        assert raised.value.response.headers["retry-after"] == "1"
    finally:
        for connection in busy:
            connection.close()  # the clients go away: their queued and running jobs are cancelled
    deadline = time.monotonic() + 60
    while (health := server.get("/health")[1])["waiting"] or health["running"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    assert (
        server.client().chat.completions.create(model=server.target, messages=user("Now?")).choices[0].message.content
    )


@pytest.fixture(scope="module")
def tight_server(models: tuple[Path, Path]) -> Iterator[RunningServer]:
    """Two rows and a 1 MiB prefix store: a few conversations' prefixes at most (a 400-token one of the tiny
    model's is ~0.3 MiB with its drafter rows), so placements take from it while what they stash evicts."""
    flags = [*model_flags(models), "--batch-size", "2", "--cache-ram", "1", "--max-queue", str(MAX_QUEUE)]
    with running_server(flags) as running:
        yield running


def cold(session: Session, models: tuple[Path, Path], messages: list[dict[str, str]], max_tokens: int) -> str:
    """The answer of a prefill from the first token (no prefix reuse)."""
    session.prefix_cache = False
    try:
        return expected_chat(session, models, messages, max_new_tokens=max_tokens).text
    finally:
        session.prefix_cache = True


def facts(rng: random.Random, count: int) -> str:
    things = ["lamp", "river", "violin", "comet", "garden", "ledger", "harbor", "kettle"]
    return " ".join(
        f"Fact {i}: the {rng.choice(things)} of {rng.choice(things)} weighs {rng.randrange(10**6)} grams."
        for i in range(count)
    )


def test_conversations_through_a_tiny_prefix_store_lose_no_request(
    tight_server: RunningServer, session: Session, models: tuple[Path, Path]
) -> None:
    """Issue 48: 24 conversations of three turns, each with a system prompt of its own facts, 6 at a time through
    2 rows and a 1 MiB store: every request answers 200 (the store failed requests with `list.remove(x): x not in
    list` when a stash evicted the prefix a placement had found), each answer equal to a cold decode."""
    rng = random.Random(48)
    systems = [{"role": "system", "content": facts(rng, 12)} for _ in range(24)]
    questions = ["Which fact is heaviest?", "And the lightest?", "Sum them."]

    def converse(system: dict[str, str]) -> list[tuple[list[dict[str, str]], str]]:
        client, messages, turns = tight_server.client(), [system], []
        for question in questions:
            messages = [*messages, *user(question)]
            answer = client.chat.completions.create(model=tight_server.target, messages=messages, max_tokens=6)
            turns.append((messages, answer.choices[0].message.content))
            messages = [*messages, {"role": "assistant", "content": answer.choices[0].message.content}]
        return turns

    reused = tight_server.metric("dflash_prefix_cache_reused_tokens_total")
    with ThreadPoolExecutor(6) as pool:
        conversations = list(pool.map(converse, systems))
    for turns in conversations:
        for messages, answer in turns:
            assert answer == cold(session, models, messages, 6)
    assert tight_server.metric('dflash_requests_finished_total{finish_reason="error"}') == 0
    assert tight_server.metric("dflash_prefix_cache_reused_tokens_total") > reused


def test_conversations_that_part_only_at_the_end_get_their_own_answers(
    tight_server: RunningServer, session: Session, models: tuple[Path, Path]
) -> None:
    """Issue 48's adversarial pairs, as a regression: 12 pairs of conversations sharing a long prefix and parting
    only at its last characters, sent concurrently and again: each answer is its own cold answer (a reused
    prefix never lends one conversation's end to the other)."""
    rng = random.Random(12)
    pairs = []
    for _ in range(12):
        shared = [{"role": "system", "content": facts(rng, 8)}, *user(facts(rng, 3) + " So the answer is")]
        a, b = rng.sample("0123456789", 2)
        pairs += [
            shared[:-1] + user(shared[-1]["content"] + f" {a}."),
            shared[:-1] + user(shared[-1]["content"] + f" {b}."),
        ]
    expected = [cold(session, models, messages, 8) for messages in pairs]

    def ask(messages: list[dict[str, str]]) -> str:
        reply = tight_server.client().chat.completions.create(
            model=tight_server.target, messages=messages, max_tokens=8
        )
        return reply.choices[0].message.content

    for _ in range(2):
        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(ask, pairs)) == expected


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing: bad requests get a 4xx JSON error, and change nothing


JSON_HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
ROUTE_BODIES = {  # a valid body per route, which the fuzzer spoils
    CHAT_URL: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    COMPLETIONS_URL: {"prompt": "Hi", "max_tokens": 2},
}
NOT_JSON_TYPES = [  # (the Content-Type header, or None for none; a body's encoding in it)
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=xyz",
    None,
    "application/xml",
    "application/json; charset=latin-1",
    "text/json",
]


def junk(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value: a wrong value for most fields."""
    kinds = ["int", "float", "string", "bool", "list", "object", "big"] if depth < 2 else ["int", "string", "bool"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randrange(-(10**6), 10**6)
    if kind == "big":
        return rng.choice([1, -1]) * rng.randrange(10**18, 10**40)
    if kind == "float":
        return rng.uniform(-1e12, 1e12)
    if kind == "string":
        return "".join(rng.choice("ab$#{}[]\\\"' 0é\u2028") for _ in range(rng.randrange(0, 12)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [junk(rng, depth + 1) for _ in range(rng.randrange(0, 3))]
    return {rng.choice(["a", "type", "$ref", "role"]): junk(rng, depth + 1) for _ in range(rng.randrange(0, 3))}


def out_of(rng: random.Random, low: float, high: float, *, integer: bool) -> Any:
    """A value outside [low, high]: a number below or above it, or not a number (a string, a boolean, a list, a
    fraction where an integer is due)."""
    step = rng.choice([1, 1000, 10**30] if integer else [0.5, 1000.0, 1e30])
    choices = [low - step, high + step, str(rng.randrange(0, 10)), rng.random() < 0.5, [low]]
    return rng.choice(choices + ([low + 0.5] if integer else []))


def cyclic_schema(rng: random.Random) -> dict[str, Any]:
    """A schema no finite value matches: every value must hold another one (`{"$ref": "#"}` and kin)."""
    name, key = rng.choice(["node", "a", "x"]), rng.choice(["next", "child", "k"])
    return rng.choice(
        [
            {"$ref": "#"},
            {"type": "object", "properties": {key: {"$ref": "#"}}, "required": [key]},
            {
                "$defs": {name: {"type": "array", "items": {"$ref": f"#/$defs/{name}"}, "minItems": 1}},
                "$ref": f"#/$defs/{name}",
            },
            {"anyOf": [{"$ref": "#"}, {"type": "object", "properties": {key: {"$ref": "#"}}, "required": [key]}]},
        ]
    )


def deep_schema(rng: random.Random) -> dict[str, Any]:
    """A schema nested past what the checks and the compiler recurse through (a chain of 20,000 references
    crashed the compiler): arrays in arrays, or a chain of references."""
    length = rng.randrange(520, 3000)
    if rng.random() < 0.5:
        schema: dict[str, Any] = {"type": "string"}
        for _ in range(length // 4):  # (json.dumps recurses too: a few hundred levels)
            schema = {"type": "array", "items": schema}
        return schema
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)} | {f"d{length}": {"type": "null"}}
    return {"type": "object", "properties": {"k": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def bad_fields(rng: random.Random, chat: bool) -> dict[str, Any]:
    """One field of a request with a value the API refuses (the key is the field an error must name)."""
    user_turn = {"role": "user", "content": "Hi"}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    spoilers: dict[str, Any] = {
        "max_tokens": lambda: rng.choice([out_of(rng, 1, 2**31 - 1, integer=True), 10**6, rng.randrange(3000, 2**31)]),
        "max_completion_tokens": lambda: out_of(rng, 1, 2**31 - 1, integer=True),
        "temperature": lambda: rng.choice([out_of(rng, 0, 2, integer=False), 10**30, 1e9, rng.uniform(2.001, 1e6)]),
        "top_p": lambda: out_of(rng, 1e-9, 1, integer=False),
        "top_k": lambda: rng.choice([out_of(rng, -1, 2**31 - 1, integer=True), 10**30, -rng.randrange(2, 10**6)]),
        "min_p": lambda: out_of(rng, 0, 0.999, integer=False),
        "seed": lambda: rng.choice([2**64 + rng.randrange(10**9), -(2**63) - 1, "s", 1.5, True]),
        "stop": lambda: rng.choice([5, [5], [""], {"a": 1}, [None], [""] * 3, [3], True]),
        "n": lambda: rng.choice([out_of(rng, 1, 128, integer=True), rng.randrange(2, 128)]),
        "presence_penalty": lambda: rng.choice([out_of(rng, -2, 2, integer=False), 0.5, -1.5]),
        "frequency_penalty": lambda: rng.choice([out_of(rng, -2, 2, integer=False), 1]),
        "top_logprobs": lambda: rng.choice([out_of(rng, 0, 20, integer=True), 3]),
        "stream": lambda: rng.choice(["yes", 1, [], {}, 0.5]),
        "stream_options": lambda: rng.choice([{"include_usage": True}, "x", 3]),  # (without stream: true)
        "logprobs": lambda: rng.choice([True, 5]),
        "echo": lambda: True,
        "logit_bias": lambda: {str(rng.randrange(100)): rng.randrange(-100, 100)},
        "best_of": lambda: rng.choice([3, 0, 10**30]),
        "suffix": lambda: "tail",
        "user": lambda: rng.choice([rng.randrange(10**31), [], {}, True, 1.5]),
        "metadata": lambda: rng.choice(["m", 5, {"a": rng.randrange(10)}, [1]]),
        "store": lambda: rng.choice(["yes", 1, []]),
        "model": lambda: rng.choice([5, "gpt-4o", "", [], {"name": "x"}]),
        "response_format": lambda: rng.choice(
            [
                {"type": "json_objekt"},
                "json",
                {"type": "json_schema"},
                {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
                {"type": "json_schema", "json_schema": {"name": "r", "schema": cyclic_schema(rng)}},
                {"type": "json_schema", "json_schema": {"name": "r", "schema": deep_schema(rng)}},
                {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}},
                {"type": "json_schema", "json_schema": {"schema": {"not": {}}}},
            ]
        ),
    }
    if chat:
        spoilers |= {
            "messages": lambda: rng.choice(
                [
                    None,
                    [],
                    "Hi",
                    [junk(rng)],
                    [{}],
                    [{"role": "user"}],
                    [{"role": rng.choice(["robot", "function", "", "USER"]), "content": "x"}],
                    [{"role": "user", "content": rng.choice([5, None, True, {"a": 1}])}],
                    [{"role": "user", "content": [{"type": "image_url"}]}],
                    [{"role": "user", "content": "\ud800"}],
                    [{"role": "user", "content": "x", "name": rng.randrange(100)}],
                    [user_turn, {"role": "tool", "tool_call_id": "c1", "content": "x"}],  # answers no call
                    [
                        user_turn,
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": rng.choice(["c2", "", "call_0"]), "content": "x"},
                    ],
                    [
                        user_turn,
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": rng.randrange(10), "content": "x"},
                    ],
                    [user_turn, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
                    {"role": "user"},
                ]
            ),
            "tools": lambda: [
                {
                    "type": "function",
                    "function": rng.choice(
                        [
                            {"name": "f", "parameters": {"type": rng.choice(["string", "array", "integer", None])}},
                            {"name": "f", "parameters": {"type": "object", "properties": rng.choice(["a", 5, [1]])}},
                            {"name": "f", "parameters": {"type": "object", "properties": {"a": 5}}},
                            {"name": "f", "parameters": {"type": "object", "required": rng.choice(["a", [1]])}},
                            {"name": "f", "parameters": cyclic_schema(rng) | {"type": "object"}},
                            {"name": "f", "parameters": rng.choice(["x", 5, []])},
                            {"name": "", "parameters": {}},
                            {"name": "f f"},
                            {"name": "f", "description": rng.randrange(10)},
                            {"name": "f", "strict": "yes"},
                        ]
                    ),
                }
            ],
            "tool_choice": lambda: rng.choice(["required", "any", {"type": "function", "function": {"name": "g"}}]),
            "chat_template_kwargs": lambda: rng.choice(
                ["x", [1], {"tokenize": False}, {"add_generation_prompt": False}]
            ),
        }
    else:
        spoilers |= {
            "prompt": lambda: rng.choice(
                [None, 3, "", [], [-1], [10**9], [[1], [-2]], ["a", ""], {"text": "x"}, [1.5], True, "\udfff"]
            ),
            "messages": lambda: [{"role": "user", "content": "x"}],  # (a conversation: not a completion's)
            "chat_template_kwargs": lambda: {},
            "tools": lambda: [{"type": "function", "function": {"name": "f"}}],  # (tools need a conversation)
        }
    key = rng.choice(sorted(spoilers))
    value = spoilers[key]()
    if key == "stream_options":
        return {key: value, "stream": False} if rng.random() < 0.5 else {key: value}
    if key == "tool_choice":
        return {key: value}  # (without tools: refused; "any" is no choice at all)
    return {key: value}


def malformed_requests(
    rng: random.Random, route: str, count: int
) -> Iterator[tuple[str, bytes, dict[str, str], set[str]]]:
    """`count` malformed requests for `route`: (method, body, headers, the fields an error may name; empty where
    the problem is the body as a whole). Most spoil one to three fields of a valid body (each refused on its own);
    the rest are not JSON, not an object, not sent as JSON (415), or sent without the key (401)."""
    base = ROUTE_BODIES[route]
    for _ in range(count):
        kind = rng.choices(["fields", "json", "shape", "content_type", "auth"], [80, 6, 5, 6, 3])[0]
        if kind == "fields":
            body, keys = dict(base), set()
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                spoilt = bad_fields(rng, route == CHAT_URL)
                body |= spoilt
                keys.add(next(iter(spoilt)))  # (the field spoilt; a "stream": false beside it is fine)
            yield "POST", json.dumps(body).encode(), JSON_HEADERS, keys
        elif kind == "json":
            text = json.dumps(base).encode()
            cut = text[: rng.randrange(0, len(text) - 1)]  # a proper prefix of an object is never JSON
            variants = [cut, b"\xff\xfe" + text, b"{'messages': []}", b"NaN", b'{"temperature": NaN}', b"[" * 5000, b""]
            yield "POST", rng.choice(variants), JSON_HEADERS, set()
        elif kind == "shape":
            yield "POST", json.dumps(rng.choice([[], 5, "text", None, [base], True])).encode(), JSON_HEADERS, set()
        elif kind == "content_type":
            media = rng.choice(NOT_JSON_TYPES)
            headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": media} if media else {})}
            yield "POST", json.dumps(base).encode(), headers, set()
        else:
            headers = rng.choice([{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}])
            yield "POST", json.dumps(base).encode(), {**headers, "Content-Type": "application/json"}, set()


def test_an_endpoint_not_served_is_named_so(client: openai.OpenAI) -> None:
    """A 404 under /v1 says what this server has and does not (it once said "the API is under /v1" there)."""
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="x", input="hi")
    message = missing.value.body["message"]
    assert "under /v1" not in message and "embeddings, images and audio are not served" in message
    assert "POST /v1/chat/completions" in message


@pytest.mark.parametrize("route", sorted(ROUTE_BODIES))
def test_1000_malformed_requests_per_route_get_4xx_json_errors(
    route: str, server: RunningServer, client: openai.OpenAI, session: Session, models: tuple[Path, Path]
) -> None:
    """Issue 48: 1,000 seeded malformed requests per route, each answered 4xx with a JSON error that names the
    field it spoilt, none reaching the engine (no token generated, no traceback in the log: `running_server`
    checks that at its end), and the server answers a normal request afterwards."""
    generated_before = server.metric("dflash_generation_tokens_total")
    statuses: dict[int, int] = {}
    for method, body, headers, keys in malformed_requests(random.Random(48), route, 1000):
        status, _, raw = raw_request(server.port, method, route, body, headers)
        assert 400 <= status < 500, (body[:300], headers, status, raw[:300])
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"], raw
        if keys and status == 400:  # names the field (maybe a part of it: messages[2].tool_call_id)
            named = re.match(r"[a-z_]*", error["param"] or "")[0] in keys
            assert named or any(key in error["message"] for key in keys), (body[:300], error)  # ("x and y disagree")
        statuses[status] = statuses.get(status, 0) + 1
    assert set(statuses) == {400, 401, 404, 415}, statuses  # (404: a model not served)
    assert statuses[400] > 800, statuses
    assert server.metric("dflash_generation_tokens_total") == generated_before  # nothing reached the engine
    reply = client.chat.completions.create(model=server.target, messages=user("Hello again"))
    assert reply.choices[0].message.content == expected_chat(session, models, user("Hello again")).text
    assert server.get("/health")[1]["status"] == "ok"
    status, _, raw = raw_request(server.port, "POST", route, b" " * (33 * 2**20), JSON_HEADERS)
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"


def test_methods_and_routes_not_served_get_json_errors(server: RunningServer) -> None:
    for method, path in [
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1/models"),
        ("GET", "/v2/x"),
        ("DELETE", "/v1/completions"),
        ("GET", "/" + "a" * 40),
    ]:
        status, _, raw = raw_request(server.port, method, path, b"", JSON_HEADERS)
        assert status in (404, 405) and json.loads(raw)["error"]["message"], (method, path, raw)


def test_a_body_not_sent_as_json_is_415(server: RunningServer) -> None:
    """curl -d sends a form (application/x-www-form-urlencoded) unless told -H 'Content-Type: application/json':
    a body sent as anything but JSON is refused by its type, never parsed as JSON by chance."""
    body = json.dumps(ROUTE_BODIES[CHAT_URL]).encode()
    for media in NOT_JSON_TYPES:
        headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": media} if media else {})}
        status, _, raw = raw_request(server.port, "POST", CHAT_URL, body, headers)
        error = json.loads(raw)["error"]
        assert status == 415 and error["code"] == "unsupported_media_type", (media, raw)
        assert "Content-Type: application/json" in error["message"]
    for media in ("application/json", "Application/JSON; charset=UTF-8", 'application/json; charset="utf-8"'):
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": media}
        assert raw_request(server.port, "POST", CHAT_URL, body, headers)[0] == 200, media
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "Content-Encoding": "gzip"}
    status, _, raw = raw_request(server.port, "POST", CHAT_URL, gzip.compress(body), headers)
    assert status == 415 and "Content-Encoding 'gzip': send it uncompressed" in json.loads(raw)["error"]["message"]
    headers["Content-Encoding"] = "identity"
    assert raw_request(server.port, "POST", CHAT_URL, body, headers)[0] == 200
    # `dflash serve --help`'s example request, as printed, answers 200 (without the header it was a 415)
    printed = " ".join(CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "300"}).stdout.split())
    curl = shlex.split(re.search(r"`(curl [^`]+)`", printed)[1])
    headers = dict(curl[i + 1].split(": ", 1) for i, arg in enumerate(curl) if arg == "-H")
    path = curl[1].removeprefix("http://127.0.0.1:8000")
    example = curl[curl.index("-d") + 1].encode()
    status, _, raw = raw_request(server.port, "POST", path, example, {"Authorization": f"Bearer {KEY}", **headers})
    assert status == 200, raw


def test_a_taken_port_fails_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        missing = str(tmp_path / "no-such-model")  # loading it would fail: the port must fail first
        result = CliRunner().invoke(app, ["serve", "--target", missing, "--port", port])
    assert result.exit_code == 1
    message = " ".join(result.stderr.split())
    assert f"cannot listen on 127.0.0.1:{port}" in message and "pick another --port" in message
    bad_host = CliRunner().invoke(app, ["serve", "--target", missing, "--host", "no.such.host.invalid"])
    assert bad_host.exit_code == 1 and "cannot listen on no.such.host.invalid" in " ".join(bad_host.stderr.split())


def test_worker_queue_bounds_cancellation_and_stop(session: Session, models: tuple[Path, Path]) -> None:
    from dflash_cli.commands.serve.worker import EngineThread, Job, QueueFull, ShuttingDown, Worker

    one_row = dataclasses.replace(session, plan=dataclasses.replace(session.plan, batch_size=1))
    engine = EngineThread()
    worker = Worker(one_row, engine, speculative=True, max_queue=0)  # no waiting: only the one decoding
    ids = session.encode_chat(user("Hi"))
    params = session.sampling_params(local_options(models))
    updates: dict[str, list[Any]] = {"a": [], "b": [], "c": []}
    jobs = {name: Job(ids, params, updates[name].append) for name in updates}
    worker.submit(jobs["a"])  # not started yet: it holds the one slot
    with pytest.raises(QueueFull):
        worker.submit(jobs["b"])
    worker.cancel(jobs["a"])  # a waiting job leaves at once and hears why
    assert [u.finish_reason for u in updates["a"]] == ["cancelled"] and not worker.full
    worker.submit(jobs["c"])
    worker.start()
    deadline = time.monotonic() + 60
    while not updates["c"] or updates["c"][-1].finish_reason is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    expected = expected_chat(session, models, user("Hi"))
    assert "".join(u.text for u in updates["c"]) == expected.text
    assert sum(len(u.token_ids) for u in updates["c"]) == len(expected.token_ids) and updates["c"][-1].stats.speculative
    assert worker.alive  # (the engine's thread runs the serve loop until stopped)
    worker.stop()
    worker.join(10)
    engine.close()
    with pytest.raises(ShuttingDown):
        worker.submit(jobs["b"])
    assert not worker.alive


def test_a_generation_that_fails_after_admission_fails_alone_and_is_counted(
    session: Session, models: tuple[Path, Path]
) -> None:
    """A job whose generation fails in the engine (its sampling overflows: params no request can carry now, made
    here past the checks) gets its own error; the jobs decoding beside it answer in full, the failure is counted
    in /metrics (dflash_requests_finished_total{finish_reason="error"}) and the worker serves on.
    (tests/engine/test_batch.py fails a row inside a shared verify step.)"""
    from dflash_cli.commands.serve.metrics import ServerMetrics
    from dflash_cli.commands.serve.worker import EngineThread, Job, Worker

    three_rows = dataclasses.replace(session, plan=dataclasses.replace(session.plan, batch_size=3))
    engine = EngineThread()
    worker = Worker(three_rows, engine, speculative=True, max_queue=4)
    metrics = ServerMetrics(
        model="m", speculative=True, block_size=4, waiting=lambda: worker.waiting, running=lambda: worker.running
    )
    worker.on_finish = lambda job, update, waited: metrics.generation_ended(update.finish_reason, update.stats, waited)
    params = session.sampling_params(local_options(models))
    broken = session.sampling_params(local_options(models), temperature=1.0)
    object.__setattr__(broken, "temperature", 10**30)  # (read_body refuses it: "must be in [0, 2]")
    asks = {"a": (user("Hi"), params), "bad": (user("Hello"), broken), "c": (user("Bye"), params)}
    updates: dict[str, list[Any]] = {name: [] for name in asks}
    for name, (messages, sampling) in asks.items():
        worker.submit(Job(session.encode_chat(messages), sampling, updates[name].append))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while any(not u or u[-1].finish_reason is None for u in updates.values()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert updates["bad"][-1].finish_reason == "error" and "int too big" in updates["bad"][-1].error
        for name in ("a", "c"):
            assert "".join(u.text for u in updates[name]) == expected_chat(session, models, asks[name][0]).text
        assert 'dflash_requests_finished_total{finish_reason="error"} 1.0' in metrics.render().decode()
        assert worker.alive
    finally:
        worker.stop()
        worker.join(10)
        engine.close()


def test_the_engine_thread_returns_results_and_raises_errors() -> None:
    """What `serve` runs on its model's one thread: the loading's result or error reaches the caller."""
    from dflash_cli.commands.serve.worker import EngineThread

    engine = EngineThread()
    try:
        name = engine.run(lambda: threading.current_thread().name)
        assert name == "dflash-engine"
        with pytest.raises(ValueError, match="no such model"):
            engine.run(lambda: (_ for _ in ()).throw(ValueError("no such model")))
        assert engine.run(lambda: 42) == 42  # it serves on after an error
    finally:
        engine.close()


# -- tools and structured output -------------------------------------------------------------------------------


def test_json_schema_replies_validate_and_equal_constrained_plain_decoding(
    client: openai.OpenAI, server: RunningServer, session: Session, models: tuple[Path, Path]
) -> None:
    import jsonschema

    from dflash_cli.protocol.requests import read_body

    body = {
        "messages": user("Describe it"),
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD, "strict": True}},
    }
    reply = client.chat.completions.create(model=server.target, **body)
    jsonschema.validate(json.loads(reply.choices[0].message.content), RECORD)
    assert reply.choices[0].finish_reason == "stop"
    # the server speculates; the same request decoded plainly (no drafter) here gives the same tokens
    request = read_body(body, "/v1/chat/completions")
    params = session.request_params(local_options(models), request)
    plain = collect(session.stream(session.encode_request(request), params, speculative=False))
    assert reply.choices[0].message.content == plain.text
    streamed = client.chat.completions.create(model=server.target, stream=True, **body)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain.text
    json_object = client.chat.completions.create(
        model=server.target, messages=user("Hi"), max_tokens=60, response_format={"type": "json_object"}
    )
    if json_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(json_object.choices[0].message.content), dict)


def test_forced_tool_calls_come_back_as_tool_calls_whole_and_streamed(
    client: openai.OpenAI, server: RunningServer
) -> None:
    """The tiny model's template renders no tools: they go into its system prompt in the hermes format, and a
    forced call is constrained by the function's schema, so even a random model calls it with valid arguments."""
    import jsonschema

    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = client.chat.completions.create(
            model=server.target,
            messages=user("Weather?"),
            tools=[WEATHER],
            tool_choice=choice,
            parallel_tool_calls=False,  # (one call, then the end: a random model would go on calling)
            max_tokens=200,
        )
        (call,) = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        assert call.id.startswith("call_") and reply.choices[0].message.content is None
    chunks = list(
        client.chat.completions.create(
            model=server.target,
            messages=user("Weather?"),
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            stream=True,
        )
    )
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].index == 0
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_reply_cut_by_max_tokens_says_length_even_with_whole_calls(
    client: openai.OpenAI, server: RunningServer
) -> None:
    """With parallel calls a random model goes on calling until max_tokens cuts it: the whole calls come back, and
    the finish reason is "length" (a further call was cut off), whole and streamed; "tool_calls" would tell the
    client the reply was complete."""
    body = {"messages": user("Weather?"), "tools": [WEATHER], "tool_choice": "required", "max_tokens": 200}
    reply = client.chat.completions.create(model=server.target, **body)
    assert reply.usage.completion_tokens == 200 and reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=server.target, stream=True, **body))
    assert any(d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or []))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_tool_conversation_round_trips_and_auto_may_answer_in_text(
    client: openai.OpenAI, server: RunningServer
) -> None:
    history = [
        *user("Weather in Paris?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 24C"},
    ]
    reply = client.chat.completions.create(model=server.target, messages=history, tools=[WEATHER], max_tokens=8)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.message.content is not None) or choice.message.tool_calls
    none = client.chat.completions.create(
        model=server.target, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens < reply.usage.prompt_tokens  # no tools in its prompt
