"""Prefix reuse (engine.prefix): a request keeps what its slot holds of its prompt and prefills the rest, exactly.

Every request here is decoded twice, with reuse and without (`prefix_cache=False`: a prefill from position 0): the
tokens, finish reasons and acceptance lengths must be the same (float32), and so must each draft the drafter
proposes, which shows that its first draft after a reuse saw the whole conversation (its kept context cache, its
ring, the features it had not read yet) as it does without reuse.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_cli.engine import Batch, PrefixStore, SamplingParams, collect, generate
from dflash_cli.engine.prefix import Held, Stored, choose_slot, common_prefix
from helpers.drafters import FORMATS, random_drafter
from helpers.runs import Recorder, conversation, decode, turns
from helpers.tiny_models import family_target, sharp_tiny


@functools.cache
def tiny_target(arch: str = "qwen3", seed: int = 0):
    return sharp_tiny(arch, seed, 2)


@pytest.mark.parametrize("fmt", [None, *FORMATS])
def test_a_conversation_with_reuse_decodes_exactly_as_without(fmt) -> None:
    target = tiny_target()
    drafter = None if fmt is None else random_drafter(target, fmt=fmt, block_size=4, window=3)
    params = SamplingParams(max_new_tokens=17)
    prompts = conversation(target, drafter, [5, 6, 7, 8, 9, 10], params, 5)
    with_reuse, without, cached = turns(target, drafter, prompts, params)
    assert with_reuse == without
    # every later turn keeps the last turn's prompt and all of its reply that reached the state
    assert all(cached[i] >= len(prompts[i - 1]) + 17 - 1 for i in range(1, len(prompts))), cached
    if drafter is not None:
        assert any(len(p) > 1 for p in with_reuse[-1][3])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_turn_with_another_block_size_keeps_the_prefix_exactly(fmt) -> None:
    """chat's /set block_size between turns: the next turn still continues from what the state holds (a drafter
    whose layers are all full-attention reads the same cache at any block size; a sliding ring is sized by the
    block, so that one starts over), and decodes exactly as without reuse at its block size."""
    target = tiny_target()
    drafter = random_drafter(target, fmt=fmt, block_size=4, window=3)
    params = SamplingParams(max_new_tokens=12)
    first, second = conversation(target, drafter, [5, 6, 7, 8, 9, 10], params, 2)
    collect(generate(target, drafter, first, params, block_size=4))
    with Recorder(drafter) as proposals:
        reused = collect(generate(target, drafter, second, params, block_size=2))
    fresh = collect(generate(target, drafter, second, params, block_size=2, prefix_cache=False))
    assert (reused.token_ids, reused.acceptance_lengths) == (fresh.token_ids, fresh.acceptance_lengths)
    assert all(len(p) == 1 for _, p in proposals)  # blocks of 2: one proposal each
    ring = drafter.new_cache(8, 4).ring is not None
    assert (reused.stats.cached_tokens == 0) if ring else reused.stats.cached_tokens >= len(first), fmt


@pytest.mark.parametrize("fmt", ["classic", "swa", "dflash2"])
def test_truncated_and_diverging_prompts_reuse_what_still_holds(fmt) -> None:
    """A prompt that ends inside the last one, one that diverges early, one that diverges late, and one the
    slot holds whole (it still prefills its last token: the first token comes from its logits)."""
    target = tiny_target("llama", 1)
    drafter = random_drafter(target, fmt=fmt, block_size=4, window=3)
    params = SamplingParams(max_new_tokens=20)
    base = conversation(target, drafter, [3, 1, 4, 1, 5, 9, 2, 6], params, 3, seed=1)[-1]
    prompts = [base, base[:20], base[:5] + [77, 78], base[:-3] + [44], base[:20], base[:-1], base[:-1]]
    with_reuse, without, cached = turns(target, drafter, prompts, params)
    assert with_reuse == without
    assert cached[1] > 0
    # the whole prompt but its last token P-1; a ring, after the reply it wrote, no longer holds the other row the
    # next block sees (window 3: P-2), which is prefilled again
    assert cached[-1] == len(prompts[-1]) - 1 - (0 if fmt == "classic" else 1)


def test_a_sliding_ring_that_evicted_the_rows_a_block_sees_keeps_less() -> None:
    """Going back far inside a long conversation: the drafter's ring no longer holds the rows before the kept
    point, so the request keeps only what lies out of the next block's window (and says how much it could not)."""
    target = tiny_target()
    drafter = random_drafter(target, fmt="swa", block_size=4, window=3)
    params = SamplingParams(max_new_tokens=30)
    first = list(range(10, 50))
    outcome, stats = decode(target, drafter, first, params, reuse=True)
    back = first[:30] + [7]  # the next block starts at 31 and sees 29 and 30: long evicted
    again, stats = decode(target, drafter, back, params, reuse=True)
    assert stats.cached_tokens == 31 - 3 + 1 and stats.unreused_tokens == 30 - stats.cached_tokens
    assert again == decode(target, drafter, back, params, reuse=False)[0]


@pytest.mark.parametrize(("rows", "fmt"), [(2, "classic"), (3, "swa")])
def test_batched_requests_reuse_their_slots_exactly(rows, fmt) -> None:
    """Several conversations through one batch, each turn placed in the slot that holds its last turn (the
    longest common prefix), decoded exactly as without reuse."""
    target = tiny_target()
    drafter = random_drafter(target, fmt=fmt, block_size=4, window=6)
    params = SamplingParams(max_new_tokens=12)
    starts = [[5, 6, 7, 8], [60, 61, 62], [9, 9, 9, 9, 9], [30, 31]]
    chats = [conversation(target, drafter, s, params, 3, seed=i) for i, s in enumerate(starts[:rows])]
    requests = [chat[turn] for turn in range(3) for chat in chats]  # turn by turn, chats interleaved
    got, cached = run_batch(target, drafter, requests, params, rows, reuse=True)
    assert got == run_batch(target, drafter, requests, params, rows, reuse=False)[0]
    assert sum(c > 0 for c in cached[rows:]) >= rows  # later turns found their slots


def run_batch(target, drafter, prompts, params, rows: int, *, reuse: bool, join_every: int = 2, store=None):
    """The prompts through one batch of `rows`, one joining every `join_every` steps; each one's outcome (tokens,
    finish reason, acceptance lengths) and the batch's proposals (sorted: rows may sit in other slots without
    reuse), and each one's reused count."""
    batch = Batch(target, drafter, rows=rows, prefix_cache=reuse, prefix_store=store)
    results: dict[int, list] = {}
    waiting, step = list(range(len(prompts))), 0
    with Recorder(drafter) as proposals:
        try:
            while waiting or not batch.idle:
                if waiting and step % join_every == 0:
                    i = waiting.pop(0)
                    results[i] = [[], None, None, 0]
                    batch.add(prompts[i], params, key=i)
                for row, event in batch.step():
                    assert not isinstance(event, BaseException), event
                    results[row.key][0] += event.token_ids
                    if event.finish_reason:
                        stats = event.stats
                        results[row.key][1:] = [
                            event.finish_reason,
                            list(stats.acceptance_lengths),
                            stats.cached_tokens,
                        ]
                step += 1
        finally:
            batch.close()
    outcomes = [tuple(results[i][:3]) for i in range(len(prompts))]
    return (outcomes, sorted(proposals)), [results[i][3] for i in range(len(prompts))]


operations = st.lists(
    st.tuples(
        st.sampled_from(["extend", "truncate", "diverge", "share", "new"]),
        st.integers(0, 3),  # which earlier prompt
        st.integers(1, 12),  # how many tokens
    ),
    min_size=3,
    max_size=9,
)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(FORMATS), rows=st.integers(1, 3), ops=operations, seed=st.integers(0, 3))
def test_interleaved_conversations_share_extend_truncate_and_diverge(fmt, rows, ops, seed) -> None:
    target = tiny_target("qwen3", seed % 2)
    drafter = random_drafter(target, fmt=fmt, block_size=4, window=6, seed=seed)
    params = SamplingParams(max_new_tokens=10)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 90) for _ in range(6)]]
    for op, which, n in ops:
        base = prompts[which % len(prompts)]
        new = [rng.randrange(1, 90) for _ in range(n)]
        prompts.append(
            {
                "extend": base + new,
                "truncate": base[: max(1, len(base) - n)],
                "diverge": base[: max(1, len(base) - n)] + new,
                "share": base[: min(len(base), n)] + new,
                "new": new,
            }[op]
        )
    got, _ = run_batch(target, drafter, prompts, params, rows, reuse=True, join_every=3)
    assert got == run_batch(target, drafter, prompts, params, rows, reuse=False, join_every=3)[0]


def test_seeded_sampling_is_the_same_with_and_without_reuse() -> None:
    target = tiny_target("llama", 2)
    drafter = random_drafter(target, fmt="classic", block_size=4)
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=11)
    prompts = conversation(target, drafter, [4, 8, 15, 16, 23, 42], SamplingParams(max_new_tokens=20), 4)
    with_reuse, without, cached = turns(target, drafter, prompts, params)
    assert with_reuse == without and cached[-1] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "bamba"])
def test_a_hybrid_target_reuses_at_its_snapshots_exactly(family) -> None:
    """Recurrent states cannot go back to any position: a conversation continues from the snapshot at its last
    reply's end; a request that ends inside a turn continues from the last snapshot before it (at a prompt's last
    token), and the same prompt again from its own."""
    target = family_target(family)
    drafter = random_drafter(target, fmt="classic", block_size=4)
    params = SamplingParams(max_new_tokens=12)
    prompts = conversation(target, drafter, [5, 17, 42, 8, 9], params, 3)
    inside = prompts[2][: len(prompts[1]) + 5] + [3]  # inside the second turn's reply: back to its prompt's end
    with_reuse, without, cached = turns(target, drafter, [*prompts, inside], params)
    assert with_reuse == without
    assert cached[1] == len(prompts[0]) + 12 - 1 and cached[2] == len(prompts[1]) + 12 - 1
    # (the snapshot before the prompt's last token, which a prompt always prefills; 6 tokens not reusable)
    assert cached[3] == len(prompts[1]) - 1
    _, stats = decode(target, drafter, inside, params, reuse=True)  # the same prompt again
    assert (stats.cached_tokens, stats.unreused_tokens) == (len(inside) - 1, 0)
    assert decode(target, drafter, inside, params, reuse=False)[0] == with_reuse[3]


def test_the_slot_with_the_longest_common_prefix_is_chosen() -> None:
    held = [Held([1, 2, 3, 4]), None, Held([1, 2, 9]), Held([7])]
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3 and common_prefix([], [1]) == 0
    assert choose_slot([0, 1, 2, 3], held, [1, 2, 3, 5]) == 0
    assert choose_slot([1, 2, 3], held, [1, 2, 9, 9]) == 2
    assert choose_slot([0, 1, 2, 3], held, [50]) == 1  # nothing in common: an empty slot
    held[1] = Held([8])
    assert choose_slot([0, 1, 2, 3], held, [50]) == 0  # then the least recently used


def test_a_follow_up_keeps_the_prompt_and_the_reply_that_reached_the_state() -> None:
    """Without a drafter too: the next prompt keeps the last prompt and every reply token but the newest (sampled
    from the last verify, it never entered the state), and prefills the rest."""
    target = tiny_target()
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    first, stats = decode(target, None, prompt[0].tolist(), SamplingParams(max_new_tokens=6), reuse=True)
    follow = prompt[0].tolist() + first[0] + [3, 4]
    again, stats = decode(target, None, follow, SamplingParams(max_new_tokens=6), reuse=True)
    assert stats.cached_tokens == 8 + 6 - 1  # the prompt and every reply token but the newest (not in the state)
    assert again == decode(target, None, follow, SamplingParams(max_new_tokens=6), reuse=False)[0]


@pytest.mark.parametrize("fmt", ["classic", "swa", "dflash2"])
def test_more_conversations_than_slots_come_back_from_the_store_exactly(fmt) -> None:
    """Four conversations through two slots: each turn finds its last turn in the prefix store (host memory) and
    continues from it there, as exactly as from a slot."""
    target = tiny_target()
    drafter = random_drafter(target, fmt=fmt, block_size=4, window=6)
    params = SamplingParams(max_new_tokens=12)
    starts = [[5, 6, 7, 8], [60, 61, 62], [9, 9, 9, 9, 9], [30, 31]]
    chats = [conversation(target, drafter, s, params, 3, seed=i) for i, s in enumerate(starts)]
    requests = [chat[turn] for turn in range(3) for chat in chats]
    store = PrefixStore(2**30)
    got, cached = run_batch(target, drafter, requests, params, 2, reuse=True, store=store)
    assert got == run_batch(target, drafter, requests, params, 2, reuse=False)[0]
    assert all(cached[i] >= len(requests[i - 4]) for i in range(4, 12)), cached  # every later turn
    assert store.entries and store.used == sum(stored.nbytes for stored in store.entries)


def test_one_row_alternating_between_conversations_uses_the_store() -> None:
    """Chat-like: one slot, two conversations taking turns; the one not in the slot waits in the store."""
    target = tiny_target("llama", 1)
    drafter = random_drafter(target, fmt="swa", block_size=4, window=6)
    params = SamplingParams(max_new_tokens=10)
    a = conversation(target, drafter, [3, 1, 4, 1, 5], params, 3, seed=1)
    b = conversation(target, drafter, [2, 7, 1, 8], params, 3, seed=2)
    store = PrefixStore(2**30)
    for turn, prompt in enumerate([a[0], b[0], a[1], b[1], a[2], b[2]]):
        with Recorder(drafter) as proposals:
            result = collect(generate(target, drafter, prompt, params, prefix_store=store))
        assert (result.token_ids, proposals) == decode(target, drafter, prompt, params, reuse=False)[0][::3]
        assert turn < 2 or result.stats.cached_tokens >= len((a if turn % 2 == 0 else b)[turn // 2 - 1])


def test_the_store_stays_within_its_bound_least_recently_used_out_first() -> None:
    target = tiny_target()
    params = SamplingParams(max_new_tokens=8)
    prompts = [[i, i + 1, i + 2, i + 3] * 3 for i in range(10, 60, 10)]
    one = PrefixStore(2**30)
    run_batch(target, None, prompts[:2], params, 1, reuse=True, store=one)
    size = one.entries[0].nbytes  # a 12-token prompt and 7 more tokens, every layer's K/V
    store = PrefixStore(int(2.5 * size))
    for prompt in prompts:
        run_batch(target, None, [prompt], params, 1, reuse=True, store=store)
        assert store.used <= store.limit and len(store.entries) <= 2
    assert [stored.held.ids[:12] for stored in store.entries] == prompts[-3:-1]  # the newest, oldest first
    again, cached = run_batch(target, None, [prompts[-2]], params, 1, reuse=True, store=store)
    assert cached == [11] and again[0] == run_batch(target, None, [prompts[-2]], params, 1, reuse=False)[0][0]
    small = PrefixStore(size - 1)
    small.add(one.entries[0])
    assert small.entries == [] and small.used == 0  # larger than the whole store: not kept


def test_many_conversations_through_a_tiny_store_lose_no_request() -> None:
    """Under pressure (issue 48): more conversations than the store holds, several rows placing and stashing
    between steps, so that what one placement stashes evicts what the store holds. Each request is decoded (none
    fails) exactly as without reuse, and the store stays within its bound."""
    target = tiny_target()
    drafter = random_drafter(target, fmt="swa", block_size=4, window=6)
    params = SamplingParams(max_new_tokens=6)
    rng = random.Random(48)
    system = [rng.randrange(1, 90) for _ in range(20)]  # a shared system prompt: every conversation matches some
    chats = [
        conversation(target, drafter, system + [rng.randrange(1, 90) for _ in range(rng.randrange(2, 9))], params, 3, i)
        for i in range(10)
    ]
    requests = [chat[turn] for turn in range(3) for chat in rng.sample(chats, len(chats))]
    sizing = PrefixStore(2**30)
    run_batch(target, drafter, requests[:4], params, 3, reuse=True, store=sizing)
    store = PrefixStore(int(1.5 * max(stored.nbytes for stored in sizing.entries)))  # one or two prefixes at most
    got, cached = run_batch(target, drafter, requests, params, 3, reuse=True, store=store, join_every=1)
    assert got == run_batch(target, drafter, requests, params, 3, reuse=False, join_every=1)[0]
    assert store.used <= store.limit and store.used == sum(stored.nbytes for stored in store.entries)
    assert sum(c > 0 for c in cached) > len(requests) // 2


def stored_prefix(ids: list[int], nbytes: int) -> Stored:
    """A stored prefix of `ids` whose tensors take `nbytes` (K/V rows of one float32 layer)."""
    return Stored(Held(list(ids)), [torch.zeros(nbytes // 4)], [], [], None)


store_operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=5), st.integers(1, 12)),
        st.tuples(st.just("take"), st.lists(st.integers(0, 3), min_size=1, max_size=5), st.integers(0, 3)),
        st.tuples(st.just("clear"), st.just([]), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ops=store_operations, limit=st.integers(4, 40))
def test_the_store_keeps_its_invariants_under_any_order_of_operations(ops, limit) -> None:
    """add, take and clear in any order: the bytes add up and stay within the bound, an add drops only the least
    recently used entries it needs room from, and a take returns the best fitting entry and removes it (a taken
    entry is never in the store again, so nothing can evict or take it twice)."""
    store = PrefixStore(limit * 4)
    fits = lambda stored: stored.held.ids[0] != 3  # noqa: E731 (some entries never fit: take skips them)
    taken: dict[int, Stored] = {}  # (held, not only their ids: a freed entry's id may be a new entry's)
    for op, ids, n in ops:
        before = list(store.entries)
        if op == "add":
            new = stored_prefix(ids, n * 4)
            store.add(new)
            if new.nbytes > store.limit:
                assert store.entries == before
            else:
                assert store.entries[-1] is new and before[len(before) - len(store.entries) + 1 :] == store.entries[:-1]
                dropped = before[: len(before) - len(store.entries) + 1]
                assert not dropped or store.used - new.nbytes + dropped[-1].nbytes + new.nbytes > store.limit
        elif op == "take":
            got = store.take(ids, fits, n)
            candidates = [s for s in before if fits(s) and common_prefix(s.held.ids, ids) > n]
            if not candidates:
                assert got is None and store.entries == before
            else:
                best = max(common_prefix(s.held.ids, ids) for s in candidates)
                assert got in before and common_prefix(got.held.ids, ids) == best and fits(got)
                assert store.entries == [s for s in before if s is not got] and id(got) not in taken
                taken[id(got)] = got
        else:
            store.clear()
            assert store.entries == []
        assert store.used == sum(s.nbytes for s in store.entries) <= store.limit
        assert len({id(s) for s in store.entries}) == len(store.entries)
        assert not taken.keys() & {id(s) for s in store.entries}


def test_placements_and_evictions_from_several_threads_never_share_an_entry() -> None:
    """One store, four threads adding and taking at once: each entry is taken by one of them at most, and the
    store's bytes add up at the end. (Threads switch every microsecond here: without the store's lock, two of
    five runs took an entry twice or lost count of its bytes.)"""
    import sys
    import threading

    store = PrefixStore(64 * 4)
    took: list[list[Stored]] = [[] for _ in range(4)]

    def work(worker: int) -> None:
        rng = random.Random(worker)
        for _ in range(2000):
            if rng.random() < 0.5:
                store.add(stored_prefix([rng.randrange(4), rng.randrange(4)], 4 * rng.randrange(1, 16)))
            elif (stored := store.take([rng.randrange(4), rng.randrange(4)], lambda s: True)) is not None:
                took[worker].append(stored)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    every = [id(stored) for taken in took for stored in taken]
    assert len(every) == len(set(every)) > 100
    assert not set(every) & {id(s) for s in store.entries}
    assert store.used == sum(s.nbytes for s in store.entries) <= store.limit
