"""The drafter's exported steps (AOTInductor, engine.drafter.compiled_step): the eager drafter's numbers for one sequence and
for several rows of a batch (bit-equal in bf16), the golden sets in float32 through them and the target's step, a
failed call falling back to the eager forward, the cost key, and packages stored once and pruned."""

from __future__ import annotations

import dataclasses
import os
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_cli.engine import SamplingParams, collect, generate
from dflash_cli.engine.drafter import compiled_step as draft_step
from dflash_cli.engine.drafter.model import make_drafter
from dflash_cli.engine.kernels.layers import use_cpu_products
from dflash_cli.engine.target import compiled_step
from dflash_cli.loading.compiled_steps import load_exported_step
from helpers.drafters import drafter_config, random_drafter
from helpers.golden import FIXTURES, GOLDEN_SETS, check_golden_sets
from helpers.runs import run_batch
from helpers.tiny_models import build_tiny

FORMAT_SETS = [
    "qwen3-tiny-swa",
    "reference-extra/dflash2-kernel3-group32",
]
# (format, causal): full layers (classic; DFlash2's convolutions, causal), then sliding layers (a ring): causal
# (swa), and both sides (DFlash2)
KINDS = [("classic", None), ("dflash2-full", True), ("swa", None), ("dflash2", None)]


def _drafter(target, fmt: str, causal: bool | None, dtype: torch.dtype):
    """A random two-layer drafter of `fmt` ("...-full": every layer full attention), causal where asked."""
    config = drafter_config(target, num_layers=2, block_size=4, fmt=fmt.removesuffix("-full"))
    if fmt.endswith("-full"):
        config = dataclasses.replace(config, layer_types=["full_attention"] * 2, sliding_window=None)
    if causal is not None:
        config = dataclasses.replace(config, is_causal=causal)
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


def _width(drafter) -> int:
    return len(drafter.config.target_layer_ids) * drafter.config.hidden_size


def _one_sequence(drafter, dtype: torch.dtype):
    """A prompt's first draft, then four steps of 1-4 new context rows and blocks of 2-4 (views of a wider block,
    as the loop passes them): each call's hidden states, and the cache."""
    torch.manual_seed(5)
    contexts = [torch.randn(1, c, _width(drafter)).to(dtype) for c in (9, 1, 4, 2, 1)]
    cache = drafter.new_cache(8, 4)  # (grown by the calls, as the loop's caches are)
    start, hidden = 0, []
    for context, width in zip(contexts, (4, 2, 3, 4, 2)):
        start += context.shape[1]
        block = torch.tensor([[start % 7 + 1] + [drafter.mask_token_id] * 5])
        with torch.no_grad():
            hidden.append(drafter.draft_hidden([context], block[:, :width], [start], cache))
    return hidden, cache


def _several_rows(drafter, dtype: torch.dtype):
    """Three slots: two rows' first drafts, then rows in slots 2 and 0 (not contiguous) with padded blocks, then all
    three (blocks as views of wider ones, as the loop passes them): each call's hidden states of the real block
    slots, and the cache."""
    torch.manual_seed(6)
    cache = drafter.new_cache(8, 4, slots=3)
    lengths, hidden = [0, 0, 0], []
    calls = [([0, 1], [6, 3], [4, 4]), ([2, 0], [5, 2], [3, 2]), ([0, 1, 2], [1, 3, 2], [3, 4, 4]), ([1], [1], [2])]
    for slots, contexts, sizes in calls:
        features = [torch.randn(1, c, _width(drafter)).to(dtype) for c in contexts]
        starts = []
        for slot, c in zip(slots, contexts):
            lengths[slot] += c
            starts.append(lengths[slot])
        block = torch.tensor([[s % 5 + 1] + [drafter.mask_token_id] * 5 for s in starts])
        with torch.no_grad():
            out = drafter.draft_hidden(features, block[:, : max(sizes)], starts, cache, sizes=sizes, slots=slots)
        hidden += [out[i, : size - 1] for i, size in enumerate(sizes)]
    return hidden, cache


def _assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor], dtype: torch.dtype) -> None:
    for a, b in zip(ours, theirs, strict=True):
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:  # inductor's float32 kernels sum in their own order
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _cached(cache) -> list[torch.Tensor]:
    """What a cache's layers hold that a later query can see: full layers their committed positions, rings all."""
    return [
        buffer if window is not None else buffer[:, :, : cache.length or None]
        for buffer, window in zip(cache.keys + cache.values, cache.windows * 2)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "causal", "dtype"), [(*kind, torch.bfloat16) for kind in KINDS] + [("dflash2", None, torch.float32)]
)
def test_the_exported_draft_steps_are_the_eager_forward(
    fmt: str, causal: bool | None, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sequence and several rows: every call's hidden states and what the cache holds, bit-equal to the eager
    forward's in bf16 (within rounding in float32), every call through a package."""
    target = build_tiny("qwen3", 2).to(dtype)
    use_cpu_products(target)
    drafter = _drafter(target, fmt, causal, dtype)
    eager = [_one_sequence(drafter, dtype), _several_rows(drafter, dtype)]
    step = draft_step.exported_draft_step(drafter, build_missing=True)
    assert step is not None and (step.one is None) == (fmt in ("swa", "dflash2"))
    calls = []
    for name in ("one_sequence", "several"):
        call = getattr(draft_step.ExportedDraftStep, name)
        monkeypatch.setattr(
            draft_step.ExportedDraftStep, name, lambda s, *a, call=call, name=name: calls.append(name) or call(s, *a)
        )
    got = [_one_sequence(drafter, dtype), _several_rows(drafter, dtype)]
    draft_step.unload(drafter)
    assert calls.count("one_sequence") == 5 and calls.count("several") >= 4
    for (hidden, cache), (eager_hidden, eager_cache) in zip(got, eager):
        assert cache.length == eager_cache.length
        _assert_same(hidden, eager_hidden, dtype)
        _assert_same(_cached(cache), _cached(eager_cache), dtype)


@pytest.mark.slow
def test_golden_sets_through_both_exported_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: the reference's tokens and acceptance lengths with the target's and the drafter's every step run by
    their packages, a golden set of each drafter format: classic, sliding layers (through the rows' step), DFlash2
    with a full layer and a sliding one."""
    assert set(FORMAT_SETS) <= set(GOLDEN_SETS)
    target = AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3-tiny" / "target", dtype=torch.float32).eval()
    use_cpu_products(target)
    assert compiled_step.exported_step(target, build_missing=True) is not None
    ran = []
    call = draft_step.ExportedDraftStep.one_sequence
    monkeypatch.setattr(draft_step.ExportedDraftStep, "one_sequence", lambda s, *a: ran.append(1) or call(s, *a))

    def prepare(drafter) -> None:
        assert draft_step.exported_draft_step(drafter, build_missing=True) is not None

    try:
        check_golden_sets(["qwen3-tiny", *FORMAT_SETS], compile=False, target=target, prepare=prepare)
    finally:
        compiled_step.unload(target)
    assert len(ran) > 100


@pytest.mark.slow
def test_a_batch_drafts_through_the_rows_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows decoding together draft in one call of the rows' package, with the eager batch's drafts (its acceptance
    lengths) and tokens, which are each row's tokens alone."""
    target = build_tiny("qwen3", 2).to(torch.bfloat16)
    use_cpu_products(target)
    drafter = _drafter(target, "classic", None, torch.bfloat16)
    params = SamplingParams(max_new_tokens=12)
    prompts = [[5, 17, 42, 9, 33], [8, 9, 3, 3, 11, 12, 30], [44] * 13]
    requests = [(p, params, i) for i, p in enumerate(prompts)]
    alone = [collect(generate(target, drafter, p, params)).token_ids for p in prompts]
    eager, _ = run_batch(target, drafter, requests, rows=3)
    assert draft_step.exported_draft_step(drafter, build_missing=True) is not None
    calls = []
    call = draft_step.ExportedDraftStep.several
    monkeypatch.setattr(
        draft_step.ExportedDraftStep, "several", lambda s, f, *a: calls.append(f.rows) or call(s, f, *a)
    )
    got, widest = run_batch(target, drafter, requests, rows=3)
    draft_step.unload(drafter)
    assert widest > 1 and got == eager and [g[0] for g in got] == alone
    assert any(not isinstance(rows, slice) or rows.stop - rows.start > 1 for rows in calls)


@pytest.mark.slow
def test_without_dflash_kernels_the_steps_round_as_eager_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 products on MKL (another CPU, no compiler): a one-row context product runs as two in eager, and so in the
    steps (a package of its own: the key differs); every call bit-equal to the eager forward, one-row contexts
    included."""
    from dflash_cli.engine.kernels import native

    monkeypatch.setattr(native, "available", lambda: False)
    target = build_tiny("qwen3", 2).to(torch.bfloat16)
    use_cpu_products(target)
    drafter = _drafter(target, "classic", None, torch.bfloat16)
    eager = [_one_sequence(drafter, torch.bfloat16), _several_rows(drafter, torch.bfloat16)]
    step = draft_step.exported_draft_step(drafter, build_missing=True)
    assert step is not None and draft_step.DraftStep(drafter).extra == 1
    got = [_one_sequence(drafter, torch.bfloat16), _several_rows(drafter, torch.bfloat16)]
    draft_step.unload(drafter)
    for (hidden, cache), (eager_hidden, eager_cache) in zip(got, eager):
        _assert_same(hidden, eager_hidden, torch.bfloat16)
        _assert_same(_cached(cache), _cached(eager_cache), torch.bfloat16)


@pytest.mark.slow
def test_a_failing_draft_step_runs_eagerly_from_then_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaded step raising mid-generation (after calls that ran): a warning, the eager drafter from then on,
    the same tokens and drafts."""
    target = build_tiny("qwen3", 2)
    use_cpu_products(target)
    drafter = random_drafter(target, seed=2, block_size=4)
    params = SamplingParams(max_new_tokens=16)
    expected = collect(generate(target, drafter, [5, 17, 42], params))
    step = draft_step.exported_draft_step(drafter, build_missing=True)
    assert step is not None
    runs = step.one.runner.loader.boxed_run
    calls = []

    def boxed_run(flat):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("shape guard")
        return runs(flat)

    monkeypatch.setattr(step.one, "runner", SimpleNamespace(loader=SimpleNamespace(boxed_run=boxed_run)))
    with pytest.warns(UserWarning, match=r"exported draft step failed \(shape guard\); running it eagerly"):
        result = collect(generate(target, drafter, [5, 17, 42], params))
    assert len(calls) == 3 and len(result.acceptance_lengths) > 3
    assert result.token_ids == expected.token_ids and result.acceptance_lengths == expected.acceptance_lengths
    assert draft_step.loaded_draft_step(drafter) is None


@pytest.mark.slow
def test_a_loaded_draft_step_changes_the_cost_key() -> None:
    """Draft costs measured on the eager drafter are not the package's."""
    from dflash_cli.engine.policy import cost_key

    target = build_tiny("qwen3", 2)
    drafter = random_drafter(target, seed=2, block_size=4)
    assert not cost_key(target, drafter, compile=False)["drafter_exported"]
    assert draft_step.exported_draft_step(drafter, build_missing=True) is not None
    assert cost_key(target, drafter, compile=False)["drafter_exported"]
    draft_step.unload(drafter)


@pytest.mark.slow
def test_a_later_start_loads_the_stored_draft_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stored once (a build deletes its kind's packages another build left: `stored.prune`), found by a later load
    (a drafter of the same shapes: any checkpoint of them, bound to its own weights); a load without building finds
    nothing for other shapes; the reason line names the packages."""
    from dflash_cli.engine.compiled import stored

    target = build_tiny("qwen3", 2)
    first = random_drafter(target, seed=2, block_size=4, num_layers=2)
    stale = stored.packages_dir() / f"draftrows-{'0' * 8}-{'c' * 16}.pt2"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"a package another build made")
    step, why = load_exported_step(first, build=True, console=None, part="drafter")
    assert step is not None and len(step.paths) == 2 and not stale.exists()
    assert why == f"exported step: the drafter's step runs compiled ahead of time ({step.paths[0]}, {step.paths[1]})"
    later = random_drafter(target, seed=7, block_size=4, num_layers=2)  # other weights, the same shapes
    eager, _ = _one_sequence(later, torch.float32)
    monkeypatch.setattr(draft_step, "build", lambda *a: pytest.fail("built again"))
    assert draft_step.exported_draft_step(later, build_missing=False).paths == step.paths
    got, _ = _one_sequence(later, torch.float32)
    _assert_same(got, eager, torch.float32)
    other = random_drafter(target, seed=2, block_size=4, num_layers=3)
    assert draft_step.exported_draft_step(other, build_missing=False) is None
    for drafter in (first, later):
        draft_step.unload(drafter)


def test_pruning_keeps_this_builds_packages_and_other_kinds(tmp_path) -> None:
    """Packages are named `{kind}-{build}-{model}`: `prune` removes the packages of a kind that another build
    (versions, code, CPU) made, those named before builds were named and the scratch directories of builds killed
    an hour ago; it keeps this build's other models, other kinds and a build running now."""
    from dflash_cli.engine.compiled import stored

    path = tmp_path / f"drafter-{'1' * 8}-{'e' * 16}.pt2"
    kept = [tmp_path / f"drafter-{'1' * 8}-{'a' * 16}.pt2", tmp_path / f"qwen3-{'0' * 8}-{'b' * 16}.pt2"]
    stale = [tmp_path / f"drafter-{'0' * 8}-{'c' * 16}.pt2", tmp_path / f"drafter-{'d' * 20}.pt2"]
    for package in [path, *kept, *stale]:
        package.write_bytes(b"a package")
    killed, building = tmp_path / ".building-killed", tmp_path / ".building-now"  # scratch directories of builds
    for scratch in (killed, building):
        scratch.mkdir()
        (scratch / path.name).write_bytes(b"half a package")
    os.utime(killed, (time.time() - 7200, time.time() - 7200))
    assert sorted(stored.prune(path)) == sorted(stale)
    assert sorted(tmp_path.glob("*.pt2")) == sorted([path, *kept])
    assert not killed.exists() and building.exists()  # (one still running, perhaps)
