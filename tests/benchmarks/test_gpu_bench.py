"""`python -m benchmarks.gpu_bench` in its CPU configuration (--smoke): the code path the GPU run takes, on tiny shapes.

No timings are asserted. What is asserted: the results have the structure docs/benchmarks.md reads, every
figure is there next to its target, NF4 really quantized the target, and the controlled-acceptance double
makes the real decode loop commit exactly the acceptance lengths it was asked for (a property of the loop).
The reference comparison runs when z-lab's wheel can be had (DFLASH_REFERENCE_WHEEL, .whl/, or PyPI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_bench as gpu_module

ROOT = Path(__file__).resolve().parents[2]
WHEEL_NAME = "dflash-0.1.0-py3-none-any.whl"


def reference_wheel(tmp: Path) -> Path | None:
    """z-lab's reference wheel: from the environment, the device carry folder, or PyPI; None if none can be had."""
    given = os.environ.get("DFLASH_REFERENCE_WHEEL")
    if given and Path(given).is_file():
        return Path(given)
    carried = ROOT / ".whl" / WHEEL_NAME
    if carried.is_file():
        return carried
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "dflash==0.1.0", "-d", str(tmp)],
            capture_output=True,
            timeout=60,
            check=True,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return next(tmp.glob("dflash-0.1.0-*.whl"), None)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("gpu_bench")
    out = tmp / "results.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_bench", "--smoke", "--output", str(out)]
    wheel = reference_wheel(tmp)
    if wheel is not None:
        cmd += ["--reference-wheel", str(wheel)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)  # run as from a checkout
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"results": json.loads(out.read_text()), "table": proc.stdout, "wheel": wheel}


@pytest.mark.slow
def test_every_section_is_there(smoke):
    results = smoke["results"]
    settings = results["settings"]
    assert results["bandwidth"]["gb_per_s"] > 0
    attention = results["whole_buffer_attention"]
    ((capacity, by_query),) = attention["by_capacity"].items()
    assert int(capacity) >= 8192 and attention["layers"] == settings["shape"]["layers"]
    assert list(by_query) == ["1", str(settings["shape"]["block_size"])]
    for ways in by_query.values():
        assert list(ways) == ["repeat_kv", "packed", "engine", "engine_compiled"]
        for way in ways.values():  # float32: each way's output is transformers' SDPA's
            assert way["ms_per_step"] > 0 and way["max_error"] < 1e-4, way
    assert list(results["runs"]) == settings["precisions"] == ["float32", "nf4"]
    for run in results["runs"].values():
        assert "error" not in run, run.get("error")
        floors = run["floors"]
        assert 0 < floors["ar_floor_ms"] < floors["spec_floor_ms"]
        assert floors["spec_step_bytes"] > floors["ar_step_bytes"] > floors["target_weight_bytes"]
        micro = run["micro"]
        assert list(micro["verify"]) == [str(b) for b in settings["verify_sizes"]]
        e2e = run["end_to_end"]
        timings = [micro["ar_step"], micro["draft_step"], *micro["verify"].values(), e2e["baseline"]["step"]]
        timings += [r["step"] for r in e2e["controlled"].values()] + [e2e["real_drafter"]["step"]]
        for t in timings:
            assert 0 < t["median_ms"] <= t["p90_ms"]
            assert t["events_median_ms"] is None  # no CUDA events on the CPU
        for r in [*e2e["controlled"].values(), e2e["real_drafter"]]:  # the loop's phase clock, per step
            assert 0 < r["draft_ms_per_step"] < r["ms_per_step_mean"] and 0 < r["verify_ms_per_step"]
        baseline = e2e["baseline"]  # no drafter: the draft phase is the loop's few lines between its marks
        assert baseline["draft_ms_per_step"] < 0.1 * baseline["verify_ms_per_step"]
        for kind in ("ar_step", "spec_step"):  # the host's Python, by function
            functions = e2e["python_functions"][kind]
            assert functions and all(f["own_ms"] >= 0 and f["count"] > 0 for f in functions)
        assert list(e2e["controlled"]) == [f"{tau:g}" for tau in settings["taus"]]
        predicted = run["predicted"]
        assert predicted["tau"] == 6.5
        assert predicted["spec_tokens_per_s"] > 0 and predicted["speedup"] > 0
        figures = [c["figure"] for c in run["targets"]]
        assert figures == [
            "AR step / AR floor",
            "spec step / AR floor",
            "spec step ours / reference",
            "host overhead per AR step (ms)",
            "host overhead per spec step (ms)",
        ]
    assert set(results["nf4_vs_dense"]) == {"ar_step", "spec_step"}


@pytest.mark.slow
def test_nf4_quantizes_every_decoder_linear(smoke):
    results = smoke["results"]
    shape = results["settings"]["shape"]
    assert results["nf4_quantized_layers"] == 7 * shape["layers"]  # q, k, v, o, gate, up, down
    dense, nf4 = (results["runs"][p]["floors"] for p in ("float32", "nf4"))
    assert nf4["target_weight_bytes"] < dense["target_weight_bytes"] / 2
    assert nf4["lm_head_bytes"] == dense["lm_head_bytes"]  # the head stays dense, as transformers leaves it


@pytest.mark.slow
def test_controlled_acceptance_double_hits_the_requested_tau(smoke):
    block = smoke["results"]["settings"]["shape"]["block_size"]
    for run in smoke["results"]["runs"].values():
        for key, r in run["end_to_end"]["controlled"].items():
            steps = len(r["acceptance_lengths"])
            wanted = min(r["tau_requested"], block)
            assert r["schedule_followed"], (key, r["acceptance_lengths"])
            assert r["lossless"] and r["equals_blockwise_decoding"], key  # the target's own greedy tokens
            assert r["tau_measured"] == r["tau_planned"]
            assert abs(r["tau_measured"] - wanted) <= 1 / steps, (key, r["tau_measured"])


@pytest.mark.slow
def test_table_prints_each_figure_with_its_target(smoke):
    table = smoke["table"]
    figures = ("AR step / AR floor", "spec step / AR floor", "spec step ours / reference", "host overhead per AR step")
    for figure in figures:
        assert figure in table
    assert "<= 1.15" in table and "<= 1.35" in table and "<= 0.333" in table and "< 1" in table
    assert "predicted at tau 6.5" in table


@pytest.mark.slow
def test_reference_runs_side_by_side(smoke):
    if smoke["wheel"] is None:
        pytest.skip("z-lab's dflash==0.1.0 wheel could not be had (no DFLASH_REFERENCE_WHEEL, no .whl/, no PyPI)")
    runs = smoke["results"]["runs"]
    reference = runs["float32"]["reference"]
    assert reference["status"] == "ok", reference.get("reason")
    for who in ("reference", "ours"):
        assert reference[who]["spec_step_ms"] > 0 and reference[who]["baseline_step_ms"] > 0
    assert runs["nf4"]["reference"]["status"] == "skipped"  # the smoke configuration runs it once
    assert smoke["results"]["environment"]["dflash_reference"] == "0.1.0"


def test_acceptance_plan_mean_and_bounds():
    for tau in (1.0, 2.3, 3.0, 6.5, 7.87, 15.5, 16.0, 40.0):
        for tokens in (1, 15, 127, 500):
            plan = gpu_module.acceptance_plan(tau, 16, tokens)
            assert all(1 <= a <= 16 for a in plan)
            assert sum(plan) >= tokens > sum(plan[:-1])
            assert abs(sum(plan) / len(plan) - min(tau, 16)) <= 1 / len(plan)
    assert gpu_module.acceptance_plan(6.5, 16, 26) == [6, 7, 6, 7]


def test_bad_precision_is_refused(capsys):
    assert gpu_module.main(["--smoke", "--precisions", "fp8"]) == 2
    assert "unknown precision ['fp8']" in capsys.readouterr().err


def test_a_short_run_keeps_to_the_decode_loop(tmp_path, capsys):
    """What fits a compiled run in one device call: fewer layers, no micro-benchmarks (each size and state is another
    graph to compile), the published tau alone; the table renders without the micro-benchmarks' lines."""
    out = tmp_path / "short.json"
    argv = ["--smoke", "--precisions", "float32", "--no-reference", "--layers", "2", "--verify-sizes", ""]
    assert gpu_module.main([*argv, "--taus", "6.5", "--output", str(out)]) == 0
    results = json.loads(out.read_text())
    run = results["runs"]["float32"]
    assert results["settings"]["shape"]["layers"] == 2 and "micro" not in run
    assert (
        list(run["end_to_end"]["controlled"]) == ["6.5"] and run["end_to_end"]["controlled"]["6.5"]["schedule_followed"]
    )
    table = capsys.readouterr().out
    assert "engine AR step" in table and "verify by block size" not in table
    assert gpu_module.main([*argv, "--taus", "1,3"]) == 2  # the predictions read tau 6.5
    assert "--taus must include 6.5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_module.main([*argv, "--taus", "0.5,6.5"])


@pytest.mark.slow
def test_whole_buffer_attention_ways_agree(tmp_path: Path) -> None:
    """benchmarks/whole_buffer_attention.py --smoke: every way of the attention it times gives transformers' SDPA
    output in float32 (a keys piece no query sees included), or says why it could not run (out_dtype scores are
    CUDA's alone)."""
    from benchmarks import whole_buffer_attention

    out = tmp_path / "attention.json"
    assert whole_buffer_attention.main(["--smoke", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    ((_, by_query),) = result["by_capacity"].items()
    for ways in by_query.values():
        assert {"packed", "engine_compiled", "split_compiled", "flex_whole", "flex_filled"} <= set(ways)
        for name, way in ways.items():
            if name == "matmul_f32_scores" and "error" in way:
                continue
            assert way["ms_per_step"] > 0 and way["max_error"] < 1e-4, (name, way)


@pytest.mark.slow
def test_gpu_4bit_measures_each_kernel(tmp_path: Path) -> None:
    """benchmarks/gpu_4bit.py --smoke: bf16, bitsandbytes' NF4 and torch's int4 kernel each time one layer at 1, 8
    and 16 rows on the CPU, the 4-bit outputs near bf16's (random weights: about 10% relative error)."""
    from benchmarks import gpu_4bit

    out = tmp_path / "4bit.json"
    assert gpu_4bit.main(["--smoke", "--output", str(out)]) == 0
    kernels = json.loads(out.read_text())["kernels"]
    assert list(kernels) == ["bf16", "nf4", "int4_tinygemm"]
    for name, result in kernels.items():
        assert "error" not in result, result
        for rows in ("1", "8", "16"):
            assert result[rows]["ms_per_layer"] > 0
            if name != "bf16":  # (bf16 is the reference)
                assert 0 < result[rows]["relative_error"] < 0.2, (name, result[rows])
