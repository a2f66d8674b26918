"""The target's exported step (AOTInductor, engine.target.compiled_step): built once, stored, loaded by later starts, and
decoding exactly: the golden sets in float32, a block's rows bit-equal to one-token steps in bf16, the standard
step itself bit-equal to transformers' eager forward in bf16."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from dflash_cli.cli.app import app
from dflash_cli.engine import SamplingParams, collect, generate
from dflash_cli.engine.kernels import native
from dflash_cli.engine.kernels.layers import use_cpu_products
from dflash_cli.engine.kernels.quantized import quantize_target
from dflash_cli.engine.target import compiled_step, rounding_cause, standard
from dflash_cli.engine.target.attention import AttentionState
from dflash_cli.engine.target.standard import StandardStep
from dflash_cli.loading.compiled_steps import load_exported_step
from helpers.drafters import random_drafter
from helpers.golden import FIXTURES, GOLDEN_SETS, check_golden_sets
from helpers.runs import run_batch
from helpers.tiny_models import build_tiny, hf_greedy, int4_packable_tiny, make_tiny_llama


def _eager(target) -> None:
    """Forget the loaded step: the target runs transformers' eager forward again."""
    compiled_step.unload(target)


@pytest.fixture(scope="module")
def int4_target():
    """A tiny int4 Qwen3 computing in bf16 (the CPU plan's 4-bit target), its step exported."""
    model = int4_packable_tiny("qwen3", 3, vocab_size=256).to(torch.bfloat16)
    model.set_attn_implementation("eager")
    quantize_target(model, "int4", torch.bfloat16)
    use_cpu_products(model)
    step = compiled_step.exported_step(model, build_missing=True)
    assert step is not None and step.path.exists()
    yield model
    _eager(model)


def _dense_bf16_target():
    """A tiny dense bf16 Llama with a wide MLP (8960: a width where MKL's one-row bf16 product rounds otherwise than
    a block's) and heads of 32 (dflash's attention kernel takes them), its step exported."""
    model = build_tiny("llama", 6, intermediate_size=8960, head_dim=32).to(torch.bfloat16)
    model.set_attn_implementation("eager")
    use_cpu_products(model)
    assert compiled_step.exported_step(model, build_missing=True) is not None
    return model


@pytest.fixture(scope="module")
def bf16_target():
    """`_dense_bf16_target` on the kernels this process runs (dflash's, where it has them)."""
    model = _dense_bf16_target()
    yield model
    _eager(model)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_the_standard_step_is_transformers_eager_forward(family: str, dtype: torch.dtype, kv_heads: int) -> None:
    """Folded query heads (kv_heads 1 and 2) and single query rows run twice (4): bf16 bit-equal, float32 within
    MKL's row-count rounding."""
    model = build_tiny(family, 0, num_key_value_heads=kv_heads).to(dtype)
    model.set_attn_implementation("eager")
    use_cpu_products(model)
    state = AttentionState(model)
    state.reserve(64, 8, ())
    step = StandardStep(model)
    keys = [torch.zeros(1, kv_heads, 40, 16, dtype=dtype) for _ in model.model.layers]
    values = [torch.zeros_like(k) for k in keys]
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(1))
    exact = dtype == torch.bfloat16
    with torch.inference_mode():
        theirs = state.prefill(ids[:, :20])
        hidden, _ = step(ids[:, :20], torch.arange(20)[None], torch.empty(20), keys, values)
        ours = [(model.lm_head(hidden[0, -1:]), theirs)]
        for q in (1, 3, 4):
            theirs = state.verify(ids[:, 20 : 20 + q])[0]
            hidden, _ = step(ids[:, 20 : 20 + q], torch.arange(20, 20 + q)[None], torch.empty(20 + q), keys, values)
            ours.append((model.lm_head(hidden[0]), theirs))
    for mine, reference in ours:
        if exact:
            assert torch.equal(mine, reference)
        else:
            torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["int4_target", "bf16_target"])
def test_a_block_computes_each_row_as_one_token_steps_do(which: str, request: pytest.FixtureRequest) -> None:
    """bf16 through the package: every row of a verify block is bit-equal to the one-token step at its position, so
    drafting changes no token (the exported step is batch-invariant by itself)."""
    target = request.getfixturevalue(which)
    if which == "bf16_target" and native.available():
        assert StandardStep(target).fused_attention  # dflash's attention and products in the graph
    _assert_blocks_are_one_token_steps(target)


@pytest.mark.slow
def test_without_dflash_kernels_the_package_runs_mkl_and_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process without dflash's kernels (another CPU, no compiler): MKL's products in the graph, a one-row block
    run as two, and still every row of a block bit-equal to one-token steps (a package of its own: the key differs)."""
    monkeypatch.setattr(native, "available", lambda: False)
    target = _dense_bf16_target()
    try:
        step = StandardStep(target)
        assert not step.fused_attention and step.extra == 1
        _assert_blocks_are_one_token_steps(target)
    finally:
        _eager(target)


def _assert_blocks_are_one_token_steps(target) -> None:
    state = AttentionState(target)
    state.reserve(200, 16, ())
    assert state.exported is not None
    vocab = target.config.vocab_size
    ids = torch.randint(0, vocab, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # a package that fails falls back to eager with a warning: not here
        state.prefill(ids[:, :160])  # the blocks below write the K/V of the same tokens again
        for start in (40, 77, 131):
            state.lengths[0] = start
            blocks = {q: state.verify(ids[:, start : start + q])[0] for q in (16, 5, 2)}
            ones = []
            for i in range(16):
                state.lengths[0] = start + i
                ones.append(state.verify(ids[:, start + i : start + i + 1])[0][0])
            for q, logits in blocks.items():
                for i in range(q):
                    assert torch.equal(logits[i], ones[i]), (start, q, i)
    assert state.exported is not None and compiled_step.loaded_step(target) is not None


@pytest.mark.slow
def test_exported_decoding_is_eager_decoding(int4_target) -> None:
    """Greedy text through the package: the baseline's, with drafts of any block size (bit-equal rows), and
    transformers' own greedy text on this sharp tiny model (within bf16 ulps of the eager forward)."""
    drafter = random_drafter(int4_target, seed=1, block_size=8, dtype=torch.bfloat16)
    params = SamplingParams(max_new_tokens=24)
    prompts = [[5, 17, 42, 9, 33], [8, 9, 3, 3, 11, 12, 30, 31, 2, 2, 70], [44] * 23]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        through = [collect(generate(int4_target, None, p, params)).token_ids for p in prompts]
        for block in (2, 8):
            drafted = [collect(generate(int4_target, drafter, p, params, block_size=block)).token_ids for p in prompts]
            assert drafted == through, block
    assert compiled_step.loaded_step(int4_target) is not None
    assert through == [hf_greedy(int4_target, p, 24) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["int4_target", "bf16_target"])
def test_a_batch_runs_every_step_through_the_package(which: str, request: pytest.FixtureRequest, monkeypatch) -> None:
    """Several rows verify together through the package too (each at its own positions), and every row decodes
    the tokens it decodes alone, with and without a drafter: the package gives a row the same bits in any step."""
    target = request.getfixturevalue(which)
    drafter = random_drafter(target, seed=1, block_size=4, dtype=torch.bfloat16)
    params = SamplingParams(max_new_tokens=16)
    prompts = [[5, 17, 42, 9, 33], [8, 9, 3, 3, 11, 12, 30], [44] * 13, [7, 6, 5]]
    alone = [collect(generate(target, None, p, params)).token_ids for p in prompts]
    assert [collect(generate(target, drafter, p, params)).token_ids for p in prompts] == alone
    calls = []
    call = compiled_step.ExportedStep.__call__
    monkeypatch.setattr(
        compiled_step.ExportedStep, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or call(self, *a)
    )
    monkeypatch.setattr(AttentionState, "_masks", lambda *a: pytest.fail("a batched step ran eagerly"))
    for with_drafter in (None, drafter):
        got, widest = run_batch(target, with_drafter, [(p, params, 2 * i) for i, p in enumerate(prompts)], rows=3)
        assert widest > 1 and [g[0] for g in got] == alone
    assert max(calls) > 1  # steps of several rows ran the package
    assert rounding_cause(target) is None


@pytest.mark.slow
def test_a_step_the_package_refuses_runs_eagerly_from_then_on(int4_target, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaded step raising mid-generation: a warning, and the same tokens from the eager forward."""
    step = compiled_step.loaded_step(int4_target)
    params = SamplingParams(max_new_tokens=12)
    expected = collect(generate(int4_target, None, [5, 17, 42], params)).token_ids
    refusing = SimpleNamespace(boxed_run=lambda flat: (_ for _ in ()).throw(RuntimeError("shape guard")))
    monkeypatch.setattr(step.package, "runner", SimpleNamespace(loader=refusing))
    try:
        with pytest.warns(UserWarning, match="exported target step failed .shape guard.; running it eagerly"):
            assert collect(generate(int4_target, None, [5, 17, 42], params)).token_ids == expected
        assert compiled_step.loaded_step(int4_target) is None
    finally:
        monkeypatch.undo()
        compiled_step._LOADED[int4_target] = step


@pytest.mark.slow
def test_a_loaded_step_changes_the_cost_key(int4_target) -> None:
    """Costs measured on eager steps are not the package's."""
    from dflash_cli.engine.policy import target_key

    with_step = target_key(int4_target, compile=False)
    assert with_step["exported"] and rounding_cause(int4_target) is None
    step = compiled_step.loaded_step(int4_target)
    _eager(int4_target)
    try:
        assert not target_key(int4_target, compile=False)["exported"] and rounding_cause(int4_target) is None
    finally:
        compiled_step._LOADED[int4_target] = step


@pytest.mark.slow
def test_every_golden_set_through_the_exported_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: the reference's tokens and acceptance lengths, the target's every step (prefill chunks, verify
    blocks of every size) run by the package."""
    target = AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3-tiny" / "target", dtype=torch.float32).eval()
    use_cpu_products(target)
    assert compiled_step.exported_step(target, build_missing=True) is not None
    ran = []
    call = compiled_step.ExportedStep.__call__
    monkeypatch.setattr(compiled_step.ExportedStep, "__call__", lambda self, *a: ran.append(1) or call(self, *a))
    try:
        check_golden_sets(["qwen3-tiny", *GOLDEN_SETS], compile=False, target=target)
    finally:
        _eager(target)
    assert len(ran) > 100


@pytest.mark.slow
def test_a_later_start_loads_the_stored_package(int4_target, monkeypatch: pytest.MonkeyPatch) -> None:
    path = compiled_step.loaded_step(int4_target).path
    _eager(int4_target)
    monkeypatch.setattr(compiled_step, "build", lambda *a: pytest.fail("built again"))
    assert compiled_step.exported_step(int4_target, build_missing=False).path == path
    # a model of other shapes has no package yet: without building, none
    other = int4_packable_tiny("qwen3", 3, vocab_size=320).to(torch.bfloat16)
    quantize_target(other, "int4", torch.bfloat16)
    assert compiled_step.package_path(other) != path and compiled_step.exported_step(other, build_missing=False) is None


@pytest.mark.slow
def test_a_broken_package_leaves_the_target_eager_until_built_again() -> None:
    model = build_tiny("llama", 5).to(torch.bfloat16)
    path = compiled_step.package_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a package")
    with pytest.warns(UserWarning, match="compiled step failed to build or load .*running it eagerly"):
        step, why = load_exported_step(model, build=False, console=None)
    assert step is None and "failed" in why and compiled_step.loaded_step(model) is None
    state = AttentionState(model)
    state.reserve(16, 2, ())
    assert state.exported is None
    step, why = load_exported_step(model, build=True, console=None)  # --compile on, pull --compile: built again
    assert step is not None and step.path == path and path.stat().st_size > 1000


@pytest.mark.parametrize(
    ("family", "fields", "why"),
    [
        ("gemma4", {}, "not one of the standard families"),
        ("qwen3_5", {}, "not one of the standard families"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "dynamic rope"),
        ("qwen3", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}, "sliding_attention"),
    ],
)
def test_other_families_have_no_exported_step(family: str, fields: dict, why: str) -> None:
    model = build_tiny(family, 0, **fields)
    assert why in standard.unsupported(model)
    assert compiled_step.exported_step(model, build_missing=True) is None


@pytest.mark.slow
def test_pull_builds_it_once_and_every_later_start_loads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI: `dflash pull --compile` builds the package (as a first `--compile on` start would); a later default
    start finds it and says so, `--compile on` loads it without building, `--compile off` runs eager; all answer
    the same."""
    target = make_tiny_llama(tmp_path / "target", seed=4)
    pulled = CliRunner().invoke(app, ["pull", "--target", str(target), "--compile", "--json"])
    assert pulled.exit_code == 0, pulled.output
    step = next(part for part in json.loads(pulled.stdout) if part["what"] == "compiled step")
    assert [Path(path).is_file() for path in step["paths"]] == [True] and "compiled ahead of time" in step["why"]
    common = ["chat", "--target", str(target), "--prompt", "Hi there", "--max-tokens", "6", "--no-spec", "--explain"]
    later = CliRunner().invoke(app, common)
    assert later.exit_code == 0, later.output
    assert "compiled step stored" in later.stderr and "exported step: the target's step runs" in later.stderr
    monkeypatch.setattr(compiled_step, "build", lambda *a: pytest.fail("built again"))
    again = CliRunner().invoke(app, [*common, "--compile", "on"])
    assert again.exit_code == 0 and "exported step: the target's step runs" in again.stderr
    assert later.stdout == again.stdout  # (eager may round a near-tie otherwise: rounding_cause says so)
    eager = CliRunner().invoke(app, [*common, "--compile", "off"])
    assert eager.exit_code == 0 and "compiled step stored" not in eager.stderr
