"""How many threads decode fastest here: measured once per machine, model and thread count offered, then cached;
and the other processes' CPU load, which decides whether a measurement is kept.

A decode step reads every weight once, so where one core alone fills the memory bandwidth more threads only add
their barrier at every op (the demo in float32 on the 2-core VM: 2 threads 0.99x of 1), while a prompt's prefill
is compute and scales with the cores. So the loop runs prompts at the plan's count and decode steps at the count
measured here: the plan's, or 1 where that is not faster by at least MIN_GAIN.

A measurement taken while other processes kept more than cpu_load.QUIET_CORES busy (a compile in the background, a
test suite) is not the machine's truth: the thread count it would choose is not used, and it is not kept, so a later
start measures again (as one kept too long ago: cpu_load.fresh).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from dflash_cli.cpu_load import QUIET_CORES, busy_since, cpu_snapshot, fresh, measured_now
from dflash_cli.engine import policy
from dflash_cli.engine.loop import collect, generate
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.wording import plural

SCHEMA = "dflash-decode-threads/2"  # (2: measured_at and others_busy; a /1 file may hold a busy moment)
MIN_GAIN = 1.03  # the plan's count decodes only if this much faster than one thread

ROUNDS = 3  # interleaved rounds of each count; the first warms up and is dropped
PROMPT_TOKENS = 48
TOKENS = 8  # plain steps timed per round


@dataclass(frozen=True)
class DecodeThreads:
    threads: int  # decode steps run at this count
    offered: int  # the plan's count (prompts run at it)
    seconds: dict[int, float]  # measured seconds per decoded token at each count
    cached: bool  # read from an earlier measurement
    others_busy: float = 0.0  # cores other processes kept busy while it was measured

    def reason(self) -> str:
        measured = ", ".join(f"{plural(n, 'thread')} {1 / s:.1f} tok/s" for n, s in self.seconds.items())
        if self.others_busy > QUIET_CORES:
            return (
                f"decoding with the plan's {self.threads} threads: measured now while other processes kept "
                f"{self.others_busy:.1f} cores busy ({measured}), not kept; a quieter start measures again"
            )
        where = "measured before" if self.cached else "measured now, once"
        return (
            f"decoding with {self.threads} of the {self.offered} threads, prompts with {self.offered} ({where}: "
            f"{measured}); a decode step reads the weights, so threads help it only while one core cannot fill the "
            "memory bandwidth"
        )


def decode_threads(target: Any, offered: int) -> DecodeThreads:
    """The thread count decode steps run at, for a CPU target with `offered` threads (torch's count now)."""
    key = {**policy.target_key(target, compile=False), "schema": SCHEMA}
    path = policy.cost_cache_dir(policy.MEASUREMENTS["decode threads"]) / f"{policy.fingerprint(key)}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key and fresh(data.get("measured_at"), data.get("others_busy")):
            seconds = {int(n): float(s) for n, s in data["seconds"].items()}
            return DecodeThreads(_choose(seconds, offered), offered, seconds, cached=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    start = cpu_snapshot()
    seconds = _measure(target, (1, offered))
    others = busy_since(start)
    if others > QUIET_CORES:  # a busy moment: not this machine's truth, neither used nor kept
        return DecodeThreads(offered, offered, seconds, cached=False, others_busy=others)
    record = {"key": key, "seconds": seconds, "measured_at": measured_now(), "others_busy": round(others, 3)}
    policy.save_measurement(path, record)
    return DecodeThreads(_choose(seconds, offered), offered, seconds, cached=False, others_busy=others)


def _choose(seconds: dict[int, float], offered: int) -> int:
    return offered if seconds[1] > MIN_GAIN * seconds[offered] else 1


def _measure(target: Any, counts: tuple[int, ...]) -> dict[int, float]:
    """Seconds per decoded token at each count: plain steps after a short prompt, counts interleaved, medians."""
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=TOKENS + 1)
    times: dict[int, list[float]] = {n: [] for n in counts}
    before = torch.get_num_threads()
    try:
        for round_ in range(ROUNDS):
            for n in counts:
                torch.set_num_threads(n)
                stats = collect(generate(target, None, prompt, params, prefix_cache=False)).stats
                if round_ > 0:
                    times[n].append(stats.decode_s / max(stats.generated_tokens - 1, 1))
    finally:
        torch.set_num_threads(before)
    return {n: statistics.median(t) for n, t in times.items()}
