"""Batched decoding: every row of a batch produces exactly the tokens it produces alone.

Rows of mixed prompt lengths, max_tokens and stop conditions join mid-way (continuous batching) and leave as they
finish; greedy rows (float32) must equal the same request decoded alone through `speculative_generate`, which the
engine tests hold equal to transformers' own greedy `generate`; seeded sampling rows are reproducible and equal
their decoding alone.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_cli.engine import Batch, SamplingParams, collect, generate
from dflash_cli.engine.policy import FixedBlock
from helpers.drafters import FORMATS, RowOracle, random_drafter
from helpers.runs import run_batch
from helpers.tiny_models import family_target, sharp_tiny


@functools.cache
def tiny_target(arch: str, seed: int, layers: int = 2):
    return sharp_tiny(arch, seed, layers)


def alone(target, drafter, prompt: list[int], params: SamplingParams) -> tuple:
    result = collect(generate(target, drafter, prompt, params))
    return result.token_ids, result.finish_reason, result.acceptance_lengths


request_strategy = st.tuples(
    st.lists(st.integers(1, 94), min_size=1, max_size=20),  # prompt
    st.integers(1, 30),  # max_tokens
    st.integers(0, 12),  # the step at which it joins
    st.integers(-1, 20),  # stop at the token this request makes alone at this index (-1: no stop token)
)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(["qwen3", "llama"]),
    seed=st.integers(0, 3),
    fmt=st.sampled_from(FORMATS),
    block_size=st.sampled_from([1, 2, 4, 8]),
    rows=st.integers(2, 4),
    requests=st.lists(request_strategy, min_size=2, max_size=7),
)
def test_every_greedy_row_equals_its_decoding_alone(arch, seed, fmt, block_size, rows, requests) -> None:
    target = tiny_target(arch, seed)
    drafter = None if block_size == 1 else random_drafter(target, seed=seed, block_size=block_size, fmt=fmt, window=3)
    batch_requests = []
    for prompt, max_tokens, join, stop_at in requests:
        free = alone(target, drafter, prompt, SamplingParams(max_new_tokens=max_tokens))[0]
        stops = (free[stop_at],) if 0 <= stop_at < len(free) else ()
        batch_requests.append((prompt, SamplingParams(max_new_tokens=max_tokens, stop_token_ids=stops), join))
    expected = [alone(target, drafter, p, params)[:2] for p, params, _ in batch_requests]
    got, _ = run_batch(target, drafter, batch_requests, rows)
    assert [g[:2] for g in got] == expected


def test_rows_with_partial_acceptance_join_leave_and_reuse_slots() -> None:
    """Each row drafts its own continuation right for a varying number of slots: every step commits and rejects
    at different depths in different rows; short rows leave and later rows take their slots (a middle slot
    frees while the rows around it go on)."""
    target = tiny_target("qwen3", 7, layers=3)
    prompts = [[5, 17, 42], [8, 9, 3, 3, 11, 12, 30, 31], [1], [60, 61, 62, 63], [7, 7, 7, 7, 7, 7, 7], [2, 4]]
    max_tokens = [40, 6, 33, 12, 25, 40]
    joins = [0, 0, 0, 2, 3, 9]
    free = [alone(target, None, p, SamplingParams(max_new_tokens=n))[0] for p, n in zip(prompts, max_tokens)]
    requests = [(p, SamplingParams(max_new_tokens=n), j) for p, n, j in zip(prompts, max_tokens, joins)]
    correct = [0, 7, 1, 4, 2]

    def oracle(which: list[int]):
        return RowOracle(
            target,
            [prompts[i] + free[i] for i in which],
            [len(prompts[i]) for i in which],
            block_size=8,
            correct=correct,
        )

    solo = [alone(target, oracle([i]), prompts[i], requests[i][1]) for i in range(len(prompts))]
    got, widest = run_batch(target, oracle(list(range(len(prompts)))), requests, rows=3)
    assert widest == 3
    assert [g[0] for g in got] == free  # lossless
    assert got == solo  # and the same steps: each row's acceptance lengths are its own
    assert any(1 < n < 8 for g in got for n in g[2])


def test_sampling_rows_are_seeded_and_reproducible() -> None:
    target = tiny_target("llama", 3)
    drafter = random_drafter(target, block_size=4)
    prompts = [[1, 2, 3], [40, 41], [9, 8, 7, 6, 5, 4], [11]]
    requests = [
        (p, SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=100 + i), i % 2)
        for i, p in enumerate(prompts)
    ]
    requests.append(([3, 3, 3], SamplingParams(max_new_tokens=24), 1))  # a greedy row among them
    first, widest = run_batch(target, drafter, requests, rows=4)
    second, _ = run_batch(target, drafter, requests, rows=3)
    assert widest > 1 and [g[0] for g in first] == [g[0] for g in second]
    assert [g[0] for g in first] == [alone(target, drafter, p, params)[0] for p, params, _ in requests]
    reseeded = [(p, SamplingParams(**{**params.__dict__, "seed": 7}), j) for p, params, j in requests[:2]]
    assert [g[0] for g in run_batch(target, drafter, reseeded, rows=2)[0]] != [g[0] for g in first[:2]]


def test_a_failing_row_fails_alone_and_a_cancelled_row_frees_its_slot() -> None:
    target = tiny_target("qwen3", 1)
    drafter = random_drafter(target, block_size=4)
    params = SamplingParams(max_new_tokens=20)
    batch = Batch(target, drafter, rows=2)
    try:
        batch.add([1, 2, 3], params, key="keep")
        gone = batch.add([4, 5], params, key="gone")
        batch.step()  # both join
        # (by key: which slot a row takes depends on what earlier requests on this cached target left in them)
        assert batch.room == 0 and sorted(row.key for row in batch.active) == ["gone", "keep"]
        batch.step()
        batch.cancel(gone)
        assert batch.room == 1 and [row.key for row in batch.active] == ["keep"]
        batch.add([1, 200], params, key="bad")  # a token outside the vocabulary: its prefill fails
        events = batch.step()
        assert [(row.key, type(event)) for row, event in events] == [("bad", IndexError)]
        assert batch.room == 1
        tokens = []
        while not batch.idle:
            tokens += [t for _, event in batch.step() for t in event.token_ids]
    finally:
        batch.close()
    expected = alone(target, drafter, [1, 2, 3], params)[0]
    assert tokens == expected[-len(tokens) :] and len(tokens) < len(expected)


class FailsToPrepareOnce(FixedBlock):
    """A block policy whose first preparation fails, as an out-of-memory calibration would."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.prepared = 0

    def prepare(self, state, drafter, prompt) -> None:
        self.prepared += 1
        if self.prepared == 1:
            raise torch.OutOfMemoryError("calibrating the block costs")


def test_a_failed_reservation_fails_its_row_and_the_next_row_reserves_again() -> None:
    """The state is taken only once reserved and prepared: a row whose reservation failed leaves nothing half set
    up behind it for the rows after it (an uncalibrated policy, a state without its feature buffer)."""
    target = tiny_target("qwen3", 1)
    drafter = random_drafter(target, block_size=4)
    params = SamplingParams(max_new_tokens=12)
    policy = FailsToPrepareOnce(4)
    batch = Batch(target, drafter, rows=1, policy=policy)
    try:
        batch.add([1, 2, 3], params, key="first")
        assert [(row.key, type(event)) for row, event in batch.step()] == [("first", torch.OutOfMemoryError)]
        assert batch.state is None and batch.idle
        batch.add([1, 2, 3], params, key="second")
        tokens = []
        while not batch.idle:
            tokens += [t for _, event in batch.step() for t in event.token_ids]
    finally:
        batch.close()
    assert policy.prepared == 2
    assert tokens == alone(target, drafter, [1, 2, 3], params)[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_draft_forward_for_all_rows_equals_each_rows_own_draft(fmt: str) -> None:
    """`draft_hidden` over a cache of a slot per row (one forward of the layers for every row) gives each row the
    hidden states `draft_hidden` gives it alone, in a one-slot cache of its own, and proposes the same: rows with
    different starts, numbers of new context rows (1..8; a long first context) and block sizes (padded to the
    step's widest), in slots that are not contiguous, a row leaving and a fresh one joining its slot, sliding rings
    (window 3, ring 10) wrapping several times. float32: equal to rounding (the GEMMs' shapes differ)."""
    import random

    target = tiny_target("qwen3", 2)
    drafter = random_drafter(target, seed=3, block_size=4, fmt=fmt, window=3, num_layers=2)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    choose = random.Random(5)
    torch.manual_seed(0)
    rows = drafter.new_cache(block_size=4, slots=3)
    alone: dict[int, list] = {}  # slot -> [its one-row cache, its next block's start]

    def join(slot: int) -> None:
        rows.make_room(96)
        alone[slot] = [drafter.new_cache(96, 4), 0]

    for slot in range(3):
        join(slot)
    multi_row_steps = 0
    for step in range(14):
        if step == 7:
            join(1)  # row 1 leaves, a fresh row takes its slot
        drafting = [slot for slot in range(3) if choose.random() < 0.8 or step == 0 or slot == 1 and step == 7]
        features, starts, sizes = [], [], []
        for slot in drafting:
            context = choose.randint(12, 16) if alone[slot][1] == 0 else choose.randint(1, 8)
            features.append(torch.randn(1, context, width))
            starts.append(alone[slot][1] + context)
            sizes.append(choose.randint(2, 4))
            alone[slot][1] = starts[-1]
        blocks = torch.full((len(drafting), max(sizes)), drafter.mask_token_id)
        blocks[:, 0] = torch.tensor(starts) % 90
        hidden = drafter.draft_hidden(features, blocks, starts, rows, sizes=sizes, slots=drafting)
        proposals = drafter.select(hidden, blocks[:, 0])
        for i, slot in enumerate(drafting):
            own = drafter.draft_hidden([features[i]], blocks[i : i + 1, : sizes[i]], [starts[i]], alone[slot][0])
            torch.testing.assert_close(hidden[i : i + 1, : sizes[i] - 1], own, rtol=1e-5, atol=1e-5)
            assert proposals[i, : sizes[i] - 1].tolist() == drafter.select(own, blocks[i : i + 1, 0])[0].tolist()
        multi_row_steps += len(drafting) > 1 and len(set(sizes)) > 1
    assert max(start for _, start in alone.values()) > 4 * 10 and multi_row_steps >= 5


def test_the_drafters_layers_run_once_per_step_for_all_rows() -> None:
    """Counted with forward hooks on the real drafter's layers: one call per decode step, however many rows draft."""
    target = tiny_target("qwen3", 1)
    drafter = random_drafter(target, block_size=4, num_layers=2)
    calls = [0] * len(drafter.layers)

    def count(index: int):
        def hook(*_: object) -> None:
            calls[index] += 1

        return hook

    handles = [layer.register_forward_hook(count(i)) for i, layer in enumerate(drafter.layers)]
    batch = Batch(target, drafter, rows=3)
    drafting_steps, multi_row_steps = 0, 0
    try:
        for i, prompt in enumerate(([1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11])):
            batch.add(prompt, SamplingParams(max_new_tokens=12 + 5 * i))
        while not batch.idle:
            decoding = not batch.scheduler.joining
            events = batch.step()
            drafted = [event for _, event in events if decoding and event.stats.block_sizes[-1] > 1]
            drafting_steps += bool(drafted)
            multi_row_steps += len(drafted) > 1
    finally:
        batch.close()
        for handle in handles:
            handle.remove()
    assert calls == [drafting_steps] * len(drafter.layers)
    assert multi_row_steps >= 10  # steps that drafted for several rows, in one call each


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "bamba"])
def test_hybrid_rows_roll_back_each_to_its_own_count(family: str) -> None:
    """Hybrid targets batch: rows of mixed prompt lengths and max_tokens join mid-way (one into a slot a finished
    row left) and share each verify, each rolls its recurrent state back to its own kept count (the oracle makes
    every step keep a different number of drafts in each row), and each row makes exactly its tokens and steps
    alone; seeded sampling rows among them are reproducible at any batch size and equal their decoding alone."""
    from helpers.tiny_models import hf_greedy

    target = family_target(family)
    prompts = [[5, 17, 42, 8, 9, 3, 3, 11, 12], [3, 1, 4], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], [27], [60, 61]]
    max_tokens = [30, 7, 22, 18, 12]
    joins = [0, 0, 1, 3, 4]
    sampled = {3: 1.0, 4: 0.7}  # rows 3 and 4: sampled, seeded (temperature)
    params = [
        SamplingParams(max_new_tokens=n, temperature=sampled.get(i, 0.0), seed=50 + i if i in sampled else None)
        for i, n in enumerate(max_tokens)
    ]
    greedy = [hf_greedy(target, p, n) for p, n in zip(prompts, max_tokens)]
    correct = [0, 7, 1, 4, 2, 6]

    def oracle(order: list[int]) -> RowOracle:  # each row drafts its own greedy continuation (known by its length)
        return RowOracle(
            target,
            [prompts[i] + greedy[i] for i in order],
            [len(prompts[i]) for i in order],
            block_size=8,
            correct=correct,
        )

    requests = [(p, sp, j) for p, sp, j in zip(prompts, params, joins)]
    solo = [alone(target, oracle([i]), prompts[i], params[i]) for i in range(len(prompts))]
    got, widest = run_batch(target, oracle(sorted(range(len(prompts)), key=joins.__getitem__)), requests, rows=3)
    assert widest == 3
    assert [g[0] for i, g in enumerate(got) if i not in sampled] == [
        greedy[i] for i in range(len(prompts)) if i not in sampled
    ]
    assert got == solo  # every row: its tokens, finish reason and acceptance lengths alone
    assert any(1 < n < 8 for i, g in enumerate(got) if i not in sampled for n in g[2])  # partial acceptance
    again, _ = run_batch(target, oracle(sorted(range(len(prompts)), key=joins.__getitem__)), requests, rows=2)
    assert [g[0] for g in again] == [g[0] for g in got]


def break_sampling(row, batch) -> None:
    """Make `row`'s sampling fail as an unchecked request's did (issue 48: a 31-digit temperature overflowed)."""
    params = SamplingParams(max_new_tokens=row.generation.params.max_new_tokens, temperature=1.0)
    object.__setattr__(params, "temperature", 10**30)  # (no request can carry it now: protocol refuses it)
    row.generation.params = params


def break_grammar(row, batch) -> None:
    """Give `row` a grammar that allows no token (compiled past the admission checks that now refuse it): its
    mask leaves nothing, and the token chosen anyway is one the grammar rejects when it is committed."""
    import xgrammar

    from dflash_cli.engine.grammar import GrammarState
    from helpers.tiny_models import tiny_tokenizer

    info = xgrammar.TokenizerInfo.from_huggingface(tiny_tokenizer(), vocab_size=batch.vocab_size)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema('{"anyOf": [{"$ref": "#"}]}')
    row.generation.grammar = GrammarState(compiled, block_size=batch.block, vocab_size=batch.vocab_size)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("breaking", [break_sampling, break_grammar])
def test_a_row_that_fails_in_a_shared_step_fails_alone(family, breaking) -> None:
    """Three rows share each verify; one row's own part of a step fails (its sampling, or its grammar when its
    tokens are committed): that row gets its error, the other two decode on, each exactly as alone (on a hybrid
    target too, whose state commits every row of a verify together)."""
    if family == "qwen3":
        target = tiny_target("qwen3", 2)
    else:
        target = family_target(family)
    drafter = random_drafter(target, block_size=4)
    prompts = {"a": [5, 6, 7, 8], "bad": [9, 10, 11], "c": [40, 41, 42, 43, 44]}
    params = SamplingParams(max_new_tokens=12)
    batch = Batch(target, drafter, rows=3)
    tokens: dict[str, list[int]] = {key: [] for key in prompts}
    outcome: dict[str, object] = {}
    try:
        rows = {key: batch.add(prompt, params, key=key) for key, prompt in prompts.items()}
        for row, event in batch.step():  # all three join
            tokens[row.key] += event.token_ids
        assert len(batch.active) == 3
        breaking(rows["bad"], batch)
        while not batch.idle:
            for row, event in batch.step():
                if isinstance(event, BaseException):
                    outcome[row.key] = event
                    continue
                tokens[row.key] += event.token_ids
                if event.finish_reason:
                    outcome[row.key] = event.finish_reason
    finally:
        batch.close()
    assert isinstance(outcome.pop("bad"), (OverflowError, RuntimeError))
    assert outcome == {"a": "length", "c": "length"}
    for key in ("a", "c"):
        assert tokens[key] == alone(target, drafter, prompts[key], params)[0]
