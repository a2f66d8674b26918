"""`dflash run PROMPTS.jsonl` (dflash_cli/jobs.py): input formats, bad lines, resume after a real SIGKILL, the output shapes.

Generation runs on a real tiny Qwen3 and a random drafter (tests/tiny_models.py, tests/drafters.py), loaded
once per module; the CLI and kill tests run `python -m dflash_cli run` in subprocesses."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dflash_cli.cli.app import app
from dflash_cli.cli.output import show_summary, summary_table
from dflash_cli.commands import run as jobs
from dflash_cli.commands.run import read_requests, run_file
from dflash_cli.commands.run_output import Done, ErrorsFile, ResultsFile, Resume, completed_ids
from dflash_cli.errors import DflashError
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.protocol.request_files import STDIN, LineError, parse_line
from dflash_cli.protocol.requests import Request
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import PlanOverrides
from helpers.drafters import save_random_drafter

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    drafter_dir = save_random_drafter(tmp_path_factory.mktemp("jobs") / "drafter", target, block_size=4)
    return tiny_qwen3_dir, drafter_dir


@pytest.fixture(scope="module")
def options(models: tuple[Path, Path]) -> RunOptions:
    return RunOptions(target=str(models[0]), drafter=str(models[1]), sampling=SamplingParams(max_new_tokens=6))


@pytest.fixture(scope="module")
def session(options: RunOptions) -> Any:
    from dflash_cli.loading.session import open_session

    return open_session(options)


def write_lines(path: Path, lines: list[Any]) -> Path:
    """Objects become JSON lines; bytes and str are written as they are."""
    with path.open("wb") as file:
        for line in lines:
            raw = line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode()
            file.write(raw + b"\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def result_id(record: dict[str, Any]) -> str:
    return record.get("custom_id", record["id"])


def no_load(options: RunOptions, console: Any) -> Any:
    raise AssertionError("the model must not load")


# ---------------------------------------------------------------------------------------------------------------
# Parsing, no model


def parse(line: Any, number: int = 1) -> Request | LineError | None:
    return parse_line(line if isinstance(line, bytes) else json.dumps(line).encode() + b"\n", number, jobs.auto_id)


def test_each_input_format_is_detected() -> None:
    plain = parse({"prompt": "Once upon a time", "id": "p1"})
    chat = parse({"messages": [{"role": "user", "content": "Hi"}], "id": 7})
    openai_chat = parse(
        {
            "custom_id": "c1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
        }
    )
    openai_text = parse({"custom_id": "c2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "def f("}})
    ids = parse({"prompt_ids": [5, 6, 7], "id": "t"})
    assert (plain.id, plain.prompt, plain.is_chat, plain.endpoint) == ("p1", "Once upon a time", False, None)
    assert (chat.id, chat.messages, chat.is_chat) == ("7", ({"role": "user", "content": "Hi"},), True)
    assert (openai_chat.id, openai_chat.messages, openai_chat.endpoint) == (
        "c1",
        ({"role": "user", "content": "Hi"},),
        "/v1/chat/completions",
    )
    assert (openai_text.id, openai_text.prompt, openai_text.is_chat) == ("c2", "def f(", False)
    assert (ids.id, ids.prompt_ids, ids.is_chat) == ("t", (5, 6, 7), False)
    assert parse(b"   \r\n") is None  # blank lines are skipped


def test_unknown_keys_are_ignored_unless_a_typo_of_a_field() -> None:
    """Metadata beside a prompt is the user's business; a misspelt field is not, nor another server's field that
    would change the answer (protocol.requests.UNSUPPORTED: refused by name, the line goes to the errors)."""
    request = parse({"prompt": "x", "category": "math", "expected": "4", "user": "u"})
    assert isinstance(request, Request) and request.sampling == {}
    refused = parse({"prompt": "x", "min_tokens": 2})
    assert isinstance(refused, LineError) and "min_tokens is not supported" in refused.message


def test_line_parameters_override_the_flags() -> None:
    simple = parse({"prompt": "x", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": -1, "stop": "\n"})
    assert simple.sampling == {
        "max_new_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 0,
        "stop_strings": ("\n",),
    }
    body = {"prompt": "x", "max_completion_tokens": 9, "min_p": 0.1, "seed": 4, "stop": ["a", "b"], "temperature": None}
    openai = parse({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body})
    assert openai.sampling == {"max_new_tokens": 9, "min_p": 0.1, "seed": 4, "stop_strings": ("a", "b")}
    assert parse({"prompt": "x"}).sampling == {}


def test_a_line_without_an_id_gets_a_stable_one() -> None:
    line = {"prompt": "same text"}
    first, again, elsewhere = parse(line, 3), parse(line, 3), parse(line, 4)
    assert first.id == again.id and first.id.startswith("line-3-")
    assert elsewhere.id.startswith("line-4-")
    assert parse({"prompt": "other text"}, 3).id != first.id


@pytest.mark.parametrize(
    ("line", "code", "reason"),
    [
        (b'{"prompt": "unterminated\n', "invalid_json", "not valid JSON: Unterminated string starting at column 12"),
        (b"\xff\xfe{}\n", "invalid_utf8", "not UTF-8: byte 0xff"),
        (b'{"prompt": "caf\xe9"}\n', "invalid_utf8", "byte 0xe9"),
        (b'{"prompt": "\\ud800"}\n', "invalid_request", "surrogate"),
        (b"[" * 100_000 + b"\n", "invalid_json", "JSON"),
        (["a list"], "invalid_request", "expected a JSON object"),
        ({"text": "hi"}, "invalid_request", 'exactly one of "prompt", "messages" or "prompt_ids" (found none)'),
        ({"id": "e", "promt": "hi"}, "invalid_request", "promt is not a request field: did you mean prompt?"),
        ({"prompt": 5}, "invalid_request", "prompt must be a string"),
        ({"prompt": ""}, "invalid_request", "prompt is empty"),
        ({"prompt": "x", "messages": []}, "invalid_request", "(found prompt, messages)"),
        ({"messages": []}, "invalid_request", "non-empty list"),
        ({"messages": [{"role": "user", "content": 3}]}, "invalid_request", "messages[0].content must be a string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "What?"}, {"type": "image_url"}]}]},
            "invalid_request",
            "messages[0].content[1]: image_url parts are not supported, only text parts: the served model reads text",
        ),
        ({"prompt": "x", "id": ["a"]}, "invalid_request", "id must be a string"),
        ({"prompt": "x", "temperature": "hot"}, "invalid_request", "temperature must be a number"),
        ({"prompt": "x", "max_tokens": 2.5}, "invalid_request", "max_tokens must be an integer"),
        ({"prompt": "x", "max_tokens": 0}, "invalid_request", "max_tokens must be >= 1, got 0"),
        ({"prompt": "x", "max_completion_tokens": -3}, "invalid_request", "max_completion_tokens must be >= 1"),
        (
            {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 0}},
            "invalid_request",
            "body.max_tokens must be >= 1",
        ),
        ({"prompt": "x", "temperature": 1e999}, "invalid_request", "temperature must be a finite number"),
        ({"messages": [{"role": "function", "content": "x"}]}, "invalid_request", "messages[0].role must be system"),
        ({"prompt_ids": [1, -2]}, "invalid_request", "prompt_ids must be a non-empty list of token ids"),
        ({"prompt": "x", "logprobs": True}, "invalid_request", "logprobs are not supported"),
        ({"prompt": "x", "logprobs": 0}, "invalid_request", "logprobs are not supported"),  # legacy: the chosen ones
        ({"prompt": "x", "top_p": 2}, "invalid_request", "top_p"),
        ({"prompt": "x", "seed": True}, "invalid_request", "seed must be an integer"),
        ({"prompt": "x", "stop": [1]}, "invalid_request", "stop must be a string"),
        ({"custom_id": "c", "url": "/v1/embeddings", "body": {}}, "invalid_request", "/v1/embeddings"),
        ({"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {}}, "invalid_request", "POST"),
        (
            {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "n": 2}},
            "invalid_request",
            "n must be 1",
        ),
        (
            {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}},
            "invalid_request",
            "several prompts where one is expected (a `dflash run` line holds one",
        ),
        ({"url": "/v1/completions", "body": {"prompt": "x"}}, "invalid_request", "without custom_id"),
        (
            {"prompt": "x", "max_token": 3},
            "invalid_request",
            "max_token is not a request field: did you mean max_tokens?",
        ),
        ({"prompt": "x", "max_new_tokens": 3}, "invalid_request", "did you mean max_tokens?"),
        (
            {
                "custom_id": "c",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "x"}], "temprature": 0.2},
            },
            "invalid_request",
            "body.temprature is not a request field: did you mean body.temperature?",
        ),
    ],
)
def test_invalid_lines_say_why(line: Any, code: str, reason: str) -> None:
    error = parse(line, 12)
    assert isinstance(error, LineError)
    assert (error.line, error.code) == (12, code)
    assert reason in error.message


def test_missing_input_file(tmp_path: Path) -> None:
    with pytest.raises(DflashError, match="not found"):
        read_requests(tmp_path / "nope.jsonl")


def test_an_empty_file_is_nothing_to_do(tmp_path: Path) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", ["", "  "])
    summary = run_file(RunOptions(), prompts, load=no_load)
    assert (summary.total, summary.exit_code) == (0, 0)
    assert not (tmp_path / "p.out.jsonl").exists()
    result = CliRunner().invoke(app, ["run", str(prompts), "--target", "unused"])
    assert result.exit_code == 0
    assert "has no requests: nothing to do" in " ".join(result.output.split())


# ---------------------------------------------------------------------------------------------------------------
# The output file: resume and repair, no model


def test_a_torn_last_line_is_cut_away(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    good = b'{"id": "a", "text": "x"}\n{"custom_id": "b", "id": "batch_req_1", "response": {}}\n'
    output.write_bytes(good + b'{"id": "c", "te')
    resume = completed_ids(output)
    assert resume.ids == {"a", "b"} and resume.repaired_bytes == len(b'{"id": "c", "te')
    assert output.read_bytes() == good
    output.write_bytes(good + b"\x00\x00\x00\n")  # a line that ends but is garbage (a crash mid-block)
    assert completed_ids(output).repaired_bytes == 4 and output.read_bytes() == good
    assert completed_ids(output) == Resume([Done("a", None, None), Done("b", None, None)], 0)


def test_a_broken_line_in_the_middle_is_not_touched(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    content = b'{"id": "a", "text": ""}\nnot a result\n{"id": "b", "text": ""}\n'
    output.write_bytes(content)
    with pytest.raises(DflashError, match="line 2"):
        completed_ids(output)
    assert output.read_bytes() == content
    foreign = b'{"id": "a", "text": ""}\n{"name": "not a result"}\n'  # whole JSON, so not torn: someone else's file
    output.write_bytes(foreign)
    with pytest.raises(DflashError, match="line 2 .* not a dflash result"):
        completed_ids(output)
    assert output.read_bytes() == foreign
    prompts = b'{"id": "a", "prompt": "hi"}\n'  # a prompts file given as the output: it has ids, and no results
    output.write_bytes(prompts)
    with pytest.raises(DflashError, match="line 1 .* not a dflash result"):
        completed_ids(output)
    assert output.read_bytes() == prompts


def test_unwritable_output_fails_before_the_model_loads(tmp_path: Path) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    (tmp_path / "taken").mkdir()
    with pytest.raises(DflashError, match="is a directory") as raised:
        run_file(RunOptions(), prompts, tmp_path / "taken", load=no_load)
    assert raised.value.fix
    with pytest.raises(AssertionError, match="must not load"):  # a new folder is made, as bench --output makes one
        run_file(RunOptions(), prompts, tmp_path / "new" / "out.jsonl", load=no_load)
    assert (tmp_path / "new" / "out.jsonl").is_file()
    with pytest.raises(DflashError, match="also the input"):
        run_file(RunOptions(), prompts, prompts, load=no_load)
    before = prompts.read_bytes()
    with pytest.raises(DflashError, match="errors file .* is also the input"):
        run_file(RunOptions(), prompts, tmp_path / "out.jsonl", errors=prompts, load=no_load)
    assert prompts.read_bytes() == before
    if os.geteuid() != 0:  # root writes through permissions
        locked = tmp_path / "readonly.jsonl"
        locked.write_text("")
        locked.chmod(0o444)
        with pytest.raises(DflashError, match="cannot write"):
            run_file(RunOptions(), prompts, locked, load=no_load)


def test_two_runs_cannot_write_one_output(tmp_path: Path) -> None:
    first = ResultsFile(tmp_path / "out.jsonl")
    try:
        with pytest.raises(DflashError, match="another dflash run"):
            ResultsFile(tmp_path / "out.jsonl")
    finally:
        first.close()


def test_a_foreign_output_is_refused_and_let_go(tmp_path: Path) -> None:
    """Refusing a file that is not ours releases it at once, even while the caller still holds the error (whose
    traceback keeps the refused object alive)."""
    output = tmp_path / "out.jsonl"
    output.write_bytes(b'{"name": "not a result"}\n')
    with pytest.raises(DflashError, match="not a dflash result") as refused:
        ResultsFile(output)
    output.write_bytes(b"")
    ResultsFile(output).close()  # "another dflash run is writing" if the refused handle still held the lock
    assert refused.value.fix


def test_an_error_record_for_odd_input_is_one_valid_line(tmp_path: Path) -> None:
    error = parse(b'{"prompt": "x", "id": "\\ud800"}\n', 4)  # a lone surrogate escape: valid JSON, not UTF-8-able
    with ErrorsFile(tmp_path / "errors.jsonl") as errors:
        errors.append(error)
    (line,) = (tmp_path / "errors.jsonl").read_bytes().splitlines()
    assert json.loads(line)["line"] == 4 and "surrogate" in json.loads(line)["error"]["message"]


def test_positional_prompts_file_is_not_taken_for_a_recipe() -> None:
    options, prompts = jobs.split_positionals(RunOptions(recipe_name="p.jsonl", target="t"), None)
    assert (options.recipe_name, prompts) == (None, "p.jsonl")
    options, prompts = jobs.split_positionals(RunOptions(recipe_name="qwen3-8b"), "p.jsonl")
    assert (options.recipe_name, prompts) == ("qwen3-8b", "p.jsonl")
    with pytest.raises(DflashError, match="no prompts file"):
        jobs.split_positionals(RunOptions(recipe_name="qwen3-8b"), None)


def test_a_prompts_file_without_a_model_says_where_the_recipe_goes(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(app, ["run", str(prompts)])
    assert result.exit_code == 1 and "the recipe comes before the prompts file" in result.stderr
    assert f"dflash run demo {prompts}" in " ".join(result.stderr.split()) and "dflash chat" not in result.stderr
    assert not list(tmp_path.glob("*.out.jsonl"))  # nothing written


# ---------------------------------------------------------------------------------------------------------------
# Generation on the tiny model


def run_with(session: Any, options: RunOptions, prompts: Path, **kwargs: Any) -> jobs.Summary:
    return run_file(options, prompts, load=lambda o, c: session, **kwargs)


def test_openai_batch_results_name_the_model_as_serve_does(tmp_path: Path, models: tuple[Path, Path]) -> None:
    from dflash_cli.loading.session import open_session

    recipe = tmp_path / "tiny.toml"
    recipe.write_text(
        f'name = "tiny"\ndescription = "d"\n[target]\nid = "{models[0]}"\n[drafter]\nid = "{models[1]}"\n'
    )
    options = RunOptions(recipe_file=str(recipe), sampling=SamplingParams(max_new_tokens=2))
    session = open_session(options)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}}
    run_with(session, options, write_lines(tmp_path / "p.jsonl", [line]))
    (record,) = read_jsonl(tmp_path / "p.out.jsonl")
    assert record["response"]["body"]["model"] == session.served_name == "tiny"


def test_a_batch_lines_error_takes_the_batch_outputs_shape(tmp_path: Path, session: Any, options: RunOptions) -> None:
    """An OpenAI batch line that fails is written as OpenAI's error file writes it (id, custom_id, response null,
    error), which batch readers parse, with its line; a plain line's error keeps dflash's own shape."""
    url = "/v1/completions"
    lines = [
        {"custom_id": "good", "url": url, "body": {"prompt": "Hi", "max_tokens": 2}},
        {"custom_id": "two", "url": url, "body": {"prompt": "Hi", "n": 2}},  # refused when read
        {"custom_id": "long", "url": url, "body": {"prompt": "word " * 2_000}},  # refused once encoded
        {"id": "plain", "prompt": "Hi", "n": 2},
    ]
    summary = run_with(session, options, write_lines(tmp_path / "p.jsonl", lines))
    assert (summary.done, summary.failed) == (1, 3)
    errors = {record["line"]: record for record in read_jsonl(tmp_path / "p.errors.jsonl")}
    for line, custom_id, code in [(2, "two", "invalid_request"), (3, "long", "context_length_exceeded")]:
        record = errors[line]
        assert record["id"].startswith("batch_req_") and record["custom_id"] == custom_id, record
        assert record["response"] is None and record["error"]["code"] == code and record["error"]["message"]
    assert set(errors[4]) == {"line", "id", "error"} and errors[4]["id"] == "plain"


def test_mixed_file_every_format_and_bad_lines(tmp_path: Path, session: Any, options: RunOptions) -> None:
    prompts = write_lines(
        tmp_path / "prompts.jsonl",
        [
            {"id": "plain", "prompt": "The quick brown fox", "max_tokens": 2},
            {"messages": [{"role": "user", "content": "Hello!"}]},
            "not json",
            {
                "custom_id": "chat-1",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 3},
            },
            b'{"prompt": "\xff"}',
            {"custom_id": "text-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "def add(a, b):"}},
            {"id": "huge", "prompt": "word " * 200_000},  # a 1 MB line, far past the 512-token context window
            {"prompt": {"not": "text"}},
        ],
    )
    summary = run_with(session, options, prompts)
    output, errors = tmp_path / "prompts.out.jsonl", tmp_path / "prompts.errors.jsonl"
    assert (summary.total, summary.done, summary.failed, summary.exit_code) == (8, 4, 4, 1)
    assert summary.errors == str(errors)
    records = {result_id(r): r for r in read_jsonl(output)}
    auto = parse({"messages": [{"role": "user", "content": "Hello!"}]}, 2).id
    assert set(records) == {"plain", auto, "chat-1", "text-1"}

    plain = records["plain"]
    assert plain["completion_tokens"] <= 2 and plain["finish_reason"] in ("stop", "length")
    assert plain["prompt_tokens"] == len(session.encode_prompt("The quick brown fox"))
    stats = {
        "speculative",
        "block_size",
        "adaptive",
        "tau",
        "acceptance_histogram",
        "block_size_histogram",
        "decode_tokens_per_s",
        "ttft_s",
        "cached_tokens",
        "unreused_tokens",
        "draft_s",
        "verify_s",
        "compile_s",
    }
    assert set(plain["stats"]) == stats
    assert plain["stats"]["speculative"] is True and plain["stats"]["block_size"] == 4
    assert sum(plain["stats"]["acceptance_histogram"].values()) >= 1
    steps = plain["stats"]["block_size_histogram"]
    assert plain["stats"]["adaptive"] is True and sum(steps.values()) == sum(
        plain["stats"]["acceptance_histogram"].values()
    )
    assert records[auto]["completion_tokens"] <= options.sampling.max_new_tokens

    chat = records["chat-1"]
    assert chat["id"].startswith("batch_req_") and chat["error"] is None
    assert chat["response"]["status_code"] == 200 and chat["response"]["request_id"]
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == str(options.target)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert body["usage"]["completion_tokens"] <= 3
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    text = records["text-1"]["response"]["body"]
    assert text["object"] == "text_completion" and "text" in text["choices"][0]

    failures = {e["line"]: e for e in read_jsonl(errors)}
    assert {n: e["error"]["code"] for n, e in failures.items()} == {
        3: "invalid_json",
        5: "invalid_utf8",
        7: "context_length_exceeded",
        8: "invalid_request",
    }
    assert failures[7]["id"] == "huge" and "context window is 512" in failures[7]["error"]["message"]


def test_the_bodies_that_reached_the_engine_are_error_records_and_the_rest_runs(
    tmp_path: Path, session: Any, options: RunOptions
) -> None:
    """Issue 48 through `dflash run`: each line the server once let through to the engine is its own error record
    naming its field (at parsing, or against the model: the context left, the schema); the good lines between
    them are done."""
    hi = [{"role": "user", "content": "Hi"}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    bad = {
        "temperature": {"prompt": "x", "temperature": 10**30},
        "top_k": {"prompt": "x", "top_k": 10**30},
        "max_tokens": {"prompt": "x", "max_tokens": 1_000_000},  # (the window is 512)
        "response_format.json_schema.schema": {
            "messages": hi,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},
        },
        "tools[0].function.parameters": {
            "messages": hi,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        },
        "messages[2].tool_call_id": {
            "messages": [
                *hi,
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "x", "content": "sunny"},
            ],
        },
        "user": {"prompt": "x", "user": 5},
        "body.temperature": {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x", "temperature": 1e9}},
    }
    lines: list[Any] = []
    for i, line in enumerate(bad.values()):
        lines += [{"id": f"good-{i}", "prompt": f"Line {i}", "max_tokens": 3}, line]
    summary = run_with(session, options, write_lines(tmp_path / "p.jsonl", lines))
    assert (summary.done, summary.failed, summary.exit_code) == (len(bad), len(bad), 1)
    assert {r["id"] for r in read_jsonl(tmp_path / "p.out.jsonl")} == {f"good-{i}" for i in range(len(bad))}
    errors = {e["line"]: e["error"] for e in read_jsonl(tmp_path / "p.errors.jsonl")}
    for i, field in enumerate(bad):
        assert errors[2 * i + 2]["message"].startswith(field), (field, errors[2 * i + 2])
    assert errors[6]["code"] == "context_length_exceeded" and "ask for at most" in errors[6]["message"]


def test_greedy_results_match_single_runs_and_stop_overrides(tmp_path: Path, session: Any, options: RunOptions) -> None:
    from dflash_cli.engine import collect

    prompt = "Speculative decoding drafts"
    alone = collect(session.stream(session.encode_prompt(prompt), session.sampling_params(options)))
    stop = alone.text[2:4]  # a stop string the greedy reply is known to contain
    assert len(stop) == 2
    lines = [{"id": "free", "prompt": prompt}, {"id": "stop", "prompt": prompt, "stop": [stop]}]
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    run_with(session, options, prompts)
    records = {r["id"]: r for r in read_jsonl(tmp_path / "p.out.jsonl")}
    assert records["free"]["text"] == alone.text  # the run path decodes exactly as a single run
    assert records["stop"]["text"] == alone.text[: alone.text.find(stop)]
    assert records["stop"]["finish_reason"] == "stop"


def test_raw_prompts_a_chat_model_answers_with_nothing_are_noted(
    tmp_path: Path, session: Any, options: RunOptions
) -> None:
    """A `prompt` line is raw text, without the chat template: the replies a chat model ends at once (its end of
    turn first) are counted and the summary says to send "messages". Not counted: a reply a stop string of the
    request emptied, and a "messages" reply. (The random tiny model ends a raw prompt at once where its first token
    is an end of turn: its generation config names that token so, as chat models' configs list several.)"""
    from dflash_cli.engine import collect

    assert session.tokenizer.chat_template  # (a chat model)
    ended, prompt = "Speculative decoding drafts", "A prompt it answers"
    first = collect(session.stream(session.encode_prompt(ended), session.sampling_params(options))).token_ids[0]
    answered = collect(session.stream(session.encode_prompt(prompt), session.sampling_params(options))).text
    config = session.target.generation_config
    eos = config.eos_token_id
    config.eos_token_id = [*(eos if isinstance(eos, list) else [eos]), first]
    try:
        assert first in session.stop_token_ids and answered[:2].strip()
        lines = [
            {"id": "ended", "prompt": ended},
            {"id": "stopped", "prompt": prompt, "stop": [answered[:2]]},  # (the user's stop string: empty too)
            {"id": "chat", "messages": [{"role": "user", "content": ended}]},
        ]
        summary = run_with(session, options, write_lines(tmp_path / "p.jsonl", lines))
    finally:
        config.eos_token_id = eos
    records = {record["id"]: record for record in read_jsonl(tmp_path / "p.out.jsonl")}
    assert records["ended"]["completion_tokens"] == 1 and records["stopped"]["text"] == ""
    assert summary.empty_raw == 1
    console = Console(record=True, width=100)
    show_summary(summary, console)
    said = " ".join(console.export_text().split())
    assert 'note: 1 "prompt" line(s) got no answer' in said and 'send "messages"' in said


def test_rerun_skips_done_ids_and_repairs_a_torn_line(tmp_path: Path, session: Any, options: RunOptions) -> None:
    lines = [{"id": f"r{i}", "prompt": f"Hello number {i}"} for i in range(3)]
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    output = tmp_path / "p.out.jsonl"
    assert run_with(session, options, prompts).done == 3
    again = run_file(options, prompts, load=no_load)  # all done: the model is not even loaded
    assert (again.done, again.skipped, again.exit_code) == (0, 3, 0)
    console = Console(record=True, width=200)
    console.print(summary_table(again, 200))
    assert re.search(r"│ 3 +│ 0 +│ 3 +│ 0 +│", console.export_text())
    narrow = Console(record=True, width=60)  # the row does not fit: a field a line, no header folded mid-word
    narrow.print(summary_table(again, 60))
    shown = narrow.export_text()
    assert re.search(r"│ requests +│ 3 +│", shown) and re.search(r"│ reused prompt +│ 0/0 +│", shown), shown

    kept = output.read_bytes().splitlines(keepends=True)[:2]
    output.write_bytes(b"".join(kept) + b'{"id": "r2", "text": "half')  # as if killed mid-write
    write_lines(prompts, [*lines, {"id": "r3", "prompt": "a new line"}])
    resumed = run_with(session, options, prompts)
    assert (resumed.done, resumed.skipped, resumed.repaired_bytes > 0) == (2, 2, True)
    ids = [r["id"] for r in read_jsonl(output)]
    assert sorted(ids) == ["r0", "r1", "r2", "r3"]


def test_a_model_loaded_in_another_plan_than_predicted_records_it_or_refuses_a_resume(
    tmp_path: Path, session: Any, options: RunOptions
) -> None:
    """The plan is predicted before loading (made_with, and the resume check); where the session loads another
    (a GPU whose free memory the loading took), new results record the loaded plan, and a resume whose results
    were made with the predicted one is refused before anything decodes."""
    from dflash_cli.loading.session import open_session

    dtype = session.plan.dtype
    other = options.overriding(dtype="float32" if dtype != "float32" else "bfloat16")
    prompts = write_lines(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hello"}])
    output = tmp_path / "p.out.jsonl"
    assert run_file(other, prompts, load=lambda o, c: session).done == 1  # (predicted `other`, loaded `dtype`)
    assert json.loads(output.read_text())["made_with"]["dtype"] == dtype  # what decoded it
    output.unlink()
    assert run_file(other, prompts, load=lambda o, c: open_session(o)).done == 1  # (made with `other`, as predicted)
    write_lines(prompts, [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": "Hi"}])
    before = output.read_bytes()
    with pytest.raises(
        DflashError, match=f"loaded in another plan than predicted \\(dtype {other.overrides.dtype} -> "
    ):
        run_file(other, prompts, load=lambda o, c: session)
    assert output.read_bytes() == before  # nothing decoded, nothing written


def test_a_changed_request_is_not_taken_for_done(tmp_path: Path, session: Any, options: RunOptions) -> None:
    """A result is skipped on resume only if it was made from the same request: the same input, sampling (the
    line's and the flags'), target, dtype and quantization. Otherwise the run refuses before writing anything, and
    says what changed."""
    prompts = write_lines(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": "Bye"}])
    output, errors = tmp_path / "p.out.jsonl", tmp_path / "p.errors.jsonl"
    assert run_with(session, options, prompts).done == 2
    assert run_file(options, prompts, load=no_load).skipped == 2  # the same requests: done
    done = output.read_bytes()
    errors.write_bytes(b'{"line": 9, "id": "x", "error": {"code": "c", "message": "m"}}\n')  # an earlier run's
    dtype = session.plan.dtype  # (the plan's default on this machine)
    other_dtype = "float32" if dtype != "float32" else "bfloat16"
    same = [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": "Bye"}]
    changed = [
        ([{"id": "a", "prompt": "Hello there"}, same[1]], options, "from another version of their line (ids a)"),
        (
            [{"id": "a", "prompt": "Hello", "temperature": 0.5}, same[1]],
            options,
            "with other settings (temperature 0.0 -> 0.5) (ids a)",
        ),
        (
            [{"id": "a", "prompt": "Hello", "max_tokens": 6}, same[1]],  # a's own max_tokens is the flag's: done
            dataclasses.replace(options, sampling=SamplingParams(max_new_tokens=7)),
            "with other settings (max_tokens 6 -> 7) (ids b)",
        ),
        (
            same,
            options.overriding(dtype=other_dtype),
            f"with other settings (dtype {dtype} -> {other_dtype}) (ids a, b)",
        ),
        (  # (int8 computes in bf16: where the default is float32, the dtype changes too)
            same,
            options.overriding(quant="int8"),
            f"with other settings ({'' if dtype == 'bfloat16' else f'dtype {dtype} -> bfloat16, '}quant none -> int8) "
            "(ids a, b)",
        ),
    ]
    for lines, changed_options, reason in changed:
        write_lines(prompts, lines)
        with pytest.raises(DflashError) as refused:
            run_file(changed_options, prompts, load=no_load)
        assert refused.value.message == (
            f"{1 + ('a, b' in reason)} result(s) in {output} were made {reason}: resuming would mix them with "
            "this run's"
        )
        assert "-o" in refused.value.fix and ("settings they were made with" in refused.value.fix) == ("->" in reason)
        assert output.read_bytes() == done and errors.exists()  # nothing written, nothing removed
    write_lines(prompts, same)
    assert run_file(options.overriding(block_size=2, batch_size=3), prompts, load=no_load).skipped == 2  # (lossless)
    assert run_file(options.overriding(dtype=dtype), prompts, load=no_load).skipped == 2  # the plan's own dtype

    record = json.loads(done.splitlines()[0])  # a result an earlier version wrote: no settings recorded
    del record["made_with"]
    output.write_text(json.dumps(record) + "\n")
    from dflash_cli.loading.session import open_session

    other = options.overriding(dtype=other_dtype)  # (loaded as asked: the plan it predicts)
    assert run_file(other, prompts, load=lambda o, c: open_session(o)).skipped == 1
    record["request_hash"] = "0" * 16
    output.write_text(json.dumps(record) + "\n")
    with pytest.raises(DflashError, match=rf"made from another line or other settings \(ids {record['id']}\)"):
        run_file(options, prompts, load=no_load)


def test_lines_without_ids_find_their_results_after_lines_are_deleted_or_inserted(
    tmp_path: Path, session: Any, options: RunOptions
) -> None:
    """A line without an id is named by its place and a hash of its text; a resume finds its result by the text, so
    deleting a line (fixing a bad one) or inserting one above it runs nothing again, and no request gets two
    results. Identical lines are counted: each has a result of its own."""
    texts = [f"Tell me about {name}" for name in ("apples", "pears", "plums", "figs")]
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": text} for text in texts])
    output = tmp_path / "p.out.jsonl"
    assert run_with(session, options, prompts).done == 4

    def results() -> dict[str, str]:
        return {r["id"]: r["text"] for r in read_jsonl(output)}

    first = results()
    write_lines(prompts, [{"prompt": text} for text in texts[:1] + texts[2:]])  # line 2 deleted
    log = io.StringIO()
    summary = run_file(options, prompts, load=no_load, console=Console(file=log, width=300))
    assert (summary.done, summary.skipped, summary.unmatched) == (0, 3, 1)
    assert f"holds 1 result(s) that match no line of {prompts}" in log.getvalue()
    assert parse({"prompt": texts[1]}, 2).id in log.getvalue()  # the deleted line's result: kept, and named

    write_lines(prompts, [{"prompt": "Tell me about kiwis"}] + [{"prompt": text} for text in texts])  # one on top
    summary = run_with(session, options, prompts)
    assert (summary.done, summary.skipped, summary.unmatched) == (1, 4, 0)
    kiwis = parse({"prompt": "Tell me about kiwis"}, 1).id
    assert results() == {**first, kiwis: collect_text(session, options, "Tell me about kiwis")}

    same = {"prompt": texts[0]}  # the same prompt on three lines: three results, each run once
    write_lines(prompts, [same, {"prompt": texts[1]}, same])
    summary = run_with(session, options, prompts)
    assert (summary.done, summary.skipped, summary.unmatched) == (1, 2, 3)
    write_lines(prompts, [{"prompt": texts[1]}, same, same, same])
    summary = run_with(session, options, prompts)
    assert (summary.done, summary.skipped, summary.unmatched) == (1, 3, 3)
    copies = [r["id"] for r in read_jsonl(output) if r["text"] == first[parse(same, 1).id]]
    assert len(copies) == len(set(copies)) == 3  # three results of the same prompt, under ids of their own
    again = run_file(options, prompts, load=no_load)
    assert (again.done, again.skipped) == (0, 4)


def test_an_output_of_another_input_is_noted_and_kept(tmp_path: Path, session: Any, options: RunOptions) -> None:
    """`-o` naming the results of another input: this run's results are added beside them, with a note before the
    model loads and a line under the summary; nothing is lost, and the ids tell them apart."""
    one = write_lines(tmp_path / "one.jsonl", [{"id": "a", "prompt": "Hello"}, {"prompt": "Bye"}])
    other = write_lines(tmp_path / "other.jsonl", [{"id": "x", "prompt": "Hi"}])
    output = tmp_path / "other.out.jsonl"
    assert run_with(session, options, other).done == 1
    log = io.StringIO()
    summary = run_with(session, options, one, output=output, console=Console(file=log, width=300))
    assert (summary.done, summary.skipped, summary.unmatched) == (2, 0, 1)
    note = " ".join(log.getvalue().split())
    assert f"note: {output} holds 1 result(s) that match no line of {one} (ids x)" in note
    assert "they are kept" in note and "-o another file" in note
    assert sorted(r["id"] for r in read_jsonl(output)) == sorted(["x", "a", parse({"prompt": "Bye"}, 2).id])
    shown = Console(record=True, width=300)
    show_summary(summary, shown)
    assert "also in the output: 1 result(s) that match no line of this input" in shown.export_text()


def test_the_summary_keeps_long_paths_whole(tmp_path: Path) -> None:
    """The output's and the errors file's paths are printed whole on their lines, however narrow the terminal, so
    that they can be copied (a table's title and caption fold at its width, mid-name)."""
    folder = "a-rather-long-folder-name/another-level-of-folders"
    summary = jobs.Summary(f"{folder}/results.out.jsonl", 3, done=2, failed=1, errors=f"{folder}/results.errors.jsonl")
    narrow = Console(record=True, width=40)
    show_summary(summary, narrow)
    lines = narrow.export_text().splitlines()
    assert f"dflash run: {summary.output}" in lines and f"failed requests: {summary.errors}" in lines


def test_the_errors_file_is_ours_to_rewrite_or_refused(tmp_path: Path) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    notes = tmp_path / "notes.txt"
    for content in (b"my precious notes\n", b"no newline at the end", b'{"line": 1}\n', b"\n[1, 2]\n"):
        notes.write_bytes(content)
        with pytest.raises(DflashError, match="holds something else") as refused:
            run_file(RunOptions(), prompts, tmp_path / "out.jsonl", errors=notes, load=no_load)
        assert "--errors" in refused.value.fix and notes.read_bytes() == content
    ours = b'{"line": 3, "id": null, "error": {"code": "invalid_json", "message": "m"}}\n'
    for content in (b"", ours, ours + b'{"line": 4, "id"'):  # empty, an earlier run's, torn by a kill
        notes.write_bytes(content)
        with pytest.raises(AssertionError, match="must not load"):  # past the checks: it would generate now
            run_file(RunOptions(), prompts, tmp_path / "out.jsonl", errors=notes, load=no_load)


def test_the_errors_file_lists_only_what_is_still_missing(tmp_path: Path, session: Any, options: RunOptions) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", [{"id": "ok", "prompt": "hi"}, "{broken"])
    errors = tmp_path / "p.errors.jsonl"
    assert run_with(session, options, prompts).failed == 1
    assert [e["line"] for e in read_jsonl(errors)] == [2]
    assert run_file(options, prompts, load=no_load).failed == 1
    assert len(read_jsonl(errors)) == 1  # rewritten, not appended to
    write_lines(prompts, [{"id": "ok", "prompt": "hi"}, {"id": "fixed", "prompt": "hello"}])
    summary = run_with(session, options, prompts)
    assert (summary.done, summary.failed, summary.errors) == (1, 0, None)
    assert not errors.exists()


# ---------------------------------------------------------------------------------------------------------------
# The real command in subprocesses


def dflash_run(*args: str, cwd: Path) -> tuple[list[str], dict[str, Any]]:
    """`python -m dflash_cli run ARGS` and the subprocess keywords to run it in `cwd`."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "XDG_CACHE_HOME": str(cwd / "cache"),
    }  # the measured block costs of tiny models stay out of the user's cache
    return [sys.executable, "-m", "dflash_cli", "run", *args], {"cwd": cwd, "env": env}


@pytest.mark.slow
def test_sigkill_mid_run_loses_nothing(tmp_path: Path, models: tuple[Path, Path]) -> None:
    ids = [f"q{i:02d}" for i in range(16)]
    write_lines(tmp_path / "prompts.jsonl", [{"id": i, "prompt": f"Tell me about {i}"} for i in ids])
    # two rows at a time: rows finish and new ones join all through the run
    args = (
        "prompts.jsonl",
        "--target",
        str(models[0]),
        "--drafter",
        str(models[1]),
        "--max-tokens",
        "6",
        "--batch-size",
        "2",
    )
    command, kwargs = dflash_run(*args, cwd=tmp_path)
    output = tmp_path / "prompts.out.jsonl"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kwargs)
    deadline = time.monotonic() + 120
    while (not output.exists() or output.read_bytes().count(b"\n") < 2) and process.poll() is None:
        assert time.monotonic() < deadline, "no results within 120 s"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, process.stderr.read().decode()
    process.stderr.close()
    first_run = output.read_bytes()
    first_ids = {json.loads(line)["id"] for line in first_run.splitlines() if line.endswith(b"}")}
    assert 2 <= len(first_ids) < len(ids)  # killed mid-run, with results on disk

    finished = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=300, **kwargs)
    assert finished.returncode == 0, finished.stderr
    summary = json.loads(finished.stdout)
    assert summary["skipped"] == len(first_ids) and summary["done"] == len(ids) - len(first_ids)
    final = read_jsonl(output)
    assert sorted(r["id"] for r in final) == ids  # every id exactly once across both runs
    assert {r["id"] for r in final} >= first_ids


def test_duplicate_ids_go_to_the_errors_file_and_the_rest_runs(
    tmp_path: Path, session: Any, options: RunOptions
) -> None:
    prompts = write_lines(
        tmp_path / "p.jsonl",
        [
            {"prompt": "a", "id": "x"},
            {"prompt": "b", "id": "y"},
            {"prompt": "c", "id": "x"},
            {"custom_id": "y", "url": "/v1/completions", "body": {"prompt": "d"}},
            {"prompt": "e", "id": "x"},
        ],
    )
    summary = run_with(session, options, prompts)
    assert (summary.done, summary.failed, summary.exit_code) == (2, 3, 1)
    records = {r["id"]: r for r in read_jsonl(tmp_path / "p.out.jsonl")}
    assert set(records) == {"x", "y"}  # the first line of each id ran
    first = collect_text(session, options, "a")
    assert records["x"]["text"] == first
    failures = read_jsonl(tmp_path / "p.errors.jsonl")
    assert [(e["line"], result_id(e), e["error"]["code"]) for e in failures] == [
        (3, "x", "duplicate_id"),
        (4, "y", "duplicate_id"),
        (5, "x", "duplicate_id"),
    ]
    assert 'id "x" is already used on line 1' in failures[0]["error"]["message"]


def collect_text(session: Any, options: RunOptions, prompt: str) -> str:
    from dflash_cli.engine import collect

    return collect(session.stream(session.encode_prompt(prompt), session.sampling_params(options))).text


def test_a_resumed_run_with_nothing_left_reports_its_real_mode(tmp_path: Path, models: tuple[Path, Path]) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}])
    (tmp_path / "p.out.jsonl").write_text('{"id": "a", "text": "done before"}\n')
    flags = ["run", str(prompts), "--target", str(models[0]), "--json"]
    speculative = CliRunner().invoke(app, [*flags, "--drafter", str(models[1])])
    assert speculative.exit_code == 0, speculative.output
    assert json.loads(speculative.stdout)["speculative"] is True and json.loads(speculative.stdout)["skipped"] == 1
    for baseline in ([*flags, "--drafter", str(models[1]), "--no-spec"], flags):
        assert json.loads(CliRunner().invoke(app, baseline).stdout)["speculative"] is False


def test_output_paths_errors_name_the_right_flag_and_fix(tmp_path: Path) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    with pytest.raises(DflashError) as raised:  # the "directory" of the output is a file
        run_file(RunOptions(), prompts, prompts.parent / "p.jsonl" / "x.jsonl", load=no_load)
    assert "p.jsonl is a file, not a directory" in raised.value.message
    assert "mkdir" not in raised.value.fix and raised.value.fix.startswith("pass a path in a directory with -o")
    with pytest.raises(DflashError) as raised:
        run_file(RunOptions(), prompts, errors="/proc/x", load=no_load)
    assert "cannot write the errors file /proc/x" in raised.value.message
    assert "--errors" in raised.value.fix and "-o" not in raised.value.fix
    with pytest.raises(DflashError) as raised:
        run_file(RunOptions(), prompts, errors="/proc/no/e.jsonl", load=no_load)
    assert "the errors directory /proc/no cannot be created" in raised.value.message
    assert raised.value.fix == "pass another --errors"


def test_run_help_names_the_errors_file_it_writes() -> None:
    help_text = " ".join(CliRunner().invoke(app, ["run", "--help"], terminal_width=200).output.split())
    assert "PROMPTS.errors.jsonl" in help_text and "OUTPUT.errors.jsonl" not in help_text


@pytest.mark.slow
def test_cli_errors_and_exit_codes(tmp_path: Path) -> None:
    write_lines(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}])
    command, kwargs = dflash_run("p.jsonl", "--target", str(tmp_path / "missing-model"), cwd=tmp_path)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, **kwargs)
    assert result.returncode == 1
    assert "error:" in result.stderr and "fix:" in result.stderr
    assert "Traceback" not in result.stderr


def test_requests_that_share_a_prefix_reuse_it_unless_no_prefix_cache(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    lines = [{"id": f"q{i}", "prompt": "You are a careful assistant. " * 6 + f"Question {i}"} for i in range(4)]
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    flags = ["run", str(prompts), "--target", str(models[0]), "--drafter", str(models[1]), "--json"]
    flags += ["--dtype", "float32", "--max-tokens", "6", "--batch-size", "2"]
    summaries, texts = [], []
    for extra in ([], ["--no-prefix-cache"]):
        output = tmp_path / f"out{len(extra)}.jsonl"
        result = CliRunner().invoke(app, [*flags, "-o", str(output), *extra])
        assert result.exit_code == 0, result.output
        summaries.append(json.loads(result.stdout))
        texts.append({r["id"]: (r["text"], r["stats"]["cached_tokens"]) for r in read_jsonl(output)})
    assert summaries[0]["cached_tokens"] > 0 and summaries[1]["cached_tokens"] == 0
    assert {k: text for k, (text, _) in texts[0].items()} == {k: text for k, (text, _) in texts[1].items()}
    assert sum(cached for _, cached in texts[0].values()) == summaries[0]["cached_tokens"]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_batched_run_gives_every_request_its_result_alone(
    tmp_path: Path, models: tuple[Path, Path], batch_size: int
) -> None:
    """Mixed prompt lengths, max_tokens, stop strings and seeded sampling, decoded three at a time (rows leave and
    join all through the run): every result is the one the request gets decoded alone (float32)."""
    from dflash_cli.engine import collect
    from dflash_cli.loading.session import open_session

    options = RunOptions(
        target=str(models[0]),
        drafter=str(models[1]),
        sampling=SamplingParams(max_new_tokens=12),
        overrides=PlanOverrides(dtype="float32", batch_size=batch_size),
    )
    session = open_session(options, batching=True)
    assert session.batch_size == batch_size
    lines = [{"id": f"g{i}", "prompt": "Tell me " * (i % 4 + 1) + str(i), "max_tokens": 4 + 3 * i} for i in range(7)]
    lines += [
        {"id": f"s{i}", "prompt": f"Sample {i}", "temperature": 0.9, "seed": i, "max_tokens": 10} for i in range(3)
    ]
    lines.append({"id": "stop", "prompt": "Tell me 3", "stop": ["e"], "max_tokens": 20})
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    summary = run_with(session, options, prompts)
    assert summary.done == len(lines) and summary.failed == 0
    records = {r["id"]: r for r in read_jsonl(tmp_path / "p.out.jsonl")}
    for request in jobs.read_requests(prompts).requests:
        params = session.sampling_params(options, **request.sampling)
        alone = collect(session.stream(session.encode_request(request), params))
        assert (records[request.id]["text"], records[request.id]["finish_reason"]) == (alone.text, alone.finish_reason)
    assert {records[f"s{i}"]["text"] for i in range(3)} != {records["g0"]["text"]}


def test_rows_of_a_batched_step_that_ran_out_of_memory_are_retried_alone(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    """A device with room for one row only: the target raises torch's out-of-memory error for any forward over
    several rows (a real forward pre-hook on the real model; nothing else is replaced). Every request still gets
    the result it gets alone; only a request that fails alone as well goes to the errors file."""
    import torch

    from dflash_cli.engine import collect
    from dflash_cli.loading.session import open_session

    options = RunOptions(
        target=str(models[0]),
        drafter=str(models[1]),
        sampling=SamplingParams(max_new_tokens=8),
        overrides=PlanOverrides(dtype="float32", batch_size=3),
        prefix_cache=False,  # the huge request's whole prompt is what runs out of memory, not a reused part
    )
    session = open_session(options, batching=True)
    lines = [{"id": f"r{i}", "prompt": "Tell me " * (i % 3 + 1) + str(i)} for i in range(5)]
    lines.append({"id": "huge", "prompt": "Tell me " * 9})
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    huge = len(session.encode_request(jobs.read_requests(prompts).requests[-1]))
    expected = {}
    for request in jobs.read_requests(prompts).requests[:-1]:
        params = session.sampling_params(options, **request.sampling)
        expected[request.id] = collect(session.stream(session.encode_request(request), params)).text
    seen_rows: list[int] = []

    def one_row_fits(_module, _args, kwargs):
        ids = kwargs["input_ids"]
        seen_rows.append(ids.shape[0])
        if ids.shape[0] > 1 or ids.shape[1] == huge:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = session.target.register_forward_pre_hook(one_row_fits, with_kwargs=True)
    try:
        summary = run_with(session, options, prompts)
    finally:
        handle.remove()
    assert max(seen_rows) > 1  # the batch did try several rows at once
    assert summary.done == 5 and summary.failed == 1
    records = {r["id"]: r for r in read_jsonl(tmp_path / "p.out.jsonl")}
    assert {i: r["text"] for i, r in records.items()} == expected
    (error,) = read_jsonl(tmp_path / "p.errors.jsonl")
    assert error["id"] == "huge" and "out of memory" in error["error"]["message"]


def test_response_format_lines_give_json_that_validates_and_bad_schemas_are_named(
    tmp_path: Path, session: Any, options: RunOptions
) -> None:
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    lines = [
        {
            "custom_id": "batch",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 40,
                "response_format": response_format,
            },
        },
        {
            "id": "plain",
            "messages": [{"role": "user", "content": "Hey"}],
            "max_tokens": 40,
            "response_format": response_format,
        },
        {
            "id": "bad",
            "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}},
        },
    ]
    summary = run_with(session, options, write_lines(tmp_path / "p.jsonl", lines))
    assert summary.failed == 1
    records = {result_id(r): r for r in read_jsonl(tmp_path / "p.out.jsonl")}
    body = records["batch"]["response"]["body"]
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
    jsonschema.validate(json.loads(records["plain"]["text"]), schema)
    (error,) = read_jsonl(tmp_path / "p.errors.jsonl")
    assert error["id"] == "bad" and "response_format.json_schema.schema" in error["error"]["message"]


def test_tool_lines_give_tool_calls_in_both_shapes(tmp_path: Path, models: tuple[Path, Path]) -> None:
    """A forced call on the tiny model (its template renders no tools: they go into the system message in the
    hermes format, ~600 of its byte-level tokens, so its window is widened here) comes back as tool_calls."""
    import shutil

    from dflash_cli.loading.session import open_session

    directory = shutil.copytree(models[0], tmp_path / "target")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    options = RunOptions(target=str(directory), drafter=str(models[1]), sampling=SamplingParams(max_new_tokens=120))
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"key": {"enum": ["a", "b"]}}, "required": ["key"]},
        },
    }
    forced = {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
    messages = [{"role": "user", "content": "find"}]
    lines = [
        {"custom_id": "batch", "url": "/v1/chat/completions", "body": {"messages": messages, **forced}},
        {"id": "plain", "messages": messages, **forced},
        # Parallel calls: a random model goes on calling until max_tokens cuts it, after some whole calls.
        {"id": "cut", "messages": messages, "tools": [tool], "tool_choice": "required", "max_tokens": 100},
    ]
    run_with(open_session(options), options, write_lines(tmp_path / "p.jsonl", lines))
    records = {result_id(r): r for r in read_jsonl(tmp_path / "p.out.jsonl")}
    choice = records["batch"]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    plain = records["plain"]
    assert plain["finish_reason"] == "tool_calls" and plain["text"] is None
    assert json.loads(plain["tool_calls"][0]["function"]["arguments"])["key"] in ("a", "b")
    cut = records["cut"]  # "length", not "tool_calls": the client must learn that a call may have been cut off
    assert cut["completion_tokens"] == 100 and cut["tool_calls"] and cut["finish_reason"] == "length"


@pytest.mark.slow
def test_requests_piped_in_give_results_on_standard_output(
    tmp_path: Path, models: tuple[Path, Path], session: Any, options: RunOptions
) -> None:
    good = [{"id": "a", "prompt": "Tell me about a"}, {"id": "b", "prompt": "Tell me about b"}]
    piped = f"{json.dumps(good[0])}\nnot json\n{json.dumps(good[1])}\n".encode()
    flags = ("--target", str(models[0]), "--drafter", str(models[1]), "--max-tokens", "6")
    command, kwargs = dflash_run("-", *flags, cwd=tmp_path)
    result = subprocess.run(command, input=piped, capture_output=True, **kwargs)
    assert result.returncode == 1, result.stderr.decode()  # a line failed
    records = [json.loads(line) for line in result.stdout.splitlines()]  # nothing but results on standard output
    assert {r["id"]: r["text"] for r in records} == {
        p: collect_text(session, options, f"Tell me about {p}") for p in "ab"
    }
    assert "line 2" in result.stderr.decode() and "not valid JSON" in result.stderr.decode()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cache"]  # (the process's cache home) no file made

    refused = subprocess.run([*command, "--json"], input=piped, capture_output=True, **kwargs)
    # (no result ran: standard output holds only the refusal, as data, since --json was asked for)
    assert refused.returncode != 0 and "-o results.jsonl" in json.loads(refused.stdout)["error"]["fix"]
    assert b"-o results.jsonl" in refused.stderr

    write_lines(tmp_path / "p.jsonl", [good[0]])  # -o - prints a file's results the same way
    command, kwargs = dflash_run("p.jsonl", "-o", "-", *flags, cwd=tmp_path)
    printed = subprocess.run(command, capture_output=True, **kwargs)
    assert printed.returncode == 0 and [json.loads(line)["id"] for line in printed.stdout.splitlines()] == ["a"]
    assert not (tmp_path / "p.out.jsonl").exists()


def test_a_file_named_dash_is_dot_slash_dash_and_errors_dash_go_to_the_console(
    tmp_path: Path, session: Any, options: RunOptions
) -> None:
    write_lines(tmp_path / "-", ["not json", {"id": "a", "prompt": "x"}])
    log = io.StringIO()
    summary = run_with(session, options, tmp_path / "-", errors="-", console=Console(file=log, width=200))
    assert (summary.done, summary.failed) == (1, 1) and (tmp_path / "-.out.jsonl").is_file()
    assert "line 1: not valid JSON" in log.getvalue() and not list(tmp_path.glob("*errors*"))


def test_results_printed_to_a_closed_pipe_stop_the_run_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_cli.commands.run_output import PrintedResults

    class Closed(io.BytesIO):
        def write(self, data: bytes) -> int:
            raise BrokenPipeError

    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(Closed()))
    with pytest.raises(DflashError) as raised:
        PrintedResults().append({"id": "a", "text": "x"})
    assert "standard output was closed after 0 result(s)" in raised.value.message and "-o" in raised.value.fix


def test_reading_requests_from_a_terminal_says_to_pipe_them(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.BytesIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    with pytest.raises(DflashError) as raised:
        read_requests(STDIN)
    assert "terminal" in raised.value.message and "| dflash run demo -" in raised.value.fix
    monkeypatch.setattr(sys, "stdin", None)  # (a daemon's, closed)
    with pytest.raises(DflashError, match="it is closed"):
        read_requests(STDIN)


def test_a_log_gets_progress_lines_as_the_run_goes(
    tmp_path: Path, session: Any, options: RunOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the console is not a terminal (nohup, CI, a log file) the live bar draws nothing until the end: a line
    every LOG_EVERY_S says how far the run is."""
    monkeypatch.setattr(jobs, "LOG_EVERY_S", 0.0)
    prompts = write_lines(tmp_path / "p.jsonl", [{"id": str(i), "prompt": f"Tell me about {i}"} for i in range(3)])
    log = io.StringIO()
    run_with(session, options, prompts, console=Console(file=log, width=200))
    lines = [line for line in log.getvalue().splitlines() if line.startswith("generating: ")]
    assert lines and lines[-1].startswith("generating: 3/3 done, ") and "tok/s" in lines[-1], log.getvalue()
    assert "elapsed, about" in lines[0]


def test_a_file_of_plain_lines_is_refused_before_the_model_loads_unless_it_is_a_txt(
    tmp_path: Path, session: Any, options: RunOptions
) -> None:
    """A .txt file is a prompt a line (user turns, as `dflash train --prompts` reads one); any other file of lines
    that are not JSON is refused before the model loads, leaving nothing behind."""
    prompts = tmp_path / "prompts.md"
    prompts.write_text("What is 2+2?\nName a color.\n")
    with pytest.raises(DflashError) as raised:
        run_file(RunOptions(), prompts, load=no_load)
    assert "no line of" in raised.value.message and '{"messages": [{"role": "user"' in raised.value.fix
    assert raised.value.fix.startswith("name a file of one prompt a line *.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.md"]  # no output or errors file
    text = tmp_path / "prompts.txt"
    text.write_text('What is 2+2?\n\n{"prompt": "as it is"}\n')
    read = read_requests(text)
    assert [(r.line, r.messages) for r in read.requests] == [
        (1, ({"role": "user", "content": "What is 2+2?"},)),
        (3, ({"role": "user", "content": '{"prompt": "as it is"}'},)),
    ]
    assert read.requests[0].id == jobs.auto_id(1, b"What is 2+2?\n") and not read.errors
    run_with(session, options, text)
    results = [json.loads(line) for line in (tmp_path / "prompts.out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in results) == sorted(r.id for r in read.requests)
    mixed = write_lines(tmp_path / "p.jsonl", ["not json", {"prompt": "hi"}])
    with pytest.raises(AssertionError, match="the model must not load"):  # one good line: the run goes on
        run_file(RunOptions(), mixed, load=no_load)


def test_an_errors_file_left_empty_takes_the_folders_made_for_it(
    tmp_path: Path, session: Any, options: RunOptions
) -> None:
    """--errors in a new folder: made before the model loads (as -o's), and removed with the empty errors file at
    the end; a folder that holds the output too stays."""
    prompts = write_lines(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hello"}])
    run_with(session, options, prompts, errors=tmp_path / "new" / "deeper" / "e.jsonl")
    assert not (tmp_path / "new").exists()
    run_with(session, options, prompts, output=tmp_path / "out" / "r.jsonl", errors=tmp_path / "out" / "e.jsonl")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["r.jsonl"]
