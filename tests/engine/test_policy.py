"""The block-size policy: the rule, its probing bound, the cost cache, and losslessness while sizes switch."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_cli.cpu_load import measured_now
from dflash_cli.engine import SamplingParams, collect, generate
from dflash_cli.engine import policy as policy_module
from dflash_cli.engine.policy import (
    AdaptiveBlock,
    FixedBlock,
    StepCosts,
    adaptive_policy,
    cost_key,
    expected_tokens,
    own_block,
    sizes_up_to,
)
from dflash_cli.engine.target.base import capture_target_features
from helpers.drafters import FORMATS, OracleDrafter, random_drafter
from helpers.sampling import chi2_p_value, exact_marginals
from helpers.tiny_models import hf_greedy, sharp_tiny


class Schedule(FixedBlock):
    """A test policy: step i verifies sizes[i % len(sizes)] tokens (capped by the limit); records what it saw."""

    def __init__(self, sizes: Sequence[int]) -> None:
        super().__init__(max(sizes))
        self.sizes, self.chosen, self.accepted = list(sizes), [], []

    def choose(self, limit: int, rows: int = 1) -> int:
        size = min(self.sizes[len(self.chosen) % len(self.sizes)], limit)
        self.chosen.append(size)
        return size

    def observe(self, size: int, accepted, draft_s: float, verify_s: float, rows: int | None = None) -> None:
        self.accepted.append(accepted)

    def padded(self, size: int) -> int:
        return size


def _greedy(target, drafter, prompt, n, policy):
    return collect(generate(target, drafter, prompt, SamplingParams(max_new_tokens=n), policy=policy))


# --- losslessness while the size switches -------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    schedule=st.lists(st.sampled_from([1, 1, 2, 4, 8]), min_size=1, max_size=6),
    prompt=st.lists(st.integers(1, 94), min_size=1, max_size=20),
    max_new=st.integers(1, 40),
    fmt=st.sampled_from(FORMATS),
    window=st.integers(1, 12),
)
def test_greedy_is_the_targets_own_whatever_the_schedule(seed, schedule, prompt, max_new, fmt, window):
    target = sharp_tiny("qwen3", seed % 50, 3)
    drafter = random_drafter(target, seed=seed, num_layers=2, block_size=8, fmt=fmt, window=window)
    policy = Schedule(schedule)
    result = _greedy(target, drafter, prompt, max_new, policy)
    assert result.token_ids == hf_greedy(target, prompt, max_new)
    assert result.stats.block_sizes == policy.chosen[: len(result.stats.block_sizes)]
    assert all(1 <= a <= size for a, size in zip(result.acceptance_lengths, result.stats.block_sizes))


@pytest.mark.parametrize("schedule", [[1, 1, 1, 8], [8, 1, 4, 1, 1, 2], [2, 1]])
def test_a_good_drafter_accepts_across_plain_steps(schedule):
    """An oracle drafter is right for 3 slots a block: long accepts, rollbacks and plain steps in one answer."""
    target = sharp_tiny("qwen3", 7, 3)
    prompt = [5, 17, 42, 8, 9]
    reference = hf_greedy(target, prompt, 60)
    drafter = OracleDrafter(target, prompt + reference, block_size=8, correct=3)
    result = _greedy(target, drafter, prompt, 60, Schedule(schedule))
    assert result.token_ids == reference
    drafted = [a for a, size in zip(result.acceptance_lengths, result.stats.block_sizes) if size > 1]
    assert max(drafted) == min(4, max(schedule))


@pytest.mark.parametrize("fmt", FORMATS)
def test_after_plain_steps_the_drafter_reads_the_whole_committed_context(fmt):
    """Each draft equals the one a fresh drafter cache makes from the features of every committed position (one
    target forward over them): the plain steps' features reach the drafter, none twice, none lost."""
    target = sharp_tiny("qwen3", 3, 3)
    drafter = random_drafter(target, seed=5, num_layers=2, block_size=8, fmt=fmt, window=3)
    layer_ids = list(drafter.config.target_layer_ids)
    prompt = [3, 14, 15, 92, 65, 35]
    committed: list[int] = list(prompt)
    checked = []
    draft = type(drafter).draft_hidden  # every format drafts through it

    def checked_draft(self, features, block_ids, starts, cache, **rows):
        out = draft(self, features, block_ids, starts, cache, **rows)
        (start,) = starts
        ids = torch.tensor([committed[:start]])
        _, all_features = capture_target_features(target, ids, layer_ids)
        fresh = draft(self, [all_features], block_ids, starts, self.new_cache(start + 8, 8))
        torch.testing.assert_close(out, fresh, rtol=1e-4, atol=1e-4)
        checked.append(start)
        return out

    drafter.draft_hidden = checked_draft.__get__(drafter)
    steps = generate(
        target, drafter, prompt, SamplingParams(max_new_tokens=40), policy=Schedule([1, 1, 4, 1, 8, 2, 1, 1, 1, 4])
    )
    for step in steps:
        committed.extend(step.token_ids)
    assert len(checked) >= 5


# --- sampling stays exact while the size switches ----------------------------------------------------------


@pytest.mark.slow
def test_sampling_is_exact_with_a_switching_schedule():
    """The 2nd and 3rd tokens' distributions (chi-square against exact marginals) with a plain step, then a
    drafted one that reads both steps' context; alpha = 0.001 per check."""
    config = Qwen3Config(
        vocab_size=6,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(11)
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(12)
    prompt, temperature = [1, 4, 2], 0.8
    p2, p3 = exact_marginals(target, prompt, temperature)
    drafter = OracleDrafter(target, prompt + hf_greedy(target, prompt, 4), block_size=4)
    runs, counts, drafted_accepts = 1200, torch.zeros(2, 6), 0
    for i in range(runs):
        policy = Schedule([1, 4] if i % 2 else [4, 1])
        params = SamplingParams(max_new_tokens=4, temperature=temperature, seed=i)
        result = collect(generate(target, drafter, prompt, params, policy=policy))
        counts[0, result.token_ids[1]] += 1
        counts[1, result.token_ids[2]] += 1
        drafted_accepts += any(a > 1 for a in result.acceptance_lengths)
    assert drafted_accepts > runs // 10, "the accept path must be exercised for this test to mean anything"
    assert chi2_p_value(counts[0], p2) > 1e-3
    assert chi2_p_value(counts[1], p3) > 1e-3


@pytest.mark.parametrize("fmt", ["classic", "dflash2"])
def test_a_seed_gives_the_same_tokens_whatever_the_block_sizes(fmt):
    """One uniform per position: a seeded answer does not depend on the schedule, nor on drafting at all."""
    target = sharp_tiny("qwen3", 5, 3)
    drafter = random_drafter(target, seed=3, num_layers=1, block_size=8, fmt=fmt)
    prompt = [7, 3, 19, 4]
    params = SamplingParams(max_new_tokens=40, temperature=0.7, top_p=0.95, seed=42)
    baseline = collect(generate(target, None, prompt, params)).token_ids
    for schedule in ([8], [1], [2, 1, 4], [1, 1, 8, 4]):
        assert collect(generate(target, drafter, prompt, params, policy=Schedule(schedule))).token_ids == baseline
    prompt_plus = prompt + baseline[:20]  # the oracle drafts the sampled answer: long accepts at T > 0
    oracle = OracleDrafter(target, prompt_plus + baseline[20:], block_size=8)
    drafted = collect(generate(target, oracle, prompt, params, policy=Schedule([8, 1])))
    assert drafted.token_ids == baseline and max(drafted.acceptance_lengths) > 1
    other = dataclasses.replace(params, seed=43)
    assert collect(generate(target, None, prompt, other)).token_ids != baseline


# --- the real policy -------------------------------------------------------------------------------------------


def _costs(verify: dict[int, float], draft: float, max_size: int = 8) -> StepCosts:
    costs = StepCosts({"test": id(verify)}, sizes_up_to(max_size))
    costs.verify_s = dict(verify)
    costs.draft_s = {size: (draft if size > 1 else 0.0) for size in verify}
    return costs


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 1) == 1
    assert expected_tokens([0.5, 0.5, 0.5], 2) == 1.5
    assert expected_tokens([0.5, 0.5, 0.5], 4) == pytest.approx(1.875)
    assert expected_tokens([1.0] * 15, 16) == 16


def test_the_rule_picks_the_fastest_size():
    cheap = _costs({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2}, draft=0.1)  # a GPU: wide verifies nearly free
    dear = _costs({1: 1.0, 2: 1.63, 4: 1.71, 8: 1.95}, draft=0.5)  # this CPU in fp32
    good, poor = AdaptiveBlock(cheap), AdaptiveBlock(dear)
    for policy in (good, poor):
        policy.successes = [20.0] * 7  # drafts almost always stand
    assert good.choose(16) == 8 and good.choose(5) == 4 and good.choose(1) == 1
    assert poor.choose(8) == 8  # at ~0.9 acceptance even this CPU drafts
    poor.successes, poor.failures = [0.0] * 7, [20.0] * 7
    assert poor.choose(8) == 1


def test_a_batch_step_costs_what_one_row_of_as_many_tokens_costs():
    """On a CPU a block of 2 is nearly free beside a plain step for one row, not for 4 rows (their products run 8
    rows: about one row's block of 8). The demo under load: one row 34.3 / 35.8 ms for blocks of 1 / 2, four rows
    44.4 / 85.0 ms, where the one-row costs had the batch draft at tau 1.4 and lose to plain steps."""
    costs = _costs({1: 1.0, 2: 1.04, 4: 1.15, 8: 2.6}, draft=0.05)
    policy = AdaptiveBlock(costs)
    policy.successes, policy.failures = [2.0] * 7, [3.0] * 7  # about 0.45 of first drafts stand
    assert costs.cost(2, rows=4) == pytest.approx(2.6 + 0.05) and costs.cost(1, rows=4) == 1.15
    assert costs.cost(8, rows=4) == pytest.approx(2.6 + 24 * 1.45 / 4 + 0.05 + 24 * 0.0)  # past 8: extrapolated
    assert policy.choose(8) > 1  # one row: drafting pays
    assert policy.choose(8, rows=4) == 1  # four rows: it does not
    for _ in range(50):  # a batch's plain steps at its own cost leave the load where it was
        policy.observe(1, [0, 0, 0, 0], 0.0, costs.cost(1, rows=4))
    assert costs.load == pytest.approx(1.0)


def test_probes_are_bounded_and_find_a_drafter_that_improves():
    """A drafter whose first draft never stands: plain steps, with probes costing at most ~PROBE_SHARE; when
    its drafts start to stand, the policy finds out and drafts."""
    costs = _costs({1: 1.0, 2: 1.6, 4: 1.7, 8: 1.9}, draft=0.4)
    policy = AdaptiveBlock(costs)
    spent = plain = 0.0
    for _ in range(2000):
        size = policy.choose(8)
        spent += costs.cost(size)
        plain += costs.cost(1)  # a probe commits one token here, as a plain step does
        policy.observe(size, 0, costs.draft_s[size], costs.verify_s[size])
    assert spent / plain - 1 <= policy_module.PROBE_SHARE * 1.25
    for _ in range(300):  # now every draft stands
        size = policy.choose(8)
        policy.observe(size, size - 1, costs.draft_s[size], costs.verify_s[size])
    assert policy.choose(8) == 8


def _decode(
    costs: StepCosts, real: dict[int, float], *, draft: float, stands: float, steps: int, seed: int
) -> tuple[float, int]:
    """`steps` steps in answers of 128, a fresh policy each, where a step of each size really takes `real[size]`
    (`draft` of it drafting) and each draft stands with chance `stands`: the time spent and the tokens committed
    over the second half."""
    import random

    draws, spent, tokens, policy = random.Random(seed), 0.0, 0, AdaptiveBlock(costs)
    for step in range(steps):
        if step % 128 == 0:
            policy = AdaptiveBlock(costs)
        size = policy.choose(8)
        accepted = 0
        while accepted < size - 1 and draws.random() < stands:
            accepted += 1
        drafting = draft if size > 1 else 0.0
        policy.observe(size, accepted, drafting, real[size] - drafting)
        if step >= steps // 2:
            spent, tokens = spent + real[size], tokens + 1 + accepted
    return spent, tokens


def test_the_policy_learns_what_the_loops_steps_cost_and_stops_drafting_at_a_loss():
    """The calibration says a block of 2 costs 1.3 plain steps and 45% of first drafts stand (1.45 tokens: it
    pays), but the loop's steps of 2 cost 1.8 and of 4 cost 2.3 (the demo on this CPU): the policy learns their
    own factors and decodes about as fast as plain steps (with one load factor for every size it took 1.28 plain
    steps' time a token)."""
    costs = _costs({1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4}, draft=0.25)
    costs.successes, costs.failures = [45.0] * 7, [55.0] * 7
    real = {1: 1.0, 2: 1.8, 4: 2.3, 8: 3.3}
    spent, tokens = _decode(costs, real, draft=0.25, stands=0.45, steps=3000, seed=46)
    assert costs.cost(2) > 1.45 * costs.cost(1)  # learned far enough: drafting 2 no longer pays
    assert spent / tokens <= real[1] * 1.02  # about plain's time per token (probes and a few bets)


def test_a_busy_spell_while_drafting_does_not_keep_the_policy_drafting() -> None:
    """Drafting throughout while the machine is 3x slower for a while, then the drafts stop standing: the load
    follows the machine on drafting steps too, so the policy decodes afterwards as it does without the spell
    (with the load moved by plain steps alone, plain steps stayed priced at 3x: it drafted blocks of 8 on at 2.4
    plain steps' time a token, against 1.08)."""
    import random

    def time_per_token(busy: float) -> float:
        costs = _costs({1: 1.0, 2: 1.1, 4: 1.5, 8: 2.4}, draft=0.4)
        real = {size: costs.cost(size) for size in costs.sizes}
        draws, policy, spent, tokens = random.Random(45), AdaptiveBlock(costs), 0.0, 0
        for step in range(2400):
            if step % 128 == 0:
                policy = AdaptiveBlock(costs)
            slower, stands = (busy if 200 <= step < 500 else 1.0), (0.9 if step < 600 else 0.15)
            size = policy.choose(8)
            accepted = 0
            while accepted < size - 1 and draws.random() < stands:
                accepted += 1
            draft = costs.draft_s.get(size, 0.0) * slower
            policy.observe(size, accepted, draft, real[size] * slower - draft)
            if step >= 1400:
                spent, tokens = spent + real[size], tokens + 1 + accepted
        return spent / tokens

    assert time_per_token(3.0) <= time_per_token(1.0) * 1.02


@pytest.mark.parametrize("factor", [0.74, 0.4])
def test_a_factor_learned_too_low_is_found_out_by_plain_steps_now_and_then(factor: float) -> None:
    """A saved factor says blocks of 2 cost 0.74 of their calibration (learned in a busy spell), so a block of 2
    looks like 1.1 plain steps for 1.4 tokens and every step drafts; really it costs 1.65 (the demo on this CPU,
    2026-11-29: 2x91 steps, 0.84x plain). Drafting with no plain step, nothing measured the plain load the factors
    are learned against, and it drafted on at 1.18 plain steps' time a token: near break-even, a few plain steps
    now and then keep measuring it; so do they where only the factor makes drafting win, by any margin (0.4)."""
    costs = _costs({1: 1.0, 2: 1.19, 4: 1.57, 8: 2.57}, draft=0.33)  # (the calibration's 1.52 / 1.9 / 2.9)
    costs.factors = {(2, 1): factor}
    costs.successes, costs.failures = [44.0] * 7, [56.0] * 7
    real = {1: 1.0, 2: 1.65, 4: 2.0, 8: 3.0}
    spent, tokens = _decode(costs, real, draft=0.33, stands=0.4, steps=2560, seed=47)
    assert spent / tokens <= real[1] * 1.03, spent / tokens


def test_drafting_that_clearly_pays_takes_no_plain_steps() -> None:
    """A GPU drafting blocks of 16 at tau 6: a plain step now and then would cost about 4% of its speed, and no
    factor could turn that decision, so none is taken."""
    costs = _costs({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2}, draft=0.2, max_size=16)
    costs.successes, costs.failures = [90.0] * 15, [10.0] * 15
    policy = AdaptiveBlock(costs)
    sizes = []
    for _ in range(500):
        sizes.append(policy.choose(16))
        policy.observe(sizes[-1], 5, 0.2, costs.verify_s[sizes[-1]])
    assert 1 not in sizes


def test_a_fresh_process_does_not_probe_a_drafter_that_does_not_pay_when_a_first_step_is_dear() -> None:
    """A shape's first step in a process also loads its code (the demo: about 130 ms, 40 plain steps: a quarter of
    a one-shot 128-token answer, which probed once and decoded at 0.8x plain): learned from that step and kept,
    it is counted in a first probe's loss, so a short-lived process does not probe; once warm, probes go on."""
    costs = _costs({1: 1.0, 2: 1.3, 4: 1.7, 8: 2.6}, draft=0.32)
    costs.successes, costs.failures = [25.0] * 7, [75.0] * 7
    policy = AdaptiveBlock(costs)
    policy.probing, policy.last_shape = True, (1, 1)
    policy.observe(2, 0, costs.draft_s[2] + 40.0, costs.verify_s[2])  # a probe's first step, 40 plain steps dear
    step = costs.cost(2)  # (one first step moves the estimate at most to COLD_BOUND times the step's cost)
    assert costs.cold_s == pytest.approx(policy_module.COLD_RATE * policy_module.COLD_BOUND * step)
    assert costs.probe_extra_s == 0.0 and costs.warm == {(2, 1)}
    costs.cold_s, costs.banked = 40.0, 0.0
    costs.save()
    again = StepCosts(costs.key, costs.sizes)  # (the next process: kept, and nothing warm)
    assert again.cold_s == 40.0 and not again.warm
    costs.warm.clear()
    assert _answers(costs, 3, warm=False)[0] == []  # three one-shot answers' worth of plain steps: no probe
    assert _answers(costs, 3)[0]  # warm: probing goes on


def _answers(costs: StepCosts, count: int, accepted_every: int = 0, outlier_probe: int = -1, warm: bool = True):
    """`count` answers of 128 steps, each a fresh policy over `costs`, where a probe also reads the context of the
    plain steps before it, its prompt's 30 rows included, a tenth of a plain step a row (`outlier_probe`: that probe
    reads 4,000 rows more); every `accepted_every`-th probe's first draft stands. Returns the steps the probes ran
    at, the seconds spent and the seconds plain steps would have taken for the same tokens. `warm`: every drafting
    shape has run in this process (as after a calibration), else each one's first step is cold."""
    if warm:
        costs.warm |= {(size, 1) for size in costs.sizes if size > 1}
    probes: list[int] = []
    spent = plain = 0.0
    for answer in range(count):
        policy, unread = AdaptiveBlock(costs), 30
        for step in range(128):
            size = policy.choose(8)
            draft = costs.draft_s[size] + (0.1 * unread if size > 1 else 0.0)
            if size > 1 and len(probes) == outlier_probe:
                draft += 400.0
            unread = 0 if size > 1 else unread + 1
            accepted = int(size > 1 and accepted_every > 0 and len(probes) % accepted_every == 0)
            if size > 1:
                probes.append(answer * 128 + step)
            spent += draft + costs.verify_s[size]
            plain += costs.cost(1) * (1 + accepted)  # the plain steps its tokens would have taken
            policy.observe(size, accepted, draft, costs.verify_s[size])
    return probes, spent, plain


def test_probes_stay_bounded_over_many_short_generations():
    """Every answer a fresh policy over the pair's costs (this CPU's demo: a block of 2 costs 1.62 plain steps, a
    quarter of first drafts stand), and a probe also reads the context of the plain steps before it: probes still
    cost about PROBE_SHARE of plain decoding in all. (With the allowance kept per answer, each 128-token answer paid
    one probe after about 75 plain steps, and with it 10 plain steps of context: 8% of plain decoding.)"""
    probes, spent, plain = _answers(_costs({1: 1.0, 2: 1.3, 4: 1.7, 8: 2.6}, draft=0.32), 200, accepted_every=4)
    assert len(probes) >= 3  # it keeps looking
    assert spent / plain - 1 <= policy_module.PROBE_SHARE * 1.25


def test_a_probe_over_a_far_longer_context_does_not_stop_the_probing():
    """One probe that reads 4,000 rows of context (400 plain steps' time) leaves a debt of at most one expected
    loss and moves the learned extra cost at most twice as far as a usual probe: the probes come when they would
    have without it (a debt of 400 steps' time stopped them for 80,000 steps)."""
    usual, _, _ = _answers(_costs({1: 1.0, 2: 1.3, 4: 1.7, 8: 2.6}, draft=0.32), 100)
    with_outlier, _, _ = _answers(_costs({1: 1.0, 2: 1.3, 4: 1.7, 8: 2.6}, draft=0.32), 100, outlier_probe=4)
    assert len(usual) >= 8 and with_outlier == usual


def test_an_adaptive_policy_that_never_drafts_needs_no_costs():
    costs = StepCosts({"test": "block 1"}, sizes_up_to(1))
    policy = AdaptiveBlock(costs)
    assert policy.choose(1) == 1
    policy.observe(1, 0, 0.0, 0.01)  # (no calibrated cost to bank against: nothing to do)
    assert costs.banked == 0.0


def test_probes_happen_while_plain(monkeypatch):
    costs = _costs({1: 1.0, 2: 1.6, 4: 1.7, 8: 1.9}, draft=0.4)
    policy = AdaptiveBlock(costs)
    sizes = []
    for _ in range(1500):
        size = policy.choose(8)
        sizes.append(size)
        policy.observe(size, 0, costs.draft_s[size], costs.verify_s[size])
    probes = [i for i, size in enumerate(sizes) if size > 1]
    assert sizes.count(1) > 1450 and len(probes) >= 3  # mostly plain, yet it keeps looking
    assert all(b - a >= 5 for a, b in zip(probes, probes[1:]))


def test_only_steps_in_a_run_of_their_shape_are_timed():
    """A step right after another size's costs more (demo, this CPU: a plain step 6.5-6.9 ms after a drafting step,
    5.45 in a run); it would price the sizes the policy switches between too dearly: such steps are not timed."""
    costs = _costs({1: 1.0, 2: 1.6, 4: 1.7, 8: 1.9}, draft=0.4)
    policy = AdaptiveBlock(costs)
    for size in [1, 2] * 20:  # every step a switch, each 30% dearer than in a run
        policy.observe(size, 0, costs.draft_s[size], costs.verify_s[size] * 1.3)
    assert costs.load == 1.0 and costs.factors == {}
    for _ in range(3):
        policy.observe(1, 0, 0.0, 1.3)
    assert costs.load > 1.0  # (the second and third plain steps in a row are timed)


def test_load_scales_every_size_alike():
    costs = _costs({1: 1.0, 2: 1.6, 4: 1.7, 8: 1.9}, draft=0.4)
    for _ in range(100):
        costs.observe_time(1, 2.0)  # twice as slow as calibrated (another process woke up)
    assert costs.load == pytest.approx(2.0, rel=0.01)
    assert costs.cost(8) / costs.cost(1) == pytest.approx(2.3)


def test_costs_and_history_are_cached_per_key(block_costs_cache):
    key = {"host": "h", "target": "t", "dtype": "float32", "threads": 1}
    costs = StepCosts(key, (1, 2, 4))
    assert not costs.calibrated
    costs.verify_s, costs.draft_s = {1: 0.01, 2: 0.02, 4: 0.03}, {1: 0.0, 2: 0.005, 4: 0.006}
    costs.measured_at, costs.others_busy = "2020-01-01T00:00:00Z", 0.0  # (calibrate's, long ago)
    costs.save()
    assert not StepCosts(key, (1, 2, 4)).calibrated  # stale: calibrated again
    costs.measured_at, costs.others_busy = measured_now(), 1.2  # calibrated while another process kept a core busy
    costs.save()
    assert not StepCosts(key, (1, 2, 4)).calibrated  # not kept
    assert "busy" in StepCosts(key, (1, 2, 4)).stale  # (the start says why it measures again)
    assert StepCosts({**key, "threads": 3}, (1, 2, 4)).stale is None  # never measured: the first time
    costs.others_busy = 0.1
    costs.observe_acceptance(4, 1)
    costs.factors = {(4, 1): 1.5, (2, 3): 0.9}  # (what the loop's steps cost beside the calibration)
    costs.save()
    again = StepCosts(key, (1, 2, 4))
    assert again.calibrated and again.cost(4) == pytest.approx(0.036 * 1.5) and again.factors == costs.factors
    assert again.successes[0] == pytest.approx(1) and again.failures[1] == pytest.approx(1)
    assert not StepCosts({**key, "threads": 2}, (1, 2, 4)).calibrated  # another key: measured anew
    kept = json.loads(again.path.read_text())
    again.path.write_text(json.dumps({**kept, "measured_at": "2020-01-01T00:00:00Z"}))  # kept, then aged
    aged = StepCosts(key, (1, 2, 4))
    assert not aged.calibrated and aged.stale == "the last ones are from 2020-01-01"
    again.path.write_text("{not json")
    assert not StepCosts(key, (1, 2, 4)).calibrated  # a broken file is ignored (and rewritten later)
    again.path.write_text(json.dumps({"schema": policy_module.COSTS_SCHEMA, "key": key, "draft_s": 3}))
    assert not StepCosts(key, (1, 2, 4)).calibrated


def test_a_quantized_target_gets_its_own_step_costs() -> None:
    """int4 weights keep the target's config and activation dtype, but not its step costs."""
    from dflash_cli.engine.kernels.quantized import quantize_target

    target = AutoModelForCausalLM.from_config(
        Qwen3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
        )
    ).eval()
    drafter = random_drafter(target, seed=0, num_layers=1, block_size=4)
    plain = cost_key(target, drafter, compile=False)
    quantize_target(target, "int4", torch.float32)
    quantized = cost_key(target, drafter, compile=False)
    assert plain["dtype"] == quantized["dtype"] and plain["target_config"] == quantized["target_config"]
    assert plain["weights"] == ["Parameter"] and quantized["weights"] == ["Int4Linear", "Int8Linear"]


def test_the_real_policy_calibrates_once_and_stays_lossless(block_costs_cache):
    target = sharp_tiny("qwen3", 9, 3)
    prompt = [5, 17, 42, 8, 9]
    reference = hf_greedy(target, prompt, 50)
    oracle = OracleDrafter(target, prompt + reference, block_size=8, correct=[7, 7, 2, 7])
    noise = random_drafter(target, seed=1, block_size=8)
    for drafter in (oracle, noise):
        policy = adaptive_policy(target, drafter, 8)
        result = _greedy(target, drafter, prompt, 50, policy)
        assert result.token_ids == reference
        assert policy.costs.calibrated and policy.costs.path.exists()
        assert result.stats.adaptive and set(result.stats.block_sizes) <= set(sizes_up_to(8))
        second = adaptive_policy(target, drafter, 8)
        assert second.costs is policy.costs  # shared by the process's generations
    assert json.loads(policy.costs.path.read_text())["verify_s"].keys() == {"1", "2", "4", "8"}


def test_sizes_up_to():
    assert sizes_up_to(16) == (1, 2, 4, 8, 16)
    assert sizes_up_to(10) == (1, 2, 4, 8, 10)
    assert sizes_up_to(3) == (1, 2, 3)
    assert sizes_up_to(1) == (1,)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_calibration_blocks_are_strided_as_the_loops(size: int) -> None:
    """A compiled step guards on its input's strides: a calibration block strided otherwise than the loop's would
    make the loop's first step of that size compile again (minutes on a CPU)."""
    block = torch.zeros(1, 8, dtype=torch.long)
    assert own_block(block, size).stride() == torch.full((1, size), 0).stride()
