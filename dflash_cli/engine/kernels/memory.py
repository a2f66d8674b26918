"""Where a CPU model's tensors live: in 2 MB pages, and the heap's freed pages given back.

A decode step reads every weight once, and with 4 KB pages it walks the page tables every 4 KB it reads (16,000
times a step for the demo's 66 MB of int4 layers). Linux backs memory with 2 MB pages where a program asks for
them (transparent huge pages, `madvise` mode, the common default) or everywhere (`always`); almost none of a loaded
model is, since each tensor is its own allocation. `in_huge_pages` moves a loaded model's tensors into one region
that asks for 2 MB pages.
Measured on the 2-core Intel AMX VM: the demo target's 120 int4 products of a step 2.59 against 2.88 ms (2 threads)
and 4.18 against 4.86 (1 thread); its plain int4 decoding 1.03-1.09x, alternating processes (benchmarks/results/
history.md, runs H-N).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

ENVIRONMENT = "DFLASH_HUGE_PAGES"  # "0": leave the tensors where loading put them
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # (linux/mman.h)
_TRIM_EVERY = 8 << 20  # bytes moved between two returns of the freed originals: the move's peak stays ~ the model


def give_back_freed_memory() -> None:
    """Return the C heap's freed pages to the system (glibc's malloc_trim; nothing elsewhere). glibc keeps freed
    blocks in its heap, and blocks allocated after them keep the heap from shrinking: a load that frees temporaries
    as it goes (a bf16 weight once quantized, the parts of a concatenation) would hold them all at the end."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def huge_pages_unavailable() -> str | None:
    """Why `in_huge_pages` leaves tensors where they are (None: it moves them)."""
    if os.environ.get(ENVIRONMENT, "1") == "0":
        return f"{ENVIRONMENT}=0"
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "no transparent huge pages (not Linux)"
    if "[never]" in mode:
        return "transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/enabled)"
    return None


def in_huge_pages(model: nn.Module) -> int:
    """Move `model`'s CPU parameters and buffers into one region that asks for 2 MB pages; return the bytes moved.

    Each storage is copied whole and every tensor on it is set to the copy at its own offset, so tensors stay the
    same objects (ties, modules holding them, views of one storage keep pointing at each other). What stays where
    it is: storages mapped from a file (safetensors' weights, read in place: a copy would hold them twice, and
    lose the page cache other processes share) and storages that hold more than the model's tensors on them. Call
    it before anything binds the tensors' addresses (a stored compiled step)."""
    if huge_pages_unavailable() is not None:
        return 0
    import torch

    mapped = _file_mappings()
    storages: dict[tuple[int, int], list[torch.Tensor]] = {}
    for tensor in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        if tensor.device.type == "cpu" and tensor.numel() > 0:
            storage = tensor.untyped_storage()
            storages.setdefault((storage.data_ptr(), storage.nbytes()), []).append(tensor)
    moving = [
        (nbytes, tensors)
        for (address, nbytes), tensors in storages.items()
        if sum(t.numel() * t.element_size() for t in tensors) >= nbytes
        and not any(start <= address < end for start, end in mapped)
    ]
    if not moving:
        return 0
    length = _aligned(sum(_aligned(nbytes, 64) for nbytes, _ in moving), HUGE_PAGE)  # whole 2 MB pages
    region = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)
    start = _aligned(region.data_ptr(), HUGE_PAGE) - region.data_ptr()
    libc = ctypes.CDLL(None)
    if libc.madvise(ctypes.c_void_p(region.data_ptr() + start), ctypes.c_size_t(length), _MADV_HUGEPAGE) != 0:
        return 0  # (a kernel without it: nothing moved, nothing lost)
    storage, offset, since_trim = region.untyped_storage(), start, 0
    with torch.no_grad():
        for nbytes, tensors in moving:
            original = tensors[0].untyped_storage()
            region[offset : offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(original))
            for tensor in tensors:
                item = tensor.element_size()
                tensor.set_(storage, offset // item + tensor.storage_offset(), tensor.shape, tensor.stride())
            del original
            size = _aligned(nbytes, 64)
            offset, since_trim = offset + size, since_trim + size
            if since_trim >= _TRIM_EVERY:
                give_back_freed_memory()
                since_trim = 0
    give_back_freed_memory()
    return offset - start


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges this process maps from files (Linux's /proc/self/maps: a path after the inode)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0":
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _aligned(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment
