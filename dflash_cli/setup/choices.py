"""The values flags and recipe fields may take, shared by the CLI, recipes and the planner.

Plain data, no torch and no other dflash module: anything may import it, so there is no cycle to make.
"""

from __future__ import annotations

from enum import Enum

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
# Pre-quantized checkpoint formats: a device runs them as stored only where transformers has kernels for them;
# elsewhere transformers dequantizes them to bf16 on load.
PREQUANTIZED_FORMATS = ("fp8", "mxfp4")
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


class Quant(str, Enum):
    """A `--quant` value (a recipe's `quant` override too), and what loading a target in it takes. A str, so it
    compares, hashes, prints and goes into JSON as its value (Python 3.10 has no StrEnum)."""

    NONE = "none"  # the checkpoint as published
    NF4 = "nf4"  # bitsandbytes 4-bit NF4, quantized on load (fast kernels on CUDA only)
    FP8 = "fp8"  # the recipe's published FP8 checkpoint, loaded as stored
    INT4 = "int4"  # weight-only 4-bit in groups of 32, quantized on load for the CPU (engine.kernels.quantized)
    INT8 = "int8"  # weight-only 8-bit per output channel, likewise

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def named(cls, name: str) -> Quant:
        """The quantization `name` spells; DflashError naming the choices for any other."""
        try:
            return cls(name)
        except ValueError:
            raise DflashError(f"unknown quantization {name!r}", fix=f"use one of {', '.join(QUANTS)}") from None

    @property
    def cpu_kernels(self) -> bool:
        """int4 / int8: quantized on load into engine.kernels.quantized's layers, which run on the CPU in bf16 only."""
        return self in (Quant.INT4, Quant.INT8)

    @property
    def quantizes_on_load(self) -> bool:
        """The target's linear layers are quantized as it loads (bitsandbytes, or the CPU kernels' layers), which
        a checkpoint published pre-quantized cannot be."""
        return self is Quant.NF4 or self.cpu_kernels


QUANTS = tuple(quant.value for quant in Quant)


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
