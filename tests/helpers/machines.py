"""Fabricated MachineFacts: what torch reports on machines CI does not have."""

from __future__ import annotations

from dflash_cli.setup.hardware import MachineFacts

GIB = 1024**3
CU126_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
CU128_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")


def cuda_machine(
    name: str,
    capability: tuple[int, int],
    total_gib: float,
    *,
    free_gib: float | None = None,
    count: int = 1,
    cuda: str = "12.8",
    archs: tuple[str, ...] = CU128_ARCHS,
    ram_gib: tuple[float, float] = (256, 200),
) -> MachineFacts:
    """A CUDA machine as detect_machine() would describe it: GPU 0's memory (free defaults to total - 0.6 GiB),
    the torch build's CUDA version and kernel arch list, and (total, available) host RAM."""
    return MachineFacts(
        kind="cuda",
        gpu_name=name,
        capability=capability,
        total_memory=int(total_gib * GIB),
        free_memory=int((free_gib if free_gib is not None else total_gib - 0.6) * GIB),
        gpu_count=count,
        torch_version=f"2.13.0+cu{cuda.replace('.', '')}",
        torch_arch_list=archs,
        torch_cuda_version=cuda,
        cpu_ram_total=int(ram_gib[0] * GIB),
        cpu_ram_available=int(ram_gib[1] * GIB),
    )
