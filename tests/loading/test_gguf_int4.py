"""An int4 plan reads a Q4_0/Q4_1 GGUF straight into int4 layers (loading/gguf.py `load_int4_target`).

The GGUFs here are written with the `gguf` package from a tiny transformers Llama, the way llama.cpp's converter
writes them (q/k rows permuted for its rotary layout, no output matrix for a tied head), with a byte-level BPE
tokenizer, so transformers' own GGUF reader (today's float conversion) reads them too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from dflash_cli import speculative_generate
from dflash_cli.engine.kernels.quantized import Int4Linear, Int8Linear, quantize_target
from dflash_cli.loading import gguf as demo
from dflash_cli.loading.models import load_models
from dflash_cli.setup.planning import Plan
from dflash_cli.setup.recipes import ModelRef, Recipe
from helpers.drafters import random_drafter
from helpers.kernels import int8_activation_product, use_kernels
from helpers.tiny_models import int4_packable_tiny

gguf = pytest.importorskip("gguf")

REPO_ID = "tiny-org/tiny-llama-gguf"
FALLBACK = {"pypi": "tiny-llama-gguf==1.0", "file": "tiny/tiny-llama.Q4_1.gguf"}
PROMPTS = ([257, 104, 101, 108, 108, 111], [257, 256, 32, 119, 111, 114, 108, 100, 33], [257, 49, 50, 51])


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: token i is byte i's printable stand-in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, printable))
    for extra, byte in enumerate(b for b in range(256) if b not in chars):
        chars[byte] = 256 + extra
    return [chr(chars[b]) for b in range(256)]


def tiny_llama(seed: int, tied: bool) -> transformers.PreTrainedModel:
    """A float32 Llama the int4 packing takes whole (helpers.tiny_models.int4_packable_tiny); vocabulary: 256 bytes,
    "he", an end token."""
    return int4_packable_tiny(
        "llama", seed, tied=tied, vocab_size=258, bos_token_id=257, eos_token_id=257, rms_norm_eps=1e-5
    )


def write_gguf(model: transformers.PreTrainedModel, path: Path, kind: str = "Q4_1", head: str = "F32") -> Path:
    """`model` as llama.cpp's converter writes it: linears in `kind`, the embedding and head in `head` (F32 or
    Q8_0, as the demo's), the rest float32."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([*byte_tokens(), "he", "<|end|>"])
    writer.add_token_types([1] * 257 + [3])
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(257)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    quant = gguf.GGMLQuantizationType[kind]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        module, _, suffix = name.rpartition(".")
        values = tensor.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's permutation for its rotary layout
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            values = values.reshape(heads, 2, -1, values.shape[-1]).swapaxes(1, 2).reshape(values.shape)
        if head != "F32" and name in ("model.embed_tokens.weight", "lm_head.weight"):
            head_quant = gguf.GGMLQuantizationType[head]
            writer.add_tensor(
                f"{names.get_name(module)}.{suffix}", gguf.quants.quantize(values, head_quant), raw_dtype=head_quant
            )
        elif module.startswith("model.layers.") and values.ndim == 2:
            writer.add_tensor(
                f"{names.get_name(module)}.{suffix}", gguf.quants.quantize(values, quant), raw_dtype=quant
            )
        else:
            writer.add_tensor(f"{names.get_name(module)}.{suffix}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def converted_then_quantized(gguf_file: Path, out_dir: Path) -> transformers.PreTrainedModel:
    """Today's path: the GGUF converted to a float32 checkpoint, then `quantize_target` to int4 (bf16 compute).
    It quantizes the float32 weights, whose min-max groups are the GGUF's own; the rest then goes to bf16."""
    demo.convert_gguf(gguf_file, out_dir, REPO_ID)
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    quantize_target(model, "int4", torch.bfloat16)
    for parameter in model.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    return model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "dflash-cache"
    monkeypatch.setattr(demo, "cache_root", lambda: root)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip must never reach a real index from a test
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    return root


def downloaded(cache: Path, model: transformers.PreTrainedModel, kind: str = "Q4_1") -> Path:
    """`model` as a GGUF where `_download_gguf` leaves the one it extracted from the wheel."""
    downloads = cache / "downloads"
    downloads.mkdir(parents=True)
    return write_gguf(model, downloads / Path(FALLBACK["file"]).name, kind)


def gguf_recipe() -> Recipe:
    return Recipe(
        name="tiny", description="d", target=ModelRef(REPO_ID, gguf_fallback=FALLBACK), drafter=None, source="ad-hoc"
    )


def int4_plan(attention: str = "sdpa") -> Plan:
    return Plan("cpu", "bfloat16", "int4", None, attention, "cpu", None, None, ())


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
def test_q4_groups_are_what_gguf_dequantizes(kind: str) -> None:
    """The nibble order and the block layout against gguf's own dequantizer: q * scale + min, exactly."""
    torch.manual_seed(1)
    weight = (torch.randn(48, 128) * 0.05).numpy()
    quant = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(weight, quant)
    entry = demo._Tensor(kind, (48, 128), 0, blocks.nbytes)
    codes, scales, mins = demo._q4_groups(entry, blocks)
    assert codes.min() >= 0 and codes.max() <= 15
    ours = (codes.reshape(48, 4, 32).float() * scales[..., None] + mins[..., None]).reshape(48, 128)
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(blocks, quant)))


@pytest.mark.parametrize("tied", [True, False])
def test_direct_int4_logits_equal_todays_conversion_bit_for_bit(tmp_path: Path, tied: bool) -> None:
    gguf_file = write_gguf(tiny_llama(seed=2, tied=tied), tmp_path / "tiny.gguf")
    reference = converted_then_quantized(gguf_file, tmp_path / "converted")
    direct = demo.load_int4_target(gguf_file, tmp_path / "converted", torch.bfloat16).eval()
    assert not any(p.device.type == "meta" for p in direct.parameters())
    assert sum(isinstance(m, Int4Linear) for m in direct.modules()) == 2 * 7
    assert isinstance(direct.get_output_embeddings(), Int8Linear)
    assert direct.get_input_embeddings().weight.dtype == torch.bfloat16
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            ours, theirs = direct(ids).logits, reference(ids).logits
            assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)


def test_greedy_text_through_the_engine_is_todays(tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_llama(seed=3, tied=True), tmp_path / "tiny.gguf")
    reference = converted_then_quantized(gguf_file, tmp_path / "converted")
    direct = demo.load_int4_target(gguf_file, tmp_path / "converted", torch.bfloat16).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "converted")
    for prompt in PROMPTS:
        texts = []
        for target in (direct, reference):
            drafter = random_drafter(target, seed=0, num_layers=1, block_size=4, dtype=torch.bfloat16)
            result = speculative_generate(target, drafter, prompt, 24)
            texts.append(tokenizer.decode(result.token_ids))
        assert texts[0] == texts[1] and len(texts[0]) > 0


def test_an_int4_plan_loads_the_demo_gguf_without_a_float_copy(offline: Path, cache: Path) -> None:
    """load_models: the target straight from the GGUF, its tokenizer and config saved once, no safetensors."""
    gguf_file = downloaded(cache, tiny_llama(seed=4, tied=True))
    loaded = load_models(gguf_recipe(), int4_plan(), with_drafter=False)
    assert loaded.target_source is not None and "straight into int4 layers" in loaded.target_source
    assert loaded.target_dir == demo.converted_dir(REPO_ID)
    assert not list(loaded.target_dir.glob("*.safetensors"))
    assert isinstance(loaded.target.model.layers[0].mlp.down_proj, Int4Linear)
    assert loaded.tokenizer.decode(loaded.tokenizer("hello").input_ids) == "hello"
    assert gguf_file.with_name(gguf_file.name + ".tensors.json").is_file()  # a later start skips gguf's parse
    assert loaded.target.config._attn_implementation == "sdpa"
    eager = load_models(gguf_recipe(), int4_plan("eager"), with_drafter=False)
    assert eager.target.config._attn_implementation == "eager"  # the plan's attention, as a float load has it
    again = load_models(gguf_recipe(), int4_plan(), with_drafter=False)
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[0]])
        assert torch.equal(again.target(ids).logits, loaded.target(ids).logits)


def test_another_quant_type_falls_back_to_the_float_conversion(offline: Path, cache: Path) -> None:
    downloaded(cache, tiny_llama(seed=5, tied=True), kind="Q8_0")
    source, why = demo.int4_gguf_source(REPO_ID, FALLBACK)
    assert source is None and "Q8_0" in why
    loaded = load_models(gguf_recipe(), int4_plan(), with_drafter=False)
    assert "converted to float" in loaded.target_source and "Q8_0" in loaded.target_source
    assert (demo.converted_dir(REPO_ID) / "model.safetensors").is_file()  # today's conversion, then quantize_target
    assert isinstance(loaded.target.model.layers[0].mlp.down_proj, Int4Linear)


def test_a_float_plan_still_converts_once(offline: Path, cache: Path) -> None:
    """The tokenizer-only directory an int4 start leaves is completed by the first plan that needs float weights."""
    downloaded(cache, tiny_llama(seed=6, tied=True))
    load_models(gguf_recipe(), int4_plan(), with_drafter=False)
    float_plan = Plan("cpu", "float32", "none", None, "sdpa", "cpu", None, None, ())
    loaded = load_models(gguf_recipe(), float_plan, with_drafter=False)
    assert loaded.target_dir == demo.converted_dir(REPO_ID)
    assert (loaded.target_dir / "model.safetensors").is_file()
    assert isinstance(loaded.target.model.layers[0].mlp.down_proj, torch.nn.Linear)


@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_pull_makes_the_float_copy_only_where_the_plan_needs_float_weights(
    offline: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, cpu_bf16: bool
) -> None:
    """`dflash pull demo`: on a CPU with bf16 the demo's plan is int4, so the GGUF and its tokenizer are enough."""
    from rich.console import Console

    from dflash_cli.commands.pull import pull_recipe
    from dflash_cli.setup import hardware
    from dflash_cli.setup.hardware import MachineFacts
    from dflash_cli.setup.recipes import get_recipe

    cpu = MachineFacts(kind="cpu", cpu_ram_total=64 * 2**30, cpu_ram_available=60 * 2**30, cpu_bf16=cpu_bf16)
    monkeypatch.setattr(hardware, "detect_machine", lambda: cpu)
    demo_recipe = get_recipe("demo")
    fallback = demo_recipe.target.gguf_fallback
    (cache / "downloads").mkdir(parents=True)
    write_gguf(tiny_llama(seed=7, tied=True), cache / "downloads" / Path(fallback["file"]).name)
    console = Console(stderr=True, quiet=True)
    assert pull_recipe(demo_recipe, console, dry_run=True)[0].data["path"] is None
    target = pull_recipe(demo_recipe, console)[0]
    assert target.data["path"] == str(demo.converted_dir(demo_recipe.target.id))
    assert (demo.converted_dir(demo_recipe.target.id) / "model.safetensors").is_file() is not cpu_bf16
    assert pull_recipe(demo_recipe, console, dry_run=True)[0].data["path"] == target.data["path"]


def test_a_stale_or_unreadable_tensor_table_is_made_again(tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_llama(seed=8, tied=True), tmp_path / "tiny.gguf")
    table = gguf_file.with_name(gguf_file.name + ".tensors.json")
    architecture, tensors = demo._tensor_table(gguf_file)
    assert architecture == "llama" and tensors["blk.0.attn_q.weight"].kind == "Q4_1"
    table.write_text("{not json")
    assert demo._tensor_table(gguf_file) == (architecture, tensors)
    write_gguf(tiny_llama(seed=8, tied=True), gguf_file, kind="Q4_0")  # a new file: its size and time differ
    assert demo._tensor_table(gguf_file)[1]["blk.0.attn_q.weight"].kind == "Q4_0"


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
def test_every_int4_layer_multiplies_by_the_gguf_weights(tmp_path: Path, kind: str) -> None:
    """In float32 each int4 layer's weight is the GGUF's exactly, q/k rows in transformers' order: Q4_0's groups
    (w = (q - 8) d) too, which min-max over the float weights would not find again."""
    gguf_file = write_gguf(tiny_llama(seed=9, tied=False), tmp_path / "tiny.gguf", kind)
    demo.convert_gguf(gguf_file, tmp_path / "converted", REPO_ID)
    floats = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "converted", dtype=torch.float32)
    direct = demo.load_int4_target(gguf_file, tmp_path / "converted", torch.float32)
    layers = {name: m for name, m in direct.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 2 * 7
    for name, layer in layers.items():
        assert torch.equal(layer.dequantized(), floats.get_submodule(name).weight), name


def test_another_architecture_or_an_unreadable_file_is_not_read_directly(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "qwen.gguf"), "qwen2")
    writer.add_tensor("token_embd.weight", torch.zeros(8, 64).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "qwen2 model" in demo.int4_gguf_problem(tmp_path / "qwen.gguf")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(12))
    assert "cannot read broken.gguf" in demo.int4_gguf_problem(tmp_path / "broken.gguf")


@pytest.mark.parametrize("tied", [True, False])
def test_a_q8_0_head_keeps_its_groups_as_stored(tmp_path: Path, tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's head is its Q8_0 embedding: read with a scale per group of 32 as stored, where a requantization
    per channel added its own error (the demo's greedy answers looped on everyday prompts). Elsewhere (torch's
    kernels) it is quantized per channel from those weights."""
    use_kernels(True, monkeypatch)
    gguf_file = write_gguf(tiny_llama(seed=4, tied=tied), tmp_path / "tiny.gguf", head="Q8_0")
    demo.convert_gguf(gguf_file, tmp_path / "converted", REPO_ID)
    direct = demo.load_int4_target(gguf_file, tmp_path / "converted", torch.bfloat16).eval()
    head = direct.get_output_embeddings()
    assert isinstance(head, Int8Linear) and head.native and head.lane_scales.dim() == 3
    _, tensors = demo._tensor_table(gguf_file)
    stored = tensors["token_embd.weight" if tied else "output.weight"]
    raw = np.memmap(gguf_file, dtype=np.uint8, mode="r")[stored.offset : stored.offset + stored.nbytes]
    weights = torch.from_numpy(gguf.quants.dequantize(raw.reshape(stored.shape[0], -1), gguf.GGMLQuantizationType.Q8_0))
    assert torch.equal(head.dequantized(), weights.reshape(stored.shape))
    hidden = torch.randn(3, direct.config.hidden_size, dtype=torch.bfloat16)
    torch.testing.assert_close(head(hidden).float(), int8_activation_product(hidden, weights), rtol=8e-3, atol=8e-3)
    assert torch.equal(head(hidden), torch.cat([head(row[None]) for row in hidden]))  # each row on its own
    use_kernels(False, monkeypatch)
    per_channel = demo.load_int4_target(gguf_file, tmp_path / "converted", torch.bfloat16).get_output_embeddings()
    assert not per_channel.native  # torch's layout: quantized per channel from the same weights
    torch.testing.assert_close(per_channel.dequantized(), weights.reshape(stored.shape), rtol=0, atol=0.02)
