"""Facts about this machine: its accelerator, GPU class, memory and CPU features.

Only `detect_machine()` touches torch (imported inside it: `dflash --help` must stay fast); everything else is a
function of `MachineFacts`, so tests fabricate machines CI does not have. How to run a recipe on these facts is
planning.py's job. GPU classes go by CUDA compute capability, never by marketing name: "Blackwell" is sm_100
(B200), sm_103 (B300) and sm_120/121 (RTX 50xx, GB10), with different kernels and different memory sizes.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_cli.setup.choices import GPU_CLASSES
from dflash_cli.setup.sizes import BYTES_PER_ELEMENT


@dataclass(frozen=True)
class MachineFacts:
    """What the planner and `dflash doctor` know about this machine. GPU numbers describe device 0."""

    kind: str  # "cuda" | "mps" | "cpu"
    gpu_name: str | None = None
    capability: tuple[int, int] | None = None  # CUDA compute capability (major, minor)
    total_memory: int | None = None  # bytes per GPU; MPS: Metal's recommended working-set size
    free_memory: int | None = None
    gpu_count: int = 0
    torch_version: str = ""
    torch_arch_list: tuple[str, ...] = ()  # torch.cuda.get_arch_list(): the sm_XY kernels this torch build ships
    torch_cuda_version: str | None = None  # None: a CPU-only torch build
    cpu_ram_total: int | None = None
    cpu_ram_available: int | None = None
    cpu_bf16: bool = False  # the CPU has bf16 matmul instructions (AVX512-BF16 or AMX): bf16 beats fp32 there
    cpu_avx2: bool = False  # AVX2 with FMA at least (torch's dispatch): dflash's int4/int8 kernels run (native.py)
    mxfp4_kernels: bool = False  # triton >= 3.4 and `kernels` installed: transformers' MXFP4 path on CUDA sm_75+

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuClass:
    key: str  # what recipes' [gpu_overrides.KEY] tables name
    label: str  # what a person reads


def gpu_class(facts: MachineFacts) -> GpuClass:
    """The class by compute capability (never by name: an "RTX PRO 6000 Blackwell" is sm_120, a B200 sm_100)."""
    if facts.kind != "cuda" or facts.capability is None:
        return GpuClass(facts.kind, GPU_CLASSES[facts.kind])
    major, minor = facts.capability
    sm = f"sm_{major}{minor}"
    if major == 12:
        return GpuClass("blackwell-consumer", f"consumer Blackwell ({sm}: RTX 50xx, RTX PRO Blackwell, GB10)")
    if (major, minor) == (10, 3):  # B300 runs sm_100 code; same class, its own name
        return GpuClass("blackwell-datacenter", f"datacenter Blackwell Ultra ({sm}: B300, GB300)")
    if major == 10:
        return GpuClass("blackwell-datacenter", f"datacenter Blackwell ({sm}: B200, GB200)")
    if major == 9:
        return GpuClass("hopper", f"Hopper ({sm}: H100, H200, GH200)")
    if (major, minor) == (8, 9):
        return GpuClass("ada", f"Ada Lovelace ({sm}: RTX 40xx, L40S, L4)")
    if major == 8:
        return GpuClass("ampere", f"Ampere ({sm}: A100, A10, RTX 30xx)")
    return GpuClass("cuda-other", f"CUDA GPU ({sm})")


def has_native_bf16(facts: MachineFacts) -> bool:
    """bf16 tensor cores arrived with Ampere (sm_80); older GPUs emulate it slowly."""
    return facts.capability is not None and facts.capability >= (8, 0)


def detect_machine() -> MachineFacts:
    """Query torch for this machine's accelerator. Works on CPU-only builds and machines without a GPU."""
    import torch

    ram_total, ram_available = _cpu_ram()
    common: dict[str, Any] = {
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "torch_arch_list": tuple(torch.cuda.get_arch_list()),
        "cpu_ram_total": ram_total,
        "cpu_ram_available": ram_available,
        "cpu_bf16": _cpu_has_bf16(),
        "cpu_avx2": torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"),
        "mxfp4_kernels": _mxfp4_kernels_installed(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        return MachineFacts(
            kind="cuda",
            gpu_name=props.name,
            capability=(props.major, props.minor),
            total_memory=total,
            free_memory=free,
            gpu_count=torch.cuda.device_count(),
            **common,
        )
    if torch.backends.mps.is_available():
        total = torch.mps.recommended_max_memory()
        free = total - torch.mps.driver_allocated_memory()
        return MachineFacts(
            kind="mps", gpu_name="Apple silicon GPU", total_memory=total, free_memory=free, gpu_count=1, **common
        )
    return MachineFacts(kind="cpu", **common)


def _cpu_has_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (x86 AVX512-BF16 or AMX), as torch's own dispatch sees it."""
    import torch

    # Private helpers in torch.cpu (torch >= 2.3); a torch without them just gets the fp32 default.
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if probe is not None)


def _mxfp4_kernels_installed() -> bool:
    """Whether transformers can keep MXFP4 expert weights (gpt-oss) as they are: it needs triton >= 3.4 and the
    `kernels` package on a CUDA GPU of compute capability 7.5+, and dequantizes them to bf16 otherwise."""
    from importlib import metadata

    try:
        triton = metadata.version("triton")
        metadata.version("kernels")
    except metadata.PackageNotFoundError:
        return False
    numbers = [int(part) for part in re.findall(r"\d+", triton)[:2]]
    return tuple(numbers) >= (3, 4)


def _cpu_ram() -> tuple[int | None, int | None]:
    """(total, available) RAM in bytes, capped by a cgroup v2 memory limit (containers); None where unknown."""
    total = available = None
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        total = int(meminfo["MemTotal"].split()[0]) * 1024
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        try:
            total = available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return None, None
    try:
        limit = int(Path("/sys/fs/cgroup/memory.max").read_text())  # "max" (no limit) fails int()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        total, available = min(total, limit), min(available, max(limit - used, 0))
    except (OSError, ValueError):
        pass
    return total, available


@functools.cache
def weight_bandwidth(device: str, dtype: str, product: Callable[[Any, Any], Any] | None = None) -> float:
    """Bytes per second a matrix-vector product reads weights in `dtype` on `device`: the bound on decoding,
    which reads every weight once per generated token. Measured, not looked up: it folds in what a spec sheet
    does not say (other processes' load, a bf16 product emulated on a CPU without bf16 instructions). Best of
    three products over a 256 MiB matrix (1 GiB on a GPU), past any cache; a fraction of a second. (The bench's
    floor, `roofline.read_bandwidth`, sums the loaded model's weights instead: memory alone, not the kernel.)
    `product(vector, weights)`: the kernel decoding runs (default: torch's F.linear)."""
    import time

    import torch

    kind = device.partition(":")[0]
    weights = torch.ones(
        ((2**30 if kind == "cuda" else 2**28) // (4096 * BYTES_PER_ELEMENT[dtype]), 4096),
        dtype=getattr(torch, dtype),
        device=device,
    )
    vector = torch.ones(1, 4096, dtype=weights.dtype, device=device)

    def seconds() -> float:
        synchronize = {"cuda": torch.cuda.synchronize, "mps": torch.mps.synchronize}.get(kind, lambda: None)
        synchronize()
        started = time.perf_counter()
        (product or torch.nn.functional.linear)(vector, weights)
        synchronize()
        return time.perf_counter() - started

    seconds()  # warm-up: first-call dispatch and page faults
    best = min(seconds() for _ in range(3))
    return weights.numel() * weights.element_size() / best


def torch_release_table() -> dict[str, set[int]] | None:
    """torch's own table of which CUDA builds of this release ship which sm codes (private; may be absent)."""
    import platform

    import torch.cuda

    table = getattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", None)
    if not isinstance(table, dict):
        return None
    host = "aarch64" if platform.machine().lower() == "aarch64" else "x86_64"
    return {cuda: set(by_arch.get(host, ())) for cuda, by_arch in table.items()}
