"""The decode loop: conformance with the reference, losslessness, exact sampling, stopping, stats."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_cli import load_drafter, speculative_generate
from dflash_cli.engine import SamplingParams, generate, sample_tokens
from dflash_cli.engine.drafter import DrafterConfig, default_target_layer_ids
from dflash_cli.errors import DflashError
from helpers.drafters import FORMATS, OracleDrafter, random_drafter, save_random_drafter
from helpers.sampling import chi2_p_value, exact_marginals
from helpers.tiny_models import hf_greedy, make_tiny_qwen3, sharp_tiny, tiny_tokenizer

# A copy of shared/conformance/qwen3-tiny (golden data from z-lab's reference, dflash==0.1.0).
GOLDEN_DIR = Path(__file__).parents[1] / "fixtures" / "qwen3-tiny"


@pytest.fixture(scope="module")
def golden():
    return json.loads((GOLDEN_DIR / "golden.json").read_text())


@pytest.fixture(scope="module")
def conformance_pair():
    target = AutoModelForCausalLM.from_pretrained(GOLDEN_DIR / "target", dtype=torch.float32).eval()
    return target, load_drafter(GOLDEN_DIR / "drafter", target)


# --- a. conformance with the reference implementation -------------------------------------------


def test_conformance_tokens_and_acceptance_lengths(golden, conformance_pair):
    target, drafter = conformance_pair
    for case in golden["cases"]:
        result = speculative_generate(target, drafter, case["prompt_ids"], golden["max_new_tokens"])
        assert result.token_ids == case["new_token_ids"]
        assert result.acceptance_lengths == case["acceptance_lengths"]
        assert sum(result.acceptance_lengths) == golden["max_new_tokens"] - 1


def test_conformance_draft_logits(golden, conformance_pair):
    from safetensors.torch import load_file

    target, drafter = conformance_pair
    data = load_file(str(GOLDEN_DIR / "golden_logits.safetensors"))
    cache = drafter.new_cache()
    tol = golden["logits_fixture"]["tolerance_abs"]
    for step, cache_before in (("step0", 0), ("step1", 14)):
        assert cache.length == cache_before
        block = data[f"{step}.block_ids"]
        with torch.no_grad():
            context = drafter.fuse_context(data[f"{step}.context_features"])
            rows = torch.cat([context, drafter.embed(block).to(context.dtype)], dim=1)
            hidden = drafter(rows, block.shape[1], data[f"{step}.position_ids"], cache)
            logits = drafter.logits(hidden[:, 1:])
        assert torch.allclose(hidden[:, 1:], data[f"{step}.draft_final_hidden"], atol=tol, rtol=0)
        assert (logits - data[f"{step}.draft_logits"]).abs().max().item() <= tol
        assert logits.argmax(-1)[0].tolist() == golden["logits_fixture"][step]["draft_token_ids"]


def test_conformance_baseline_is_plain_greedy(golden, conformance_pair):
    target, _ = conformance_pair
    for case in golden["cases"][:3]:
        result = speculative_generate(target, None, case["prompt_ids"], golden["max_new_tokens"])
        assert result.token_ids == case["greedy_new_token_ids"]
        assert result.acceptance_lengths == [1] * (golden["max_new_tokens"] - 1)  # block of 1 per step
        assert result.stats.tau == 1.0


# --- b. property: speculative greedy == transformers greedy --------------------------------------


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(["qwen3", "llama"]),
    seed=st.integers(0, 10_000),
    layers=st.integers(2, 4),
    draft_layers=st.integers(1, 2),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    prompt=st.lists(st.integers(1, 94), min_size=1, max_size=20),
    max_new=st.integers(1, 40),
    fmt=st.sampled_from(FORMATS),
    window=st.integers(1, 12),
)
def test_speculative_greedy_equals_transformers_greedy(
    arch, seed, layers, draft_layers, block_size, prompt, max_new, fmt, window
):
    target = sharp_tiny(arch, seed, layers)
    drafter = random_drafter(target, seed=seed, num_layers=draft_layers, block_size=block_size, fmt=fmt, window=window)
    result = speculative_generate(target, drafter, prompt, max_new)
    assert result.token_ids == hf_greedy(target, prompt, max_new)
    assert len(result.token_ids) == max_new and result.finish_reason == "length"
    assert all(1 <= a <= block_size for a in result.acceptance_lengths)
    assert sum(result.acceptance_lengths) == max_new - 1


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_good_drafter_greedy_equals_transformers_greedy(block_size):
    """A drafter that is mostly right exercises long accepts, partial accepts and rollbacks of the cache."""
    target = sharp_tiny("qwen3", 7, 3)
    prompt = [5, 17, 42, 8, 9]
    reference = hf_greedy(target, prompt, 60)
    drafter = OracleDrafter(target, prompt + reference, block_size=block_size, correct=block_size // 2)
    result = speculative_generate(target, drafter, prompt, 60)
    assert result.token_ids == reference
    assert max(result.acceptance_lengths) == block_size // 2 + 1


# --- c. NF4 target (real bitsandbytes on CPU) -----------------------------------------------------


def test_nf4_target_speculative_equals_its_own_greedy(tmp_path):
    from transformers import BitsAndBytesConfig

    path = make_tiny_qwen3(tmp_path / "t", seed=3, with_tokenizer=False, num_hidden_layers=3, vocab_size=128)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=True,
    )
    target = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32).eval()
    assert any(type(m).__name__ == "Linear4bit" for m in target.modules())
    drafter_dir = save_random_drafter(tmp_path / "d", target, num_layers=1, block_size=4, seed=1)
    drafter = load_drafter(drafter_dir, target)
    for prompt in ([3, 14, 15, 92, 65], [1, 2, 3]):
        result = speculative_generate(target, drafter, prompt, 24)
        assert result.token_ids == hf_greedy(target, prompt, 24)


# --- d. sampling is exact --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling_target():
    common = dict(
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
    target = AutoModelForCausalLM.from_config(Qwen3Config(**common), dtype=torch.float32).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(12)
    prompt, temperature = [1, 4, 2], 0.8
    return target, prompt, temperature, exact_marginals(target, prompt, temperature)


# The oracle proposes the most likely continuation: often accepted, so the accept path is exercised. The
# random drafters in the 2026 formats check that their proposals (DFlash2: the selector's greedy chain)
# go through the same one-hot acceptance rule, which keeps sampling exact whatever the proposal (their seeds
# are ones whose first draft the target often samples: about 40% of runs).
@pytest.mark.slow
@pytest.mark.parametrize(("proposer", "seed"), [("oracle", 0), ("baseline", 0), ("swa", 6), ("dflash2", 2)])
def test_speculative_sampling_matches_the_target_distribution(sampling_target, proposer, seed):
    """Chi-square goodness of fit against the exact marginals. With fixed seeds the test is deterministic;
    as a statistical test each check has a false-alarm rate of 0.1% (alpha = 0.001)."""
    target, prompt, temperature, (p2, p3) = sampling_target
    if proposer == "oracle":
        drafter = OracleDrafter(target, prompt + hf_greedy(target, prompt, 3), block_size=4)
    elif proposer == "baseline":  # checks the test itself
        drafter = None
    else:
        drafter = random_drafter(target, seed=seed, num_layers=2, block_size=4, fmt=proposer, window=2)
    runs = 600 if drafter is None else 1200
    counts = torch.zeros(2, 6)
    accepted_multi = 0
    for i in range(runs):
        r = speculative_generate(target, drafter, prompt, 3, temperature=temperature, seed=i)
        counts[0, r.token_ids[1]] += 1
        counts[1, r.token_ids[2]] += 1
        accepted_multi += drafter is not None and r.acceptance_lengths[0] > 1
    if drafter is not None:
        assert accepted_multi > runs // 10, "the accept path must be exercised for this test to mean anything"
    assert chi2_p_value(counts[0], p2) > 1e-3
    assert chi2_p_value(counts[1], p3) > 1e-3


def test_seeded_sampling_is_reproducible():
    target = sharp_tiny("llama", 3, 2)
    drafter = random_drafter(target, block_size=4)
    runs = [
        speculative_generate(target, drafter, [1, 2, 3], 30, temperature=1.0, top_p=0.9, seed=42).token_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    other = speculative_generate(target, drafter, [1, 2, 3], 30, temperature=1.0, top_p=0.9, seed=43).token_ids
    assert other != runs[0]


def test_sample_filters_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_tokens(logits, SamplingParams(temperature=1.0, top_k=2), g).tolist()) == {0, 1}
    # softmax: [.64, .24, .09, .03, .01]; top_p 0.8 keeps the first two (0.64 < 0.8 <= 0.88)
    assert set(sample_tokens(logits, SamplingParams(temperature=1.0, top_p=0.8), g).tolist()) == {0, 1}
    # min_p 0.1: keep p >= 0.064 -> tokens 0, 1, 2
    assert set(sample_tokens(logits, SamplingParams(temperature=1.0, min_p=0.1), g).tolist()) == {0, 1, 2}
    assert set(sample_tokens(logits[:3], SamplingParams(), g).tolist()) == {0}


def test_invalid_sampling_parameters_are_clear_errors():
    with pytest.raises(DflashError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(DflashError, match="temperature"):
        SamplingParams(temperature=-1)


# --- e. stopping, limits, context window ------------------------------------------------------------


@pytest.fixture(scope="module")
def text_pair(tmp_path_factory):
    path = make_tiny_qwen3(tmp_path_factory.mktemp("tq") / "t", seed=5, num_hidden_layers=3)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(6)
    return target, random_drafter(target, block_size=4), tiny_tokenizer()


def test_eos_stops_and_is_included(text_pair):
    target, drafter, _ = text_pair
    free = speculative_generate(target, drafter, [10, 20, 30], 40)
    eos = free.token_ids[6]
    first = free.token_ids.index(eos)
    stopped = speculative_generate(target, drafter, [10, 20, 30], 40, stop_token_ids=[eos])
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    assert sum(stopped.acceptance_lengths) + 1 == len(stopped.token_ids)


def test_stop_string_truncates_text(text_pair):
    target, drafter, tok = text_pair
    prompt = tok.encode("The quick brown fox")
    free = speculative_generate(target, drafter, prompt, 40, tokenizer=tok)
    assert free.text == tok.decode(free.token_ids, skip_special_tokens=True)
    stop = free.text[10:13]
    assert stop.strip(), "pick a visible stop string"
    stopped = speculative_generate(target, drafter, prompt, 40, tokenizer=tok, stop_strings=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(stop)]
    assert stop not in stopped.text


def test_stop_string_cuts_tokens_like_the_baseline(text_pair):
    """A verify step commits several tokens at once; a stop string must still end the ids where
    one-token-at-a-time decoding ends them."""
    target, _, tok = text_pair
    prompt = tok.encode("Hello there")
    reference = hf_greedy(target, prompt, 60)
    oracle = OracleDrafter(target, prompt + reference, block_size=8)
    free = speculative_generate(target, None, prompt, 60, tokenizer=tok)
    for start in (5, 12, 20, 31):
        stop = free.text[start : start + 2]
        runs = [speculative_generate(target, d, prompt, 60, tokenizer=tok, stop_strings=[stop]) for d in (None, oracle)]
        assert runs[0].token_ids == runs[1].token_ids and runs[0].text == runs[1].text
        assert runs[1].finish_reason == "stop" and runs[1].stats.generated_tokens == len(runs[1].token_ids)
        assert max(runs[1].acceptance_lengths, default=1) > 1 or len(runs[1].token_ids) < 3


def test_streamed_text_concatenates_to_the_final_text(text_pair):
    target, drafter, tok = text_pair
    steps = list(generate(target, drafter, tok.encode("Hello"), SamplingParams(max_new_tokens=30), tokenizer=tok))
    assert "".join(s.text for s in steps) == tok.decode(
        [t for s in steps for t in s.token_ids], skip_special_tokens=True
    )
    assert steps[0].acceptance_length is None and all(s.acceptance_length for s in steps[1:])
    assert [s.finish_reason for s in steps[:-1]] == [None] * (len(steps) - 1) and steps[-1].finish_reason == "length"


def test_a_character_cut_by_the_token_limit_is_dropped_not_shown_as_a_replacement() -> None:
    from dflash_cli.engine.text import TextStream

    tok = tiny_tokenizer()
    ids = tok.encode("ok 😀")
    assert len(ids) > len(tok.encode("ok ")) + 1, "the emoji must take several byte tokens"
    stream = TextStream(tok, ())
    shown, _ = stream.push(ids[:-1])  # the emoji's last byte never comes: the limit was reached
    said = shown + stream.flush()
    assert said.rstrip() == "ok" and "\ufffd" in tok.decode(ids[:-1])  # (decoded whole, it ends in U+FFFD)
    whole = TextStream(tok, ())
    assert "".join([whole.push(ids)[0], whole.flush()]) == "ok 😀"


def test_a_raw_stream_keeps_special_tokens_skips_end_ids_and_decodes_a_window_per_push() -> None:
    """The text a tool parser reads while a reply streams (serve, under tools): special tokens kept, end-of-turn
    ids left out, the same text as decoding the whole reply; each push decodes a short window, so a long reply
    costs linear time (it decoded the whole reply at every step before)."""
    from dflash_cli.engine.text import TextStream

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("<tool_call>\n" + '{"name": "f", "arguments": {"x": "' + "word " * 300 + '"}}\n</tool_call>')
    ids = ids + [end]
    decoded: list[int] = []
    decode = tok.decode

    def counting(token_ids, **kwargs):
        decoded.append(len(token_ids))
        return decode(token_ids, **kwargs)

    tok.decode = counting
    stream = TextStream(tok, (), special=True, skip_ids=[end])
    text = "".join(stream.push(ids[i : i + 3])[0] for i in range(0, len(ids), 3)) + stream.flush()
    tok.decode = decode
    assert text == decode(ids[:-1], skip_special_tokens=False) and text.startswith("<tool_call>")
    assert sum(decoded) < 8 * len(ids), (sum(decoded), len(ids))  # whole-reply decodes: ~len(ids)**2 / 6


def test_max_tokens_is_exact(text_pair):
    target, drafter, _ = text_pair
    for n in (1, 2, 5, 17):
        result = speculative_generate(target, drafter, [1, 2], n)
        assert len(result.token_ids) == n and result.finish_reason == "length"


def test_a_stop_token_just_past_max_tokens_ends_by_length(text_pair):
    """A verify commits several tokens at once: an end-of-turn token right after the limit is not one of them."""
    target, _, _ = text_pair
    free = speculative_generate(target, None, [1, 2], 30).token_ids
    stop = free[12]
    limit = free.index(stop)
    oracle = OracleDrafter(target, [1, 2] + free, block_size=8)
    for drafter in (None, oracle):
        result = speculative_generate(target, drafter, [1, 2], limit, stop_token_ids=[stop])
        assert (result.token_ids, result.finish_reason) == (free[:limit], "length")


def test_empty_prompt_is_a_clear_error(text_pair):
    target, drafter, _ = text_pair
    with pytest.raises(DflashError, match="empty"):
        speculative_generate(target, drafter, [], 5)


def test_prompt_at_the_context_limit(tmp_path):
    path = make_tiny_qwen3(tmp_path / "t", seed=1, with_tokenizer=False, max_position_embeddings=32)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    drafter = random_drafter(target, block_size=4)
    with pytest.raises(DflashError, match="context window is 32"):
        speculative_generate(target, drafter, list(range(1, 33)), 5)
    result = speculative_generate(target, drafter, list(range(1, 32)), 5)
    assert len(result.token_ids) == 1 and result.finish_reason == "length"
    result = speculative_generate(target, drafter, list(range(1, 25)), 50)
    assert len(result.token_ids) == 8 and result.token_ids == hf_greedy(target, list(range(1, 25)), 8)


# --- f. multi-token accept path ----------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_oracle_drafter_reaches_tau_equal_to_block_size(block_size):
    target = sharp_tiny("qwen3", 1, 2)
    prompt = [3, 1, 4, 1, 5]
    n = 1 + 5 * block_size
    reference = hf_greedy(target, prompt, n)
    result = speculative_generate(target, OracleDrafter(target, prompt + reference, block_size=block_size), prompt, n)
    assert result.token_ids == reference
    assert result.acceptance_lengths == [block_size] * 5
    assert result.stats.tau == block_size


@pytest.mark.parametrize("correct", [0, 1, 3])
def test_controlled_acceptance(correct):
    target = sharp_tiny("llama", 2, 2)
    prompt = [7, 7, 7]
    reference = hf_greedy(target, prompt, 41)
    drafter = OracleDrafter(target, prompt + reference, block_size=8, correct=correct)
    result = speculative_generate(target, drafter, prompt, 41)
    assert result.token_ids == reference
    assert result.acceptance_lengths == [correct + 1] * (40 // (correct + 1))


# --- stats and config ---------------------------------------------------------------------------------


def test_stats_are_consistent(conformance_pair, golden):
    target, drafter = conformance_pair
    stats = speculative_generate(target, drafter, golden["cases"][2]["prompt_ids"], 48).stats
    assert stats.speculative and stats.block_size == 8 and stats.generated_tokens == 48
    assert sum(k * v for k, v in stats.histogram.items()) == 47
    assert math.isclose(stats.tau, golden["cases"][2]["mean_acceptance_length"], rel_tol=1e-9)
    assert stats.ttft_s > 0 and stats.decode_s > 0 and stats.draft_s > 0 and stats.verify_s > 0
    d = stats.to_dict()
    assert d["tau"] == stats.tau and d["histogram"] == stats.histogram and json.dumps(d)


def test_default_target_layer_ids_match_the_published_drafters():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(30, 1) == [15]


def _config_dict(**changes):
    raw = json.loads((GOLDEN_DIR / "drafter" / "config.json").read_text())
    for key, value in changes.items():
        raw[key] = value
    return raw


def test_drafter_config_variants():
    cfg = DrafterConfig.from_dict(_config_dict())
    assert cfg.block_size == 8 and cfg.mask_token_id == 511 and cfg.target_layer_ids == [1, 4]
    raw = _config_dict(block_size=None)
    raw["dflash_config"]["block_size"] = 16
    del raw["dflash_config"]["target_layer_ids"]
    cfg = DrafterConfig.from_dict(raw)
    assert cfg.block_size == 16 and cfg.target_layer_ids == default_target_layer_ids(6, 2)
    assert DrafterConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    sliding = DrafterConfig.from_dict(
        _config_dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4, use_sliding_window=True)
    )
    assert sliding.layer_types[0] == "sliding_attention" and sliding.sliding_window == 4


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"hidden_act": "swiglu9"}, "hidden_act"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
        ({"block_size": 0}, "block_size"),
        ({"dflash_config": {"target_layer_ids": [1]}}, "mask_token_id"),
        ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": None}, "sliding_window"),
    ],
)
def test_unsupported_drafter_config_names_the_field(changes, field):
    with pytest.raises(DflashError, match=field):
        DrafterConfig.from_dict(_config_dict(**changes))


def test_mismatched_drafter_is_refused(tmp_path):
    target = sharp_tiny("qwen3", 1, 2)
    path = save_random_drafter(tmp_path / "d", target)
    raw = json.loads((path / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [7]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DflashError, match="target layers"):
        load_drafter(path, target)


@pytest.mark.parametrize("limit", [1, 2, 3, 5])
def test_a_stop_token_past_max_tokens_is_not_committed(limit: int) -> None:
    """A block may carry the token after the limit; when that token is a stop token, plain decoding never makes it
    (it stops at the limit, finish "length"), so neither may speculation."""
    target = sharp_tiny("qwen3", 0)
    prompt = [3, 14, 15, 92, 65]
    free = speculative_generate(target, None, prompt, 12).token_ids
    for stop in (free[limit], free[limit - 1]):
        expected = speculative_generate(target, None, prompt, limit, stop_token_ids=(stop,))
        drafter = OracleDrafter(target, prompt + free, block_size=8)
        got = speculative_generate(target, drafter, prompt, limit, stop_token_ids=(stop,))
        assert (got.token_ids, got.finish_reason) == (expected.token_ids, expected.finish_reason)
        assert len(got.token_ids) <= limit
