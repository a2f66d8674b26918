"""Reading a checkpoint without loading it: a model directory's config and safetensors headers (`Checkpoint`: its
tensors, its size in each precision through `setup.sizes`, whether it is pre-quantized), parameter counts from a
meta-device build, and a DFlash drafter's config and weights. Every file is checked (present, parses, whole)
before a byte of it is used; a broken one is a DflashError that says how to fetch it again."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cli.errors import DflashError
from dflash_cli.loading.hub import (
    check_model_dir,
    safetensors_files,
)
from dflash_cli.protocol.drafters import DRAFT_VOCAB_FILE
from dflash_cli.setup.choices import Quant
from dflash_cli.setup.sizes import (
    BYTES_PER_ELEMENT,
    CPU_QUANT_BYTES_PER_PARAM,
    NF4_BYTES_PER_PARAM,
    NF4_BYTES_PER_TENSOR,
    ParameterCounts,
)

if TYPE_CHECKING:
    import torch

    from dflash_cli.engine.drafter import DrafterConfig

_MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


def count_parameters(config: Any) -> ParameterCounts:
    """Build the model of `config` on the meta device (no memory, no weights) and sort its parameters the way the
    weight-only formats treat them: transformers 5 fuses MoE experts into 3-D tensors, which bitsandbytes and the
    CPU formats (they replace nn.Linear only) leave in the compute dtype, so quantizing saves nothing on them."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from dflash_cli.engine.kernels.quantized import quantizable

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    counts = dict.fromkeys(
        ("linear", "experts", "other", "linear_tensors", "int8_left", "int4_left", "int8_outputs"), 0
    )
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied embeddings are one tensor
                continue
            seen.add(id(param))
            if isinstance(module, nn.Linear) and module is not head and name == "weight":
                kind = "linear"
                counts["int8_outputs"] += param.shape[0] if quantizable(module, "int8") else 0
                counts["int8_left"] += 0 if quantizable(module, "int8") else param.numel()
                counts["int4_left"] += 0 if quantizable(module, "int4") else param.numel()
            elif param.dim() >= 3 and not isinstance(module, nn.modules.conv._ConvNd):
                kind = "experts"
            else:
                kind = "other"
            counts[kind] += param.numel()
            counts["linear_tensors"] += kind == "linear"
    plain_head = quantizable(head, "int8")  # what engine.kernels.quantized.quantize_target turns into int8
    return ParameterCounts(
        **counts,
        head=head.weight.numel() if plain_head else 0,
        head_tied=plain_head and head.weight is model.get_input_embeddings().weight,
        head_outputs=head.weight.shape[0] if plain_head else 0,
    )


@dataclass
class Checkpoint:
    """What the files of a model directory say, read without loading any tensor."""

    path: Path
    config: dict[str, Any]
    weight_files: list[Path]
    # per tensor: (name, number of elements, bytes stored); enough to size the model in any dtype or quantization
    tensors: list[tuple[str, int, int]]

    @property
    def stored_bytes(self) -> int:
        return sum(size for _, _, size in self.tensors)

    @property
    def prequantized(self) -> str | None:
        """The quantization the checkpoint is published in ("mxfp4", "fp8", ...), None for plain weights."""
        quantization = self.config.get("quantization_config")
        return quantization.get("quant_method") if isinstance(quantization, dict) else None

    @functools.cached_property
    def parameter_counts(self) -> ParameterCounts | None:
        """The model's parameters as transformers builds it; None where the config is not a transformers model."""
        from transformers import AutoConfig

        try:
            return count_parameters(AutoConfig.from_pretrained(self.path))
        except Exception:  # any failure here only means: size it from the tensors instead
            return None

    def nbytes(self, dtype: str, quant: str = "none", native: tuple[str, ...] = ()) -> int:
        """Weight bytes once loaded as `dtype`, quantizing the linear layers when `quant` is "nf4", "int4" or
        "int8". A
        pre-quantized checkpoint that the device runs natively (`native`) keeps its stored size."""
        if self.prequantized is not None and (self.prequantized == quant or self.prequantized in native):
            return self.stored_bytes
        counts = self.parameter_counts
        if counts is not None:
            return counts.nbytes(dtype, quant)
        dtype_bytes = BYTES_PER_ELEMENT[dtype]
        total = 0.0
        for name, numel, _ in self.tensors:
            # by name: a per-expert weight (".experts.") is fused on load, and bitsandbytes leaves fused experts
            quantized = Quant(quant).quantizes_on_load and name.endswith("proj.weight")
            if not quantized or ".experts." in name:
                total += numel * dtype_bytes
            elif quant == "nf4":
                total += numel * NF4_BYTES_PER_PARAM + NF4_BYTES_PER_TENSOR
            else:
                total += numel * CPU_QUANT_BYTES_PER_PARAM[quant]
        return int(total)


def read_checkpoint(model_dir: Path) -> Checkpoint:
    """Parse config.json and every safetensors header of `model_dir`; DflashError for any broken file."""
    check_model_dir(model_dir)
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise DflashError(
            f"{config_path} is not valid JSON ({exc})",
            fix="delete it and re-run `dflash pull`, or restore it from the original model",
        ) from None
    if not isinstance(config, dict):
        raise DflashError(f"{config_path} does not hold a JSON object", fix="restore it from the original model")
    weight_files = safetensors_files(model_dir)
    tensors = [t for f in weight_files for t in _safetensors_tensors(f)]
    return Checkpoint(model_dir, config, weight_files, tensors)


def corrupt_file_error(where: str, detail: str) -> DflashError:
    return DflashError(
        f"{where} is corrupt or truncated ({detail})",
        fix="delete it and re-run `dflash pull` (an interrupted download leaves such files), "
        "or copy it again from the original model",
    )


def _safetensors_tensors(path: Path) -> list[tuple[str, int, int]]:
    """(name, numel, stored bytes) of each tensor in a safetensors file, checking the file holds every byte its
    header claims."""
    return [(name, math.prod(t.shape), t.end - t.begin) for name, t in safetensors_header(path).items()]


@dataclass(frozen=True)
class StoredTensor:
    """A tensor in a safetensors file: its dtype as the format names it ("BF16", "F32", ...), its shape, and the
    byte range of its data in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file by name, from its header; the file checked to hold every byte the header
    claims (a DflashError that says how to fetch it again, if not)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < header_len <= min(size - 8, _MAX_HEADER_BYTES):
            raise corrupt_file_error(f"file {path}", f"{size} bytes, no complete safetensors header")
        try:
            header = json.loads(f.read(header_len))
            start = 8 + header_len
            tensors = {
                name: StoredTensor(
                    str(entry["dtype"]),
                    tuple(int(n) for n in entry["shape"]),
                    start + int(entry["data_offsets"][0]),
                    start + int(entry["data_offsets"][1]),
                )
                for name, entry in header.items()
                if name != "__metadata__"
            }
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            raise corrupt_file_error(f"file {path}", "unreadable safetensors header") from None
    data_end = max((t.end for t in tensors.values()), default=start)
    if size < data_end:
        raise corrupt_file_error(f"file {path}", f"{size} bytes on disk, its header describes {data_end}")
    return tensors


def read_drafter_config(directory: Path) -> DrafterConfig:
    from dflash_cli.engine.drafter import DrafterConfig

    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise DflashError(
            f"no config.json in drafter directory {directory}", fix="point at a DFlash drafter directory or repo id"
        ) from None
    except json.JSONDecodeError as exc:
        raise DflashError(
            f"{path} is not valid JSON ({exc})", fix="delete the file and download the drafter again (`dflash pull`)"
        ) from None
    return DrafterConfig.from_dict(raw, source=str(path))


def read_draft_vocabulary(directory: Path, config: DrafterConfig) -> torch.Tensor:
    """The drafter's draft vocabulary (dflash_config.draft_vocab_size): its DRAFT_VOCAB_FILE, checked to list that
    many target ids, ascending and distinct (positions are looked up in it)."""
    import torch

    path, size, limit = directory / DRAFT_VOCAB_FILE, config.draft_vocab_size, config.vocab_size
    try:
        ids = json.loads(path.read_text())
    except FileNotFoundError:
        raise DflashError(
            f"drafter {directory} sets dflash_config.draft_vocab_size but has no {DRAFT_VOCAB_FILE}",
            fix="download the drafter again (`dflash pull`), or copy the whole directory `dflash train` wrote",
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DflashError(f"cannot read {path} ({exc})", fix="download the drafter again (`dflash pull`)") from None
    whole = isinstance(ids, list) and len(ids) == size and all(type(i) is int for i in ids)
    if not whole or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] >= limit:
        raise DflashError(
            f"{path} must list {size} distinct target token ids below {limit}, ascending "
            "(dflash_config.draft_vocab_size)",
            fix="use the drafter directory `dflash train` wrote, unedited",
        )
    return torch.tensor(ids, dtype=torch.long)


def read_drafter_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(directory.glob("*.safetensors"))]
    if not files:
        raise DflashError(
            f"no .safetensors weights in drafter directory {directory}",
            fix="only safetensors checkpoints are loaded; download the drafter again",
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.exists():
            raise DflashError(f"drafter shard {path} is missing", fix="download the drafter again (`dflash pull`)")
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError) as exc:
            raise DflashError(
                f"drafter weights {path} are corrupt or truncated ({exc})",
                fix="delete the file and download the drafter again (`dflash pull`)",
            ) from None
    return state
