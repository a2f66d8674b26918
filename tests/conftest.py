"""Shared fixtures: an isolated Hugging Face cache, offline mode, a local fake Hub, tiny models.

huggingface_hub reads HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE / HF_ENDPOINT once, at import, into
`huggingface_hub.constants`; the fixtures patch those attributes (and the environment, for subprocesses).
Model builders live in helpers/tiny_models.py (`from helpers.tiny_models import make_tiny_qwen3`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants

from helpers.fake_hub import FakeHub
from helpers.tiny_models import make_tiny_llama, make_tiny_qwen3


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a busy 2-core CI box spinning OpenMP threads slow them 10x."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def block_costs_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Measured step costs (the adaptive block policy's, the decode threads') go to a temporary directory, not the
    user's cache."""
    from dflash_cli.engine import policy

    directory = tmp_path_factory.mktemp("block-costs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policy, "cost_cache_dir", lambda what="block-costs": directory / what)
        if sys.platform.startswith("linux"):  # (where platformdirs reads XDG_CACHE_HOME)
            patch.setenv("HF_HOME", constants.HF_HOME)  # (else derived from XDG_CACHE_HOME)
            home = _cache_without_measurements(tmp_path_factory.mktemp("xdg-cache"), set(policy.MEASUREMENTS.values()))
            patch.setenv("XDG_CACHE_HOME", str(home))
        yield directory


def _cache_without_measurements(home: Path, measurements: set[str]) -> Path:
    """A cache home for the processes tests start (a server, a chat): the user's dflash cache entries linked in
    (built kernels and steps, converted models: shared, as a user's runs share them; written through the links
    too), its `measurements` folders left out, so those processes keep theirs here, not among the user's."""
    from platformdirs import user_cache_dir

    real = Path(user_cache_dir("dflash"))
    (home / "dflash").mkdir()
    for entry in real.iterdir() if real.is_dir() else ():
        if entry.name not in measurements:
            (home / "dflash" / entry.name).symlink_to(entry)
    return home


@pytest.fixture(scope="session", autouse=True)
def exported_steps_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Exported steps (engine.compiled.stored: the target's, the drafter's) are built into and found in a temporary
    directory: a test never loads a package from the user's cache, nor writes one there."""
    from dflash_cli.engine.compiled import stored

    directory = tmp_path_factory.mktemp("compile")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stored, "packages_dir", lambda: directory / "exported")
        yield directory


@pytest.fixture(scope="session", autouse=True)
def quiet_measurements() -> Iterator[None]:
    """The decode threads and step costs a test measures are kept as if the machine were quiet (a suite keeps a
    small CI machine's cores busy with its own subprocesses); tests/engine/test_decode_threads.py measures under a
    real load."""
    from dflash_cli import cpu_load
    from dflash_cli.engine import decode_threads, policy

    def quiet(start: cpu_load.Snapshot) -> float:
        cpu_load.busy_since(start)  # (what it was given is read as a measurement would read it)
        return 0.0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_threads, "busy_since", quiet)
        patch.setattr(policy, "busy_since", quiet)
        yield


@pytest.fixture(scope="session", autouse=True)
def no_background_builds() -> Iterator[None]:
    """No session a test opens starts a background build of compiled steps (a process outliving the test); the
    tests of that build turn it back on (tests/loading/test_compiled_steps.py)."""
    from dflash_cli.loading.compiled_steps import ENVIRONMENT

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENVIRONMENT, "0")
        yield


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME for this test (cache in `hf_home / "hub"`), online, with no token."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return home


@pytest.fixture
def offline(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`hf_home` with HF_HUB_OFFLINE=1: every Hub request fails, only the cache answers."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home


@pytest.fixture
def fake_hub(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A local HTTP server standing in for huggingface.co; huggingface_hub is pointed at it."""
    hub = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    url_template = hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url_template)
    yield hub
    hub.stop()


def closed_port() -> int:
    """A local TCP port nothing listens on: connecting is refused at once."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def unreachable_hub(monkeypatch: pytest.MonkeyPatch) -> str:
    """HF_ENDPOINT at a local port nothing listens on: the Hub is unreachable, and no test touches the network."""
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    return endpoint


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 model with tokenizer, built once per test session. Read-only: copy it before editing."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model with tokenizer, built once per test session. Read-only: copy it before editing."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", seed=0)
