"""`dflash export`: the vLLM / SGLang commands, parsed back with shlex the way a shell would."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from dflash_cli.commands.export import (
    ServingHardware,
    llama_cpp_command,
    serving_hardware,
    sglang_command,
    tensor_parallel_size,
    vllm_command,
)
from dflash_cli.engine.drafter import DrafterConfig
from dflash_cli.errors import DflashError
from dflash_cli.setup.hardware import MachineFacts
from dflash_cli.setup.recipes import ModelRef, adhoc_recipe, get_recipe
from helpers.golden import FIXTURES
from helpers.tiny_models import make_hf_cache

ONE_H100 = ServingHardware(gpu_count=1, gpu_memory=85_000_000_000)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def spec_config(argv: list[str]) -> dict:
    return json.loads(flag(argv, "--speculative-config"))


def test_vllm_command_for_qwen3_8b_parses_back() -> None:
    command = vllm_command(get_recipe("qwen3-8b"), ONE_H100)
    argv = shlex.split(command.shell)
    assert argv == command.argv
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    assert spec_config(argv) == {"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 15}
    assert flag(argv, "--tensor-parallel-size") == "1"
    assert command.text().splitlines()[-1] == command.shell
    assert any("enable_thinking" in note for note in command.notes)


def test_vllm_speculative_tokens_is_block_size_minus_one() -> None:
    assert spec_config(vllm_command(get_recipe("llama3.1-8b"), ONE_H100).argv)["num_speculative_tokens"] == 9
    assert spec_config(vllm_command(get_recipe("gpt-oss-20b"), ONE_H100).argv)["num_speculative_tokens"] == 7


def test_sglang_command_counts_the_whole_block() -> None:
    command = sglang_command(get_recipe("qwen3-8b"), ONE_H100)
    argv = shlex.split(command.shell)
    assert argv[:5] == ["python", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-8B"]
    assert flag(argv, "--speculative-algorithm") == "DFLASH"
    assert flag(argv, "--speculative-draft-model-path") == "z-lab/Qwen3-8B-DFlash-b16"
    assert flag(argv, "--speculative-num-draft-tokens") == "16"
    assert flag(argv, "--tp-size") == "1"


def test_revisions_are_passed_to_both_servers() -> None:
    pinned = dataclasses.replace(
        get_recipe("qwen3-8b"),
        target=ModelRef("Qwen/Qwen3-8B", "t" * 40),
        drafter=ModelRef("z-lab/Qwen3-8B-DFlash-b16", "d" * 40),
    )
    vllm = vllm_command(pinned, ONE_H100).argv
    assert flag(vllm, "--revision") == "t" * 40 and spec_config(vllm)["revision"] == "d" * 40
    sglang = sglang_command(pinned, ONE_H100).argv
    assert flag(sglang, "--revision") == "t" * 40
    assert flag(sglang, "--speculative-draft-model-revision") == "d" * 40


@pytest.mark.parametrize(
    ("weight_bytes", "gpus", "gpu_gb", "expected"),
    [
        (16_380_854_272, 8, 85, 1),  # Qwen3-8B on H100s
        (61_060_000_000, 8, 85, 1),  # 30B MoE bf16: 79 GB with headroom, fits one H100
        (61_060_000_000, 8, 42.4, 2),  # ... two A100-40GB
        (61_060_000_000, 8, 25.3, 4),  # ... four RTX 4090
        (61_060_000_000, 3, 25.3, 2),  # only powers of two split the heads evenly: capped at 2, with a warning
        (13_760_000_000, 1, 25.3, 1),  # gpt-oss-20b in its own MXFP4 weights
    ],
)
def test_tensor_parallel_size(weight_bytes: int, gpus: int, gpu_gb: float, expected: int) -> None:
    tp, note = tensor_parallel_size(weight_bytes, ServingHardware(gpus, int(gpu_gb * 1e9)))
    assert tp == expected
    assert (note is not None) == (tp * gpu_gb * 1e9 < weight_bytes * 1.3)


def test_export_sizes_by_the_checkpoint_precision() -> None:
    four_4090s = ServingHardware(4, 25_300_000_000)
    assert flag(vllm_command(get_recipe("gpt-oss-20b"), four_4090s).argv, "--tensor-parallel-size") == "1"
    assert flag(vllm_command(get_recipe("qwen3-coder-30b-a3b"), four_4090s).argv, "--tensor-parallel-size") == "4"


def test_serving_hardware_from_facts_and_flags() -> None:
    cpu = MachineFacts(kind="cpu")
    assert serving_hardware(cpu) == ServingHardware(None, 80_000_000_000, assumed=True)  # no count: as needed
    # kimi-k2.5's int4 weights (594 GB) with no GPU here: sized to fit (16 x 80 GB), never capped at one GPU
    unknown = serving_hardware(cpu)
    assert tensor_parallel_size(594_000_000_000, unknown) == (16, None)
    exported = vllm_command(get_recipe("kimi-k2.5"), unknown)
    assert flag(exported.argv, "--tensor-parallel-size") == "16"
    assert any("80.0 GB GPUs, as many as the weights need" in note for note in exported.notes)
    assert not any("warning" in note for note in exported.notes)
    assert any("16 GPUs is more than one node of 8" in note for note in exported.notes)
    eight = MachineFacts(kind="cuda", gpu_name="H100", capability=(9, 0), total_memory=85_000_000_000, gpu_count=8)
    assert serving_hardware(eight) == ServingHardware(8, 85_000_000_000, assumed=False)
    assert serving_hardware(eight, gpus=2, gpu_memory_gb=141) == ServingHardware(2, 141_000_000_000, assumed=True)
    with pytest.raises(DflashError):
        serving_hardware(cpu, gpus=0)


def test_block_size_from_the_cached_drafter_config(hf_home: Path, tmp_path: Path) -> None:
    recipe = dataclasses.replace(get_recipe("qwen3-coder-30b-a3b"))
    assert recipe.block_size is None
    uncached = vllm_command(recipe, ONE_H100)
    assert spec_config(uncached.argv)["num_speculative_tokens"] == 15
    assert any("block size 16 assumed" in note for note in uncached.notes)

    config = DrafterConfig(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_target_layers=48,
        block_size=10,
        mask_token_id=151669,
        target_layer_ids=[1, 7, 14, 20, 27, 33, 40, 46],
    )
    source = tmp_path / "drafter"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config.to_dict()))
    make_hf_cache(hf_home, recipe.drafter.id, source)
    cached = sglang_command(recipe, ONE_H100)
    assert flag(cached.argv, "--speculative-num-draft-tokens") == "10"
    assert not any("assumed" in note for note in cached.notes)


def test_local_paths_are_absolute_and_quoted(tmp_path: Path) -> None:
    target = tmp_path / "my models" / "target"
    drafter = tmp_path / "my models" / "drafter"
    target.mkdir(parents=True)
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"block_size": 8}))  # not a valid drafter: must be refused
    recipe = dataclasses.replace(adhoc_recipe(str(target), str(drafter)), block_size=8)
    command = vllm_command(recipe, ONE_H100)
    assert "'" in command.shell  # the space is quoted
    argv = shlex.split(command.shell)
    assert argv[2] == str(target) and spec_config(argv)["model"] == str(drafter)


def test_a_broken_cached_drafter_config_is_an_error(tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"block_size": 8}))
    with pytest.raises(DflashError, match="architectures"):
        vllm_command(adhoc_recipe("Qwen/Qwen3-8B", str(drafter)), ONE_H100)


def test_no_drafter_no_export() -> None:
    with pytest.raises(DflashError, match="no drafter"):
        sglang_command(adhoc_recipe("Qwen/Qwen3-8B", None), ONE_H100)


def test_llama_cpp_command_with_its_gguf_conversion() -> None:
    command = llama_cpp_command(get_recipe("qwen3-8b"), ONE_H100)
    argv = shlex.split(command.shell)
    assert argv == command.argv and argv[0] == "llama-server"
    assert flag(argv, "-m") == "Qwen3-8B-bf16.gguf" and flag(argv, "-md") == "Qwen3-8B-DFlash-b16-bf16.gguf"
    assert flag(argv, "--spec-type") == "draft-dflash"
    assert flag(argv, "--draft-max") == "15"  # drafted tokens: block size 16 minus the anchor
    assert command.setup == [  # commands of their own, not prose among the notes
        "python convert_hf_to_gguf.py $(hf download Qwen/Qwen3-8B) --outtype bf16 --outfile Qwen3-8B-bf16.gguf",
        "python convert_hf_to_gguf.py $(hf download z-lab/Qwen3-8B-DFlash-b16) --outtype bf16 "
        "--outfile Qwen3-8B-DFlash-b16-bf16.gguf",
    ]
    assert not any("convert_hf_to_gguf.py" in note for note in command.notes)
    assert command.to_dict()["setup"] == command.setup
    assert [f"#   {step}" for step in command.setup] == command.text().splitlines()[-3:-1]  # shown under the notes
    assert any("llama-quantize Qwen3-8B-bf16.gguf Qwen3-8B-Q4_K_M.gguf Q4_K_M" in note for note in command.notes)
    assert not any("tensor parallel" in note for note in command.notes)  # llama.cpp splits layers itself


def test_llama_cpp_keeps_a_prequantized_target_as_published(tmp_path: Path) -> None:
    command = llama_cpp_command(get_recipe("gpt-oss-20b"), ONE_H100)
    assert flag(command.argv, "-m") == "gpt-oss-20b-mxfp4.gguf" and flag(command.argv, "--draft-max") == "7"
    assert not any("llama-quantize" in note for note in command.notes)
    local = dataclasses.replace(adhoc_recipe(str(tmp_path / "my model"), str(tmp_path / "d")), block_size=8)
    setup = "\n".join(llama_cpp_command(local, ONE_H100).setup)
    assert f"convert_hf_to_gguf.py '{tmp_path / 'my model'}'" in setup  # a local path, quoted


def test_export_cli_accepts_llama_cpp_spellings() -> None:
    from typer.testing import CliRunner

    from dflash_cli.cli.app import app

    for spelling in ("llama.cpp", "llamacpp", "llama-server"):
        result = CliRunner().invoke(app, ["export", spelling, "qwen3-4b", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["command"][0] == "llama-server"
    assert CliRunner().invoke(app, ["export", "ollama", "qwen3-4b"]).exit_code == 2


def test_a_drafter_with_a_draft_vocabulary_says_other_engines_propose_from_all(tmp_path: Path) -> None:
    config = dataclasses.replace(
        DrafterConfig.from_dict(json.loads((FIXTURES / "qwen3-tiny" / "drafter" / "config.json").read_text())),
        draft_vocab_size=100,
    )
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(config.to_dict()))
    recipe = adhoc_recipe("Qwen/Qwen3-8B", str(drafter))
    for command in (
        vllm_command(recipe, ONE_H100),
        sglang_command(recipe, ONE_H100),
        llama_cpp_command(recipe, ONE_H100),
    ):
        assert any("only the 100 tokens it was trained on" in note for note in command.notes), command.notes
    (drafter / "config.json").write_text(json.dumps(dataclasses.replace(config, draft_vocab_size=None).to_dict()))
    assert not any("tokens it was trained on" in note for note in vllm_command(recipe, ONE_H100).notes)


def test_chat_template_options_are_the_servers_default_where_it_has_one() -> None:
    """Qwen3's drafter wants enable_thinking off: a server-side default (clients such as Open WebUI cannot send it
    with each request) on vLLM and llama-server; SGLang documents none, so its note still says to send it."""
    qwen3 = get_recipe("qwen3-8b")
    assert qwen3.chat_template_kwargs == {"enable_thinking": False}
    vllm = vllm_command(qwen3, ONE_H100)
    assert json.loads(flag(shlex.split(vllm.shell), "--default-chat-template-kwargs")) == {"enable_thinking": False}
    llama = llama_cpp_command(qwen3, ONE_H100)
    assert flag(shlex.split(llama.shell), "--chat-template-kwargs") == '{"enable_thinking":false}'
    for command in (vllm, llama):
        assert not any("send them with each request" in note for note in command.notes)
        assert any("server's default" in note for note in command.notes)
    sglang = sglang_command(qwen3, ONE_H100)
    assert not any("chat-template" in arg for arg in sglang.argv)
    assert any('send them with each request: "chat_template_kwargs"' in note for note in sglang.notes)
    # a recipe without options: no flag, no note; every server's JSON has the same fields
    llama31 = get_recipe("llama3.1-8b")
    for command in (vllm_command(llama31, ONE_H100), sglang_command(llama31, ONE_H100), vllm, sglang, llama):
        assert command.to_dict().keys() == {"command", "shell", "notes", "setup"}
    assert not any("chat-template" in arg for arg in vllm_command(llama31, ONE_H100).argv)
    assert not any("chat-template" in arg for arg in llama_cpp_command(llama31, ONE_H100).argv)


def test_fewer_gpus_than_given_says_why_and_how_to_use_the_rest() -> None:
    """--gpus 3 printed --tensor-parallel-size 1 "for 3 x 80 GB" without a word: the weights fit on one GPU, and 3
    cannot split Qwen3-8B's 32 heads; the rest serve as data-parallel copies."""
    qwen3 = get_recipe("qwen3-8b")
    three = ServingHardware(3, 80_000_000_000, assumed=True)
    vllm = vllm_command(qwen3, three)
    assert flag(vllm.argv, "--tensor-parallel-size") == "1"
    (note,) = [note for note in vllm.notes if note.startswith("tensor parallel size 1 of 3 GPUs")]
    assert "the weights (16.4 GB) fit on 1 GPU" in note and "cannot split the model's 32 attention heads" in note
    assert note.endswith("run 3 copies of the model, data parallel: --data-parallel-size 3")
    assert any(note.endswith("--dp-size 3") for note in sglang_command(qwen3, three).notes)  # SGLang's spelling
    # capped by the heads, with nothing left for a second copy: said, with the GPU that stays idle
    coder = get_recipe("qwen3-coder-30b-a3b")
    capped = vllm_command(coder, ServingHardware(3, 40_000_000_000, assumed=True))
    assert flag(capped.argv, "--tensor-parallel-size") == "2"
    assert any(
        n.startswith("tensor parallel size 2 of 3 GPUs") and n.endswith("the other GPU stays idle")
        for n in capped.notes
    )
    # every GPU used, or the count unknown, or the size unknown, or llama.cpp (it splits layers itself): no such note
    unsized = dataclasses.replace(qwen3, weight_bytes={})
    for command in (
        vllm_command(coder, ServingHardware(4, 25_300_000_000, assumed=True)),
        vllm_command(qwen3, ServingHardware(None, 80_000_000_000, assumed=True)),
        vllm_command(unsized, ServingHardware(4, 80_000_000_000, assumed=True)),
        llama_cpp_command(qwen3, three),
    ):
        assert not any(" GPUs: " in note for note in command.notes), command.notes
