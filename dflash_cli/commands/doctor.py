"""`dflash doctor`: pass / warn / fail checks of this machine, each failure with its fix.

Every check is a function of plain inputs (machine facts, versions, paths), so tests fabricate failing
machines; `run_checks()` gathers the real inputs and `report` is what `--json` prints. The table is drawn in
cli/output.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from dflash_cli.engine.compiled import stored
from dflash_cli.engine.kernels import native
from dflash_cli.engine.policy import kept_measurements
from dflash_cli.errors import DflashError
from dflash_cli.loading.compiled_steps import background_builds
from dflash_cli.loading.hub import hub_reachable
from dflash_cli.loading.models import quiet_bitsandbytes_import
from dflash_cli.setup.choices import Quant, gb
from dflash_cli.setup.hardware import MachineFacts, detect_machine, gpu_class, torch_release_table, weight_bandwidth
from dflash_cli.setup.planning import Plan, PlanOverrides, make_plan, native_formats
from dflash_cli.setup.recipes import Recipe, load_registry
from dflash_cli.setup.sizes import recipe_stored_bytes
from dflash_cli.setup.speed import CHAT_SPEED, SpeedEstimate, expected_speed
from dflash_cli.wording import plural

TORCH_INDEX = "https://download.pytorch.org/whl"
OUR_DISTRIBUTION = "dflash-cli"  # ours is the `dflash` command this distribution installs, whatever its entry point


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "pass" | "warn" | "fail"
    detail: str
    fix: str | None = None
    items: tuple[dict[str, Any], ...] = ()  # what the detail lists, as data (`--json`): the recipes check's recipes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.items:
            del data["items"]
        return data


def exit_code(checks: list[Check]) -> int:
    return 1 if any(check.status == "fail" for check in checks) else 0


def report(checks: list[Check]) -> dict[str, Any]:
    return {"checks": [check.to_dict() for check in checks], "exit_code": exit_code(checks)}


# ---------------------------------------------------------------------------------------------------------------
# Python, torch, driver, GPU


def check_python(version: tuple[int, ...]) -> Check:
    shown = ".".join(map(str, version[:3]))
    if tuple(version[:2]) >= (3, 10):
        return Check("python", "pass", f"Python {shown}")
    return Check("python", "fail", f"Python {shown} is too old", "install Python 3.10 or newer")


def arch_supported(arch_list: tuple[str, ...] | list[str], capability: tuple[int, int]) -> bool:
    """Whether torch ships kernels this GPU runs: sm_XY code runs on the same major, minor >= Y (torch's rule)."""
    major, minor = capability
    for arch in arch_list:
        if arch.startswith("sm_"):
            code = int(arch[3:].rstrip("af"))  # sm_90a, sm_100f: arch-specific variants of the same code
            if code // 10 == major and code % 10 <= minor:
                return True
    return False


def torch_wheel_fix(capability: tuple[int, int], releases: dict[str, set[int]] | None) -> str:
    """The pip command for a torch build with kernels for `capability`. `releases` maps the CUDA versions of
    the installed torch release to the sm codes its wheels ship (torch's own table, when it has one)."""
    fitting = sorted(
        (tuple(map(int, cuda.split("."))), cuda)
        for cuda, codes in (releases or {}).items()
        if any(arch_supported([f"sm_{code}"], capability) for code in codes)
    )
    if fitting:  # the oldest CUDA that works asks the least of the driver
        cuda = fitting[0][1]
    elif capability >= (10, 0):
        cuda = "12.8"  # Blackwell kernels first shipped in CUDA 12.8 builds
    else:
        cuda = "12.6"
    tag = "cu" + cuda.replace(".", "")
    need = "CUDA 12.8+" if capability >= (10, 0) else f"CUDA {cuda}"
    return (
        f"install a torch built for {need} (sm_{capability[0]}{capability[1]} kernels): "
        f"pip install --force-reinstall torch --index-url {TORCH_INDEX}/{tag}"
    )


@dataclass(frozen=True)
class SmiGpu:
    name: str
    compute_cap: str
    memory_total: str
    driver_version: str


@dataclass(frozen=True)
class SmiResult:
    gpus: tuple[SmiGpu, ...] = ()
    error: str | None = None  # nvidia-smi exists but failed (driver not loaded, version mismatch)


def query_nvidia_smi() -> SmiResult | None:
    """What nvidia-smi reports, or None where it is not installed. The driver version is only known here."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = "--query-gpu=name,compute_cap,memory.total,driver_version"
    try:
        done = subprocess.run([exe, query, "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return SmiResult(error=str(exc))
    if done.returncode != 0:
        return SmiResult(error=(done.stderr or done.stdout).strip() or f"exit code {done.returncode}")
    rows = [[part.strip() for part in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
    return SmiResult(gpus=tuple(SmiGpu(*row[:4]) for row in rows if len(row) >= 4))


def _smi_capability(smi: SmiResult | None) -> tuple[int, int] | None:
    try:
        major, minor = smi.gpus[0].compute_cap.split(".")  # type: ignore[union-attr]
        return int(major), int(minor)
    except (AttributeError, IndexError, ValueError):
        return None


def check_torch(facts: MachineFacts, smi: SmiResult | None, releases: dict[str, set[int]] | None = None) -> Check:
    build = f"CUDA {facts.torch_cuda_version} build" if facts.torch_cuda_version else "CPU-only build"
    detail = f"torch {facts.torch_version}, {build}"
    if facts.kind == "cuda" and facts.capability is not None:
        sm = f"sm_{facts.capability[0]}{facts.capability[1]}"
        if not arch_supported(facts.torch_arch_list, facts.capability):
            shipped = " ".join(facts.torch_arch_list) or "none"
            return Check(
                "torch",
                "fail",
                f"{detail} has no kernels for this GPU ({facts.gpu_name}, {sm}); it ships {shipped}",
                torch_wheel_fix(facts.capability, releases),
            )
        return Check("torch", "pass", f"{detail}, kernels for {sm}")
    smi_capability = _smi_capability(smi)
    if facts.kind == "cpu" and smi is not None and smi.gpus:
        gpu = smi.gpus[0].name
        if facts.torch_cuda_version is None:
            fix = torch_wheel_fix(smi_capability, releases) if smi_capability else f"see {TORCH_INDEX}"
            return Check("torch", "fail", f"{detail} on a machine with an NVIDIA GPU ({gpu})", fix)
        return Check(
            "torch",
            "fail",
            f"{detail} cannot use the NVIDIA GPU ({gpu}); the driver is likely older than CUDA "
            f"{facts.torch_cuda_version} needs",
            "update the NVIDIA driver (nvidia-smi shows its version), or install a torch built for an older CUDA",
        )
    return Check("torch", "pass", detail)


def check_driver(facts: MachineFacts, smi: SmiResult | None) -> Check:
    if smi is None:
        if facts.kind == "cuda":
            return Check(
                "driver",
                "warn",
                "nvidia-smi not found; torch reaches the GPU, so the driver works",
                "install the NVIDIA utilities (nvidia-smi) to see the driver version",
            )
        return Check("driver", "pass", "no NVIDIA driver (no nvidia-smi): nothing to check")
    if smi.error is not None:
        return Check(
            "driver",
            "fail",
            f"nvidia-smi failed: {smi.error}",
            "reinstall or update the NVIDIA driver; reboot after a driver update",
        )
    rows = [f"driver {g.driver_version}: {g.name}, compute {g.compute_cap}, {g.memory_total}" for g in smi.gpus]
    return Check("driver", "pass", "\n".join(rows) or "nvidia-smi lists no GPUs")


def check_gpu(facts: MachineFacts) -> Check:
    ram = f"{gb(facts.cpu_ram_total or 0)} RAM ({gb(facts.cpu_ram_available or 0)} available)"
    if facts.kind == "cpu":
        dtype = (
            "bf16 (AVX512-BF16/AMX)"
            if facts.cpu_bf16
            else "bf16 (dflash's AVX2 kernels)"
            if facts.cpu_avx2
            else "fp32 (neither AVX512-BF16/AMX nor AVX2)"
        )
        return Check("gpu", "pass", f"no GPU: runs on the CPU in {dtype}, {ram}")
    memory = f"{gb(facts.total_memory or 0)} total, {gb(facts.free_memory or 0)} free"
    count = f", {facts.gpu_count} GPUs" if facts.gpu_count > 1 else ""
    return Check("gpu", "pass", f"{facts.gpu_name}: {gpu_class(facts).label}, {memory}{count}; {ram}")


# ---------------------------------------------------------------------------------------------------------------
# Packages


@dataclass(frozen=True)
class BnbInstall:
    version: str | None  # None: bitsandbytes cannot be imported
    cuda_libs: tuple[tuple[int, int], ...] = ()  # the CUDA versions its native libraries were built for
    has_cpu_lib: bool = False
    native_loaded: bool = False  # whether bitsandbytes loaded a native library at import
    error: str | None = None


def inspect_bitsandbytes() -> BnbInstall:
    try:
        with quiet_bitsandbytes_import():  # (the check below reports what matters)
            import bitsandbytes
            from bitsandbytes import cextension
    except Exception as exc:  # a broken install raises anything from ImportError to RuntimeError
        return BnbInstall(None, error=f"{type(exc).__name__}: {exc}")
    package = Path(bitsandbytes.__file__).parent
    cuda_libs = []
    for lib in package.glob("libbitsandbytes_cuda*"):
        digits = lib.name.removeprefix("libbitsandbytes_cuda").split(".")[0]
        if digits.isdigit() and len(digits) >= 3:
            cuda_libs.append((int(digits[:-1]), int(digits[-1])))  # "128" -> 12.8, as bitsandbytes reads them
    return BnbInstall(
        version=bitsandbytes.__version__,
        cuda_libs=tuple(sorted(cuda_libs)),
        has_cpu_lib=any(package.glob("libbitsandbytes_cpu.*")),
        native_loaded=not isinstance(cextension.lib, cextension.ErrorHandlerMockBNBNativeLibrary),
    )


def bnb_library_for(cuda: tuple[int, int], shipped: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
    """The library bitsandbytes loads for torch's CUDA version: exact, else the newest older one of the same
    major, else the oldest newer one of the same major; never across majors."""
    same_major = [v for v in shipped if v[0] == cuda[0]]
    if cuda in same_major:
        return cuda
    older = [v for v in same_major if v < cuda]
    newer = [v for v in same_major if v > cuda]
    return max(older) if older else min(newer) if newer else None


def check_bitsandbytes(facts: MachineFacts, bnb: BnbInstall) -> Check:
    if bnb.version is None:
        return Check(
            "bitsandbytes",
            "fail",
            f"cannot import bitsandbytes: {bnb.error}",
            "pip install --force-reinstall 'bitsandbytes>=0.46.1'",
        )
    name = f"bitsandbytes {bnb.version}"
    if facts.kind != "cuda" or facts.torch_cuda_version is None or facts.capability is None:
        if bnb.has_cpu_lib and bnb.native_loaded:
            return Check("bitsandbytes", "pass", f"{name}, CPU library (NF4 works on CPU, slowly)")
        return Check(
            "bitsandbytes",
            "warn",
            f"{name} has no working CPU library: --quant nf4 is unavailable here",
            "pip install --force-reinstall 'bitsandbytes>=0.46.1' (needs an AVX2 CPU)",
        )
    cuda = tuple(int(part) for part in facts.torch_cuda_version.split(".")[:2])
    lib = bnb_library_for(cuda, bnb.cuda_libs)  # type: ignore[arg-type]
    if lib is None or not bnb.native_loaded:
        return Check(
            "bitsandbytes",
            "fail",
            f"{name} has no working library for CUDA {facts.torch_cuda_version} (it ships "
            f"{', '.join(f'{a}.{b}' for a, b in bnb.cuda_libs) or 'none'}): NF4 loading will fail",
            "pip install --force-reinstall 'bitsandbytes>=0.46.1'; `python -m bitsandbytes` shows the details",
        )
    # Its CUDA 11.8-12.6 libraries stop at sm_90; Blackwell code (sm_100, sm_120) is in the 12.8+ ones.
    if facts.capability >= (10, 0) and lib < (12, 8):
        return Check(
            "bitsandbytes",
            "fail",
            f"{name} loads its CUDA {lib[0]}.{lib[1]} library (chosen from torch's CUDA "
            f"{facts.torch_cuda_version}), which has no sm_{facts.capability[0]}{facts.capability[1]} kernels",
            torch_wheel_fix(facts.capability, None) + " (bitsandbytes follows torch's CUDA version)",
        )
    return Check("bitsandbytes", "pass", f"{name}, CUDA {lib[0]}.{lib[1]} library")


def check_mxfp4(facts: MachineFacts) -> Check:
    """Whether MXFP4 checkpoints (gpt-oss) run as stored here or load dequantized to bf16 (three times the size)."""
    native = "mxfp4" in native_formats(facts.kind, facts)
    if native:
        return Check("mxfp4", "pass", "triton >= 3.4 and kernels installed: MXFP4 checkpoints (gpt-oss) run as stored")
    if facts.kind == "cuda" and facts.capability is not None and facts.capability >= (7, 5):
        return Check(
            "mxfp4",
            "pass",
            "MXFP4 checkpoints (gpt-oss) load dequantized to bf16, three times their size; "
            "`pip install 'triton>=3.4' kernels` runs them as stored on this GPU",
        )
    return Check("mxfp4", "pass", "MXFP4 checkpoints (gpt-oss) load dequantized to bf16 here (no kernels for them)")


def check_package(name: str, version: str | None, major: int | None, install: str) -> Check:
    """An installed dependency, optionally of a required major version."""
    if version is None:
        return Check(name, "fail", f"{name} is not installed", f"pip install '{install}'")
    if major is not None and version.split(".")[0] != str(major):
        return Check(name, "fail", f"{name} {version}: dflash needs {major}.x", f"pip install '{install}'")
    return Check(name, "pass", f"{name} {version}")


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def dflash_commands() -> list[tuple[str, str]]:
    """(distribution, entry point) of every installed console script named `dflash`; the distribution's name as
    packaging normalizes it (dflash_cli, dflash.cli and dflash-cli are one project)."""
    return [
        (canonicalize_name(ep.dist.name) if ep.dist else "unknown", ep.value)
        for ep in metadata.entry_points(group="console_scripts", name="dflash")
    ]


def check_command_conflicts(commands: list[tuple[str, str]]) -> Check:
    others = [(dist, value) for dist, value in commands if dist != OUR_DISTRIBUTION]
    if others:
        names = ", ".join(f"{dist} ({value})" for dist, value in others)
        return Check(
            "dflash command",
            "warn",
            f"another package also installs a `dflash` command: {names}; the one installed last wins",
            f"pip uninstall {others[0][0]}, or run this tool as `python -m dflash_cli`",
        )
    ours = any(dist == OUR_DISTRIBUTION for dist, _ in commands)
    return Check(
        "dflash command",
        "pass",
        "installed, no other package claims `dflash`"
        if ours
        else "not installed as a command (running from source: `python -m dflash_cli`)",
    )


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face and recipes


def _fits(facts: MachineFacts, recipe: Recipe) -> bool:
    """Whether the planner runs `recipe` on this machine (a recipe it refuses is not one this machine downloads)."""
    try:
        make_plan(facts, recipe)
    except DflashError:
        return False
    return True


def check_hf_cache(cache_dir: Path, free_bytes: int, recipes: list[Recipe]) -> Check:
    """Whether the cache's disk holds the largest of `recipes` (those this machine can run)."""
    detail = f"{cache_dir}: {gb(free_bytes)} free on its disk"
    largest = max((r for r in recipes if r.runnable), key=recipe_stored_bytes, default=None)
    if largest is not None and free_bytes < recipe_stored_bytes(largest):
        return Check(
            "hf cache",
            "warn",
            f"{detail}; {largest.name} downloads {gb(recipe_stored_bytes(largest))}",
            "free disk space, or point HF_HOME at a bigger disk (export HF_HOME=/big/disk/huggingface)",
        )
    return Check("hf cache", "pass", detail)


def disk_free(path: Path) -> int:
    """Free bytes on the disk that holds `path` (or would: the cache directory may not exist yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_hf_token(has_token: bool, recipes: list[Recipe]) -> Check:
    if has_token:
        return Check("hf token", "pass", "a Hugging Face token is configured (not shown)")
    gated = [r.name for r in recipes if r.gated]
    if not gated:
        return Check("hf token", "pass", "no token; no recipe needs one")
    return Check(
        "hf token",
        "warn",
        f"no Hugging Face token: gated recipes ({', '.join(gated)}) cannot download",
        "accept the model's license on huggingface.co, then run `hf auth login` (or set HF_TOKEN)",
    )


def check_hub(offline: bool, endpoint: str, unreachable: str | None) -> Check:
    """Whether models can download: HF_HUB_OFFLINE, else whether `endpoint` answered (`unreachable` is why not)."""
    if offline:
        return Check(
            "hugging face hub", "pass", "offline (HF_HUB_OFFLINE=1): only cached models load, the Hub is not asked"
        )
    if unreachable is None:
        return Check("hugging face hub", "pass", f"{endpoint} answers: models download on first use")
    return Check(
        "hugging face hub",
        "warn",
        f"cannot reach {endpoint} ({unreachable}): only cached models load (the demo needs no Hub)",
        "check the network, or HTTPS_PROXY / HF_ENDPOINT; on a machine that is offline on purpose set HF_HUB_OFFLINE=1",
    )


def check_recipes(
    facts: MachineFacts, recipes: list[Recipe], bandwidth: Callable[[str, str], float] | None = None
) -> Check:
    """Which recipes fit this machine, how (the planner's choice with no flags), and how fast they can decode
    here: `bandwidth(device, dtype)` is the measured weight bandwidth (None: speed not estimated)."""
    lines, items, fitting = [], [], 0
    for recipe in recipes:
        if not recipe.runnable:
            lines.append(f"{recipe.name}: not runnable in dflash; `dflash export vllm {recipe.name}`")
            items.append({"name": recipe.name, "fits": False, "runnable": False})
            continue
        try:
            plan = make_plan(facts, recipe)
        except DflashError as exc:
            lines.append(f"{recipe.name}: does not fit: {exc.message}")
            items.append({"name": recipe.name, "fits": False, "runnable": True, "why": exc.message})
            continue
        fitting += 1
        memory = plan.memory
        size = f", ~{gb(memory.total)} at {memory.context_tokens:,} tokens" if memory is not None else ""
        rate = bandwidth(plan.device, plan.dtype) if bandwidth else None
        speed = expected_speed(recipe, plan, rate) if rate else None
        lines.append(
            f"{recipe.name}: fits, {plan.device} {plan.weights}{size}"
            + (f"; {speed.describe()}" if speed else "")
            + _faster_quant(facts, recipe, plan, speed, rate)
        )
        items.append(
            {
                "name": recipe.name,
                "fits": True,
                "runnable": True,
                "device": plan.device,
                "weights": plan.weights,
                "estimated_bytes": plan.estimated_bytes,
                "max_tokens_per_s": round(speed.tokens_per_s, 1) if speed else None,
            }
        )
    if fitting or not recipes:
        return Check("recipes", "pass", "\n".join(lines) or "no recipes", items=tuple(items))
    return Check(
        "recipes",
        "warn",
        "\n".join(lines),
        "free memory, use a machine with a bigger GPU, or serve across GPUs with `dflash export vllm`",
        items=tuple(items),
    )


def _faster_quant(
    facts: MachineFacts, recipe: Recipe, plan: Plan, speed: SpeedEstimate | None, rate: float | None
) -> str:
    """Where a CPU plan is too slow for chat, the --quant int4 a user may trade precision for (the planner keeps the
    published weights where they fit, as llama.cpp users pick a Q4 for speed): "" where it does not help."""
    if speed is None or rate is None or plan.device != "cpu" or speed.tokens_per_s >= CHAT_SPEED:
        return ""
    if plan.quant is Quant.INT4 or Quant.INT4 not in recipe.weight_bytes:
        return ""
    try:
        smaller = make_plan(facts, recipe, PlanOverrides(quant="int4"))
    except DflashError:  # (a CPU without bf16 instructions: the int4 kernel cannot run)
        return ""
    faster = expected_speed(recipe, smaller, rate)
    if faster is None or faster.tokens_per_s < 1.5 * speed.tokens_per_s:
        return ""
    return f"; with --quant int4 ~{faster.tokens_per_s:.1f} tok/s at most ({gb(faster.bytes_per_token)} a token)"


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build compiled CPU steps with (its own choice: $CXX, else the first of its
    candidates on PATH), or None."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        compiler = get_cpp_compiler()
    except Exception:  # inductor raises when none of its candidates exists
        return None
    return shutil.which(compiler) or (compiler if Path(compiler).is_file() else None)


def check_compiled_steps(
    facts: MachineFacts, compiler: str | None, stored: list[Path], building: Sequence[tuple[Path, float]] = ()
) -> Check:
    """Whether compiled CPU steps can be built here (a C++ compiler), which are stored, and which build in the
    background now (`building`: each one's log and start time)."""
    if facts.gpu_name is not None:
        return Check("compiled steps", "pass", "GPU: CUDA graphs are captured at each start (no stored CPU step)")
    families = Counter(path.stem.split("-")[0] for path in stored)
    kept = f"; stored: {', '.join(f'{family} x{n}' for family, n in sorted(families.items()))}" if stored else ""
    for log, started in building:
        kept += f"; building in the background since {time.strftime('%H:%M', time.localtime(started))} (log {log})"
    if compiler is None:
        return Check(
            "compiled steps",
            "warn",
            "no C++ compiler: compiled CPU steps (`dflash pull NAME --compile`, `--compile on`) cannot be built; "
            f"eager decoding works{kept}",
            "install one (Debian/Ubuntu: apt install g++), or set CXX",
        )
    return Check(
        "compiled steps",
        "pass",
        f"C++ compiler {compiler}: `dflash pull NAME --compile` builds a recipe's compiled CPU step once{kept}",
    )


def check_measurements(kept: list[dict[str, Any]]) -> Check:
    """What this machine keeps measured (decode threads, step costs), when, and whether it still stands (taken
    quiet and recent; otherwise the next start measures again)."""
    if not kept:
        return Check("measurements", "pass", "none kept yet: the first chat, run or serve measures what it needs")

    def gone(entry: dict[str, Any]) -> bool:  # (a local model since deleted: a test's, a moved checkout's)
        target = str(entry.get("target", ""))
        return not entry.get("unreadable") and Path(target).is_absolute() and not Path(target).exists()

    lines, stale = [], [entry for entry in kept if gone(entry)]
    for entry in (entry for entry in kept if entry not in stale):
        if entry.get("unreadable"):
            lines.append(f"{entry['what']}: {entry['path']} unreadable (measured again when needed)")
            continue
        when = entry["measured_at"] or "a busy moment, not kept"
        state = "stands" if entry["stands"] else "measured again at the next start"
        busy = f", others kept {entry['others_busy']:.2f} cores busy" if entry["others_busy"] is not None else ""
        threads = plural(entry["threads"], "thread")
        lines.append(f"{entry['what']} of {entry['target']} ({threads}): {when}{busy}; {state}")
    # (files for other drafters, block sizes or compile modes read alike here: once, counted)
    alike = Counter(lines)
    lines = [line if n == 1 else f"{line} ({n} files: other drafters or step modes)" for line, n in alike.items()]
    if stale:
        folders = sorted({str(Path(entry["path"]).parent) for entry in stale})
        lines.append(
            f"{plural(len(stale), 'file')} for models no longer on disk (such as {stale[0]['target']}): never read "
            f"again, safe to delete in {' and '.join(folders)}"
        )
    return Check("measurements", "pass", "\n".join(lines))


def check_cpu_kernels(
    facts: MachineFacts,
    unusable: str | None,
    built: bool,
    compiler: str | None,
    failed: str | None = None,
    tier: str | None = "avx512",
) -> Check:
    """Whether dflash's CPU kernels (engine.kernels.native) run here, and which tier (`tier`): usable, built,
    buildable, or why the last build failed."""
    if facts.gpu_name is not None:
        return Check("cpu kernels", "pass", "GPU: products run on CUDA (dflash's CPU kernels are for CPU decoding)")
    if unusable is not None:
        return Check("cpu kernels", "pass", f"products and attention run on torch's kernels: {unusable}")
    kernels = f"dflash's CPU kernels ({'AVX2' if tier == 'avx2' else 'AVX-512'} tier)"
    if failed is not None and not built:
        return Check(
            "cpu kernels",
            "warn",
            f"{kernels} did not build, torch's run (about half as fast at one row): {failed}",
            "a GCC 10+ or clang 12+ (set CXX to it); the next start builds them",
        )
    if built:
        return Check("cpu kernels", "pass", f"{kernels} are built for this machine")
    if compiler is None:
        return Check(
            "cpu kernels",
            "warn",
            f"no C++ compiler: {kernels} (about 2x torch's at one row) cannot be built; torch's run",
            "install one (Debian/Ubuntu: apt install g++), or set CXX",
        )
    return Check("cpu kernels", "pass", f"{kernels} are compiled by {compiler} at the first CPU run")


# ---------------------------------------------------------------------------------------------------------------


def measured_bandwidth(device: str, dtype: str) -> float | None:
    """hardware.weight_bandwidth through the kernel decoding runs (dflash's bf16 product on a CPU where it is built:
    MKL's read at half its speed, and the speed line said ~40 tok/s for a demo decoding 250), or None where the
    device cannot run the probe: doctor reports, never crashes."""
    product = None
    if device == "cpu" and dtype == "bfloat16" and not native.pending_build() and native.available():
        import torch

        product = torch.ops.dflash.bf16_linear
    try:
        return weight_bandwidth(device, dtype, product)
    except Exception:  # a broken CUDA setup raises anything from RuntimeError to AssertionError; other checks say why
        return None


def run_checks(facts: MachineFacts | None = None) -> list[Check]:
    """All checks against this machine (or fabricated `facts` for the GPU side: then speeds are not measured)."""
    from huggingface_hub import constants, get_token

    bandwidth = measured_bandwidth if facts is None else None
    facts = facts or detect_machine()
    smi = query_nvidia_smi()
    try:
        loaded, unreadable = load_registry()
        recipes = list(loaded.values())
        recipe_check = check_recipes(facts, recipes, bandwidth)
    except DflashError as exc:  # two user files claiming one name: report it, keep checking
        recipes, unreadable, recipe_check = [], {}, Check("recipes", "fail", exc.message, exc.fix)
    cache = Path(constants.HF_HUB_CACHE)
    offline = bool(constants.HF_HUB_OFFLINE)
    return [
        check_python(tuple(sys.version_info)),
        check_torch(facts, smi, torch_release_table()),
        check_driver(facts, smi),
        check_gpu(facts),
        check_bitsandbytes(facts, inspect_bitsandbytes()),
        check_mxfp4(facts),
        check_package("transformers", installed_version("transformers"), 5, "transformers>=5,<6"),
        check_package("accelerate", installed_version("accelerate"), None, "accelerate>=1.0"),
        check_hf_cache(cache, disk_free(cache), [recipe for recipe in recipes if _fits(facts, recipe)]),
        check_hf_token(get_token() is not None, recipes),
        check_hub(offline, constants.ENDPOINT, None if offline else hub_reachable(constants.ENDPOINT)),
        recipe_check,
        *(Check("user recipe", "fail", error.message, error.fix) for error in unreadable.values()),
        check_compiled_steps(facts, cpp_compiler(), stored.stored_packages(), background_builds()),
        check_measurements(kept_measurements()),
        check_cpu_kernels(
            facts,
            native.unusable(),
            native.library_path().is_file(),
            shutil.which(native.compiler()),
            native.failed_build(),
            native.cpu_tier(),
        ),
        check_command_conflicts(dflash_commands()),
    ]
