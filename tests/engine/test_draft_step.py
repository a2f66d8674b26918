"""The drafter's exported step (AOTInductor, engine.drafter.step): the eager drafter's numbers over a one-slot cache
(bit-equal in bf16), the golden sets in float32 through it and the target's step, a failed call falling back to the
eager forward, and the drafters it does not cover running eagerly."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from test_compiled import FIXTURES
from transformers import AutoModelForCausalLM

from dflash_cli import load_drafter
from dflash_cli.engine import SamplingParams, collect, generate
from dflash_cli.engine.drafter import step as draft_step
from dflash_cli.engine.drafter.model import make_drafter
from dflash_cli.engine.kernels import use_cpu_products
from dflash_cli.engine.target import exported
from dflash_cli.loading.session import load_exported_step
from helpers.drafters import drafter_config, random_drafter
from helpers.tiny_models import build_tiny


def _drafter(target, fmt: str, causal: bool | None, dtype: torch.dtype):  # noqa: ANN001, ANN202
    """A random drafter of `fmt` whose layers all attend to the full buffer (causal or not)."""
    config = drafter_config(target, num_layers=2, block_size=4, fmt=fmt)
    config = dataclasses.replace(config, layer_types=["full_attention"] * 2, sliding_window=None, is_causal=causal)
    torch.manual_seed(3)
    drafter = make_drafter(config, target).to(dtype).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("base_kernel"):
                p.add_(torch.randn_like(p) * 0.3)
    use_cpu_products(drafter)
    return drafter


def _draft_calls(drafter, dtype: torch.dtype):  # noqa: ANN001, ANN202
    """The hidden states of a prompt's first draft, then four steps of 1-4 new context rows, and the cache after."""
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    torch.manual_seed(5)
    contexts = [torch.randn(1, c, width).to(dtype) for c in (9, 1, 4, 2, 1)]
    cache = drafter.new_cache(8, 4)  # (grown by the calls, as the loop's caches are)
    start, hidden = 0, []
    for context in contexts:
        start += context.shape[1]
        block = torch.tensor([[start % 7 + 1] + [drafter.mask_token_id] * 3])
        with torch.no_grad():
            hidden.append(drafter.draft_hidden([context], block, [start], cache))
    return hidden, cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("fmt", "causal"), [("classic", None), ("classic", True), ("dflash2", False)])
def test_the_exported_draft_step_is_the_eager_forward(
    fmt: str, causal: bool | None, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16: every call's hidden states and the cache's K/V bit-equal to the eager forward's; float32: within
    rounding (inductor's float32 kernels sum in their own order)."""
    target = build_tiny("qwen3", 2).to(dtype)
    use_cpu_products(target)
    drafter = _drafter(target, fmt, causal, dtype)
    eager, eager_cache = _draft_calls(drafter, dtype)
    assert draft_step.exported_draft_step(drafter, build_missing=True) is not None
    calls = []
    call = draft_step.ExportedDraftStep.__call__
    monkeypatch.setattr(draft_step.ExportedDraftStep, "__call__", lambda s, *a: calls.append(1) or call(s, *a))
    got, cache = _draft_calls(drafter, dtype)
    draft_step.unload(drafter)
    assert len(calls) == len(eager) and cache.length == eager_cache.length == 17
    n = eager_cache.length
    for ours, theirs in [*zip(got, eager), *zip(cache.keys + cache.values, eager_cache.keys + eager_cache.values)]:
        ours, theirs = (
            ours[..., :n, :] if ours.dim() == 4 else ours,
            theirs[..., :n, :] if theirs.dim() == 4 else theirs,
        )
        if dtype == torch.bfloat16:
            assert torch.equal(ours, theirs)
        else:
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_golden_sets_through_both_exported_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: the reference's tokens and acceptance lengths with the target's and the drafter's every step run by
    their packages (the golden sets whose drafters attend to full buffers)."""
    target = AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3-tiny" / "target", dtype=torch.float32).eval()
    use_cpu_products(target)
    assert exported.exported_step(target, build_missing=True) is not None
    ran = []
    call = draft_step.ExportedDraftStep.__call__
    monkeypatch.setattr(draft_step.ExportedDraftStep, "__call__", lambda s, *a: ran.append(1) or call(s, *a))
    try:
        for name in ["qwen3-tiny", "reference-extra/causal-full-attention"]:
            golden = json.loads((FIXTURES / name / "golden.json").read_text())
            drafter = load_drafter(FIXTURES / name / golden.get("drafter_dir", "drafter"), target)
            assert draft_step.exported_draft_step(drafter, build_missing=True) is not None
            for case in golden["cases"]:
                params = SamplingParams(max_new_tokens=golden["max_new_tokens"])
                steps = generate(target, drafter, case["prompt_ids"], params, block_size=case.get("block_size"))
                result = collect(steps)
                assert result.token_ids == case["new_token_ids"], (name, case["prompt_ids"][:4])
                assert result.acceptance_lengths == case["acceptance_lengths"], (name, case["prompt_ids"][:4])
            draft_step.unload(drafter)
    finally:
        exported.unload(target)
    assert len(ran) > 50


def test_a_failing_draft_step_runs_eagerly_from_then_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaded step raising mid-generation: a warning, the eager drafter from then on, the same tokens."""
    target = build_tiny("qwen3", 2)
    use_cpu_products(target)
    drafter = random_drafter(target, seed=2, block_size=4)
    params = SamplingParams(max_new_tokens=12)
    expected = collect(generate(target, drafter, [5, 17, 42], params))
    step = draft_step.exported_draft_step(drafter, build_missing=True)
    assert step is not None
    refusing = SimpleNamespace(boxed_run=lambda flat: (_ for _ in ()).throw(RuntimeError("shape guard")))
    monkeypatch.setattr(step.package, "runner", SimpleNamespace(loader=refusing))
    with pytest.warns(UserWarning, match=r"exported draft step failed \(shape guard\); running it eagerly"):
        result = collect(generate(target, drafter, [5, 17, 42], params))
    assert result.token_ids == expected.token_ids and result.acceptance_lengths == expected.acceptance_lengths
    assert draft_step.loaded_draft_step(drafter) is None


def test_a_loaded_draft_step_changes_the_cost_key() -> None:
    """Draft costs measured on the eager drafter are not the package's."""
    from dflash_cli.engine.policy import cost_key

    target = build_tiny("qwen3", 2)
    drafter = random_drafter(target, seed=2, block_size=4)
    assert not cost_key(target, drafter, compile=False)["drafter_exported"]
    assert draft_step.exported_draft_step(drafter, build_missing=True) is not None
    assert cost_key(target, drafter, compile=False)["drafter_exported"]
    draft_step.unload(drafter)


@pytest.mark.parametrize("fmt", ["swa", "dflash2"])
def test_sliding_drafters_have_no_exported_step(fmt: str) -> None:
    target = build_tiny("qwen3", 2)
    drafter = random_drafter(target, seed=2, fmt=fmt, num_layers=2)
    assert "sliding-window layers" in draft_step.unsupported(drafter)
    assert draft_step.exported_draft_step(drafter, build_missing=True) is None
    step, why = load_exported_step(drafter, build=True, console=None, part="drafter")
    assert step is None and why.startswith("no compiled CPU step for this drafter: sliding-window layers")


def test_a_later_start_loads_the_stored_draft_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stored once, found by a later load (a drafter of the same shapes: any checkpoint of them); `--compile auto`'s
    load without building finds nothing for other shapes; the reason line names the package."""
    target = build_tiny("qwen3", 2)
    first = random_drafter(target, seed=2, block_size=4)
    step, why = load_exported_step(first, build=True, console=None, part="drafter")
    assert step is not None and why == f"exported step: the drafter's step runs compiled ahead of time ({step.path})"
    later = random_drafter(target, seed=7, block_size=4)  # other weights, the same shapes
    eager, _ = _draft_calls(later, torch.float32)
    monkeypatch.setattr(draft_step, "build", lambda *a: pytest.fail("built again"))
    assert draft_step.exported_draft_step(later, build_missing=False).path == step.path
    got, _ = _draft_calls(later, torch.float32)  # bound to its own weights
    for ours, theirs in zip(got, eager):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    other = random_drafter(target, seed=2, block_size=4, num_layers=3)
    assert draft_step.exported_draft_step(other, build_missing=False) is None
    for drafter in (first, later):
        draft_step.unload(drafter)


def test_a_build_deletes_the_packages_earlier_builds_left(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Packages are named `{kind}-{build}-{model}`: building one removes the packages of its kind that another build
    (versions, code, CPU) made, and those named before builds were named, and keeps other models' of this build."""
    from dflash_cli.engine import packages

    monkeypatch.setattr(packages, "packages_dir", lambda: tmp_path)
    target = build_tiny("qwen3", 2)
    drafter = random_drafter(target, seed=2, block_size=4)
    path = draft_step.package_path(drafter)
    kind, build, _ = path.stem.split("-")
    kept = [tmp_path / f"{kind}-{build}-{'a' * 16}.pt2", tmp_path / f"qwen3-{'0' * 8}-{'b' * 16}.pt2"]
    stale = [tmp_path / f"{kind}-{'0' * 8}-{'c' * 16}.pt2", tmp_path / f"{kind}-{'d' * 20}.pt2"]
    for other in kept + stale:
        other.write_bytes(b"a package")
    assert draft_step.exported_draft_step(drafter, build_missing=True).path == path
    draft_step.unload(drafter)
    assert sorted(tmp_path.glob("*.pt2")) == sorted([path, *kept])
