"""engine/kernels/memory.py: a loaded model's tensors moved into 2 MB pages, the model unchanged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

from dflash_cli import speculative_generate
from dflash_cli.engine.kernels import memory
from dflash_cli.engine.kernels.memory import huge_pages_unavailable, in_huge_pages
from dflash_cli.engine.kernels.quantized import quantize_target, share_inputs
from helpers.tiny_models import quantizable_tiny

needs_huge_pages = pytest.mark.skipif(
    huge_pages_unavailable() is not None, reason=f"this machine: {huge_pages_unavailable()}"
)


def tensors_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def greedy(model: transformers.PreTrainedModel) -> list[int]:
    return speculative_generate(model, None, [3, 17, 42, 9, 5], max_new_tokens=24).token_ids


def vma_of(address: int) -> str:
    """The /proc/self/smaps entry of the mapping that holds `address`."""
    entries = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text())
    for entry in entries:
        start, end = (int(part, 16) for part in entry.split()[0].split("-"))
        if start <= address < end:
            return entry
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_huge_pages
@pytest.mark.parametrize("kind", ["float32", "int4"])
def test_moved_tensors_share_one_region_in_huge_pages_and_the_model_decodes_the_same(kind: str) -> None:
    model = quantizable_tiny(3, tied=True)
    if kind == "int4":
        quantize_target(model, "int4", torch.bfloat16)
        share_inputs(model)
    before = greedy(model)
    values = {id(t): t.clone() for t in tensors_of(model)}
    objects = {id(t) for t in tensors_of(model)}

    moved = in_huge_pages(model)

    tensors = tensors_of(model)
    assert {id(t) for t in tensors} == objects  # the same tensor objects: modules and ties still hold them
    assert moved >= sum(t.numel() * t.element_size() for t in tensors)
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1
    for tensor in tensors:
        assert torch.equal(tensor, values[id(tensor)])
    if kind == "float32":  # tied: the head's weight is the embedding's, one tensor
        assert model.lm_head.weight is model.model.embed_tokens.weight
    entry = vma_of(tensors[0].data_ptr())
    assert re.search(r"^VmFlags:.* hg\b", entry, re.M), entry  # the region asked for 2 MB pages (MADV_HUGEPAGE)
    assert greedy(model) == before


@needs_huge_pages
def test_views_of_one_storage_stay_views_of_one_storage_and_a_larger_storage_stays(tmp_path: Path) -> None:
    module = torch.nn.Module()
    whole = torch.arange(64, dtype=torch.float32)
    module.register_buffer("first", whole[:32])
    module.register_buffer("second", whole[32:])
    mapped = torch.arange(1000, dtype=torch.float32)
    module.register_buffer("part", mapped[:10])  # its storage holds 990 more than the model's tensors
    (tmp_path / "weights.bin").write_bytes(torch.arange(256, dtype=torch.float32).numpy().tobytes())
    module.register_buffer("read_in_place", torch.from_file(str(tmp_path / "weights.bin"), size=256))
    file_backed = module.read_in_place.data_ptr()  # (as safetensors' weights are: mapped from the file)
    in_huge_pages(module)
    assert module.read_in_place.data_ptr() == file_backed
    assert torch.equal(module.read_in_place, torch.arange(256, dtype=torch.float32))
    assert module.first.untyped_storage().data_ptr() == module.second.untyped_storage().data_ptr()
    assert module.first.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
    module.first[0] = -1.0  # still one storage: a write through one view is seen through the storage
    assert torch.equal(module.second, torch.arange(32, 64, dtype=torch.float32))
    assert module.part.untyped_storage().data_ptr() == mapped.untyped_storage().data_ptr()


def test_switched_off_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.ENVIRONMENT, "0")
    model = quantizable_tiny(4)
    addresses = [t.data_ptr() for t in tensors_of(model)]
    assert huge_pages_unavailable() == f"{memory.ENVIRONMENT}=0"
    assert in_huge_pages(model) == 0
    assert [t.data_ptr() for t in tensors_of(model)] == addresses
