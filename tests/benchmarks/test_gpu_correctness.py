"""`python -m benchmarks.gpu_correctness` on the CPU: the checks the GPU run makes (golden sets
exactly in float32; identity and mismatch causes outside it), on one golden set, eagerly. It must pass on our engine
and fail on a golden set whose recorded numbers are not what the engine produces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import gpu_correctness as correctness

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_golden_set_passes_and_an_altered_one_fails(tmp_path: Path) -> None:
    fixtures = tmp_path / "fixtures"
    shutil.copytree(ROOT / "tests" / "fixtures" / "qwen3-tiny-swa", fixtures / "qwen3-tiny-swa")
    golden_path = fixtures / "qwen3-tiny-swa" / "golden.json"
    golden = json.loads(golden_path.read_text())
    golden["cases"] = golden["cases"][:2]  # (two cases are enough to see both outcomes; all run on the device)
    golden_path.write_text(json.dumps(golden))

    def check(name: str) -> tuple[int, dict]:
        """The script on the fixtures as they stand: its exit status and its one run."""
        out = tmp_path / f"{name}.json"
        status = correctness.main(
            ["--device", "cpu", "--precisions", "float32", "--fixtures", str(fixtures), "--output", str(out)]
        )
        (run,) = json.loads(out.read_text())["runs"]
        return status, run

    status, run = check("ok")
    assert status == 0
    assert run["set"] == "qwen3-tiny-swa" and run["cases"] == 2
    assert run["eager"]["passed"] and run["eager"]["failures"] == [] and "compiled" not in run
    assert run["paths"]["passed"] and run["paths"]["failures"] == []  # batched rows, prefix reuse

    golden["cases"][1]["acceptance_lengths"][0] += 1  # a number the engine does not produce
    golden_path.write_text(json.dumps(golden))
    status, run = check("altered")
    assert status == 1
    (failure,) = run["eager"]["failures"]
    assert failure["wrong"] == ["acceptance"] and failure["prompt"] == golden["cases"][1]["prompt_ids"][:4]
    assert run["paths"]["passed"]  # (the paths check tokens: a batch's acceptance may round otherwise)

    golden["cases"][1]["acceptance_lengths"][0] -= 1
    golden["cases"][1]["new_token_ids"][-1] += 1  # a token the engine does not produce: the batched row says so
    golden_path.write_text(json.dumps(golden))
    status, run = check("token")
    assert status == 1
    assert [f["path"] for f in run["paths"]["failures"]] == ["rows"]


def test_a_mismatch_is_explained_by_the_baselines_margin() -> None:
    """A DFlash token that is not the baseline's: where, and how far apart the baseline's top two were there."""
    from helpers.tiny_models import sharp_tiny

    target = sharp_tiny("qwen3", 1)
    prompt = [3, 4, 5]
    from dflash_cli.engine import SamplingParams, collect, generate

    baseline = collect(generate(target, None, prompt, SamplingParams(max_new_tokens=6))).token_ids
    other = baseline[:2] + [(baseline[2] + 1) % 90] + baseline[3:]
    cause = correctness.mismatch_cause(target, prompt, baseline, other)
    assert (cause["position"], cause["baseline_token"], cause["dflash_token"]) == (2, baseline[2], other[2])
    assert cause["dflash_token_rank"] >= 1 and cause["top2_margin"] > 0  # the baseline's token was the top one
