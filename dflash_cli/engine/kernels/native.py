"""dflash's own CPU kernels for bf16 decoding (`native.cpp`): `torch.ops.dflash.bf16_linear` (a dense bf16
weight times rows: a decode step's few or a prefill chunk's hundreds), `int4_linear` and `int8_linear`,
`torch.ops.dflash.attention` (each row's block of queries over its own K/V) and `argmax` (greedy's token).

Why our own: a decode step's time on a CPU is the time to read every weight once. MKL's bf16 product for one to a
few rows reads the weights at about half the memory bandwidth, and rounds a row by the row count (one row differs
from two: engine.kernels.layers); a batched product over a K/V buffer first copies the keys transposed (two copies a
layer, a fifth of a demo step). These read each weight once per call for all its rows, read the keys in place,
and compute every output in one order whatever the row count and threads, so a row's bits do not depend on the
step it runs in (a plain step, a verify block, a batch, a prefill chunk): bf16 speculative decoding stays lossless
with no one-row special case. Measured on the 2-core AVX512-BF16 VM (`benchmarks/cpu_products.py`,
docs/benchmarks.md): the demo target's 210 layer products at one row 4.7 against MKL's 10.5 ms.

The library is compiled once per machine (the C++ compiler and torch's headers, about 10 s) into the dflash cache
and loaded into the process before its first product: `available()` decides once per process, so every product of
a session runs on the same kernel. It comes in two tiers, each with every op: for CPUs with AVX-512 BF16 and VNNI,
and for CPUs with AVX2 (FMA, F16C) but not those (the same layouts, sums and operations, 8 lanes an instruction;
torch has no fast bf16 product there: its batched ones were most of a verify block's cost, docs/benchmarks.md).
Other CPUs, a failed build or `DFLASH_CPU_KERNELS=0` keep torch's kernels (a warning says why a build failed, once:
later starts, `--explain` and `dflash doctor` read it from a marker beside the library until the compiler changes).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.cpp")
ENVIRONMENT = "DFLASH_CPU_KERNELS"  # "0": torch's kernels for every product and attention; "avx2": that tier
CPU_FLAGS = (
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
    "f16c",
)  # what the AVX-512 tier is compiled for (every op)
AVX2_FLAGS = ("avx2", "fma", "f16c")  # what the AVX2 tier is compiled for
_COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp"]
_TIER_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mf16c", "-mfma"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


def cpu_flag_line() -> str:
    """The CPU's instruction-set flags (Linux's /proc/cpuinfo; the processor's name elsewhere). Compiled code is
    built for them, and code built elsewhere may hold instructions this CPU lacks (a crash no handler catches)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def unavailable() -> str | None:
    """Why this process's products and attention run on torch's kernels rather than ours (None: ours run)."""
    return _state()


def available() -> bool:
    """Whether dflash's kernels run this process's products and attention (built and loaded on the first call)."""
    return _state() is None


def loaded_tier() -> str | None:
    """The tier of dflash's kernels this process runs ("avx512", "avx2"), None where it runs torch's."""
    return cpu_tier() if _state() is None else None


def unusable() -> str | None:
    """Why this process cannot run dflash's kernels whatever is built (switched off, or a CPU without the
    instructions); None: it can, once built."""
    if os.environ.get(ENVIRONMENT, "1") == "0":
        return f"{ENVIRONMENT}=0"
    return _missing(AVX2_FLAGS) if cpu_tier() is None else None


@functools.cache  # (decided once per process, as `_state`: greedy sampling asks `available()` at every step)
def cpu_tier() -> str | None:
    """The widest tier of dflash's kernels this CPU runs ("avx512", "avx2"), None: neither; DFLASH_CPU_KERNELS=avx2
    takes the AVX2 tier on an AVX-512 CPU too (to compare the two)."""
    if not _missing(CPU_FLAGS) and os.environ.get(ENVIRONMENT) != "avx2":
        return "avx512"
    return "avx2" if not _missing(AVX2_FLAGS) else None


def _missing(flags: tuple[str, ...]) -> str:
    missing = [flag for flag in flags if flag not in cpu_flag_line().split()]
    return f"this CPU lacks {', '.join(missing)}" if missing else ""


def pending_build() -> bool:
    """Whether the first `available()` of this process compiles the kernels (about 10 s; a frontend says so)."""
    return (
        _state.cache_info().currsize == 0
        and unusable() is None
        and failed_build() is None
        and not library_path().is_file()
    )


@functools.cache
def _state() -> str | None:
    why = unusable() or failed_build()
    if why is not None:
        return why
    path = library_path()
    try:
        if not path.is_file():
            _compile(path)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        why = f"could not build them ({str(error).strip().splitlines()[-1] if str(error).strip() else error!r})"
        warnings.warn(f"dflash's CPU kernels: {why}; torch's kernels run instead", stacklevel=3)
        if not path.is_file():  # said once: later starts read it here (doctor too) until the compiler changes
            path.parent.mkdir(parents=True, exist_ok=True)
            _failure_marker(path).write_text(json.dumps({"compiler": _compiler_identity(), "why": why}))
        return why
    _register_shapes()
    return None


def failed_build() -> str | None:
    """Why the last build of these kernels failed with the compiler there is now (None: none failed, or the
    compiler changed since, so the next start tries again)."""
    marker = _failure_marker(library_path())
    try:
        failure = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if failure.get("compiler") != _compiler_identity():
        return None
    return f"{failure.get('why')}; with another compiler (CXX) the next start builds them again"


def _failure_marker(library: Path) -> Path:
    return library.with_suffix(".failed")


def _compiler_identity() -> list[str | float | None]:
    """The compiler a build would run: its name, the file it resolves to and that file's time."""
    name = compiler()
    resolved = shutil.which(name)
    return [name, resolved, os.path.getmtime(resolved) if resolved else None]


def library_path() -> Path:
    """Where this machine's compiled kernels are, or go (keyed by `build_id`)."""
    from dflash_cli.engine.compiled.jit import compile_cache_dir

    return compile_cache_dir() / "kernels" / f"{build_id()}.so"


@functools.cache  # (the step-cost key asks at every request: the source is read and hashed once per process)
def build_id() -> str:
    """The kernels' build, named by their source, torch and the flags: a library of another build is never loaded."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(_compile_flags()).encode())
    return f"dflash_cpu_kernels-{key.hexdigest()[:16]}"


def _compile_flags() -> list[str]:
    return _COMMON_FLAGS + _TIER_FLAGS[cpu_tier() or "avx512"]


def compiler() -> str:
    """The C++ compiler the kernels are built with: $CXX, else c++ (inductor picks its own for the stored steps,
    and would pass over a $CXX that fails; a build here reports the failure instead)."""
    return os.environ.get("CXX", "c++")


def _compile(path: Path) -> None:
    from torch.utils import cpp_extension

    compiler_ = compiler()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    libraries = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        command = [compiler_, *_compile_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(SOURCE), "-o",
                   str(built), *libraries]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler_} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(built, path)
    _failure_marker(path).unlink(missing_ok=True)
    for other in path.parent.glob("dflash_cpu_*"):  # earlier builds' (other sources, torch, flags or names)
        if other.name.split(".")[0] != path.stem:
            other.unlink(missing_ok=True)


def _register_shapes() -> None:
    """The ops' output shapes, for torch.export and torch.compile (which trace without running them)."""

    @torch.library.register_fake("dflash::int4_linear")
    def _(
        x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("dflash::int8_linear")
    def _(
        x: torch.Tensor, codes: torch.Tensor, sums: torch.Tensor, scales: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("dflash::argmax")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], dtype=torch.long)

    @torch.library.register_fake("dflash::attention")
    def _(
        rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return torch.empty_like(rows, memory_format=torch.contiguous_format)

    @torch.library.register_fake("dflash::bf16_linear")
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])
