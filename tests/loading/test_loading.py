"""loading.py: real tiny checkpoints loaded through transformers (and bitsandbytes NF4 on CPU), broken ones refused."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from transformers.utils import logging as hf_logging

from dflash_cli.errors import DflashError
from dflash_cli.loading import models as loading
from dflash_cli.loading.checkpoint import read_checkpoint
from dflash_cli.loading.models import load_models, load_target, load_tokenizer
from dflash_cli.setup.planning import Plan
from dflash_cli.setup.recipes import ModelRef, Recipe
from dflash_cli.setup.sizes import MemoryEstimate
from helpers.tiny_models import make_hf_cache, make_tiny, make_tiny_qwen3

REPO = "tiny-org/tiny-qwen3"


def cpu_plan(dtype: str = "float32", quant: str = "none", estimated_bytes: int | None = None) -> Plan:
    memory = None if estimated_bytes is None else MemoryEstimate(8192, estimated_bytes, 0, 0, 0, 0)
    return Plan("cpu", dtype, quant, None, "sdpa", "cpu", memory, None, ())


def recipe(target: str, drafter: str | None = None) -> Recipe:
    return Recipe(
        name="tiny",
        description="tiny test recipe",
        target=ModelRef(target),
        drafter=ModelRef(drafter) if drafter else None,
        chat_template_kwargs={"enable_thinking": False},
        source="ad-hoc",
    )


@pytest.fixture
def model_copy(tiny_qwen3_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model that a test may break."""
    return Path(shutil.copytree(tiny_qwen3_dir, tmp_path / "model"))


def test_load_models_from_the_offline_cache(offline: Path, tiny_qwen3_dir: Path) -> None:
    snapshot = make_hf_cache(offline, REPO, tiny_qwen3_dir)
    loaded = load_models(recipe(REPO), cpu_plan(), with_drafter=False)
    assert loaded.target_dir == snapshot and loaded.drafter is None and loaded.drafter_dir is None
    target = loaded.target
    assert type(target).__name__ == "Qwen3ForCausalLM" and not target.training
    assert not any(p.requires_grad for p in target.parameters())
    saved = load_file(snapshot / "model.safetensors")
    assert torch.equal(target.lm_head.weight, saved["lm_head.weight"])  # the weights on disk, not a fresh init
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, enable_thinking=False
    )
    logits = target(torch.tensor([prompt["input_ids"]])).logits
    assert logits.shape == (1, len(prompt["input_ids"]), target.config.vocab_size)


def test_bfloat16_plan_loads_bfloat16_weights(tiny_qwen3_dir: Path) -> None:
    model = load_target(tiny_qwen3_dir, cpu_plan("bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_nf4_on_cpu_through_bitsandbytes(tiny_llama_dir: Path) -> None:
    import bitsandbytes as bnb

    model = load_target(tiny_llama_dir, cpu_plan("float32", "nf4"))
    quantized = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert not isinstance(model.lm_head, bnb.nn.Linear4bit)
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert weight.quant_state.quant_type == "nf4" and weight.quant_state.nested  # double quantization
    reference = load_target(tiny_llama_dir, cpu_plan("float32"))
    ids = torch.tensor([[5, 17, 99, 3, 250, 42]])
    with torch.no_grad():
        nf4, fp32 = model(ids).logits, reference(ids).logits
    assert nf4.isfinite().all()
    # 4-bit weights perturb the logits a little, and only a little
    assert torch.nn.functional.cosine_similarity(nf4.flatten(), fp32.flatten(), dim=0) > 0.95
    assert not torch.equal(nf4, fp32)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_cpu_weight_only_quant_loads_packed_linears_in_bf16(tiny_qwen3_dir: Path, quant: str) -> None:
    from dflash_cli.engine.kernels import native
    from dflash_cli.engine.kernels.quantized import Int4Linear, Int8Linear, Projection
    from dflash_cli.setup.sizes import module_weight_bytes

    model = load_target(tiny_qwen3_dir, cpu_plan("bfloat16", quant))
    kind = Int4Linear if quant == "int4" else Int8Linear
    projections = [m for name, m in model.named_modules() if name.endswith("_proj")]
    assert len(projections) == 2 * 7  # each projection quantized, alone or as part of its input's shared product
    assert all(
        isinstance(m, kind) or isinstance(m, Projection) and isinstance(m.shared.product, kind) for m in projections
    )
    if native.available():  # dflash's kernels: each layer's q, k, v and gate, up share their input's product
        assert sum(isinstance(m, Projection) for m in projections) == 2 * 5
    assert isinstance(model.get_output_embeddings(), Int8Linear)  # and the head, in 8 bits
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    reference = load_target(tiny_qwen3_dir, cpu_plan("bfloat16"))
    ids = torch.tensor([[5, 17, 99, 3, 250, 42]])
    with torch.no_grad():
        quantized, plain = model(ids).logits.float(), reference(ids).logits.float()
    assert torch.nn.functional.cosine_similarity(quantized.flatten(), plain.flatten(), dim=0) > 0.95
    assert not torch.equal(quantized, plain)
    # what the loader estimated is an upper bound of what the model holds
    assert module_weight_bytes(model) <= read_checkpoint(tiny_qwen3_dir).nbytes("bfloat16", quant)
    assert read_checkpoint(tiny_qwen3_dir).nbytes("bfloat16", quant) < read_checkpoint(tiny_qwen3_dir).nbytes(
        "bfloat16"
    )


def test_checkpoint_sizes_come_from_the_safetensors_headers(tiny_qwen3_dir: Path) -> None:
    checkpoint = read_checkpoint(tiny_qwen3_dir)
    model = load_target(tiny_qwen3_dir, cpu_plan())
    params = sum(p.numel() for p in model.parameters())
    assert sum(n for _, n, _ in checkpoint.tensors) == params
    assert checkpoint.nbytes("float32") == 4 * params
    assert checkpoint.nbytes("bfloat16") == 2 * params
    # about half: 4-bit linears, float32 embeddings and norms, and the per-tensor tables that weigh on tiny tensors
    assert checkpoint.nbytes("float32", "nf4") < 0.55 * checkpoint.nbytes("float32")


def test_nf4_size_of_a_moe_target_is_what_bitsandbytes_really_leaves(tmp_path: Path) -> None:
    """transformers fuses MoE experts into 3-D tensors and bitsandbytes quantizes nn.Linear only: the estimate
    must count the experts at full precision, as the loaded model really holds them."""
    path = make_tiny("qwen3_moe", tmp_path / "moe", with_tokenizer=False, hidden_size=128, moe_intermediate_size=128)
    checkpoint = read_checkpoint(path)
    counts = checkpoint.parameter_counts
    assert counts is not None and counts.experts > counts.linear  # mostly experts, like the real 30B-A3B
    model = load_target(path, cpu_plan("float32", "nf4"))
    expert_types = {type(p).__name__ for n, p in model.named_parameters() if ".experts." in n}
    assert expert_types == {"Parameter"}  # not Params4bit: left as they were
    footprint = model.get_memory_footprint()  # packed 4-bit bytes, without the absmax scales
    estimate = checkpoint.nbytes("float32", "nf4")
    assert footprint <= estimate <= footprint * 1.05
    assert checkpoint.nbytes("float32", "nf4") > 0.6 * checkpoint.nbytes("float32")  # NF4 saves little here


def test_models_without_sdpa_load_with_eager_attention(tmp_path: Path) -> None:
    path = make_tiny("gpt_oss", tmp_path / "gpt-oss", with_tokenizer=False)
    console = Console(file=StringIO(), width=200)
    model = load_target(path, cpu_plan(), console=console)
    assert model.config._attn_implementation == "eager"
    assert "attention eager: GptOssForCausalLM has no SDPA path" in console.file.getvalue()
    assert loading.attention_implementation(model.config, "eager") == ("eager", None)


def test_prequantized_checkpoints_keep_their_stored_size_only_where_native(
    tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "q"
    shutil.copytree(tiny_qwen3_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (copy / "config.json").write_text(json.dumps(config))
    checkpoint = read_checkpoint(copy)
    assert checkpoint.prequantized == "mxfp4"
    assert checkpoint.nbytes("bfloat16", native=("mxfp4",)) == checkpoint.stored_bytes  # kept as stored
    assert checkpoint.nbytes("bfloat16") == 2 * sum(
        n for _, n, _ in checkpoint.tensors
    )  # dequantized on a device without kernels
    with pytest.raises(DflashError, match="pre-quantized \\(mxfp4\\)"):
        load_target(copy, cpu_plan("float32", "nf4"))


def test_corrupt_config_is_named(model_copy: Path) -> None:
    (model_copy / "config.json").write_text('{"model_type": "qwen3",')
    with pytest.raises(DflashError, match="config.json is not valid JSON") as info:
        load_target(model_copy, cpu_plan())
    assert str(model_copy / "config.json") in info.value.message


def test_missing_shard_is_named(tmp_path: Path) -> None:
    model_dir = make_tiny_qwen3(tmp_path / "sharded", max_shard_size="100KB", with_tokenizer=False)
    shards = sorted(model_dir.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(DflashError, match=f"incomplete: {shards[1].name} missing"):
        load_target(model_dir, cpu_plan())


def test_truncated_safetensors_is_refused(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(DflashError, match="corrupt or truncated") as info:
        load_target(model_copy, cpu_plan())
    assert str(weights) in info.value.message and "dflash pull" in info.value.fix


def test_garbage_safetensors_header_is_refused(model_copy: Path) -> None:
    (model_copy / "model.safetensors").write_bytes((20).to_bytes(8, "little") + b"not json at all!!!!!" + b"\0" * 64)
    with pytest.raises(DflashError, match="unreadable safetensors header"):
        load_target(model_copy, cpu_plan())


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [("not-a-model", "model_type 'not-a-model'"), ("t5", "not a causal language model")],
)
def test_unknown_architecture_is_refused(model_copy: Path, model_type: str, expected: str) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    config["model_type"] = model_type
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(DflashError, match=expected) as info:
        load_target(model_copy, cpu_plan())
    assert "transformers" in info.value.fix


def test_memory_refusal_before_loading(tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "available_memory", lambda device: 100_000)  # a 100 kB machine
    with pytest.raises(DflashError, match=r"needs about .* but only 100.0 kB is free") as info:
        load_models(recipe(str(tiny_qwen3_dir)), cpu_plan(), with_drafter=False)
    assert "--quant nf4" in info.value.fix and "smaller recipe" in info.value.fix
    with pytest.raises(DflashError) as info:
        load_target(tiny_qwen3_dir, cpu_plan("float32", "nf4", estimated_bytes=10**12))
    assert "1.0 TB" in info.value.message and "--quant nf4" not in info.value.fix
    monkeypatch.setattr(loading, "available_memory", lambda device: 10**9)
    assert load_target(tiny_qwen3_dir, cpu_plan()) is not None  # the same model fits a 1 GB budget


def test_tokenizer_with_chat_template(tiny_qwen3_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_qwen3_dir, recipe(str(tiny_qwen3_dir)))
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer.encode("Hello, world!")) == "Hello, world!"


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    model_dir = make_tiny_qwen3(tmp_path / "m", with_tokenizer=False)
    with pytest.raises(DflashError, match="cannot load the tokenizer"):
        load_tokenizer(model_dir)


def test_loading_display_restores_transformers_bars(tiny_qwen3_dir: Path) -> None:
    console = Console(file=StringIO(), force_terminal=True)
    load_target(tiny_qwen3_dir, cpu_plan(), console=console)
    assert hf_logging.is_progress_bar_enabled()
    assert "loading" in console.file.getvalue()


def test_load_models_with_a_local_drafter(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    from helpers.drafters import save_random_drafter

    target = load_target(tiny_qwen3_dir, cpu_plan())
    drafter_dir = save_random_drafter(tmp_path / "drafter", target, block_size=4)
    loaded = load_models(recipe(str(tiny_qwen3_dir), str(drafter_dir)), cpu_plan())
    assert loaded.drafter is not None and loaded.drafter_dir == drafter_dir.resolve()
    assert loaded.target_dir == tiny_qwen3_dir.resolve()


@pytest.mark.slow
def test_bitsandbytes_import_says_nothing_the_plan_says_better() -> None:
    """bitsandbytes' import warns about an optional CPU kernel package on CPUs with AVX512-BF16; loading an NF4
    target imports it quietly (the plan's note on NF4 off CUDA is what the user reads)."""

    def stderr(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr

    ops = logging.getLogger("bitsandbytes.backends.cpu.ops")  # the logger its import warns on
    with loading.quiet_bitsandbytes_import():
        assert not ops.isEnabledFor(logging.WARNING) and ops.isEnabledFor(logging.ERROR)
    assert ops.isEnabledFor(logging.WARNING)  # restored for whoever logs next
    if "kernels" in stderr("import bitsandbytes"):  # (a CPU where the real import warns: there it says nothing)
        quiet = "from dflash_cli.loading.models import quiet_bitsandbytes_import as q\nwith q(): import bitsandbytes"
        assert "kernels" not in stderr(quiet)


# Gemma's rule, as its templates enforce it: no system role, user and assistant strictly alternating.
STRICT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('Only user and assistant roles') }}"
    "{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Roles must alternate') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "conversation, folded",
    [
        ([("system", "S"), ("user", "u")], [("user", "S\n\nu")]),
        ([("user", "u"), ("system", "S")], [("user", "u\n\nS")]),  # Claude Code's mid-conversation system text
        (
            [("system", "S"), ("user", "u"), ("assistant", "a"), ("system", "T"), ("system", "W"), ("user", "v")],
            [("user", "S\n\nu"), ("assistant", "a"), ("user", "T\n\nW\n\nv")],
        ),
        ([("user", "u"), ("assistant", "a"), ("system", "T")], [("user", "u"), ("assistant", "a"), ("user", "T")]),
    ],
)
def test_a_template_without_system_messages_gets_them_folded_into_user_turns_in_order(
    conversation: list[tuple[str, str]], folded: list[tuple[str, str]]
) -> None:
    """A template that renders no system message (Gemma's) gets the conversation with its system messages as text
    of the nearest user turn, order kept (as ollama folds a system prompt); a template that renders them gets
    them as sent."""
    from dflash_cli.loading.session import apply_chat_template
    from helpers.tiny_models import tiny_tokenizer

    messages = [{"role": role, "content": text} for role, text in conversation]
    tokenizer = tiny_tokenizer()
    assert (
        apply_chat_template(tokenizer, messages, {})
        == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    tokenizer.chat_template = STRICT_TEMPLATE
    expected = tokenizer.apply_chat_template(
        [{"role": role, "content": text} for role, text in folded], add_generation_prompt=True, tokenize=True
    )
    assert apply_chat_template(tokenizer, messages, {}) == list(expected["input_ids"])
    with pytest.raises(DflashError, match="Roles must alternate"):  # what folding cannot mend is refused as before
        apply_chat_template(tokenizer, [{"role": "assistant", "content": "a"}, *messages], {})
