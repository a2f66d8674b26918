"""Decoding runs the engine tests compare: a batch of requests joining at given steps (`run_batch`), a request with
and without prefix reuse, the drafter's proposals recorded (`decode`, `turns`), a conversation's prompts
(`conversation`)."""

from __future__ import annotations

import random

from dflash_cli.engine import Batch, SamplingParams, collect, generate


def run_batch(target, drafter, requests: list[tuple[list[int], SamplingParams, int]], rows: int) -> tuple[list, int]:
    """Decode `requests` (prompt, params, the step at which it joins) in one batch of `rows`; return each
    request's (token ids, finish reason, acceptance lengths) and the most rows that verified together."""
    batch = Batch(target, drafter, rows=rows)
    results: dict[int, list] = {}
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    widest, step = 0, 0
    try:
        while pending or not batch.idle:
            while pending and requests[pending[0]][2] <= step:
                i = pending.pop(0)
                results[i] = [[], None, None]
                batch.add(requests[i][0], requests[i][1], key=i)
            decoding = len(batch.active) if not batch.scheduler.joining else 0
            widest = max(widest, decoding)
            for row, event in batch.step():
                assert not isinstance(event, BaseException), event
                results[row.key][0] += event.token_ids
                if event.finish_reason:
                    results[row.key][1] = event.finish_reason
                    results[row.key][2] = list(event.stats.acceptance_lengths)
            step += 1
    finally:
        batch.close()
    return [tuple(results[i]) for i in range(len(requests))], widest


class Recorder:
    """Records every proposal of `drafter` (row by row) while installed."""

    def __init__(self, drafter) -> None:
        self.drafter, self.proposals = drafter, []
        self.propose = drafter.propose if drafter is not None else None

    def __enter__(self) -> list:
        def recording(features, block_ids, starts, cache, *, sizes=None, slots=None):
            out = self.propose(features, block_ids, starts, cache, sizes=sizes, slots=slots)
            sizes = sizes or [block_ids.shape[1]] * len(starts)
            self.proposals += [(start, row[: size - 1].tolist()) for start, row, size in zip(starts, out, sizes)]
            return out

        if self.drafter is not None:
            self.drafter.propose = recording
        return self.proposals

    def __exit__(self, *exc) -> None:
        if self.drafter is not None:
            del self.drafter.propose


def decode(target, drafter, prompt, params, *, reuse: bool):
    with Recorder(drafter) as proposals:
        result = collect(generate(target, drafter, prompt, params, prefix_cache=reuse))
    return (result.token_ids, result.finish_reason, result.acceptance_lengths, proposals), result.stats


def turns(target, drafter, prompts, params):
    """Each prompt decoded with reuse (in order, on one state) and without; both outcomes and the reused counts."""
    with_reuse, cached = [], []
    for prompt in prompts:
        outcome, stats = decode(target, drafter, prompt, params, reuse=True)
        with_reuse.append(outcome)
        cached.append(stats.cached_tokens)
    without = [decode(target, drafter, prompt, params, reuse=False)[0] for prompt in prompts]
    return with_reuse, without, cached


def conversation(target, drafter, first, params, count: int, seed: int = 0) -> list[list[int]]:
    """A chat's prompts: each turn is the last prompt, its reply, and a new user message."""
    rng = random.Random(seed)
    prompts, prompt = [], list(first)
    for _ in range(count):
        prompts.append(prompt)
        reply = collect(generate(target, drafter, prompt, params, prefix_cache=False)).token_ids
        prompt = prompt + reply + [rng.randrange(1, 90) for _ in range(rng.randrange(1, 6))]
    return prompts
