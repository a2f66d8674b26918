"""The compiled CPU steps a first start builds in the background (loading.compiled_steps): it never waits for them,
one build runs at a time, the next start loads them, and a failed build is said once and not tried again."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dflash_cli.engine.compiled import stored
from dflash_cli.loading.compiled_steps import ENVIRONMENT, background_builds
from dflash_cli.loading.session import open_session
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import PlanOverrides


@pytest.fixture
def user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh dflash cache that this process and the background builder (a child process) both use; background
    builds on."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv(ENVIRONMENT, "1")
    monkeypatch.setattr(stored, "packages_dir", lambda: stored.compile_cache_dir() / "exported")
    return cache


def wait_for_the_build(cache: Path, seconds: float = 600) -> None:
    locks = cache / "dflash" / "compile" / "background"
    deadline = time.monotonic() + seconds
    while any(locks.glob("*.lock")):
        assert time.monotonic() < deadline, "the background build did not end"
        time.sleep(1)


@pytest.mark.slow
def test_the_first_start_builds_in_the_background_and_the_next_one_loads(
    tiny_qwen3_dir: Path, user_cache: Path
) -> None:
    options = RunOptions(target=str(tiny_qwen3_dir), no_spec=True)
    first = open_session(options, build_later=True)
    assert not first.exported and "building them in the background" in first.build_note  # (it did not wait)
    again = open_session(options, build_later=True)
    assert "still building" in again.build_note  # one build at a time
    # The builder at the lowest priority, its session's scheduling group too where Linux groups processes by
    # session (autogroups): there a nice value alone ranks it only within its own group, which then took half the
    # CPU from the decoding session (1 tok/s against 50).
    (lock,) = (user_cache / "dflash" / "compile" / "background").glob("*.lock")
    builder = int(lock.read_text())
    assert os.getpriority(os.PRIO_PROCESS, builder) == 19
    group = Path(f"/proc/{builder}/autogroup")
    if group.exists():
        assert group.read_text().split()[-1] == "19"
    log = lock.with_suffix(".log")
    assert f"since {time.strftime('%H:%M', time.localtime(lock.stat().st_mtime))}" in again.build_note
    assert str(log) in again.build_note
    assert background_builds() == [(log, lock.stat().st_mtime)]  # (`dflash doctor` lists it)
    wait_for_the_build(user_cache)
    assert background_builds() == []
    said = log.read_text()  # what it built, and in how long
    assert "compiled step: exported step" in said and said.rstrip().splitlines()[-1].startswith("done in ")
    later = open_session(options, build_later=True)
    assert later.exported and later.build_note is None
    overridden = open_session(
        RunOptions(target=str(tiny_qwen3_dir), no_spec=True, overrides=PlanOverrides(dtype="float32")), build_later=True
    )
    assert overridden.build_note is None  # built for the default plan only: another plan does not start one


@pytest.mark.slow
def test_a_failed_build_is_said_once_and_not_tried_again(
    tiny_qwen3_dir: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # the builder's compiler: inductor reads CXX
    options = RunOptions(target=str(tiny_qwen3_dir), no_spec=True)
    assert "building them in the background" in open_session(options, build_later=True).build_note
    wait_for_the_build(user_cache)
    monkeypatch.delenv("CXX")
    note = open_session(options, build_later=True).build_note
    assert note.startswith("compiled steps: the background build failed (") and "decoding eagerly" in note
    assert not list((user_cache / "dflash" / "compile" / "background").glob("*.lock"))  # not started again


def test_no_background_build_when_switched_off(
    tiny_qwen3_dir: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENVIRONMENT, "0")
    assert open_session(RunOptions(target=str(tiny_qwen3_dir), no_spec=True), build_later=True).build_note is None
    off = RunOptions(target=str(tiny_qwen3_dir), no_spec=True, compile="off")
    monkeypatch.setenv(ENVIRONMENT, "1")
    assert open_session(off, build_later=True).build_note is None
    assert open_session(RunOptions(target=str(tiny_qwen3_dir), no_spec=True)).build_note is None  # bench, train
    assert not (user_cache / "dflash" / "compile" / "background").exists()
