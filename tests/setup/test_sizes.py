"""One model's size, counted by every part that counts it, agrees: the planner (from a recipe's listed sizes, made as
scripts/recipe_sizes.py makes them), the loader's memory check (from the checkpoint's files), doctor's speed bound,
the GPU benchmark (the loaded module, NF4's quantization data included) and the roofline (what a step reads)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dflash_cli.loading.checkpoint import read_checkpoint
from dflash_cli.loading.models import load_target
from dflash_cli.setup.planning import Plan, expected_speed, target_weight_bytes
from dflash_cli.setup.recipes import adhoc_recipe
from dflash_cli.setup.sizes import (
    BYTES_PER_ELEMENT,
    module_weight_bytes,
    recipe_stored_bytes,
    step_bytes,
    tensor_bytes,
)


def cpu_plan(dtype: str, quant: str = "none") -> Plan:
    return Plan("cpu", dtype, quant, None, "sdpa", "cpu", None, None, ())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_count_of_one_models_size_agrees(tiny_qwen3_dir: Path, dtype: str) -> None:
    checkpoint = read_checkpoint(tiny_qwen3_dir)
    counts = checkpoint.parameter_counts
    assert counts is not None and counts.linear > 0
    listed = {"bf16": counts.nbytes("bfloat16"), "nf4": counts.nbytes("bfloat16", "nf4")}
    recipe = dataclasses.replace(adhoc_recipe(str(tiny_qwen3_dir), None), weight_bytes=listed)

    planned = target_weight_bytes(recipe, dtype, "none")
    target = load_target(tiny_qwen3_dir, cpu_plan(dtype))
    held = module_weight_bytes(target)
    assert planned == checkpoint.nbytes(dtype) == held == counts.total * BYTES_PER_ELEMENT[dtype]
    assert expected_speed(recipe, cpu_plan(dtype), 1e9).bytes_per_token == planned  # doctor's bound
    assert recipe_stored_bytes(recipe) == listed["bf16"]  # doctor's disk check: the checkpoint as listed

    # the roofline reads every weight but the input embedding's unused rows (this model does not tie it)
    embedding = target.get_input_embeddings().weight
    assert target.get_output_embeddings().weight is not embedding
    unread = tensor_bytes(embedding) - embedding.shape[-1] * embedding.element_size()
    assert step_bytes(target, 0).weights == held - unread


def test_nf4_counts_agree_with_what_bitsandbytes_holds(tiny_qwen3_dir: Path) -> None:
    checkpoint = read_checkpoint(tiny_qwen3_dir)
    counts = checkpoint.parameter_counts
    listed = {"bf16": counts.nbytes("bfloat16"), "nf4": counts.nbytes("bfloat16", "nf4")}
    recipe = dataclasses.replace(adhoc_recipe(str(tiny_qwen3_dir), None), weight_bytes=listed)

    planned = target_weight_bytes(recipe, "bfloat16", "nf4")
    assert planned == checkpoint.nbytes("bfloat16", "nf4")
    held = module_weight_bytes(load_target(tiny_qwen3_dir, cpu_plan("bfloat16", "nf4")))
    # (packing rounds each tensor's blocks up: a few bytes per tensor)
    assert held == pytest.approx(planned, rel=0.005)
    assert held < checkpoint.nbytes("bfloat16")  # it did quantize
