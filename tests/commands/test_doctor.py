"""`dflash doctor`: the real checks on this machine, and fabricated broken machines for every failure."""

from __future__ import annotations

import dataclasses
import http.server
import socket
import threading
import time
from pathlib import Path

import pytest
import tomllib
from packaging.utils import canonicalize_name

from dflash_cli.commands import doctor
from dflash_cli.commands.doctor import (
    BnbInstall,
    Check,
    SmiGpu,
    SmiResult,
    arch_supported,
    bnb_library_for,
    check_bitsandbytes,
    check_command_conflicts,
    check_driver,
    check_hf_cache,
    check_hf_token,
    check_hub,
    check_package,
    check_python,
    check_recipes,
    check_torch,
    dflash_commands,
    exit_code,
    run_checks,
)
from dflash_cli.loading.hub import hub_reachable
from dflash_cli.setup import recipes
from dflash_cli.setup.hardware import MachineFacts, detect_machine
from dflash_cli.setup.planning import PlanOverrides, make_plan
from dflash_cli.setup.recipes import get_recipe, load_recipes
from dflash_cli.setup.speed import expected_speed
from helpers.machines import CU126_ARCHS, CU128_ARCHS, GIB, cuda_machine

TORCH_213_RELEASES = {
    "12.6": {50, 60, 70, 75, 80, 86, 90},
    "12.9": {75, 80, 86, 90, 100, 120},
    "13.0": {75, 80, 86, 90, 100, 120},
}
SHIPPED_BNB = BnbInstall("0.50.2", ((11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (13, 0), (13, 2)), True, True)


def gpu(
    name: str, capability: tuple[int, int], archs: tuple[str, ...], cuda: str, total_gib: float = 31.4
) -> MachineFacts:
    return cuda_machine(name, capability, total_gib, free_gib=total_gib - 0.5, cuda=cuda, archs=archs, ram_gib=(64, 60))


RTX_5090_CU126 = gpu("NVIDIA GeForce RTX 5090", (12, 0), CU126_ARCHS, "12.6")
RTX_5090_CU128 = gpu("NVIDIA GeForce RTX 5090", (12, 0), CU128_ARCHS, "12.8")
B300_CU128 = gpu("NVIDIA B300", (10, 3), CU128_ARCHS, "12.8", total_gib=268)
H100_CU126 = gpu("NVIDIA H100 80GB HBM3", (9, 0), CU126_ARCHS, "12.6", total_gib=79.2)
CPU = MachineFacts(kind="cpu", torch_version="2.13.0+cpu", cpu_ram_total=32 * GIB, cpu_ram_available=28 * GIB)


@pytest.fixture(autouse=True)
def no_user_recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unreachable_hub: str) -> None:
    """No user recipes, and the Hub probe goes to a closed local port unless a test brings the fake Hub."""
    monkeypatch.setattr(recipes, "user_recipe_dir", lambda: tmp_path / "user-recipes")


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def test_real_checks_on_this_machine_are_sane(hf_home: Path, fake_hub) -> None:
    checks = by_name(run_checks())
    expected = {
        "python",
        "torch",
        "driver",
        "gpu",
        "bitsandbytes",
        "mxfp4",
        "transformers",
        "accelerate",
        "hf cache",
        "hf token",
        "hugging face hub",
        "recipes",
        "compiled steps",
        "measurements",
        "cpu kernels",
        "dflash command",
    }
    assert set(checks) == expected
    for name in ("python", "torch", "driver", "gpu", "bitsandbytes", "transformers", "accelerate"):
        assert checks[name].status == "pass", checks[name]
    # The cache's check weighs this machine's free disk against the largest recipe it can run (a full disk warns:
    # the rule itself is tested with given sizes below), so here it passes or warns with its fix, never fails.
    assert checks["hf cache"].status == "pass" or "HF_HOME" in (checks["hf cache"].fix or ""), checks["hf cache"]
    assert checks["hf token"].status == "warn" and "llama3.1-8b" in checks["hf token"].detail  # hf_home has no token
    assert str(hf_home / "hub") in checks["hf cache"].detail
    assert exit_code(list(checks.values())) == 0
    facts = detect_machine()
    if facts.kind == "cpu":
        assert "CPU library" in checks["bitsandbytes"].detail
        assert checks["gpu"].detail.startswith("no GPU")
        assert checks["compiled steps"].detail.startswith("C++ compiler ")  # (CI and this machine have g++)
    for name in ("qwen3-4b", "qwen3-8b", "gpt-oss-20b"):
        assert name in checks["recipes"].detail
    assert checks["hugging face hub"].status == "pass" and fake_hub.endpoint in checks["hugging face hub"].detail
    demo = next(line for line in checks["recipes"].detail.splitlines() if line.startswith("demo:"))
    assert "tok/s at most here" in demo  # measured on this machine


def test_hub_reachability(fake_hub, unreachable_hub: str) -> None:
    assert hub_reachable(fake_hub.endpoint) is None  # any HTTP answer means the Hub is there
    refused = hub_reachable(unreachable_hub)
    assert refused is not None and "refused" in refused.lower()
    check = check_hub(False, unreachable_hub, refused)
    assert check.status == "warn" and unreachable_hub in check.detail and "HF_HUB_OFFLINE=1" in check.fix
    assert check_hub(False, fake_hub.endpoint, None).status == "pass"
    offline = check_hub(True, unreachable_hub, None)
    assert offline.status == "pass" and "HF_HUB_OFFLINE" in offline.detail


def test_a_hub_that_never_answers_times_out() -> None:
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        started = time.perf_counter()
        reason = hub_reachable(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=0.5)
    assert reason == "no answer within 0.5 s" and time.perf_counter() - started < 5


def test_a_hub_that_fails_is_reported() -> None:
    class Failing(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert hub_reachable(f"http://127.0.0.1:{server.server_address[1]}") == "it answers HTTP 503"
    finally:
        server.shutdown()
        server.server_close()


def test_run_checks_offline_never_asks_the_hub(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "hub_reachable", lambda *a, **k: pytest.fail("the Hub was asked while offline"))
    assert by_name(run_checks(CPU))["hugging face hub"].status == "pass"


def test_a_token_is_reported_but_never_shown(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "hf_abcdefghijklmnopqrstuvwxyz0123456789"
    monkeypatch.setenv("HF_TOKEN", secret)
    checks = run_checks()
    assert by_name(checks)["hf token"].status == "pass"
    assert secret not in repr(checks)


def test_rtx_5090_on_a_cu126_torch_fails_with_the_fix() -> None:
    check = check_torch(RTX_5090_CU126, None, None)
    assert check.status == "fail"
    assert "sm_120" in check.detail and "sm_90" in check.detail
    assert check.fix == (
        "install a torch built for CUDA 12.8+ (sm_120 kernels): "
        "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu128"
    )
    # with torch's own release table, the oldest CUDA build that has sm_120 kernels
    assert check_torch(RTX_5090_CU126, None, TORCH_213_RELEASES).fix.endswith("/whl/cu129")


def test_whole_run_fails_on_a_broken_machine() -> None:
    checks = by_name(run_checks(RTX_5090_CU126))
    assert checks["torch"].status == "fail"
    assert exit_code(list(checks.values())) == 1


@pytest.mark.parametrize(
    ("facts", "status"),
    [(RTX_5090_CU128, "pass"), (B300_CU128, "pass"), (H100_CU126, "pass"), (RTX_5090_CU126, "fail")],
)
def test_torch_arch_coverage(facts: MachineFacts, status: str) -> None:
    assert check_torch(facts, None).status == status


def test_arch_rules_follow_binary_compatibility() -> None:
    assert arch_supported(["sm_100"], (10, 3))  # B300 runs sm_100 code
    assert arch_supported(["sm_80"], (8, 6))
    assert arch_supported(["sm_90a"], (9, 0))
    assert not arch_supported(["sm_90"], (12, 0))
    assert not arch_supported(["sm_86"], (8, 0))  # newer minor code does not run on an older minor
    assert not arch_supported(["compute_90"], (9, 0))


def test_cpu_torch_on_a_machine_with_an_nvidia_gpu_fails() -> None:
    smi = SmiResult(gpus=(SmiGpu("NVIDIA GeForce RTX 4090", "8.9", "24564 MiB", "570.86"),))
    check = check_torch(CPU, smi, None)
    assert check.status == "fail" and "RTX 4090" in check.detail
    assert "download.pytorch.org/whl/cu126" in check.fix
    old_driver = check_torch(dataclasses.replace(CPU, torch_cuda_version="13.0"), smi, None)
    assert old_driver.status == "fail" and "driver" in old_driver.fix


def test_driver_checks() -> None:
    assert check_driver(CPU, None).status == "pass"
    assert check_driver(RTX_5090_CU128, None).status == "warn"
    failed = check_driver(RTX_5090_CU128, SmiResult(error="NVIDIA-SMI has failed because it couldn't communicate"))
    assert failed.status == "fail" and failed.fix
    ok = check_driver(
        RTX_5090_CU128, SmiResult(gpus=(SmiGpu("NVIDIA GeForce RTX 5090", "12.0", "32607 MiB", "575.51"),))
    )
    assert ok.status == "pass" and "575.51" in ok.detail


def test_bitsandbytes_library_choice_mirrors_bitsandbytes() -> None:
    shipped = SHIPPED_BNB.cuda_libs
    assert bnb_library_for((12, 8), shipped) == (12, 8)
    assert bnb_library_for((12, 9), shipped) == (12, 8)  # newest older one of the same major
    assert bnb_library_for((13, 1), shipped) == (13, 0)
    assert bnb_library_for((12, 0), shipped) == (12, 1)  # oldest newer one of the same major
    assert bnb_library_for((14, 0), shipped) is None  # never across majors


def test_bitsandbytes_checks() -> None:
    assert check_bitsandbytes(RTX_5090_CU128, SHIPPED_BNB).status == "pass"
    assert check_bitsandbytes(H100_CU126, SHIPPED_BNB).status == "pass"
    blackwell_old_lib = check_bitsandbytes(RTX_5090_CU126, SHIPPED_BNB)
    assert blackwell_old_lib.status == "fail" and "CUDA 12.8+" in blackwell_old_lib.fix
    no_lib = check_bitsandbytes(gpu("X", (7, 0), ("sm_70",), "10.2"), SHIPPED_BNB)  # no CUDA 10 library
    assert no_lib.status == "fail"
    missing = check_bitsandbytes(CPU, BnbInstall(None, error="ModuleNotFoundError: No module named 'bitsandbytes'"))
    assert missing.status == "fail" and "pip install" in missing.fix
    assert check_bitsandbytes(CPU, SHIPPED_BNB).status == "pass"
    assert check_bitsandbytes(CPU, dataclasses.replace(SHIPPED_BNB, has_cpu_lib=False)).status == "warn"


def test_this_machines_bitsandbytes_is_inspected_for_real() -> None:
    install = doctor.inspect_bitsandbytes()
    assert install.version and install.native_loaded
    assert install.has_cpu_lib or install.cuda_libs


def test_package_versions() -> None:
    assert check_package("transformers", "5.23.0", 5, "transformers>=5,<6").status == "pass"
    old = check_package("transformers", "4.57.3", 5, "transformers>=5,<6")
    assert old.status == "fail" and old.fix == "pip install 'transformers>=5,<6'"
    assert check_package("accelerate", None, None, "accelerate>=1.0").status == "fail"


def test_python_version() -> None:
    assert check_python((3, 11, 7)).status == "pass"
    assert check_python((3, 9, 18)).status == "fail"


def test_command_conflicts() -> None:
    ours = ("dflash-cli", "dflash_cli.cli:main")
    assert check_command_conflicts([ours]).status == "pass"
    assert check_command_conflicts([("dflash-cli", "dflash_cli.cli.app:main")]).status == "pass"  # an older install
    clash = check_command_conflicts([ours, ("dflash", "dflash.cli:main")])
    assert clash.status == "warn" and "dflash (dflash.cli:main)" in clash.detail
    assert clash.fix.startswith("pip uninstall dflash")
    assert "python -m dflash_cli" in check_command_conflicts([]).detail


def test_hf_cache_space_and_token() -> None:
    shipped = list(load_recipes().values())
    assert check_hf_cache(Path("/cache"), 500 * 10**9, shipped).status == "pass"
    low = check_hf_cache(Path("/cache"), 5 * 10**9, shipped)
    assert low.status == "warn" and "HF_HOME" in low.fix
    assert check_hf_token(False, [get_recipe("qwen3-8b")]).status == "pass"  # nothing gated


def test_recipe_speed_classes() -> None:
    shipped = list(load_recipes().values())
    # A 2-core CPU streaming 10 GB/s in float32 and 4.5 GB/s in emulated bf16 (what this session's machine measured).
    bandwidth = {"float32": 10e9, "bfloat16": 4.5e9}
    cpu = dataclasses.replace(CPU, cpu_ram_total=64 * GIB, cpu_ram_available=60 * GIB)
    lines = {
        line.split(":")[0]: line for line in check_recipes(cpu, shipped, lambda d, t: bandwidth[t]).detail.splitlines()
    }
    assert "~19 tok/s at most here" in lines["demo"] and "fine for chat" in lines["demo"]  # 0.54 GB per token
    assert "(32.8 GB read per token at 10 GB/s): too slow for chat" in lines["qwen3-8b"]  # fp32 fits 60 GB
    h100 = check_recipes(H100_CU126, shipped, lambda d, t: 3.0e12).detail
    assert "qwen3-8b: fits, cuda bfloat16" in h100 and "~183 tok/s at most here" in h100 and ": fast" in h100
    nf4 = check_recipes(cpu, [get_recipe("qwen3-4b")], lambda d, t: bandwidth[t])
    assert "NF4" not in nf4.detail  # the planner never picks NF4 on a CPU by itself


def test_a_cpu_plan_too_slow_for_chat_names_the_int4_speed() -> None:
    """The planner keeps the published weights where they fit (bf16: 16.4 GB a token for Qwen3-8B); where that is
    below chat speed, doctor says what --quant int4 would reach; a plan fast enough, or already int4, says nothing."""
    cpu = dataclasses.replace(CPU, cpu_bf16=True, cpu_ram_total=64 * GIB, cpu_ram_available=60 * GIB)
    lines = {
        line.split(":")[0]: line
        for line in check_recipes(
            cpu, [get_recipe("qwen3-8b"), get_recipe("demo")], lambda d, t: 40e9
        ).detail.splitlines()
    }
    assert "fits, cpu bfloat16" in lines["qwen3-8b"] and "slow: sluggish in chat" in lines["qwen3-8b"]
    assert lines["qwen3-8b"].endswith("; with --quant int4 ~6.4 tok/s at most (6.2 GB a token)")
    assert "--quant" not in lines["demo"]  # (int4 already, and fast)
    fast = check_recipes(cpu, [get_recipe("qwen3-8b")], lambda d, t: 400e9).detail
    assert "--quant" not in fast


def test_speed_verdicts_and_the_nf4_note_off_cuda() -> None:
    recipe = get_recipe("qwen3-8b")
    plan = make_plan(CPU, recipe, PlanOverrides(quant="nf4"))
    speed = expected_speed(recipe, plan, 10e9)
    assert speed is not None and speed.bytes_per_token == recipe.weight_bytes["nf4"]
    assert "NF4 off CUDA" in speed.describe()
    for rate, verdict in ((0.9, "too slow for chat"), (5, "slow"), (12, "fine for chat"), (40, "fast")):
        assert dataclasses.replace(speed, tokens_per_s=rate).verdict.startswith(verdict)
    adhoc = make_plan(CPU, recipes.adhoc_recipe("someone/model", None))
    assert expected_speed(recipes.adhoc_recipe("someone/model", None), adhoc, 10e9) is None  # size unknown


def test_recipe_fit_report() -> None:
    shipped = list(load_recipes().values())
    on_5090 = check_recipes(RTX_5090_CU128, shipped)
    assert on_5090.status == "pass"
    assert "qwen3-8b: fits, cuda bfloat16" in on_5090.detail
    assert "kimi-k2.5: not runnable" in on_5090.detail
    assert "gpt-oss-20b: does not fit" in on_5090.detail and "MXFP4" in on_5090.detail  # no MXFP4 kernels here
    items = {item["name"]: item for item in on_5090.to_dict()["items"]}  # --json: the same, as data
    assert set(items) == {recipe.name for recipe in shipped}
    assert items["qwen3-8b"]["fits"] and (items["qwen3-8b"]["device"], items["qwen3-8b"]["weights"]) == (
        "cuda",
        "bfloat16",
    )
    assert items["kimi-k2.5"] == {"name": "kimi-k2.5", "fits": False, "runnable": False}
    assert not items["gpt-oss-20b"]["fits"] and "MXFP4" in items["gpt-oss-20b"]["why"]
    assert "items" not in check_recipes(RTX_5090_CU128, []).to_dict()  # other checks keep their shape
    tiny = dataclasses.replace(RTX_5090_CU128, total_memory=4 * GIB, free_memory=3 * GIB)
    zlab = [recipe for recipe in shipped if recipe.drafter and recipe.drafter.id.startswith("z-lab/")]
    nothing = check_recipes(tiny, zlab)
    assert nothing.status == "warn" and "qwen3-4b: does not fit" in nothing.detail


def test_a_24_gb_cpu_lists_the_27b_recipes_as_fitting_in_int4() -> None:
    """A 24.5 GB machine with bf16 instructions and 23 GiB free: the 27 B dense targets fit in int4 (bf16 takes
    59 GB), the 35B-A3B MoEs fit in nothing (their fused experts stay bf16 in every CPU format)."""
    machine = MachineFacts(kind="cpu", cpu_ram_total=int(24.5e9), cpu_ram_available=23 * GIB, cpu_bf16=True)
    check = check_recipes(machine, list(load_recipes().values()))
    lines = {line.split(":")[0]: line for line in check.detail.splitlines()}
    assert lines["qwen3.6-27b"].startswith("qwen3.6-27b: fits, cpu int4, ~24.2 GB at 8,192 tokens")
    assert "qwen3.5-35b-a3b: does not fit" in lines["qwen3.5-35b-a3b"] and "in int4" in lines["qwen3.5-35b-a3b"]
    items = {item["name"]: item for item in check.to_dict()["items"]}
    assert (items["qwen3.6-27b"]["fits"], items["qwen3.6-27b"]["weights"]) == (True, "int4")
    assert (items["qwen3-8b"]["fits"], items["qwen3-8b"]["weights"]) == (True, "bfloat16")  # 20.9 GB: fits as is


def test_a_broken_user_recipe_is_a_failed_check(tmp_path: Path) -> None:
    (tmp_path / "user-recipes").mkdir()
    (tmp_path / "user-recipes" / "bad.toml").write_text("name = 1\n")
    checks = by_name(run_checks(CPU))
    assert checks["user recipe"].status == "fail" and "bad.toml" in checks["user recipe"].detail
    assert checks["recipes"].status != "fail" and "demo" in checks["recipes"].detail  # the others still checked


def test_mxfp4_check_says_how_gpt_oss_will_load() -> None:
    from dflash_cli.commands.doctor import check_mxfp4

    assert "run as stored" in check_mxfp4(dataclasses.replace(RTX_5090_CU128, mxfp4_kernels=True)).detail
    without = check_mxfp4(RTX_5090_CU128)
    assert "dequantized to bf16" in without.detail and "pip install 'triton>=3.4' kernels" in without.detail
    assert "no kernels" in check_mxfp4(CPU).detail


def test_a_moe_speed_bound_reads_only_the_routed_experts() -> None:
    recipe = recipes.get_recipe("qwen3-coder-30b-a3b")
    plan = make_plan(dataclasses.replace(RTX_5090_CU128, free_memory=200 * GIB), recipe)
    speed = expected_speed(recipe, plan, 1000e9)
    # 3.3 B of 30.5 B parameters per token, in bf16: ~6.6 GB read, not the 61 GB held
    assert 6.0e9 < speed.bytes_per_token < 7.5e9
    dense = dataclasses.replace(recipe, active_params_billion=None)
    assert expected_speed(dense, plan, 1000e9).bytes_per_token == recipe.weight_bytes["bf16"]


def test_compiled_steps_check_says_what_a_cpu_can_build(tmp_path: Path) -> None:
    cpu = detect_machine()
    cpu = dataclasses.replace(cpu, gpu_name=None)
    stored = [tmp_path / "llama-0123.pt2", tmp_path / "qwen3-4567.pt2", tmp_path / "llama-89ab.pt2"]
    missing = doctor.check_compiled_steps(cpu, None, stored)
    assert missing.status == "warn" and "no C++ compiler" in missing.detail and "apt install g++" in missing.fix
    assert "stored: llama x2, qwen3 x1" in missing.detail
    found = doctor.check_compiled_steps(cpu, "/usr/bin/g++", [])
    assert found.status == "pass" and "/usr/bin/g++" in found.detail and "stored" not in found.detail
    started = time.time()
    building = doctor.check_compiled_steps(cpu, "/usr/bin/g++", [], [(tmp_path / "k.log", started)])
    since = time.strftime("%H:%M", time.localtime(started))
    assert f"building in the background since {since} (log {tmp_path / 'k.log'})" in building.detail
    gpu = doctor.check_compiled_steps(dataclasses.replace(cpu, gpu_name="NVIDIA H100"), None, [])
    assert gpu.status == "pass" and "CUDA graphs" in gpu.detail


def test_cpu_kernels_check_says_what_runs_and_what_to_install() -> None:
    cpu = dataclasses.replace(detect_machine(), gpu_name=None)
    built = doctor.check_cpu_kernels(cpu, None, True, "/usr/bin/c++")
    assert built.status == "pass" and "built" in built.detail
    later = doctor.check_cpu_kernels(cpu, None, False, "/usr/bin/c++")
    assert later.status == "pass" and "/usr/bin/c++" in later.detail and "first CPU run" in later.detail
    no_compiler = doctor.check_cpu_kernels(cpu, None, False, None)
    assert no_compiler.status == "warn" and "apt install g++" in no_compiler.fix
    old_cpu = doctor.check_cpu_kernels(cpu, "this CPU lacks avx512_bf16", False, None)
    assert old_cpu.status == "pass" and "torch's kernels" in old_cpu.detail and "avx512_bf16" in old_cpu.detail
    failed = doctor.check_cpu_kernels(cpu, None, False, "/usr/bin/c++", "could not build them (unknown option)")
    assert failed.status == "warn" and "unknown option" in failed.detail and "CXX" in failed.fix
    gpu = doctor.check_cpu_kernels(dataclasses.replace(cpu, gpu_name="NVIDIA H100"), None, False, None)
    assert gpu.status == "pass" and "CUDA" in gpu.detail
    avx2 = doctor.check_cpu_kernels(cpu, None, True, "/usr/bin/c++", tier="avx2")
    assert avx2.status == "pass" and "(AVX2 tier) are built" in avx2.detail
    assert "(AVX-512 tier)" in built.detail


def test_our_own_command_is_no_conflict() -> None:
    """The `dflash` command pyproject.toml declares, as an install reports it, is ours: doctor once told every user
    to uninstall dflash-cli, comparing the entry point with a name the package no longer used. And this
    environment's own install (CI's `pip install -e .`; none at all is "not installed", a pass too)."""

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    declared = check_command_conflicts([(canonicalize_name(project["name"]), project["scripts"]["dflash"])])
    assert declared.status == "pass" and declared.fix is None and "no other package" in declared.detail
    found = dflash_commands()
    assert all(dist == "dflash-cli" for dist, _ in found), found
    assert check_command_conflicts(found).status == "pass"


def test_doctor_shows_what_was_measured_when_and_whether_it_stands(block_costs_cache: Path) -> None:
    """Decode threads and step costs kept on this machine: each with its target, when, the others' load, and
    whether it stands (a busy or old one is measured again at the next start)."""
    from dflash_cli.cpu_load import measured_now
    from dflash_cli.engine.policy import StepCosts, kept_measurements, save_measurement

    assert doctor.check_measurements([]).detail.startswith("none kept yet")
    key = {"host": "h", "target": "org/doctor-tiny", "dtype": "bfloat16", "threads": 2}
    quiet = StepCosts(key, (1, 2))
    quiet.verify_s, quiet.draft_s, quiet.measured_at, quiet.others_busy = {1: 0.01, 2: 0.02}, {}, measured_now(), 0.1
    quiet.save()
    for drafter in ("a", "b"):  # (two drafters' costs measured while busy: one line, counted)
        busy = StepCosts({**key, "threads": 1, "drafter": drafter}, (1, 2))
        busy.verify_s, busy.measured_at, busy.others_busy = {1: 0.01, 2: 0.02}, measured_now(), 1.0
        busy.save()
    threads = block_costs_cache / "decode-threads" / "x.json"
    old = {"key": key, "seconds": {"1": 0.01}, "measured_at": "2020-01-01T00:00:00Z", "others_busy": 0.0}
    save_measurement(threads, old)
    detail = doctor.check_measurements(kept_measurements()).detail
    ours = [line for line in detail.splitlines() if "org/doctor-tiny" in line]
    assert len(ours) == 3, detail
    assert any("step costs of org/doctor-tiny (2 threads): 20" in line and "stands" in line for line in ours)
    assert any("(1 thread): a busy moment, not kept" in line and "(2 files: " in line for line in ours)
    assert any("decode threads" in line and "2020-01-01" in line and "measured again" in line for line in ours)
    for name in ("gone-a", "gone-b"):  # measured for local models since deleted (a test's): one line, counted
        gone = StepCosts({**key, "target": str(block_costs_cache / name)}, (1, 2))
        gone.verify_s, gone.measured_at, gone.others_busy = {1: 0.01, 2: 0.02}, measured_now(), 0.1
        gone.save()
    (block_costs_cache / "gone-a").mkdir()  # (this one is back: listed as any other)
    lines = doctor.check_measurements(kept_measurements()).detail.splitlines()
    assert [line for line in lines if "gone-b" in line] == [
        f"1 file for models no longer on disk (such as {block_costs_cache / 'gone-b'}): never read again, safe to "
        f"delete in {block_costs_cache / 'block-costs'}"
    ]
    assert any(line.startswith(f"step costs of {block_costs_cache / 'gone-a'}") for line in lines)


def test_the_cpu_speed_line_measures_the_kernel_decoding_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with dflash's bf16 kernel built, the bandwidth behind doctor's speed line is that kernel's (MKL's
    read at half its speed: the line said ~40 tok/s for a demo decoding 250); elsewhere, and for float32, torch's."""
    import torch

    from dflash_cli.engine.kernels import native

    used = []
    monkeypatch.setattr(doctor, "weight_bandwidth", lambda device, dtype, product=None: used.append(product) or 1.0)
    built = not native.pending_build()  # (doctor never waits for a build: unbuilt, it measures torch's)
    doctor.measured_bandwidth("cpu", "float32")
    doctor.measured_bandwidth("cpu", "bfloat16")
    ours = torch.ops.dflash.bf16_linear if built and native.available() else None
    assert used == [None, ours]
    if ours is not None:  # (and it reads a weight as decoding does: the product's values, here all 4096)
        weights, vector = torch.ones(8, 4096, dtype=torch.bfloat16), torch.ones(1, 4096, dtype=torch.bfloat16)
        assert ours(vector, weights).float().eq(4096).all()
