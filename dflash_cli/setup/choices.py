"""The values flags and recipe fields may take, shared by the CLI, recipes and the planner.

Plain data, no torch and no other dflash module: anything may import it, so there is no cycle to make.
"""

from __future__ import annotations

from dflash_cli.errors import DflashError

GPU_CLASSES = {
    "blackwell-consumer": "consumer Blackwell (sm_120/121: RTX 50xx, RTX PRO Blackwell, GB10)",
    "blackwell-datacenter": "datacenter Blackwell (sm_100/103: B200, B300)",
    "hopper": "Hopper (sm_90: H100, H200, GH200)",
    "ada": "Ada Lovelace (sm_89: RTX 40xx, L40S, L4)",
    "ampere": "Ampere (sm_80/86/87: A100, A10, RTX 30xx)",
    "cuda-other": "other CUDA GPU",
    "mps": "Apple silicon GPU (MPS)",
    "cpu": "CPU only",
}
DEVICE_KINDS = ("cuda", "mps", "cpu")
# "none": the checkpoint as published; "nf4": bitsandbytes 4-bit; "fp8": the recipe's published FP8 checkpoint;
# "int4" / "int8": weight-only 4-bit (groups of 32) / 8-bit (per channel) on torch's packed CPU kernels.
QUANTS = ("none", "nf4", "fp8", "int4", "int8")
CPU_QUANTS = ("int4", "int8")
# Pre-quantized checkpoint formats: a device runs them as stored only where transformers has kernels for them;
# elsewhere transformers dequantizes them to bf16 on load.
PREQUANTIZED_FORMATS = ("fp8", "mxfp4")
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def normalize_dtype(name: str) -> str:
    dtype = DTYPE_ALIASES.get(name.lower(), name.lower())
    if dtype not in DTYPES:
        raise DflashError(f"unknown dtype {name!r}", fix=f"use one of {', '.join(DTYPES)} (or bf16, fp16, fp32)")
    return dtype


def normalize_device(name: str) -> str:
    """`cuda`, `cuda:N`, `mps` or `cpu`, lowercased. Only the spelling: whether this machine has it is the plan's
    question (planning.py), which needs torch."""
    device = name.strip().lower()
    kind, colon, index = device.partition(":")
    if kind not in DEVICE_KINDS or (colon and not (kind == "cuda" and index.isdigit())):
        raise DflashError(f"unknown device {name!r}", fix="use cuda, cuda:N (N = 0, 1, ...), mps or cpu")
    return device


def gb(n_bytes: float) -> str:
    """Decimal gigabytes, as model cards and nvidia-smi's marketing sizes use them."""
    return f"{n_bytes / 1e9:.1f} GB"
