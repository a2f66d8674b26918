"""The 2026 drafter formats: conformance with the reference on every golden set, the config schemas, the
attention rule (causal, sliding window on absolute positions, bounded cache), DFlash2's convolution and
candidate selector, and the errors for what is not supported."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_cli import load_drafter, speculative_generate
from dflash_cli.engine.drafter import DFlash2Drafter, DFlashDrafter, DrafterConfig, make_drafter
from dflash_cli.engine.drafter.cache import window_mask as _window_mask
from dflash_cli.engine.drafter.layers import GroupedDynamicConv
from dflash_cli.engine.sampling import greedy_tokens
from dflash_cli.errors import DflashError
from dflash_cli.protocol.drafters import DEFAULT_BLOCK_SIZE
from helpers.drafters import random_drafter
from helpers.golden import FIXTURES, GOLDEN_SETS


def _raw(name: str) -> dict:
    return json.loads((FIXTURES / name / "drafter" / "config.json").read_text())


@pytest.fixture(scope="module")
def targets():
    loaded: dict[Path, torch.nn.Module] = {}

    def get(directory: Path):
        directory = directory.resolve()
        if directory not in loaded:
            loaded[directory] = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        return loaded[directory]

    return get


# --- conformance: every case of every golden set, through the public path ------------------------------


def test_every_golden_set_is_checked():
    assert len(GOLDEN_SETS) >= 8, GOLDEN_SETS


@pytest.mark.slow
@pytest.mark.parametrize("name", GOLDEN_SETS)
def test_golden_set_reproduces_exactly(name, targets):
    directory = FIXTURES / name
    golden = json.loads((directory / "golden.json").read_text())
    target = targets(directory / golden["target_dir"])
    drafter = load_drafter(directory / golden["drafter_dir"], target)
    assert golden["cases"]
    for case in golden["cases"]:
        block_size = case.get("block_size")
        result = speculative_generate(
            target, drafter, case["prompt_ids"], golden["max_new_tokens"], block_size=block_size
        )
        assert result.token_ids == case["new_token_ids"], (name, case["prompt_ids"][:4], block_size)
        assert result.acceptance_lengths == case["acceptance_lengths"], (name, case["prompt_ids"][:4], block_size)
        baseline = speculative_generate(target, None, case["prompt_ids"], golden["max_new_tokens"])
        assert baseline.token_ids == case["greedy_new_token_ids"]


def test_the_sliding_fixture_depends_on_causality(targets):
    """The public swa set pins the causal rule: made non-causal, its acceptance lengths change."""
    directory = FIXTURES / "qwen3-tiny-swa"
    golden = json.loads((directory / "golden.json").read_text())
    target = targets(directory / "target")
    drafter = load_drafter(directory / "drafter", target)
    drafter.layers[0].self_attn.causal = False
    changed = sum(
        speculative_generate(target, drafter, c["prompt_ids"], golden["max_new_tokens"]).acceptance_lengths
        != c["acceptance_lengths"]
        for c in golden["cases"]
    )
    assert changed >= 3


# --- config schemas ---------------------------------------------------------------------------------------


def test_legacy_and_nested_schemas_read_the_same_drafter():
    legacy = DrafterConfig.from_dict(_raw("qwen3-tiny"))
    nested = DrafterConfig.from_dict(_raw("qwen3-tiny-swa"))
    assert (legacy.block_size, legacy.mask_token_id, legacy.target_layer_ids) == (8, 511, [1, 4])
    assert (nested.block_size, nested.mask_token_id, nested.target_layer_ids) == (8, 511, [1, 4])
    assert not legacy.nested and nested.nested
    assert (nested.input_embedding_scale, nested.output_multiplier, nested.final_logit_softcapping) == (1.25, 0.9, 8.0)
    assert nested.layer_types == ["sliding_attention", "full_attention"] and nested.sliding_window == 5
    assert [nested.layer_is_causal(i) for i in range(2)] == [True, False]
    assert [nested.layer_window(i) for i in range(2)] == [5, None]
    assert legacy.rope_theta == nested.rope_theta == 1e6


DFLASH_FIELD_VALUES = [
    ("block_size", 4, 6, DEFAULT_BLOCK_SIZE),
    ("target_layer_ids", [0, 5], [2, 3], [1, 3]),  # default: the published formula for 6 target layers, 2 layers
    ("input_embedding_scale", 0.5, 2.0, 1.0),
    ("output_multiplier", 0.7, 3.0, 1.0),
    ("final_logit_softcapping", 12.0, 30.0, None),
    ("mask_token_id", 7, 9, None),
]


@pytest.mark.parametrize(("name", "nested", "top", "default"), DFLASH_FIELD_VALUES)
def test_dflash_fields_read_dflash_config_then_top_level_then_default(name, nested, top, default):
    raw = _raw("qwen3-tiny")
    raw.pop(name, None)
    raw["dflash_config"] = {"mask_token_id": 511, "target_layer_ids": [1, 4]}
    raw["dflash_config"].pop(name, None)

    def read(config):
        return getattr(DrafterConfig.from_dict(config), name)

    with_both = copy.deepcopy(raw)
    with_both["dflash_config"][name] = nested
    with_both[name] = top
    assert read(with_both) == nested
    with_top = copy.deepcopy(raw)
    with_top[name] = top
    assert read(with_top) == top
    if default is None and name == "mask_token_id":  # never assumed
        with pytest.raises(DflashError, match="mask_token_id"):
            read(raw)
    else:
        assert read(raw) == default


@pytest.mark.parametrize("name", ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"])
def test_dflash2_fields_read_dflash_config_then_top_level(name):
    raw = _raw("qwen3-tiny-dflash2")
    value = raw["dflash_config"].pop(name)
    raw[name] = value
    assert getattr(DrafterConfig.from_dict(raw), name) == value
    raw["dflash_config"][name] = value * 2
    assert getattr(DrafterConfig.from_dict(raw), name) == value * 2
    del raw["dflash_config"][name], raw[name]
    with pytest.raises(DflashError, match=name):
        DrafterConfig.from_dict(raw)


def test_top_level_read_as_transformers_reads_it():
    raw = _raw("qwen3-tiny")
    # rope_parameters wins over a top-level rope_theta; either alone is used; neither: transformers' default
    raw["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    raw["rope_theta"] = 1e4
    assert DrafterConfig.from_dict(raw).rope_theta == 5e5
    del raw["rope_parameters"]
    assert DrafterConfig.from_dict(raw).rope_theta == 1e4
    del raw["rope_theta"]
    assert DrafterConfig.from_dict(raw).rope_theta == Qwen3Config().rope_parameters["rope_theta"]
    # scaled RoPE (YaRN) is read, built by transformers, and round-trips
    raw["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    yarn = DrafterConfig.from_dict(raw)
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert DFlashDrafter(yarn)._rope_scale > 1.0
    assert DrafterConfig.from_dict(yarn.to_dict()) == yarn
    del raw["rope_parameters"]
    # no layer_types: sliding from layer max_window_layers on, when use_sliding_window is set
    del raw["layer_types"]
    raw.update(use_sliding_window=True, sliding_window=7, max_window_layers=1)
    cfg = DrafterConfig.from_dict(raw)
    assert cfg.layer_types == ["full_attention", "sliding_attention"] and cfg.sliding_window == 7
    raw["use_sliding_window"] = False
    cfg = DrafterConfig.from_dict(raw)
    assert cfg.layer_types == ["full_attention", "full_attention"] and cfg.sliding_window is None
    # top-level is_causal overrides every layer
    raw["is_causal"] = True
    assert [DrafterConfig.from_dict(raw).layer_is_causal(i) for i in range(2)] == [True, True]


def test_vllm_only_keys_are_ignored_like_the_reference():
    plain = DrafterConfig.from_dict(_raw("qwen3-tiny-swa"))
    raw = _raw("qwen3-tiny-swa")
    raw.update(use_swa=True, swa_window_size=2, attention_sink_bias=True)
    raw["dflash_config"]["causal"] = True
    cfg = DrafterConfig.from_dict(raw)
    for name in ("layer_types", "sliding_window", "is_causal", "block_size"):
        assert getattr(cfg, name) == getattr(plain, name)
    assert cfg.dflash_extra == {"causal": True} and cfg.extra["swa_window_size"] == 2  # kept for the round trip


@pytest.mark.parametrize(
    "name", ["qwen3-tiny", "qwen3-tiny-swa", "qwen3-tiny-dflash2"] + [g for g in GOLDEN_SETS if "extra" in g]
)
def test_configs_round_trip(name):
    raw = _raw(name)
    raw["dflash_config"]["future_field"] = "kept"
    raw["another_future_field"] = [1, 2]
    cfg = DrafterConfig.from_dict(raw)
    again = DrafterConfig.from_dict(cfg.to_dict())
    assert again == cfg
    out = cfg.to_dict()
    assert out["dflash_config"]["future_field"] == "kept" and out["another_future_field"] == [1, 2]
    # each schema keeps its block size where it was
    assert ("block_size" in out["dflash_config"]) == ("block_size" in raw["dflash_config"])


def test_legacy_output_is_unchanged_for_trained_drafters():
    """`dflash train` writes the legacy schema: a drafter config it wrote before the 2026 formats (the first demo
    drafter's, kept in tests/fixtures) and the shipped demo drafter's come back unchanged."""
    root = Path(__file__).parents[2]
    for path in (
        root / "tests" / "fixtures" / "legacy-drafter-config.json",
        root / "dflash_cli" / "assets" / "demo-drafter" / "config.json",
    ):
        raw = json.loads(path.read_text())
        assert DrafterConfig.from_dict(raw).to_dict() == raw


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda c: c.update(architectures=["EagleDraftModel"]), "architectures"),
        (lambda c: c.update(dflash_config=[1]), "dflash_config"),
        (lambda c: c.update(hidden_act="swiglu9"), "hidden_act"),
        (lambda c: c.update(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
        (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
        (lambda c: c["dflash_config"].update(block_size=0), "dflash_config.block_size"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c["dflash_config"].update(output_multiplier="big"), "dflash_config.output_multiplier"),
        (lambda c: c.update(use_sliding_window=False), "sliding_window"),
        (lambda c: c.update(architectures=["DFlash2DraftModel"]), "conv_kernel_size"),
        (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda c: c.update(rope_parameters={"rope_type": "spiral", "rope_theta": 1e6}), "rope_parameters.rope_type"),
        (lambda c: c.update(rms_norm_eps="small"), "rms_norm_eps"),
    ],
)
def test_unsupported_config_is_an_error_naming_the_field(change, field):
    raw = _raw("qwen3-tiny-swa")
    change(raw)
    with pytest.raises(DflashError, match=field.replace(".", r"\.")):
        DrafterConfig.from_dict(raw)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"conv_group_size": 48}, "conv_group_size"),
        ({"selector_top_k": 600}, "selector_top_k"),
        ({"conv_kernel_size": 0}, "conv_kernel_size"),
    ],
)
def test_unsupported_dflash2_sizes_name_the_field(changes, field):
    raw = _raw("qwen3-tiny-dflash2")
    raw["dflash_config"].update(changes)
    with pytest.raises(DflashError, match=field):
        DrafterConfig.from_dict(raw)


def test_dflash2_checkpoints_load_with_or_without_codebook_suffix(tmp_path, targets):
    from safetensors.torch import load_file, save_file

    target = targets(FIXTURES / "qwen3-tiny" / "target")
    shutil.copytree(FIXTURES / "qwen3-tiny-dflash2" / "drafter", tmp_path / "d")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in state  # the published layout: no .weight
    published = load_drafter(tmp_path / "d", target)
    assert isinstance(published, DFlash2Drafter)
    state = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in state.items()}
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    suffixed = load_drafter(tmp_path / "d", target)
    for (name, a), (_, b) in zip(published.state_dict().items(), suffixed.state_dict().items()):
        assert torch.equal(a, b), name
    saved = tmp_path / "saved"
    published.save_pretrained(saved)
    assert set(load_file(str(saved / "model.safetensors"))) == set(
        load_file(str(FIXTURES / "qwen3-tiny-dflash2" / "drafter" / "model.safetensors"))
    )


# --- the attention rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3, 9])
def test_window_mask_is_the_rule_on_absolute_positions(causal, window):
    past_rows, ctx, q = 4, 3, 5
    keys = list(range(10, 10 + past_rows + ctx + q))
    queries = keys[-q:]
    mask = _window_mask(torch.tensor([queries]), torch.tensor([keys]), causal, window)[0, 0]
    for i, qp in enumerate(queries):
        for j, kp in enumerate(keys):
            expected = (not causal or kp <= qp) and (
                window is None or (qp - kp < window and (causal or kp - qp < window))
            )
            assert bool(mask[i, j]) == expected, (qp, kp)


def _tiny_target(layers: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _block_hidden(drafter: DFlashDrafter, features: torch.Tensor, block: torch.Tensor, start: int) -> torch.Tensor:
    """All block slots' hidden (slot 0 included), one call, no cache."""
    positions = torch.arange(start - features.shape[1], start + block.shape[1])[None]
    with torch.no_grad():
        context = drafter.fuse_context(features)
        return drafter(torch.cat([context, drafter.embed(block).to(context.dtype)], dim=1), block.shape[1], positions)


def _one_layer_drafter(target, *, layer_type: str, is_causal, window):
    drafter = random_drafter(target, num_layers=1, block_size=8)
    config = copy.deepcopy(drafter.config)
    config.layer_types, config.is_causal, config.sliding_window = [layer_type], is_causal, window
    fresh = DFlashDrafter(config, target)
    fresh.load_state_dict(drafter.state_dict())
    return fresh.eval()


@pytest.mark.parametrize(
    ("layer_type", "is_causal", "window", "sees_later_slots", "reach"),
    [
        ("sliding_attention", None, 3, False, 3),  # causal within the window
        ("sliding_attention", False, 3, True, 3),  # window on both sides
        ("full_attention", None, None, True, None),  # non-causal, everything
        ("full_attention", True, None, False, None),  # top-level is_causal
    ],
)
def test_which_positions_a_block_slot_sees(layer_type, is_causal, window, sees_later_slots, reach):
    target = _tiny_target()
    drafter = _one_layer_drafter(target, layer_type=layer_type, is_causal=is_causal, window=window)
    width = drafter.fc.in_features
    torch.manual_seed(1)
    features, start = torch.randn(1, 20, width), 20
    block = torch.tensor([[5] + [95] * 7])
    base = _block_hidden(drafter, features, block, start)
    # a later block slot (slot 6) changed: slots before it move only if they may see later slots (within reach)
    later = block.clone()
    later[0, 6] = 17
    moved = (_block_hidden(drafter, features, later, start) - base).abs().amax(-1)[0] > 0
    for slot in range(6):
        visible = sees_later_slots and (reach is None or 6 - slot < reach)
        assert bool(moved[slot]) == visible, slot
    assert moved[6]
    # a context row changed (position 10): a slot at position p sees it iff p - 10 < reach
    older = features.clone()
    older[0, 10] += 1.0
    moved = (_block_hidden(drafter, older, block, start) - base).abs().amax(-1)[0] > 0
    for slot in range(8):
        assert bool(moved[slot]) == (reach is None or start + slot - 10 < reach), slot


@pytest.mark.parametrize("fmt", ["classic", "swa", "swa-noncausal", "dflash2"])
@pytest.mark.parametrize("window", [1, 2, 5, 40])
def test_cached_drafting_equals_one_pass_and_sliding_caches_stay_bounded(fmt, window):
    """Drafting step by step with the (bounded) cache gives what one pass over the whole context gives."""
    target = _tiny_target()
    drafter = random_drafter(target, num_layers=2, block_size=4, fmt=fmt, window=window)
    width = drafter.fc.in_features
    torch.manual_seed(2)
    total = 60
    features = torch.randn(1, total, width)
    cache = drafter.new_cache()
    done = 0
    for step in range(30):
        new = 1 + step % 4
        if done + new > total - 1:
            break
        start = done + new
        block = torch.tensor([[3 + step, 95, 95, 95]])
        with torch.no_grad():
            stepped = drafter.draft([features[:, done:start]], block, [start], cache)
            whole = drafter.draft([features[:, :start]], block, [start], drafter.new_cache())
        assert torch.allclose(stepped, whole, atol=1e-5, rtol=0), step
        done = start
        assert cache.length == done
        for i in range(len(drafter.layers)):
            bound = drafter.config.layer_window(i)
            held = cache.keys[i].shape[-2]
            if bound is None:  # every committed position
                assert held >= done, (i, held)
            else:  # the ring: the window's rows plus one call's context and block
                assert held == bound - 1 + 2 * drafter.block_size, (i, held)


def test_long_conversation_keeps_sliding_layers_bounded():
    """A sliding layer's cache holds window - 1 rows however long the conversation; full layers hold all."""
    target = _tiny_target()
    drafter = random_drafter(target, num_layers=2, block_size=4, fmt="swa", window=6)
    caches = []
    original = drafter.propose

    def spy(features, block_ids, starts, cache, **rows):
        caches.append(cache)
        return original(features, block_ids, starts, cache, **rows)

    drafter.propose = spy
    prompt = [(7 * i) % 90 + 1 for i in range(300)]
    speculative_generate(target, drafter, prompt, 40)
    cache = caches[-1]
    assert cache.length >= 300 and cache.keys[1].shape[-2] >= cache.length
    assert cache.keys[0].shape[-2] == 5 + 2 * 4, (
        "the sliding layer's buffer stays window-sized however long the context"
    )


# --- DFlash2: convolution and candidate selector --------------------------------------------------------


def test_grouped_dynamic_conv_matches_its_definition():
    torch.manual_seed(3)
    hidden, kernel, group, length = 12, 3, 4, 5
    conv = GroupedDynamicConv(hidden, kernel, group)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(2, length, hidden)
    out, dynamic = conv.prepare(x)
    finished = conv.finish(x, dynamic)
    dyn_all = conv.kernel_projection(x).view(2, length, 2, kernel, hidden // group)
    for half, got in ((0, out), (1, finished)):
        expected = torch.zeros_like(x)
        for b in range(2):
            for t in range(length):
                for o in range(min(kernel, t + 1)):
                    coeff = conv.base_kernel[half, o] + dyn_all[b, t, half, o].repeat_interleave(group)
                    expected[b, t] += coeff * x[b, t - o]
        assert torch.allclose(got, expected, atol=1e-5), half
    # causal over block positions: a later position never reaches an earlier one
    later = x.clone()
    later[:, 3] += 1
    assert torch.equal(conv.prepare(later)[0][:, :3], out[:, :3])


def test_fresh_convolution_is_the_identity():
    conv = GroupedDynamicConv(8, 2, 4)
    with torch.no_grad():
        conv.kernel_projection.weight.zero_()
    x = torch.randn(1, 3, 8)
    out, dynamic = conv.prepare(x)
    assert torch.equal(out, x) and torch.equal(conv.finish(x, dynamic), x)


def _brute_force_chain(selector, hidden, logits, anchor):
    values, order = logits.sort(dim=-1, descending=True)
    projected = selector.hidden_projection(hidden)
    prev, chain = int(anchor), []
    for slot in range(hidden.shape[0]):
        best, best_score = None, None
        for rank in range(selector.top_k):
            c = int(order[slot, rank])
            score = float(values[slot, rank]) + float(
                (selector.predecessor_codebook[prev] * projected[slot] * selector.successor_codebook[c]).sum()
            )
            if best_score is None or score > best_score:
                best, best_score = c, score
        chain.append(best)
        prev = best
    return chain


def test_candidate_selector_greedy_chain():
    target = _tiny_target()
    drafter = random_drafter(target, num_layers=1, block_size=8, fmt="dflash2")
    selector = drafter.candidate_selector
    torch.manual_seed(4)
    with torch.no_grad():
        selector.predecessor_codebook.mul_(5)
        hidden, logits = torch.randn(1, 7, 32), torch.randn(1, 7, 96)
        chain = selector.greedy_chain(hidden, logits, torch.tensor([11]))[0].tolist()
        assert chain == _brute_force_chain(selector, hidden[0], logits[0], 11)
        assert chain != logits[0].argmax(-1).tolist()  # the selector overrules the argmax here
        assert all(c in logits[0, i].topk(selector.top_k).indices.tolist() for i, c in enumerate(chain))


def test_dflash2_proposals_are_the_selector_chain():
    target = _tiny_target()
    drafter = random_drafter(target, num_layers=2, block_size=8, fmt="dflash2")
    with torch.no_grad():
        drafter.candidate_selector.predecessor_codebook.mul_(5)
    torch.manual_seed(5)
    features, block = torch.randn(1, 12, drafter.fc.in_features), torch.tensor([[4] + [95] * 7])
    proposed = drafter.propose([features], block, [12], drafter.new_cache())
    hidden = drafter.draft_hidden([features], block, [12], drafter.new_cache())
    with torch.no_grad():
        expected = _brute_force_chain(drafter.candidate_selector, hidden[0], drafter.logits(hidden)[0], 4)
    assert proposed[0].tolist() == expected


def test_dflash2_needs_a_selector_covering_the_targets_vocabulary():
    target = _tiny_target()
    config = random_drafter(target, fmt="dflash2").config
    config.vocab_size = 64
    with pytest.raises(DflashError, match="selector"):
        DFlash2Drafter(config, target)


# --- a draft vocabulary (dflash_config.draft_vocab_size, draft_vocab.json beside the weights) -------------------


def _with_vocabulary(drafter: DFlashDrafter, vocab: torch.Tensor, target) -> DFlashDrafter:
    config = dataclasses.replace(drafter.config, draft_vocab_size=len(vocab))
    limited = make_drafter(config, target)
    limited.load_state_dict(drafter.state_dict())
    limited.use_vocabulary(vocab)
    return limited.eval()


@pytest.mark.parametrize("fmt", ["classic", "dflash2"])
def test_a_draft_vocabulary_bounds_the_proposals_and_the_output_stays_the_targets(fmt, tmp_path):
    from safetensors.torch import load_file

    target = _tiny_target()
    vocab = torch.tensor([i for i in range(96) if i % 3 != 1])  # two thirds of the target's ids
    drafter = _with_vocabulary(random_drafter(target, block_size=6, fmt=fmt), vocab, target)
    drafter.save_pretrained(tmp_path / "d")
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["dflash_config"]["draft_vocab_size"] == len(vocab)
    # Beside the weights, which stay the published format (what other engines and converters read).
    assert json.loads((tmp_path / "d" / "draft_vocab.json").read_text()) == vocab.tolist()
    assert set(load_file(str(tmp_path / "d" / "model.safetensors"))) == set(
        random_drafter(target, fmt=fmt).state_dict()
    )
    loaded = load_drafter(tmp_path / "d", target)
    assert loaded.config.draft_vocab_size == len(vocab) and loaded.draft_vocab.dtype == torch.long
    assert torch.equal(loaded.draft_vocab, vocab)

    torch.manual_seed(1)
    features, block = torch.randn(1, 10, loaded.fc.in_features), torch.tensor([[4] + [95] * 5])
    hidden = loaded.draft_hidden([features], block, [10], loaded.new_cache())
    with torch.no_grad():
        logits = loaded.logits(hidden)
        outside = torch.ones(96, dtype=torch.bool).index_fill_(0, vocab, False)
        assert torch.isneginf(logits[..., outside]).all() and torch.isfinite(logits[..., vocab]).all()
        # What training's loss reads: the same logits, of the vocabulary's ids alone.
        torch.testing.assert_close(loaded.vocab_logits(hidden), logits[..., vocab])
        assert loaded.logits(hidden[:, :0]).shape == (1, 0, 96)  # (a block of one drafts no slot)
    proposal = loaded.propose([features], block, [10], loaded.new_cache())[0]
    assert torch.isin(proposal, vocab).all()
    # A classic drafter proposes from the vocabulary's logits alone: what the masked whole-vocabulary logits give,
    # ties included (all logits 0: the first id of the vocabulary either way), and no slot for a block of one.
    for rows in (hidden, torch.zeros_like(hidden), hidden[:, :0]) if not loaded.config.is_dflash2 else ():
        assert torch.equal(loaded.select(rows, block[:, 0]), greedy_tokens(loaded.logits(rows)))
    # Over a dense bf16 head (a float32 training step over a bf16 target): its rows in the hidden states' dtype.
    bf16_head = _tiny_target()
    bf16_head.get_output_embeddings().bfloat16()
    on_bf16 = load_drafter(tmp_path / "d", bf16_head)
    rows = bf16_head.get_output_embeddings().weight.detach()[vocab]
    with torch.no_grad():
        wide = on_bf16.vocab_logits(hidden.float())
        assert wide.dtype == torch.float32
        torch.testing.assert_close(wide, hidden.float() @ rows.float().T)
        assert on_bf16.vocab_logits(hidden.bfloat16()).dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):  # (a bf16 step's float32 norm output: the bf16 rows)
            assert on_bf16.vocab_logits(hidden.float()).dtype == torch.bfloat16
        assert on_bf16._vocab_head[2] == torch.bfloat16

    prompt = [3, 14, 15, 92, 65]
    baseline = speculative_generate(target, None, prompt, 32).token_ids
    result = speculative_generate(target, loaded, prompt, 32)
    assert result.token_ids == baseline


@pytest.mark.parametrize(
    "vocab",
    [
        [5, 3, 9],  # not ascending
        [3, 3, 9],  # repeated
        [3, 9, 96],  # past the vocabulary
        [-1, 3, 9],  # not a token
        [3, 9],  # fewer than the config says
        [3.0, 9.0, 11.0],  # not ids
        {"ids": [3, 9, 11]},
        None,  # no file
        "a directory",
        b"\xff\xfe[3, 9, 11]",  # not UTF-8
    ],
)
def test_a_draft_vocabulary_that_is_not_ascending_target_ids_is_refused(vocab, tmp_path):
    target = _tiny_target()
    _with_vocabulary(random_drafter(target), torch.tensor([3, 9, 11]), target).save_pretrained(tmp_path)
    if vocab is None:
        (tmp_path / "draft_vocab.json").unlink()
    elif vocab == "a directory":
        (tmp_path / "draft_vocab.json").unlink()
        (tmp_path / "draft_vocab.json").mkdir()
    elif isinstance(vocab, bytes):
        (tmp_path / "draft_vocab.json").write_bytes(vocab)
    else:
        (tmp_path / "draft_vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(DflashError, match="draft_vocab"):
        load_drafter(tmp_path, target)


@pytest.mark.parametrize("size", [0, 97, "8k", True])
def test_a_draft_vocabulary_size_outside_the_vocabulary_names_the_field(size):
    raw = _raw("qwen3-tiny")
    raw.setdefault("dflash_config", {})["draft_vocab_size"] = size
    raw["vocab_size"] = 96
    with pytest.raises(DflashError, match=r"dflash_config\.draft_vocab_size"):
        DrafterConfig.from_dict(raw)


def test_a_top_level_draft_vocab_size_is_another_formats_and_is_kept_as_is(tmp_path):
    # EAGLE-3 / speculators configs carry a top-level draft_vocab_size (often the whole vocabulary) and no list.
    raw = _raw("qwen3-tiny")
    raw["draft_vocab_size"] = raw["vocab_size"]
    config = DrafterConfig.from_dict(raw)
    assert config.draft_vocab_size is None and config.extra["draft_vocab_size"] == raw["vocab_size"]
    assert config.to_dict()["draft_vocab_size"] == raw["vocab_size"]
    assert "draft_vocab_size" not in config.to_dict()["dflash_config"]
    target = _tiny_target()
    random_drafter(target).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "draft_vocab_size": 96}))
    assert load_drafter(tmp_path, target).config.draft_vocab_size is None


def test_a_draft_vocabulary_past_the_targets_head_is_refused_when_bound():
    target = _tiny_target()  # its head scores 96 tokens
    config = dataclasses.replace(random_drafter(target).config, vocab_size=200, draft_vocab_size=2)
    drafter = make_drafter(config)
    drafter.use_vocabulary(torch.tensor([3, 150]))
    with pytest.raises(DflashError, match="lm_head scores 96"):
        drafter.bind(target)
