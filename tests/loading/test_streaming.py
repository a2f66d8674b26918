"""An int4 / int8 plan reads the target tensor by tensor into quantized layers (loading/streaming.py): the model is
today's (`from_pretrained` in bf16, then `quantize_target`) bit for bit, and the load never holds it in bf16."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from dflash_cli.engine.kernels.quantized import Int4Linear, Int8Linear, quantize_target, share_inputs
from dflash_cli.errors import DflashError
from dflash_cli.loading.checkpoint import read_checkpoint
from dflash_cli.loading.models import load_target
from dflash_cli.loading.streaming import cannot_stream
from dflash_cli.setup.planning import Plan
from helpers.tiny_models import FAMILIES, make_tiny, tiny_config

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 42, 11, 3, 250, 64]])
# Families outside helpers.tiny_models.FAMILIES (those the engine tests run), at the same toy size.
SMALL = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
OTHER_FAMILIES = {
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,  # q/k/v biases
    "gemma": transformers.GemmaConfig,  # tied, scaled embeddings
    "gemma2": transformers.Gemma2Config,
}


def plan(quant: str) -> Plan:
    return Plan("cpu", "bfloat16", quant, None, "eager", "cpu", None, None, ())


def streamed(model_dir: Path, quant: str) -> transformers.PreTrainedModel:
    """`load_target` under an int4 / int8 plan, which must not load the model whole (from_pretrained)."""

    def whole(*args: object, **kwargs: object) -> None:
        raise AssertionError("an int4 / int8 plan loaded the whole model")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", whole)
        return load_target(model_dir, plan(quant), check_free_memory=False)


def todays(model_dir: Path, quant: str) -> transformers.PreTrainedModel:
    """What an int4 / int8 plan loaded before: the whole model in bf16, then quantized (and each input's projections
    shared, as every int4 / int8 load does)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager"
    )
    quantize_target(model, quant, torch.bfloat16)
    share_inputs(model)
    return model.eval()


def assert_same_model(streamed: transformers.PreTrainedModel, expected: transformers.PreTrainedModel) -> None:
    """Every parameter and buffer (int4 codes, scales, embeddings, norms, rotary frequencies) equal in value and
    dtype, the same layers, the same config and generation config, and the same logits to the bit."""
    ours, theirs = streamed.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    ours, theirs = dict(streamed.named_buffers()), dict(expected.named_buffers())  # the non-persistent ones too
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in theirs)
    assert [type(m) for m in streamed.modules()] == [type(m) for m in expected.modules()]
    assert streamed.config.to_dict() == expected.config.to_dict()
    assert streamed.generation_config.to_dict() == expected.generation_config.to_dict()
    with torch.no_grad():
        assert torch.equal(streamed(IDS).logits, expected(IDS).logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_streamed_int4_target_is_todays_bit_for_bit(tmp_path: Path, family: str) -> None:
    model_dir = make_tiny(family, tmp_path / family, seed=3, max_shard_size="100KB")  # several shards
    model = streamed(model_dir, "int4")
    assert_same_model(model, todays(model_dir, "int4"))
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe", "gemma4"])
def test_a_streamed_int8_target_is_todays_bit_for_bit(tmp_path: Path, family: str) -> None:
    model_dir = make_tiny(family, tmp_path / family, seed=4)
    assert_same_model(streamed(model_dir, "int8"), todays(model_dir, "int8"))


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_other_families_stream_bit_for_bit_too(tmp_path: Path, family: str) -> None:
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(OTHER_FAMILIES[family](**SMALL), dtype=torch.float32)
    model.save_pretrained(tmp_path / family)
    assert_same_model(streamed(tmp_path / family, "int4"), todays(tmp_path / family, "int4"))


def test_a_published_qwen3_5_checkpoint_streams_past_its_vision_tower_and_mtp_layer(tmp_path: Path) -> None:
    """Qwen3.5 / 3.6 checkpoints are multimodal: the language model's tensors under `model.language_model.`,
    beside a vision tower and a multi-token-prediction layer that the causal LM does not hold. transformers'
    conversion mapping renames the first; the others are skipped, as from_pretrained skips them."""
    text = tiny_config("qwen3_5")
    torch.manual_seed(6)
    model = transformers.AutoModelForCausalLM.from_config(text, dtype=torch.bfloat16)
    tensors = {
        ("model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name): t.contiguous()
        for name, t in model.state_dict().items()
    }
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(48, 16, dtype=torch.bfloat16)
    tensors["mtp.layers.0.mlp.down_proj.weight"] = torch.randn(64, 128, dtype=torch.bfloat16)
    model_dir = tmp_path / "qwen3.6"
    model_dir.mkdir()
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    transformers.Qwen3_5Config(text_config=text.to_dict()).save_pretrained(model_dir)
    for quant in ("int4", "int8"):
        assert_same_model(streamed(model_dir, quant), todays(model_dir, quant))


def test_a_checkpoint_missing_a_weight_or_of_another_shape_is_refused_by_name(tmp_path: Path) -> None:
    model_dir = make_tiny("qwen3", tmp_path / "qwen3", seed=7)
    tensors = load_file(model_dir / "model.safetensors")
    norm = tensors.pop("model.layers.1.post_attention_layernorm.weight")
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DflashError, match="no weights for model.layers.1.post_attention_layernorm.weight"):
        load_target(model_dir, plan("int4"), check_free_memory=False)
    tensors["model.layers.1.post_attention_layernorm.weight"] = torch.cat([norm, norm])
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DflashError, match=r"post_attention_layernorm.weight is \(128,\) in the checkpoint but \(64,\)"):
        load_target(model_dir, plan("int4"), check_free_memory=False)


def test_a_prequantized_checkpoint_is_the_one_that_loads_whole_first(tmp_path: Path) -> None:
    """Its stored tensors need transformers' dequantization: it loads whole, then quantize_target runs."""
    model_dir = make_tiny("qwen3", tmp_path / "qwen3", seed=8, with_tokenizer=False)
    config = json.loads((model_dir / "config.json").read_text())
    text_config = transformers.AutoConfig.from_pretrained(model_dir)
    assert cannot_stream(config, text_config) is None
    config["quantization_config"] = {"quant_method": "fp8"}
    assert cannot_stream(config, text_config) == "it is published pre-quantized (fp8)"
    assert read_checkpoint(model_dir).prequantized is None  # (the tiny model itself is plain)


# A subprocess that loads `model_dir` (after a warm-up load of `warm_dir`, the same layer shapes: the kernels' and
# threads' first allocations are then in the baseline; streamed, its tensors then moved into 2 MB pages) and prints its RSS before, its peak during the load, and
# the bytes of the weights it then holds.
MEASURE = """
import gc, json, re, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from dflash_cli.loading.models import load_target
from dflash_cli.setup.planning import Plan
from dflash_cli.setup.sizes import module_weight_bytes
from dflash_cli.engine.kernels.memory import in_huge_pages
from dflash_cli.engine.kernels.quantized import quantize_target
from transformers import AutoModelForCausalLM

def status(field):
    return int(re.search(field + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

def load(model_dir):
    if sys.argv[1] == "streamed":
        plan = Plan("cpu", "bfloat16", "int4", None, "eager", "cpu", None, None, ())
        model = load_target(model_dir, plan, check_free_memory=False)
        in_huge_pages(model)  # (as load_models does next: the move's peak counts too)
        return model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)  # today's: bf16, then int4
    quantize_target(model, "int4", torch.bfloat16)
    return model

warm = load(Path(sys.argv[3]))
del warm
gc.collect()
baseline = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
model = load(Path(sys.argv[2]))
print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "weights": module_weight_bytes(model)}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is read from Linux's /proc")
def test_an_int4_load_peaks_at_the_int4_weights_not_the_bf16_model(tmp_path: Path) -> None:
    """A Llama of 390 MB in bf16 whose int4 weights take 128 MB: streamed, the load's peak RSS over the process's
    baseline stays within 1.3x of the int4 weights (measured 141-154 MB, the move into 2 MB pages included); today's path, the bf16 model whole, then
    quantized, passes the bf16 size (about 500 MB)."""
    shapes = dict(vocab_size=4096, hidden_size=768, intermediate_size=2048, num_attention_heads=12)
    shapes |= dict(num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)
    for name, layers in (("model", 30), ("warm", 1)):
        torch.manual_seed(9)
        config = transformers.LlamaConfig(num_hidden_layers=layers, **shapes)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / name)

    def measure(how: str) -> dict[str, int]:
        command = [sys.executable, "-c", MEASURE, how, str(tmp_path / "model"), str(tmp_path / "warm")]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    streamed, today = measure("streamed"), measure("today")
    int4_weights = streamed["weights"]
    assert today["weights"] == int4_weights  # the same model, however it was loaded
    bf16_bytes = read_checkpoint(tmp_path / "model").stored_bytes
    print(f"bf16 {bf16_bytes / 1e6:.0f} MB, int4 weights {int4_weights / 1e6:.0f} MB; peak over the baseline: "
          f"streamed {(streamed['peak'] - streamed['baseline']) / 1e6:.0f} MB, "
          f"today's {(today['peak'] - today['baseline']) / 1e6:.0f} MB")  # fmt: skip
    assert streamed["peak"] - streamed["baseline"] <= 1.3 * int4_weights
    assert today["peak"] - today["baseline"] > bf16_bytes > 1.3 * int4_weights
