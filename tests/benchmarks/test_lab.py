"""benchmarks/: each benchmark only we run, as `python -m benchmarks.NAME` from a checkout, run on tiny shapes in
seconds.

The benchmarks' figures are timings, which no test can check; what is checked is that each one runs through the
engine's code it measures (a benchmark that imports what the engine no longer has, or calls it the old way, fails
here), that its output has the lines and fields docs/benchmarks.md quotes, and the properties it reports (the
same tokens at every row count, the recipe sizes a recipe lists)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(path for path in (ROOT / "benchmarks").glob("*.py") if path.name != "__init__.py")


@pytest.mark.parametrize("module", BENCHMARKS, ids=lambda path: path.stem)
def test_every_benchmark_runs_as_a_module(module: Path) -> None:
    """Each file is a command: `main(argv)` returning the exit status, called when run with `python -m`."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    assert any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body), module.name
    last = tree.body[-1]
    assert isinstance(last, ast.If) and ast.unparse(last.test) == "__name__ == '__main__'", module.name
    assert ast.unparse(last.body[0]) == "sys.exit(main())", module.name


def test_recipe_sizes_are_the_ones_a_recipe_lists(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import recipe_sizes

    assert recipe_sizes.main(["qwen3.5-4b"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# qwen3.5-4b: 4.21 B params loaded")
    printed = dict(line.split(" = ") for line in out.splitlines() if " = " in line)
    from dflash_cli.setup.recipes import tomllib

    recipe = tomllib.loads((ROOT / "recipes" / "qwen3.5-4b.toml").read_text())
    for key in ("drafter_bytes", "kv_bytes_per_token", "state_bytes_per_row"):
        assert int(printed[key].replace("_", "")) == recipe[key], key
    assert float(printed["params_billion"]) == recipe["params_billion"]
    assert int(printed["bf16"].replace("_", "")) == recipe["weight_bytes"]["bf16"]
    assert {"nf4", "fp8"} <= set(printed) and "expert_bytes" not in printed  # a dense target: no experts


def test_cpu_decode_floor_measures_every_variant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks.cpu_decode_floor on a tiny Qwen3 in place of the recipe's target."""
    from benchmarks import cpu_decode_floor
    from helpers.tiny_models import build_tiny

    loaded: list[tuple[str, str]] = []
    monkeypatch.setattr(
        cpu_decode_floor, "load", lambda recipe, dtype: loaded.append((recipe, dtype)) or build_tiny("qwen3")
    )
    out = tmp_path / "floor.json"
    argv = ["--threads", "1", "--context", "8", "--blocks", "2,4", "--rounds", "1", "--calls", "1"]
    assert cpu_decode_floor.main([*argv, "--compare-kernel", "--compare-layout", "--json", str(out)]) == 0
    assert loaded == [("demo", "float32")] * 3  # eager, F.linear, column-major
    summary = json.loads(out.read_text())
    assert summary["threads"] == 1 and summary["context"] == 8 and len(summary["rounds"]) == 1
    assert summary["step_bytes"]["total"] == summary["step_bytes"]["weights"] + summary["step_bytes"]["kv"] > 0
    for clock in ("wall", "cpu"):
        assert summary[clock]["floor_ms"] > 0
        for variant in ("eager", "F.linear", "column-major"):
            figures = summary[clock][variant]
            assert figures["plain_ms"] > 0 and figures["verify_2_over_plain"] > 0 and figures["verify_4_over_plain"] > 0
            assert set(figures) >= {"step_1_over_eager", "step_2_over_eager", "step_4_over_eager"}
        assert summary[clock]["eager"]["step_2_over_eager"] == 1.0
    text = capsys.readouterr().out
    assert "round 1 (wall ms): floor" in text and "[cpu time] floor" in text
    assert re.search(r"column-major: plain step [\d.]+ ms = [\d.]+x the floor", text)


def test_batch_bench_tabulates_every_size_and_compares_the_texts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks.batch_bench with `dflash run` replaced by a double that writes what the command writes; the
    table and the text check are the script's own. At batch size 4 the double's texts differ: the check says so."""
    from benchmarks import batch_bench

    commands: list[list[str]] = []

    def fake_run(command: list[str], **_: object) -> subprocess.CompletedProcess:
        commands.append(command)
        size, out = int(command[command.index("--batch-size") + 1]), Path(command[command.index("-o") + 1])
        prompts = [json.loads(line) for line in Path(command[5]).read_text().splitlines()]
        stats = {"draft_s": 1.0, "verify_s": 3.0, "decode_tokens_per_s": 10.0, "ttft_s": 0.5}
        records = [
            {"id": p["id"], "text": f"answer {i}" + ("!" if size == 4 else ""), "completion_tokens": 11, "stats": stats}
            for i, p in enumerate(prompts)
        ]
        out.write_text("".join(json.dumps(record) + "\n" for record in records))
        summary = {"completion_tokens": 11 * len(records), "generate_s": 4.0 / size, "tokens_per_s": 10.0 * size}
        summary["wall_s"] = 2.0 + 4.0 / size  # the load and the rest: the same at every size
        return subprocess.CompletedProcess(command, 0, json.dumps({**summary, "tau": 1.5}), "")

    monkeypatch.setattr(batch_bench.subprocess, "run", fake_run)
    argv = ["--sizes", "1", "2", "4", "--rounds", "1", "--prompts", "3", "--max-tokens", "11", "--", "--threads", "1"]
    assert batch_bench.main(argv) == 0
    assert [c[c.index("--batch-size") + 1] for c in commands] == ["1", "2", "4"]
    assert all(c[2:5] == ["dflash_cli", "run", "demo"] and c[-3:] == ["--json", "--threads", "1"] for c in commands)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("demo: 3 prompts, --max-tokens 11, --threads 1;")
    # 33 tokens; draft share 1 / (1 + 3); each row: 0.5 s to its first token, 10 more at 10 tok/s
    assert lines[3].startswith("| 1 | 1 | 33 | 4.0 | 10.0 | 1.00x | 6.0 | 1.00x | 1.50 | 25% | 1.5 / 1.5 |")
    assert lines[4].startswith("| 1 | 2 | 33 | 2.0 | 20.0 | 2.00x | 4.0 | 0.67x |")
    assert lines[5].startswith("| 1 | 4 | 33 | 1.0 | 40.0 | 4.00x | 3.0 | 0.50x |")
    assert lines[6] == "every request's text is the same at every batch size: NO"


def test_hybrid_batch_bench_gives_every_row_count_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import hybrid_batch_bench
    from dflash_cli.engine.target.hybrid import LinearStateRollback

    keep = LinearStateRollback.keep
    monkeypatch.setattr(
        hybrid_batch_bench, "COMMON", {**hybrid_batch_bench.COMMON, "hidden_size": 64, "intermediate_size": 128}
    )
    argv = ["--rows", "1", "3", "--requests", "3", "--rounds", "1", "--block", "4", "--threads", "1"]
    assert hybrid_batch_bench.main(argv) == 0
    assert LinearStateRollback.keep is keep  # the timing is put back
    out = capsys.readouterr().out
    assert re.search(r"round 1 rows 1: [\d.]+ tok/s \(1\.00x rows 1\), rollback [\d.]+% of decode step time", out)
    shares = [float(share) for share in re.findall(r"round 1 rows \d: .*rollback ([\d.]+)%", out)]
    assert len(shares) == 2 and all(share > 0 for share in shares)  # every step rolled back
    assert "rows 3: median" in out
    assert "every request's tokens the same at every row count: yes" in out


def test_hybrid_rollback_bench_runs_every_method(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import hybrid_rollback_bench

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16, linear_key_head_dim=16)
    small.update(linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    monkeypatch.setattr(hybrid_rollback_bench, "SHAPE", {**hybrid_rollback_bench.SHAPE, **small})
    monkeypatch.setattr(hybrid_rollback_bench, "PROMPT", 16)
    assert hybrid_rollback_bench.main(["--block", "8", "--repeats", "1"]) == 0
    rows = re.findall(r"^(\w+) +(\d+) +([\d.]+) +(-?[\d.]+)  -?[\d.]+ \(", capsys.readouterr().out, re.MULTILINE)
    assert [(method, int(n)) for method, n, _, _ in rows] == [
        (method, n) for method in ("replay", "rerun", "mixer", "pertoken") for n in (1, 2, 4, 7)
    ]
    assert all(float(verify_ms) > 0 for _, _, verify_ms, _ in rows)


def test_quant_loss_reports_each_format_against_bf16(tiny_qwen3_dir: Path, tmp_path: Path, capsys) -> None:
    from benchmarks import quant_loss

    out = tmp_path / "loss.json"
    argv = ["--target", str(tiny_qwen3_dir), "--prompts", "2", "--tokens", "6", "--json", str(out)]
    assert quant_loss.main(argv) == 0
    table = capsys.readouterr().out
    assert "| int4 |" in table and "| int8 |" in table
    results = json.loads(out.read_text())["results"]
    assert results["fp32"]["mean_logprob_diff"] == 0 and results["fp32"]["identical_greedy"] == 1
    for quant in ("bf16", "int4", "int8"):
        assert 0 <= results[quant]["argmax_agreement"] <= 1 and results[quant]["mean_kl"] > 0  # it did quantize


def test_vs_llamacpp_reads_both_llama_cpp_outputs() -> None:
    """The two lines of llama.cpp's output the side-by-side reads, in the formats of its sources (llama-bench's
    JSON records; speculative-simple.cpp's `decoded %4d tokens in %8.3f seconds, speed: %8.3f t/s`)."""
    from benchmarks import vs_llamacpp

    bench = [{"n_prompt": 0, "n_gen": 128, "avg_ts": 101.5, "stddev_ts": 1.2}]
    assert vs_llamacpp.parse_llama_bench(json.dumps(bench)) == 101.5
    log = "encoded   31 tokens in    0.101 seconds, speed:  306.9 t/s\n"
    log += "decoded  128 tokens in    1.600 seconds, speed:   80.000 t/s\n\nn_draft   = 3\naccept    = 41.250%\n"
    assert vs_llamacpp.parse_speculative(log) == {"tokens": 128.0, "tok_s": 80.0, "accept": 0.4125}
    with pytest.raises(RuntimeError, match="no speed line"):
        vs_llamacpp.parse_speculative("error: unknown argument")


def test_grammar_bench_runs_every_mode_and_the_constrained_ones_agree(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """benchmarks.grammar_bench's modes on the tiny Qwen3 with a random drafter, float32: the three constrained
    modes give the same text (only the drafts differ), the grammar's time is counted, text mode has none."""
    from transformers import AutoModelForCausalLM

    from benchmarks import grammar_bench
    from dflash_cli.loading.session import open_session
    from dflash_cli.setup.options import RunOptions
    from dflash_cli.setup.planning import PlanOverrides
    from helpers.drafters import save_random_drafter

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    drafter = save_random_drafter(tmp_path / "drafter", target, block_size=4)
    options = RunOptions(target=str(tiny_qwen3_dir), drafter=str(drafter), overrides=PlanOverrides(dtype="float32"))
    session = open_session(options)
    message, schema = grammar_bench.PROMPTS[3]
    results = {
        mode: grammar_bench.run_mode(session, options, mode, message, schema, 24) for mode in grammar_bench.MODES
    }
    assert len({results[mode]["text"] for mode in grammar_bench.MODES[1:]}) == 1
    assert results["text"]["grammar_s"] == 0 and all(results[m]["grammar_s"] > 0 for m in grammar_bench.MODES[1:])
    assert results["schema, no drafter"]["tau"] == 1.0 and results["schema"]["steps"] > 0


@pytest.mark.slow
def test_prefix_bench_times_chat_turns_and_served_requests_both_ways(
    tiny_qwen3_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks.prefix_bench on a tiny model (short questions: its context is 512 tokens): the chat turns (the same
    replies both ways, later turns reusing the earlier ones) and a real `dflash serve` with and without
    --no-prefix-cache (cached_tokens from the usage)."""
    from transformers import AutoModelForCausalLM

    from benchmarks import prefix_bench

    monkeypatch.setattr(prefix_bench, "questions", lambda: [f"Question {i}: why is the sky blue?" for i in range(12)])
    from dflash_cli.protocol.params import SamplingParams
    from dflash_cli.setup.options import RunOptions
    from dflash_cli.setup.planning import PlanOverrides
    from helpers.drafters import save_random_drafter

    drafter = save_random_drafter(
        tmp_path / "drafter", AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir), block_size=4
    )
    model = ["--target", str(tiny_qwen3_dir), "--drafter", str(drafter)]
    options = RunOptions(
        target=model[1], drafter=model[3], sampling=SamplingParams(), overrides=PlanOverrides(dtype="float32")
    )
    prefix_bench.chat(options, 3, 4)
    prefix_bench.serve(model, 3, 60, 4, ["--dtype", "float32", "--threads", "1"])
    out = capsys.readouterr().out
    assert "differ" not in out
    turns = re.findall(r"^\| (\d) \| (\d+) \| (\d+) \| [\d.]+ \| [\d.]+ \|$", out, re.M)
    assert [int(turn) for turn, _, _ in turns] == [1, 2, 3]
    assert all(int(reused) >= int(turns[i][1]) for i, (_, _, reused) in enumerate(turns[1:]))
    assert "with reuse: last turn's TTFT / first turn's = " in out and "without reuse: last turn's" in out
    served = re.findall(r"^\| (\d) \| (\d+) \| (\d+) \| [\d.]+ \| \d+% \| [\d.]+ \|$", out, re.M)
    assert len(served) == 6  # both ways
    assert all(int(cached) > 20 for _, _, cached in served[1:3]) and all(c == "0" for _, _, c in served[3:])
    assert "--no-prefix-cache: requests 2-3 TTFT = " in out


def test_cpu_products_tabulates_each_kernel_at_each_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import cpu_products

    assert cpu_products.main(["--layers", "1", "--repeats", "1", "--rows", "1", "3", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if re.match(r"\| \d+ \|", line)]
    assert [line.split("|")[1].strip() for line in table] == ["1", "3"]
    assert all(len(line.split("|")) == 8 for line in table)  # rows + five kernels
    assert "1 layers x 7 products" in lines[0]


@pytest.mark.slow
def test_a_benchmark_runs_from_a_checkout() -> None:
    """`python -m benchmarks.NAME` in the checkout's root finds both the lab and the package (no install of either
    needed) and passes its arguments on."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.recipe_sizes", "qwen3.5-4b"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# qwen3.5-4b: 4.21 B params loaded")


def test_attention_bench_alternates_the_attentions_and_compares_the_texts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks.attention_bench with `dflash chat` replaced by a double printing what chat prints: the rounds
    alternate which attention runs first, the ratio is of the medians, and differing texts are reported."""
    from benchmarks import attention_bench

    commands: list[list[str]] = []
    rates = {"eager": iter([90.0, 100.0, 110.0]), "sdpa": iter([100.0, 100.0, 130.0])}

    def fake_run(command: list[str], **_: object) -> subprocess.CompletedProcess:
        commands.append(command)
        attention = command[command.index("--attention") + 1]
        stats = f"128 tokens, {next(rates[attention])} tok/s, TTFT 0.30 s (prompt 42, 0 reused), tau 1.00\n"
        return subprocess.CompletedProcess(command, 0, f"a story ({attention})\n", "plan line\n" + stats)

    monkeypatch.setattr(attention_bench.subprocess, "run", fake_run)
    assert attention_bench.main(["--rounds", "3", "--", "--compile", "off"]) == 0
    order = [c[c.index("--attention") + 1] for c in commands]
    assert order == ["eager", "sdpa", "sdpa", "eager", "eager", "sdpa"]
    assert all(
        c[2:6] == ["dflash_cli", "chat", "demo", "--no-spec"] and c[-2:] == ["--compile", "off"] for c in commands
    )
    out = capsys.readouterr().out
    assert "default (invariant) median 100.0 tok/s, sdpa median 100.0 tok/s: 1.00x" in out
    assert out.rstrip().endswith("the same text with both: NO")


def test_objective_tau_scores_a_trained_drafter_above_an_untrained_one(
    tiny_qwen3_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The training objective's tau of drafters over a run's stored answers and features: a drafter trained on them
    scores above a fresh one of its shape (the features it reads are the samples' own), and a run without its
    layers' features is refused."""
    from benchmarks import objective_tau
    from dflash_cli.commands.train import train
    from dflash_cli.training.options import TrainOptions
    from helpers.drafters import save_random_drafter

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about item {i}."}) + "\n" for i in range(12)))
    run = tmp_path / "run"
    options = TrainOptions(
        target=str(tiny_qwen3_dir), prompts=str(prompts), output=str(run), block_size=4, feature_layers=2,
        steps=60, batch_size=4, lr=3e-3, warmup_steps=2, anchors_per_sequence=4, max_new_tokens=16,
        eval_prompts=0, checkpoint_every=100,
    )  # fmt: skip
    train(options)
    trained = run / "drafter"
    from dflash_cli.loading.models import load_drafter
    from dflash_cli.training.loop import open_target

    target, _ = open_target(str(tiny_qwen3_dir), "cpu", "float32")
    layers = load_drafter(str(trained), target).config.target_layer_ids
    fresh = save_random_drafter(tmp_path / "fresh", target, block_size=4, layer_ids=layers, seed=3)
    argv = [str(run), str(trained), str(fresh), "--target", str(tiny_qwen3_dir), "--batches", "4"]
    assert objective_tau.main(argv) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["samples"] for row in rows] == [12, 12]
    assert rows[0]["tau"] > rows[1]["tau"] >= 1.0
    other = save_random_drafter(tmp_path / "other", target, block_size=4, layer_ids=[0], seed=3)
    assert objective_tau.main([str(run), str(other), "--target", str(tiny_qwen3_dir)]) == 2
