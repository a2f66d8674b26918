"""`dflash bench`: prompt loading, the baseline-vs-DFlash comparison, the report's structure and JSON schema.

Real tiny models decode through the real loop; speeds are never asserted (they go to docs/benchmarks.md).
The arithmetic of the summary is checked on hand-made runs whose times and acceptance lengths are known.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from rich.console import Console
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from dflash_cli.bench import measure as bench_measure
from dflash_cli.bench import prompts as bench_prompts
from dflash_cli.bench import report as bench_report
from dflash_cli.bench import runner as bench_run
from dflash_cli.bench.measure import BASELINE, Mode, PromptRuns, Run
from dflash_cli.bench.report import BenchReport, BenchSettings
from dflash_cli.cli.app import app
from dflash_cli.errors import DflashError
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import PlanOverrides
from helpers.drafters import save_random_drafter
from helpers.tiny_models import make_tiny_qwen3

REPO = Path(__file__).resolve().parents[2]
CONFORMANCE = REPO / "tests" / "fixtures" / "qwen3-tiny"
runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen3 target (with tokenizer and chat template) and a random block-4 drafter for it."""
    root = tmp_path_factory.mktemp("bench")
    target_dir = make_tiny_qwen3(root / "target", seed=0)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    return target_dir, save_random_drafter(root / "drafter", target, block_size=4)


def options_for(models: tuple[Path, Path], **changes: object) -> RunOptions:
    target, drafter = models
    changes = {"sampling": SamplingParams(max_new_tokens=8), **changes}
    return RunOptions(target=str(target), drafter=str(drafter), **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def report(models: tuple[Path, Path]) -> BenchReport:
    """--before-after with a block-size sweep: 2 prompts x 4 modes (baseline, adaptive, b2, b4) x 2 repetitions on
    the real loop."""
    settings = BenchSettings(before_after=True, prompt_set="math", limit=2, repeat=2, block_sizes=(2, 4))
    # float32, where greedy identity is bit-exact (a CPU with AVX512-BF16 would otherwise plan bf16)
    return bench_run.benchmark(options_for(models, overrides=PlanOverrides(dtype="float32")), settings)


# ---------------------------------------------------------------------------------------------------------------
# Prompts


def test_builtin_prompt_sets() -> None:
    every = bench_prompts.load_prompt_set("all")
    for name in bench_prompts.PROMPT_SETS:
        prompts = bench_prompts.load_prompt_set(name)
        assert len(prompts) == 8
        assert all(p.id.startswith(f"{name}-") and p.prompt and p.prompt.strip() for p in prompts)
        assert all(p in every for p in prompts)
    assert len({p.id for p in every}) == len(every) == 24
    with pytest.raises(DflashError, match="unknown prompt set 'maths'") as raised:
        bench_prompts.load_prompt_set("maths")
    assert "did you mean 'math'" in (raised.value.fix or "")


def test_prompt_file_takes_text_conversations_and_token_ids(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    lines = [
        {"id": "q", "prompt": "Hi there"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]},
        {"id": 7, "prompt_ids": [3, 1, 4, 1, 5]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n")
    prompts = bench_prompts.load_prompt_file(path)
    assert [p.id for p in prompts] == ["q", "mine-2", "7"]
    assert prompts[0].prompt == "Hi there"
    assert prompts[1].messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"})
    assert prompts[2].prompt_ids == (3, 1, 4, 1, 5)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "ok"}\n{"prompt": "no closing brace"\n', ":2: not valid JSON"),
        ('["a list"]\n', ':1: expected a JSON object, got ["a list"]'),
        ('{"text": "hello"}\n', 'exactly one of "prompt", "messages" or "prompt_ids" (found none)'),
        ('{"prompt": "a", "prompt_ids": [1]}\n', "(found prompt, prompt_ids)"),
        ('{"prompt": ""}\n', "prompt is empty"),
        ('{"prompt_ids": [1, -2]}\n', "non-negative integers"),
        ('{"prompt_ids": ["1"]}\n', "non-negative integers"),
        ('{"prompt_ids": [true]}\n', "non-negative integers"),
        ('{"prompt_ids": []}\n', "non-negative integers"),
        ('{"messages": [{"role": "user"}]}\n', "messages[0].content must be a string"),
        ('{"id": [1], "prompt": "a"}\n', "id must be a string, got [1]"),
        ('{"id": "x", "prompt": "a"}\n{"id": "x", "prompt": "b"}\n', ':2: id "x" is already used on line 1'),
        (
            '{"prompt": "a", "temperature": 0.5}\n',
            ":1: sets temperature, but `dflash bench` runs every prompt with the same",
        ),
        ('{"prompt": "a", "max_tokens": 0}\n', ":1: max_tokens must be >= 1"),
        ("\n\n", "holds no prompts"),
    ],
)
def test_bad_prompt_files_say_where_and_how_to_fix(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DflashError) as raised:
        bench_prompts.load_prompt_file(path)
    assert message in raised.value.message and str(path) in raised.value.message
    assert raised.value.fix  # every error says how to fix the file


def test_missing_prompt_file(tmp_path: Path) -> None:
    with pytest.raises(DflashError, match="does not exist"):
        bench_prompts.load_prompt_file(tmp_path / "nope.jsonl")


def test_set_and_prompts_together_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DflashError, match="--set or --prompts, not both"):
        bench_run.load_prompts(BenchSettings(prompt_set="math", prompts_file=str(tmp_path / "x.jsonl")))


def test_an_output_that_is_a_directory_is_refused_before_measuring(tmp_path: Path) -> None:
    with pytest.raises(DflashError, match="--output .* is a directory") as refused:
        bench_run.check_outputs(BenchSettings(output=str(tmp_path)))
    assert "bench.json" in refused.value.fix
    bench_run.check_outputs(BenchSettings(output=str(tmp_path / "new" / "bench.json")))  # a new file, its folder made
    assert (tmp_path / "new").is_dir()


@pytest.mark.parametrize(("text", "sizes"), [(None, ()), ("4,8,16", (4, 8, 16)), (" 8, 4,8 ", (8, 4))])
def test_parse_block_sizes(text: str | None, sizes: tuple[int, ...]) -> None:
    assert bench_run.parse_block_sizes(text) == sizes


@pytest.mark.parametrize("text", ["1,4", "four", ",", "4;8"])
def test_bad_block_sizes(text: str) -> None:
    with pytest.raises(DflashError, match="--block-sizes"):
        bench_run.parse_block_sizes(text)


# ---------------------------------------------------------------------------------------------------------------
# Comparing and summarizing


def test_compare_reports_the_first_differing_position() -> None:
    assert bench_report.compare([1, 2, 3], [1, 2, 3]) == bench_report.Comparison(True, None)
    assert bench_report.compare([1, 2, 3, 4], [1, 2, 9, 4]) == bench_report.Comparison(False, 2)
    assert bench_report.compare([5, 2], [1, 2]) == bench_report.Comparison(False, 0)
    assert bench_report.compare([1, 2, 3], [1, 2]) == bench_report.Comparison(False, 2)  # one stopped early
    assert bench_report.compare([1, 2], [1, 2, 3]) == bench_report.Comparison(False, 2)


def make_run(tokens: list[int], decode_s: float, acceptance: Sequence[int] = ()) -> Run:
    """A generation that took `decode_s` after its first token (all of it verifying)."""
    return Run(tokens, "length", 0.01, decode_s, 0.0, decode_s, decode_s + 0.01, list(acceptance))


def test_summary_arithmetic_on_known_runs() -> None:
    dflash = Mode(True, 4)
    rows = [
        # prompt a: 9 tokens (8 after the first); baseline 0.8 s and 1.2 s, DFlash 0.2 s and 0.3 s
        PromptRuns("a", BASELINE, 5, [make_run(list(range(9)), 0.8), make_run(list(range(9)), 1.2)]),
        PromptRuns("b", BASELINE, 6, [make_run(list(range(5)), 0.4), make_run(list(range(5)), 0.4)]),
        PromptRuns("a", dflash, 5, [make_run(list(range(9)), 0.2, [4, 4]), make_run(list(range(9)), 0.3, [4, 4])]),
        # prompt b: DFlash diverged at position 3
        PromptRuns(
            "b", dflash, 6, [make_run([0, 1, 2, 7, 4], 0.2, [1, 1, 2]), make_run([0, 1, 2, 7, 4], 0.2, [1, 1, 2])]
        ),
    ]
    baseline, spec = bench_report.summarize(rows, {BASELINE: 100, dflash: 200})
    assert (rows[2].identical, rows[2].first_mismatch) == (True, None)
    assert (rows[3].identical, rows[3].first_mismatch) == (False, 3)
    assert rows[2].speedup == pytest.approx((2.0 / 16) / (0.5 / 16))  # 4x
    assert rows[3].speedup == pytest.approx((0.8 / 8) / (0.4 / 8))  # 2x
    assert baseline.speedup is None and baseline.tau is None and baseline.histogram == []
    assert baseline.identical_prompts is None and baseline.peak_memory_bytes == 100
    # over all prompts and rounds: baseline 2.8 s / 24 tokens, DFlash 0.9 s / 24 tokens
    assert spec.speedup == pytest.approx(2.8 / 0.9)
    assert spec.tau == pytest.approx((4.0 + 4 / 3) / 2)  # mean of per-prompt means
    assert spec.tokens_per_step == pytest.approx(24 / 10)  # pooled over all steps
    assert spec.histogram == [4, 2, 0, 4]
    assert spec.identical_prompts == 1 and spec.prompts == 2
    # decode tok/s per round: round 1 = 12 tokens / 0.4 s, round 2 = 12 / 0.5 s
    assert spec.decode_tokens_per_s is not None
    assert spec.decode_tokens_per_s.mean == pytest.approx((30 + 24) / 2)
    assert spec.decode_tokens_per_s.std == pytest.approx(4.242640687)
    assert spec.generated_tokens == 14


# ---------------------------------------------------------------------------------------------------------------
# The real loop


def test_before_after_report_structure(report: BenchReport) -> None:
    labels = ["baseline", "dflash auto≤4", "dflash b2", "dflash b4"]
    assert [s.mode.label for s in report.modes] == labels
    assert [(row.mode.label, row.prompt_id) for row in report.rows] == [
        (mode, prompt) for mode in labels for prompt in ("math-1", "math-2")
    ]
    adaptive = report.modes[1]
    # the sizes the policy chose: one per verify step, from the policy's set
    assert sum(adaptive.size_histogram.values()) == sum(adaptive.histogram) and set(adaptive.size_histogram) <= {
        1,
        2,
        4,
    }
    assert report.modes[2].size_histogram.keys() <= {1, 2} and report.modes[0].size_histogram == {}
    assert all(len(row.runs) == 2 for row in report.rows)
    assert report.identity_expected and report.identical is True and report.mismatches == []
    for summary in report.modes:
        assert summary.prompts == 2
        if summary.mode.speculative:
            assert summary.identical_prompts == 2 and summary.speedup is not None and summary.speedup > 0
            assert len(summary.histogram) == summary.mode.block_size and sum(summary.histogram) > 0
            assert 1 <= (summary.tau or 0) <= summary.mode.block_size
    baseline_rows = [row for row in report.rows if row.mode == BASELINE]
    for row in report.rows:
        # every repetition reproduces the first (greedy), and every verify step's tokens add up
        assert all(r.token_ids == row.token_ids for r in row.runs)
        assert all(sum(r.acceptance_lengths) == len(r.token_ids) - 1 for r in row.runs if row.mode.speculative)
    assert all(1 <= len(row.token_ids) <= 8 for row in baseline_rows)


def test_json_report_schema(report: BenchReport) -> None:
    data = json.loads(json.dumps(report.to_dict()))
    assert data["schema"] == "dflash-bench/1"
    assert data["identity_expected"] is True and data["identical"] is True
    assert data["memory"] == {"kind": bench_measure.PROCESS_MEMORY, "unit": "bytes"}
    metadata = data["metadata"]
    assert {"command", "created", "versions", "machine", "plan", "recipe", "drafter_block_size"} <= set(metadata)
    assert metadata["plan"]["device"] == "cpu" and metadata["recipe"]["name"] == "ad-hoc"
    assert metadata["batch_invariant"] is False  # float32: MKL rounds a row by the row count (engine.target)
    assert metadata["drafter_block_size"] == 4 and metadata["machine"]["torch_threads"] == 1
    settings = data["settings"]
    assert settings["prompts"] == "set:math" and settings["prompt_count"] == 2 and settings["repeat"] == 2
    assert (
        settings["modes"] == ["baseline", "dflash auto≤4", "dflash b2", "dflash b4"] and settings["temperature"] == 0.0
    )
    mode_types = {
        "mode": str,
        "speculative": bool,
        "block_size": int,
        "prompts": int,
        "generated_tokens": int,
        "ttft_s": dict,
        "decode_tokens_per_s": dict,
        "time_per_output_token_s": float,
        "histogram": list,
        "peak_memory_bytes": int,
        "bandwidth_gb_s": float,
        "floor_share": float,
        "adaptive": bool,
        "size_histogram": dict,
    }
    assert metadata["read_bandwidth_gb_s"] > 0
    for mode in data["modes"]:
        # bandwidth achieved = bytes a plain step reads / time per output token, as a share of the measured floor
        assert mode["floor_share"] == pytest.approx(mode["bandwidth_gb_s"] / metadata["read_bandwidth_gb_s"])
        assert {k: type(mode[k]) for k in mode_types} == mode_types
        assert set(mode["ttft_s"]) == {"mean", "std"}
        for key in ("speedup", "tau", "tokens_per_step", "identical_prompts"):
            assert (mode[key] is None) == (not mode["speculative"])
    row_types = {
        "prompt_id": str,
        "mode": str,
        "speculative": bool,
        "block_size": int,
        "prompt_tokens": int,
        "generated_tokens": int,
        "finish_reason": str,
        "ttft_s": list,
        "decode_s": list,
        "draft_s": list,
        "verify_s": list,
        "total_s": list,
        "decode_tokens_per_s": list,
        "histogram": list,
        "acceptance_lengths": list,
        "block_sizes": list,
        "token_ids": list,
    }
    assert len(data["rows"]) == 8
    for row in data["rows"]:
        assert {k: type(row[k]) for k in row_types} == row_types
        assert len(row["ttft_s"]) == len(row["decode_s"]) == 2
        if row["speculative"]:
            assert row["identical"] is True and row["first_mismatch"] is None
            assert isinstance(row["tau"], float) and isinstance(row["speedup"], float)
            assert sum(row["histogram"]) == 2 * len(row["acceptance_lengths"])
        else:
            assert row["identical"] is None and row["speedup"] is None and row["tau"] is None


def test_forced_mismatch_is_reported_not_raised(report: BenchReport) -> None:
    tampered = [dataclasses.replace(row, runs=list(row.runs)) for row in report.rows]
    victim = next(row for row in tampered if row.mode.label == "dflash b4")
    original = victim.runs[0]
    changed = list(original.token_ids)
    changed[2] = (changed[2] + 1) % 384
    victim.runs[0] = dataclasses.replace(original, token_ids=changed)
    broken = dataclasses.replace(report, rows=tampered, modes=bench_report.summarize(tampered, {}))
    assert broken.identical is False and broken.mismatches == [victim]
    assert (victim.identical, victim.first_mismatch) == (False, 2)
    assert [s.identical_prompts for s in broken.modes] == [None, 2, 2, 1]
    console = Console(record=True, width=200)
    bench_report.print_report(broken, console)
    text = console.export_text()
    assert f"prompt {victim.prompt_id}, dflash b4: differs from the baseline at generated token 2" in text
    assert f"(baseline {original.token_ids[2]}, dflash {changed[2]})" in text
    assert "1/2 ✗" in text and "this is a bug" in text
    rows = broken.to_dict()["rows"]
    assert [(r["identical"], r["first_mismatch"]) for r in rows if r["mode"] == "dflash b4"].count((False, 2)) == 1
    # In bf16 on a GPU the same mismatch is a near-tie rounding difference, said as such with its cause, not a bug.
    plan = {**broken.metadata["plan"], "dtype": "bfloat16", "device": "cuda:0", "attn_implementation": "sdpa"}
    cause = "cuda:0: fused attention and matrix kernels pick their tiling by the step's shape"
    metadata = {**broken.metadata, "plan": plan, "batch_invariant": False, "rounding_cause": cause}
    bf16 = dataclasses.replace(broken, metadata=metadata)
    console = Console(record=True, width=200)
    bench_report.print_report(bf16, console)
    text = console.export_text()
    assert "1/2 ~" in text and "here a block verify rounds differently" in text and "--dtype fp32" in text
    assert "cuda:0: fused attention and matrix kernels" in text and "bug" not in text
    assert "identity rate in bfloat16 (exact identity is expected in float32, and in bf16 on a CPU" in text
    assert "dflash b2 2/2, dflash b4 1/2" in text
    data = bf16.to_dict()  # greedy, but not float32: identity is a measured rate, not an expectation
    assert data["identity_expected"] is False and broken.to_dict()["identity_expected"] is True
    assert [m["identity_rate"] for m in data["modes"] if m["mode"] == "dflash b4"] == [0.5]
    # bf16 on a CPU with eager attention is batch-invariant: there the mismatch is a bug again.
    plan = {**broken.metadata["plan"], "dtype": "bfloat16", "device": "cpu", "attn_implementation": "eager"}
    invariant = dataclasses.replace(broken, metadata={**broken.metadata, "plan": plan, "batch_invariant": True})
    console = Console(record=True, width=200)
    bench_report.print_report(invariant, console)
    text = console.export_text()
    assert "1/2 ✗" in text and "in batch-invariant bf16 greedy DFlash must reproduce the baseline" in text
    assert invariant.to_dict()["identity_expected"] is True


def test_piped_report_keeps_every_number_whole(report: BenchReport) -> None:
    """Not a terminal (stdout to a file): the table is not cut to 80 columns mid-number."""
    import io

    piped = Console(file=io.StringIO(), width=80, force_terminal=False)
    bench_report.print_report(report, piped)
    text = piped.file.getvalue()
    assert "…" not in text
    summary = report.modes[-1]
    assert f"{summary.tau:.2f}" in text


def test_terminal_report(report: BenchReport) -> None:
    console = Console(record=True, width=120)
    bench_report.print_report(report, console)
    text = console.export_text()
    for expected in (
        "mode",
        "TTFT ms",
        "decode tok/s",
        "speedup",
        "tau",
        "same",
        "GB/s",
        "baseline",
        "dflash b2",
        "dflash b4",
        "2/2",
        "peak memory:",
        "token-identical to the baseline on all 2 prompts",
        "acceptance length, dflash b4",
        "speedup per prompt",
        "math-1",
        "x",
    ):
        assert expected in text
    assert "█" in text  # the bars


def test_speculative_only_without_before_after(models: tuple[Path, Path]) -> None:
    settings = BenchSettings(prompt_set="code", limit=1, repeat=1)
    only = bench_run.benchmark(options_for(models, overrides=PlanOverrides(block_size=3)), settings)
    assert [s.mode.label for s in only.modes] == ["dflash b3"]  # --block-size goes through the plan
    assert only.identical is None and only.modes[0].speedup is None
    assert "not checked" in bench_report.render_identity(only).plain


def test_sampling_says_identity_is_not_expected(models: tuple[Path, Path]) -> None:
    settings = BenchSettings(before_after=True, prompt_set="chat", limit=1, repeat=1)
    sampled = bench_run.benchmark(
        options_for(models, sampling=SamplingParams(max_new_tokens=8, temperature=0.8, seed=3)), settings
    )
    assert sampled.identity_expected is False
    assert "not expected at temperature > 0" in bench_report.render_identity(sampled).plain
    assert sampled.to_dict()["identity_expected"] is False


@pytest.mark.parametrize(
    ("changes", "settings", "message"),
    [
        ({"no_spec": True}, BenchSettings(before_after=True), "--no-spec was given"),
        (
            {"overrides": PlanOverrides(block_size=4)},
            BenchSettings(block_sizes=(2, 4)),
            "--block-size or --block-sizes, not both",
        ),
    ],
)
def test_contradictory_modes(models: tuple[Path, Path], changes: dict, settings: BenchSettings, message: str) -> None:
    with pytest.raises(DflashError, match=message):
        bench_run.benchmark(options_for(models, **changes), dataclasses.replace(settings, limit=1, repeat=1))


def test_token_ids_outside_the_vocabulary(models: tuple[Path, Path], tmp_path: Path) -> None:
    path = tmp_path / "ids.jsonl"
    path.write_text('{"id": "big", "prompt_ids": [1, 2, 384]}\n')
    with pytest.raises(DflashError, match="token id 384 is outside the vocabulary"):
        bench_run.benchmark(options_for(models), BenchSettings(prompts_file=str(path), repeat=1))


# ---------------------------------------------------------------------------------------------------------------
# The command


def test_cli_json_and_output_file(models: tuple[Path, Path], tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "ids", "prompt_ids": [5, 6, 7, 8]}\n{"id": "text", "prompt": "What is 2 + 2?"}\n')
    out = tmp_path / "results" / "bench.json"
    target, drafter = models
    args = [
        "bench",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--before-after",
        "--prompts",
        str(prompts),
        "--repeat",
        "1",
        "--max-tokens",
        "6",
        "--json",
        "--output",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert json.loads(out.read_text()) == printed
    assert [row["prompt_id"] for row in printed["rows"]] == ["ids", "text", "ids", "text"]
    assert printed["identical"] is True and printed["metadata"]["command"].startswith("dflash ")


def test_cli_a_file_that_cannot_be_saved_leaves_one_json_document(models: tuple[Path, Path], tmp_path: Path) -> None:
    """--png of a run without DFlash has nothing to draw: with --json, stdout holds the error alone (the report was
    printed before the files were saved, and the error after it: two documents, neither parseable as one)."""
    pytest.importorskip("matplotlib")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "ids", "prompt_ids": [5, 6, 7, 8]}\n')
    target, _ = models
    args = ["bench", "--target", str(target), "--prompts", str(prompts), "--max-tokens", "2", "--json"]
    result = runner.invoke(app, [*args, "--png", str(tmp_path / "chart.png")])
    assert result.exit_code == 1
    assert "nothing to draw" in json.loads(result.stdout)["error"]["message"]


def test_cli_table(models: tuple[Path, Path]) -> None:
    target, drafter = models
    args = [
        "bench",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--before-after",
        "--set",
        "chat",
        "--limit",
        "1",
        "--repeat",
        "1",
        "--max-tokens",
        "4",
        "--block-sizes",
        "2,4",
    ]
    result = runner.invoke(app, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "dflash b2" in result.stdout and "dflash b4" in result.stdout and "speedup per prompt" in result.stdout


def test_cli_png_without_matplotlib_fails_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importlib then finds no matplotlib
    result = runner.invoke(app, ["bench", "--target", "/no/such/model", "--png", "chart.png"])
    assert result.exit_code == 1
    assert "--png needs matplotlib" in result.stderr and "pip install matplotlib" in result.stderr


def test_cli_bad_block_sizes() -> None:
    result = runner.invoke(app, ["bench", "--target", "/no/such/model", "--block-sizes", "8,1"])
    assert result.exit_code == 1 and "--block-sizes '8,1'" in result.stderr


def test_png(report: BenchReport, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = bench_report.save_png(report, tmp_path / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------------------
# The conformance pair: token ids only (no tokenizer), a trained drafter


def test_conformance_fixture_acceptance_matches_golden(tmp_path: Path) -> None:
    golden = json.loads((CONFORMANCE / "golden.json").read_text())
    cases = golden["cases"][:2]
    prompts = tmp_path / "golden.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"golden-{i}", "prompt_ids": c["prompt_ids"]}) + "\n" for i, c in enumerate(cases))
    )
    # The golden run was float32; that is also where greedy identity is bit-exact (a bf16-capable CPU defaults to bf16).
    options = RunOptions(
        target=str(CONFORMANCE / "target"),
        drafter=str(CONFORMANCE / "drafter"),
        sampling=SamplingParams(max_new_tokens=golden["max_new_tokens"]),
        overrides=PlanOverrides(dtype="float32", block_size=golden["block_size"]),  # the golden run's fixed block
    )
    result = bench_run.benchmark(options, BenchSettings(before_after=True, prompts_file=str(prompts), repeat=1))
    assert result.identical is True
    spec_rows = [row for row in result.rows if row.mode.speculative]
    assert [row.token_ids for row in spec_rows] == [c["new_token_ids"] for c in cases]
    assert [row.runs[0].acceptance_lengths for row in spec_rows] == [c["acceptance_lengths"] for c in cases]
    assert result.modes[1].tau == pytest.approx(sum(c["mean_acceptance_length"] for c in cases) / len(cases))


def test_text_prompts_on_a_target_without_tokenizer(tmp_path: Path) -> None:
    options = RunOptions(
        target=str(CONFORMANCE / "target"),
        drafter=str(CONFORMANCE / "drafter"),
        sampling=SamplingParams(max_new_tokens=4),
    )
    with pytest.raises(DflashError, match="is text, but .* has no tokenizer") as raised:
        bench_run.benchmark(options, BenchSettings(prompt_set="math", repeat=1))
    assert "prompt_ids" in (raised.value.fix or "")


# ---------------------------------------------------------------------------------------------------------------
# The default run: sized to about a minute here, said before it starts, progress on a non-terminal too


def test_the_quick_run_fits_the_budget_at_the_measured_pace() -> None:
    fast = [bench_run.Pace(0.01, 0.001), bench_run.Pace(0.01, 0.001)]
    assert bench_run.size_quick_run(fast, 60, 24, 3, 128, 1, shorten=True) == (24, 128)  # everything fits
    # 128 tokens at 10 and 5 tok/s: 12.7 + 25.4 + 2 s TTFT = 40 s a prompt -> 1 prompt of 128 tokens
    demo = [bench_run.Pace(1.0, 0.1), bench_run.Pace(1.0, 0.2)]
    assert bench_run.size_quick_run(demo, 60, 24, 3, 128, 1, shorten=True) == (1, 128)
    assert bench_run.size_quick_run(demo, 130, 24, 3, 128, 1, shorten=True) == (3, 128)  # 3 prompts: one per set
    assert bench_run.size_quick_run(demo, 100, 24, 3, 128, 1, shorten=True) == (2, 128)  # below a set each: any count
    # a busy machine: 128 tokens do not fit once, so generations get shorter (64: 14.6 s + 27.6 s... -> 32)
    busy = [bench_run.Pace(4.0, 0.3), bench_run.Pace(2.4, 0.9)]
    assert bench_run.size_quick_run(busy, 60, 24, 3, 128, 1, shorten=True) == (1, 32)
    assert bench_run.size_quick_run(busy, 60, 24, 3, 128, 1, shorten=False) == (1, 128)  # --max-tokens given: kept
    assert bench_run.size_quick_run(demo, 130, 24, 3, 128, 2, shorten=True) == (1, 128)  # --repeat 2 halves the room
    assert [bench_run.format_duration(s) for s in (0.2, 42, 150, 7200 + 300)] == ["1 s", "42 s", "2 min", "2 h 05 min"]


def test_the_estimate_comes_from_the_warm_up() -> None:
    modes = [bench_measure.BASELINE, Mode(True, 8)]
    paces = [bench_run.Pace(1.0, 0.1), bench_run.Pace(1.0, 0.2)]
    text = bench_run.describe_run(modes, paces, 3, 128, 1, asked_tokens=128, full_prompts=24)
    assert text.startswith("bench: 3 prompts × up to 128 tokens × 1 round, baseline and dflash b8: about 2 min")
    assert "(warm-up here: baseline 10.0 tok/s, dflash b8 5.0 tok/s)" in text
    assert "--full (24 prompts × 512 tokens × 3 rounds, about 3 h 06 min here)" in text
    short = bench_run.describe_run(modes, paces, 1, 32, 1, asked_tokens=128, full_prompts=None)
    assert "1 prompt × up to 32 tokens (128 would not fit a minute here) × 1 round" in short and "--full" not in short


def test_the_builtin_sets_interleave_so_the_first_prompts_cover_every_set() -> None:
    assert [p.id for p in bench_prompts.load_prompt_set("all")[:4]] == ["math-1", "code-1", "chat-1", "math-2"]


def test_default_bench_is_sized_here_and_says_so(models: tuple[Path, Path]) -> None:
    target, drafter = models
    args = [
        "bench",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--before-after",
        "--max-tokens",
        "3",
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    settings = json.loads(result.stdout)["settings"]
    # a tiny model decodes thousands of tokens a second: all 24 prompts fit the minute
    assert (settings["prompt_count"], settings["repeat"], settings["max_new_tokens"]) == (24, 1, 3)
    assert settings["sized_to_s"] == bench_report.QUICK_BUDGET_S
    plan = next(line for line in result.stderr.splitlines() if line.startswith("bench: "))
    assert "24 prompts × up to 3 tokens × 1 round, baseline and dflash auto≤4: about" in plan
    assert "(warm-up here: baseline " in result.stderr
    assert "The full sweep: --full (24 prompts × 512 tokens × 3 rounds" in result.stderr.replace("\n", " ")
    # stderr is not a terminal here: one progress line per generation, the warm-ups first
    progress = [line for line in result.stderr.splitlines() if line.startswith("bench ") and "elapsed" in line]
    assert len(progress) == 2 + 2 * 24 and progress[0].startswith("bench 1: baseline · warm-up")
    assert "left)" in progress[-1]


def test_default_max_tokens_is_128_and_full_is_the_old_sweep(models: tuple[Path, Path]) -> None:
    target, drafter = models
    base = ["bench", "--target", str(target), "--drafter", str(drafter), "--json"]
    quick = runner.invoke(app, [*base, "--limit", "1"])
    assert quick.exit_code == 0, quick.output
    assert json.loads(quick.stdout)["settings"]["max_new_tokens"] == bench_report.QUICK_MAX_TOKENS
    full = runner.invoke(app, [*base, "--full", "--set", "chat", "--max-tokens", "2"])
    assert full.exit_code == 0, full.output
    settings = json.loads(full.stdout)["settings"]
    assert (settings["prompt_count"], settings["repeat"], settings["max_new_tokens"]) == (8, 3, 2)
    assert "--full (" not in full.stderr  # already the full sweep: no hint


def test_step_bytes_and_read_bandwidth(models: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from dflash_cli.bench.roofline import read_bandwidth
    from dflash_cli.setup.sizes import step_bytes

    target = AutoModelForCausalLM.from_pretrained(models[0])
    config = target.config
    embedding = target.get_input_embeddings().weight
    everything = sum(p.numel() * 4 for p in target.parameters())
    counted = step_bytes(target, 10)
    # untied: the input embedding is read one row at a time; the K/V of 10 positions in every layer
    assert counted.weights == everything - embedding.numel() * 4 + config.hidden_size * 4
    assert counted.kv == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 10 * 4
    assert read_bandwidth(target) > 0
