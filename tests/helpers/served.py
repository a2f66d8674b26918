"""A real `dflash serve` for the server tests (test_serve.py, test_serve_agents.py): `python -m dflash_cli serve` in a
subprocess on a tiny Qwen3 with a random drafter, the fixtures that start it once per test module (`models`,
`server`, `client`, `session`, `long_prompt`), and the same models decoded in-process for the expected answers."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from dflash_cli.engine import collect
from dflash_cli.loading.session import Session, open_session
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import PlanOverrides
from helpers.drafters import save_random_drafter

REPO = Path(__file__).resolve().parents[2]
KEY = "test-key-123"
MAX_TOKENS = 16  # the server's --max-tokens: the default for requests that do not say
MAX_QUEUE = 16
BATCH = 4  # the server's --batch-size: rows decoded together
WINDOW = 2048  # the served model's context window
BUSY = 1500  # tokens a request that keeps the server busy asks for


def subprocess_env() -> dict[str, str]:
    """A served process's environment: the session's as it is when the process starts (conftest's cache home is
    set after this module is imported), the repo importable, offline, one thread."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@dataclass
class RunningServer:
    process: subprocess.Popen[str]
    url: str  # http://127.0.0.1:PORT
    target: str  # the served model's name: an ad-hoc --target is served under its path
    log: list[str] = field(default_factory=list)  # the server's stderr lines so far

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120, **kwargs)

    def get(self, path: str) -> tuple[int, Any]:
        status, _, body = raw_request(self.port, "GET", path)
        return status, json.loads(body) if path != "/metrics" else body.decode()

    def metric(self, name: str) -> float:
        line = next((line for line in self.get("/metrics")[1].splitlines() if line.startswith(name + " ")), None)
        return float(line.split()[-1]) if line else 0.0


def raw_request(
    port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> tuple[Path, Path]:
    import shutil

    from transformers import AutoModelForCausalLM

    # a longer window than the shared tiny model's: tools in the system prompt take ~600 of its byte-level tokens
    directory = shutil.copytree(tiny_qwen3_dir, tmp_path_factory.mktemp("serve") / "target")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": WINDOW}))
    target = AutoModelForCausalLM.from_pretrained(directory)
    drafter = save_random_drafter(tmp_path_factory.mktemp("serve") / "drafter", target, block_size=4)
    return directory, drafter


def model_flags(models: tuple[Path, Path]) -> list[str]:
    return [
        "--target",
        str(models[0]),
        "--drafter",
        str(models[1]),
        "--dtype",
        "float32",
        "--max-tokens",
        str(MAX_TOKENS),
    ]


@contextlib.contextmanager
def running_server(flags: list[str]) -> Iterator[RunningServer]:
    """`python -m dflash_cli serve FLAGS` on a free port until the block ends (Ctrl-C, then a clean stop)."""
    command = [sys.executable, "-m", "dflash_cli", "serve", *flags, "--port", "0", "--api-key", KEY]
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=subprocess_env()
    )
    log: list[str] = []
    started = threading.Event()

    def read_stderr() -> None:  # always drain it: a full pipe would block the server's logging
        assert process.stderr is not None
        for line in process.stderr:
            log.append(line.rstrip("\n"))
            if " at http://" in line:
                started.set()
        started.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    assert started.wait(180), "server did not start"
    match = re.search(r" at (http://127\.0\.0\.1:\d+)/v1", "\n".join(log))
    assert match and process.poll() is None, "\n".join(log)
    running = RunningServer(process, match.group(1), flags[flags.index("--target") + 1], log)
    deadline = time.monotonic() + 60
    while True:  # the line is printed once the socket is bound; it accepts once uvicorn runs
        try:
            running.get("/health")
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "\n".join(log)
            time.sleep(0.05)
    try:
        yield running
    except BaseException:
        process.kill()  # a failed test leaves no server behind
        raise
    process.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop
    assert process.wait(timeout=60) == 0, "\n".join(log[-20:])
    reader.join(10)
    assert log[-1] == "dflash serve: stopped" and not any("Traceback" in line for line in log), "\n".join(log)


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path]) -> Iterator[RunningServer]:
    flags = [*model_flags(models), "--max-queue", str(MAX_QUEUE), "--batch-size", str(BATCH)]
    with running_server(flags) as running:
        yield running


@pytest.fixture(scope="module")
def session(models: tuple[Path, Path]) -> Session:
    return open_session(local_options(models))


def local_options(models: tuple[Path, Path]) -> RunOptions:
    return RunOptions(
        target=str(models[0]),
        drafter=str(models[1]),
        sampling=SamplingParams(max_new_tokens=MAX_TOKENS),
        overrides=PlanOverrides(dtype="float32"),
    )


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


def expected_chat(session: Session, models: tuple[Path, Path], messages: list[dict[str, str]], **changes: Any) -> Any:
    params = session.sampling_params(local_options(models), **changes)
    return collect(session.stream(session.encode_chat(messages), params))


def expected_completion(session: Session, models: tuple[Path, Path], prompt: str, **changes: Any) -> Any:
    params = session.sampling_params(local_options(models), **changes)
    return collect(session.stream(session.encode_prompt(prompt), params))


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def long_prompt(session: Session, models: tuple[Path, Path]) -> str:
    """A prompt whose greedy reply runs to BUSY tokens (no end-of-turn token before): a request that stays busy
    (the tiny model decodes 1,000+ tokens/s here: 300 tokens ended before a client's hang-up reached the server)."""
    for i in range(10):
        prompt = f"Tell me everything, part {i}."
        if expected_chat(session, models, user(prompt), max_new_tokens=BUSY).finish_reason == "length":
            return prompt
    raise AssertionError(f"no prompt keeps the tiny model talking for {BUSY} tokens")


# Tools and structured output: a function and a schema the replies must follow.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "maximum": 9}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
RECORD = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
