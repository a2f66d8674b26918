"""engine/decode_threads.py: decode steps at the thread count measured fastest, prompts at the plan's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dflash_cli import cpu_load
from dflash_cli.engine import SamplingParams, collect, generate
from dflash_cli.engine import decode_threads as threads_module
from dflash_cli.engine import policy as policy_module
from dflash_cli.engine.decode_threads import MIN_GAIN, decode_threads
from helpers.drafters import random_drafter
from helpers.tiny_models import sharp_tiny


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_prompts_run_at_the_plans_count_and_decode_steps_at_the_measured_one(two_threads) -> None:
    target = sharp_tiny("qwen3", 0)
    drafter = random_drafter(target, block_size=4)
    seen: list[tuple[int, int]] = []  # (tokens in the forward, threads) for every target forward
    hook = target.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((kwargs["input_ids"].shape[1], torch.get_num_threads())),
        with_kwargs=True,
    )
    try:
        prompt = list(range(3, 40))
        result = collect(generate(target, drafter, prompt, SamplingParams(max_new_tokens=12), decode_threads=1))
    finally:
        hook.remove()
    assert seen[0] == (len(prompt), 2) and {threads for _, threads in seen[1:]} == {1}, seen
    assert torch.get_num_threads() == 2  # back to the plan's count
    again = collect(generate(target, drafter, prompt, SamplingParams(max_new_tokens=12), prefix_cache=False))
    assert again.token_ids == result.token_ids


def test_the_measurement_is_made_once_and_picks_one_thread_unless_more_is_faster(two_threads) -> None:
    target = sharp_tiny("llama", 1)
    first = decode_threads(target, 2)
    assert not first.cached and set(first.seconds) == {1, 2} and all(s > 0 for s in first.seconds.values())
    assert first.threads == (2 if first.seconds[1] > MIN_GAIN * first.seconds[2] else 1)
    again = decode_threads(target, 2)
    assert again.cached and again.seconds == first.seconds and again.threads == first.threads
    assert "measured before" in again.reason() and "prompts with 2" in again.reason()
    # the rule, on what a cache file says: 2 threads only where they are faster by MIN_GAIN
    # this target's file, found by its key (other tests' measurements share the folder)
    key = {**policy_module.target_key(target, compile=False), "schema": threads_module.SCHEMA}
    path = policy_module.cost_cache_dir("decode-threads") / f"{policy_module.fingerprint(key)}.json"
    data = json.loads(path.read_text())
    assert data["key"] == key
    for one, two, chosen in ((1.0, 0.99, 1), (1.0, 0.9, 2), (0.8, 1.0, 1)):
        path.write_text(json.dumps({**data, "seconds": {"1": one, "2": two}}))
        assert decode_threads(target, 2).threads == chosen
    path.write_text("not json")  # a broken cache file: measured again
    assert not decode_threads(target, 2).cached


def test_a_measurement_under_load_is_neither_used_nor_kept(two_threads, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy moment (here a process spinning on a core) is not this machine's truth: the plan's count decodes and
    nothing is kept, so the start after it measures again and decides as after a quiet measurement."""
    target = sharp_tiny("qwen3", 2, 3)  # (a config no other test measures: the key is the config, not the weights)
    monkeypatch.setattr(threads_module, "busy_since", cpu_load.busy_since)  # the real load, not the suite's quiet
    kept = policy_module.cost_cache_dir("decode-threads")
    before = set(kept.glob("*.json"))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaded = decode_threads(target, 2)
    finally:
        spinner.kill()
        spinner.wait()
    assert loaded.others_busy > cpu_load.QUIET_CORES and loaded.threads == 2, loaded
    assert "not kept" in loaded.reason() and set(kept.glob("*.json")) == before
    monkeypatch.setattr(threads_module, "busy_since", lambda start: 0.0)  # a quiet start
    quiet = decode_threads(target, 2)
    after = decode_threads(target, 2)
    assert not quiet.cached and after.cached and after.threads == quiet.threads
    # a kept measurement stands for MAX_AGE_DAYS, and only if it was taken quiet
    (path,) = set(kept.glob("*.json")) - before
    data = json.loads(path.read_text())
    for stale in ({"measured_at": "2020-01-01T00:00:00Z"}, {"others_busy": 1.0}, {"measured_at": None}):
        path.write_text(json.dumps({**data, **stale}))
        assert not decode_threads(target, 2).cached
