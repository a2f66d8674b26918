"""The plan: how to run a recipe on this machine (device, dtype, quantization, block size, memory fit).

`make_plan(facts, recipe, overrides)` is a pure function of the machine facts (hardware.py) and the recipe
(recipes.py), so every GPU class is unit-tested with fabricated facts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dflash_cli.errors import DflashError
from dflash_cli.setup.choices import GPU_CLASSES, PREQUANTIZED_FORMATS, Quant, gb, normalize_device, normalize_dtype
from dflash_cli.setup.hardware import GpuClass, MachineFacts, gpu_class, has_native_bf16
from dflash_cli.setup.sizes import (
    MemoryEstimate,
    memory_estimate,
    recipe_weight_bytes,
)

if TYPE_CHECKING:
    import torch

    from dflash_cli.setup.recipes import Recipe

# The context the plan sizes memory for: the KV cache it reserves grows linearly with the context, and 8k tokens
# covers a multi-turn conversation (the state reserves at least that many positions per row, attention.MIN_CAPACITY).
# The estimate (sizes.memory_estimate) is one row at this context: weights, drafter, KV cache, the prefill's
# activations and the runtime; the runtime also holds a hybrid target's first row of linear-attention state with
# the verify's copy of it (twice the recipe's `state_bytes_per_row`: 0.31 GB for Qwen3.5-27B). Each further row is
# counted in the batch size.
PLAN_CONTEXT_TOKENS = 8192
# Rows `dflash run` and `dflash serve` decode together at most, unless --batch-size says otherwise: where one verify
# of 16 rows stops being nearly free on a GPU, and past where a small CPU gains (benchmarks/results/history.md,
# "Batched decoding").
MAX_BATCH_ROWS = 16
# The prefix store's default bound (prefixes beyond the slots, in host memory): llama-server's --cache-ram default,
# or a quarter of the RAM free at start where that is less.
CACHE_RAM_MIB = 8192


@dataclass(frozen=True)
class PlanOverrides:
    """What the user forced on the command line (`--device`, `--dtype`, `--quant`, `--attention`, `--block-size`,
    `--batch-size`, `--cache-ram`); None: the plan decides."""

    device: str | None = None
    dtype: str | None = None
    quant: Quant | None = None
    attention: str | None = None
    block_size: int | None = None
    batch_size: int | None = None
    cache_ram_mib: int | None = None


@dataclass(frozen=True)
class Plan:
    device: str  # "cuda", "cuda:1", "mps", "cpu"
    dtype: str  # compute dtype (and weight dtype when quant == "none")
    quant: Quant  # none, nf4 (bitsandbytes 4-bit, double quant, compute in `dtype`), fp8, int4, int8
    block_size: int | None  # None: the drafter's config decides
    attn_implementation: str
    gpu_class: str
    memory: (
        MemoryEstimate | None
    )  # one row at PLAN_CONTEXT_TOKENS; None: the recipe's sizes are unknown, fit not checked
    budget_bytes: int | None  # free memory on the device the plan runs on
    reasons: tuple[str, ...]  # one line per decision, for --explain
    notes: tuple[str, ...] = ()  # settings that will run but badly: shown under the plan line even without --explain
    # Pre-quantized checkpoint formats this device runs as stored ("mxfp4", "fp8"); others are dequantized on load.
    native_formats: tuple[str, ...] = ()
    weights: str = ""  # what the target's weights are in memory: the dtype, "nf4", "fp8" or "mxfp4"
    adaptive_block: bool = False  # each step picks its block size up to `block_size` (engine.policy); else fixed
    batch_size: int = 1  # rows `run` and `serve` decode together: the KV cache (and state) of that many fits
    cache_ram_mib: int = CACHE_RAM_MIB  # the prefix store's bound in host memory (engine.prefix.PrefixStore); 0: none

    def __post_init__(self) -> None:
        object.__setattr__(self, "quant", Quant.named(self.quant))
        if not self.weights:
            object.__setattr__(self, "weights", self.dtype if self.quant is Quant.NONE else self.quant.value)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def estimated_bytes(self) -> int | None:
        """Memory for one request at the plan's context (None: unknown)."""
        return None if self.memory is None else self.memory.total

    def one_line(self, drafter_block_size: int | None = None, *, drafting: bool = True, rows: int = 1) -> str:
        """`cuda (hopper) bfloat16, block 16, sdpa, ~18.9 GB at 8,192 tokens`; `drafter_block_size` (the loaded
        drafter's own) fills in a block size the plan leaves to the drafter; `drafting=False` (the baseline) has no
        block; the size is what `rows` rows hold at the plan's context (a batch holds every row's K/V)."""
        device = self.device if self.device.partition(":")[0] == self.gpu_class else f"{self.device} ({self.gpu_class})"
        weights = f"{self.weights} weights, " if self.weights != self.dtype else ""
        block: Any = self.block_size or drafter_block_size
        if self.adaptive_block:
            block = f"≤{block} adaptive" if block else "adaptive up to the drafter's"
        block = f"block {block or 'from drafter'}" if drafting else "no drafter"
        memory = self.memory
        size = f", ~{gb(memory.with_rows(rows))} at {memory.context_tokens:,} tokens" if memory is not None else ""
        return f"{device} {self.dtype}, {weights}{block}, {self.attn_implementation}{size}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "estimated_bytes": self.estimated_bytes, "reasons": list(self.reasons)}


def native_formats(kind: str, facts: MachineFacts) -> tuple[str, ...]:
    """The pre-quantized checkpoint formats a device of `kind` on this machine runs as they are stored.

    transformers keeps MXFP4 experts (gpt-oss) on CUDA sm_75+ when triton >= 3.4 and `kernels` are installed, and
    fine-grained FP8 on sm_89+ (Ada, Hopper, Blackwell); everywhere else it dequantizes them to bf16 on load.
    """
    if kind != "cuda" or facts.capability is None:
        return ()
    formats = []
    if facts.capability >= (7, 5) and facts.mxfp4_kernels:
        formats.append("mxfp4")
    if facts.capability >= (8, 9):
        formats.append("fp8")
    return tuple(formats)


def weights_format(recipe: Recipe, dtype: str, quant: str, native: tuple[str, ...] = ()) -> str:
    """What the target's weights are in memory under (dtype, quant): the dtype, "nf4", "fp8", or the checkpoint's
    own pre-quantized format where this device runs it natively."""
    if quant != "none":
        return quant
    if recipe.checkpoint_precision in native:
        return recipe.checkpoint_precision
    return dtype


def target_weight_bytes(recipe: Recipe, dtype: str, quant: str, native: tuple[str, ...] = ()) -> int | None:
    """The target's weights as they will be in memory (`sizes.recipe_weight_bytes` in the format this plan holds
    them in); None when the recipe does not list its sizes."""
    return recipe_weight_bytes(recipe, weights_format(recipe, dtype, quant, native), dtype)


def estimate_memory(
    recipe: Recipe, dtype: str, quant: str, kind: str, native: tuple[str, ...] = ()
) -> MemoryEstimate | None:
    """Memory to run `recipe` in `dtype` with `quant` on a device of `kind` running `native` formats as stored
    (`sizes.memory_estimate` at the plan's context). None when the recipe does not say how big the target is."""
    weights = target_weight_bytes(recipe, dtype, quant, native)
    return memory_estimate(recipe, weights, dtype, kind, PLAN_CONTEXT_TOKENS)


def estimate_bytes(recipe: Recipe, dtype: str, quant: str, kind: str, native: tuple[str, ...] = ()) -> int | None:
    """`estimate_memory`'s total."""
    estimate = estimate_memory(recipe, dtype, quant, kind, native)
    return None if estimate is None else estimate.total


def _choose_device(facts: MachineFacts, requested: str | None) -> tuple[str, str]:
    """(device, why). A request for hardware this machine lacks is an error, not a silent CPU fallback."""
    if requested is None:
        why = {
            "cuda": f"{facts.gpu_name}, the GPU torch sees",
            "mps": "Apple silicon GPU through Metal",
            "cpu": "no GPU visible to torch",
        }[facts.kind]
        return facts.kind, why
    device = normalize_device(requested)
    kind, _, index = device.partition(":")
    if kind != "cpu" and kind != facts.kind:
        raise DflashError(
            f"--device {requested}: no {kind.upper()} device is visible to torch on this machine",
            fix="run `dflash doctor` to see what torch finds, or drop --device",
        )
    if index and int(index) >= facts.gpu_count:
        raise DflashError(
            f"--device {requested}: this machine has {facts.gpu_count} CUDA GPU(s), numbered from 0",
            fix=f"use cuda:0 to cuda:{facts.gpu_count - 1}",
        )
    return device, "--device"


def default_dtype(kind: str, facts: MachineFacts) -> tuple[str, str]:
    """The compute dtype for a device kind on this machine, and why."""
    if kind == "cuda" and has_native_bf16(facts):
        return "bfloat16", "native on sm_80+, the published weights' own dtype, fp32's range (no overflow)"
    if kind == "cuda":
        return "float16", "this GPU has no native bf16 (that needs sm_80+); fp16 tensor cores are fast"
    if kind == "mps":
        return "float16", "Metal runs fp16 natively; bf16 support depends on the macOS version"
    if facts.cpu_bf16:
        return "bfloat16", (
            "this CPU has bf16 matmul instructions (AVX512-BF16/AMX): faster than fp32 (bit-exact greedy "
            "identity with the baseline needs --dtype fp32)"
        )
    if facts.cpu_avx2:
        return "bfloat16", (
            "dflash's AVX2 kernels run bf16 products at the memory's speed, where fp32 reads twice the bytes (the "
            "demo unquantized, eager: 3.1x fp32's speed on an AVX2 EPYC)"
        )
    return "float32", "this CPU lacks AVX2 (dflash's CPU kernels) and bf16 instructions, so fp32 is faster"


def _candidates(
    kind: str, facts: MachineFacts, recipe: Recipe, dtype: str | None, quant: Quant | None
) -> list[tuple[str, Quant]]:
    """(dtype, quant) pairs in order of preference: the published weights; the recipe's FP8 checkpoint on GPUs
    that run FP8 natively; NF4 (automatic on CUDA only, where bitsandbytes has fast kernels). On CPU the fallback
    is bf16 (half of fp32), then on a CPU with bf16 instructions or AVX2 int8 and int4 weights
    (engine.kernels.quantized, which take bf16 activations) where the recipe lists their sizes; NF4 only when asked
    for."""
    preferred = default_dtype(kind, facts)[0]
    pairs = [(preferred, Quant.NONE)]
    if kind == "cuda" and Quant.FP8 in recipe.checkpoints and Quant.FP8 in native_formats(kind, facts):
        pairs.append((preferred, Quant.FP8))
    if kind == "cuda" and Quant.NF4 in recipe.weight_bytes:
        pairs.append((preferred, Quant.NF4))
    if kind == "cpu":
        pairs.append(("bfloat16", Quant.NONE))
        if cpu_formats(facts) and recipe.checkpoint_precision == "bf16":
            pairs += [("bfloat16", q) for q in (Quant.INT8, Quant.INT4) if q in recipe.weight_bytes]
    pairs = list(dict.fromkeys(pairs))
    if dtype is not None:  # a forced compute dtype other than bf16 rules out the CPU formats (they compute in bf16)
        pairs = [(dtype, q) for q in dict.fromkeys(q for _, q in pairs if dtype == "bfloat16" or not q.cpu_kernels)]
    if quant is not None:
        pairs = [(d, quant) for d in dict.fromkeys(d for d, _ in pairs)]
    if quant is not None and quant.cpu_kernels and dtype is None:
        pairs = [("bfloat16", quant)]  # the packed kernels want bf16 activations (engine.kernels.quantized)
    return pairs


def cpu_formats(facts: MachineFacts) -> bool:
    """Whether the CPU's int4/int8 formats are worth running here: dflash's kernels need AVX2 at least (AVX-512 BF16
    and VNNI for all of them), and torch's want bf16 instructions (engine.kernels.native)."""
    return facts.cpu_bf16 or facts.cpu_avx2


def _check_forced_quant(recipe: Recipe, quant: Quant, kind: str, facts: MachineFacts, cls: GpuClass) -> None:
    """A --quant (or recipe override) this recipe or device cannot honour is an error before anything loads."""
    if quant is Quant.FP8:
        if Quant.FP8 not in recipe.checkpoints:
            raise DflashError(
                f"--quant fp8: recipe {recipe.name} names no published FP8 checkpoint of its target",
                fix="pass an FP8 checkpoint as --target (it then loads as stored), or use --quant none / nf4",
            )
        if "fp8" not in native_formats(kind, facts):
            raise DflashError(
                f"--quant fp8: FP8 weights need a CUDA GPU of compute capability 8.9 or newer; this is {cls.label}",
                fix="use --quant none (bf16) or --quant nf4",
            )
    if quant.cpu_kernels and kind != "cpu":
        raise DflashError(
            f"--quant {quant}: the int4/int8 weight-only kernels run on the CPU; this plan runs on {cls.label}",
            fix="use --quant nf4 on a CUDA GPU (bitsandbytes), or --device cpu",
        )
    if quant.quantizes_on_load and recipe.checkpoint_precision != "bf16":
        raise DflashError(
            f"--quant {quant}: {recipe.target.id} is published pre-quantized ({recipe.checkpoint_precision}), and "
            "dflash does not quantize it again",
            fix="drop --quant: the planner keeps the published weights or dequantizes them to bf16",
        )


def make_plan(facts: MachineFacts, recipe: Recipe, overrides: PlanOverrides | None = None) -> Plan:
    """How to run `recipe` on this machine. Precedence for each setting: the user's flag, then the recipe's
    override for this GPU class, then the default for the device. Raises DflashError when nothing fits."""
    overrides = overrides or PlanOverrides()
    if not recipe.runnable:
        raise DflashError(
            f"recipe {recipe.name} cannot run in dflash yet: {recipe.not_runnable_reason}",
            fix=f"serve it with vLLM or SGLang: `dflash export vllm {recipe.name}`",
        )
    device, device_why = _choose_device(facts, overrides.device)
    kind = device.partition(":")[0]
    cls = gpu_class(facts) if kind == facts.kind else GpuClass(kind, GPU_CLASSES[kind])
    tuned = recipe.gpu_overrides.get(cls.key, {})
    # Free memory of GPU 0 stands for the GPU chosen: multi-GPU machines are usually uniform.
    budget = facts.free_memory if kind != "cpu" else facts.cpu_ram_available
    reasons = [f"device {device}: {device_why}; class {cls.label}"]
    notes: list[str] = []

    recipe_override = f"the recipe's override for {cls.key}"

    dtype = overrides.dtype or tuned.get("dtype")
    dtype = normalize_dtype(dtype) if dtype else None
    quant = overrides.quant or tuned.get("quant")
    quant = Quant.named(quant) if quant is not None else None
    if (
        quant is not None
        and quant.cpu_kernels
        and not overrides.quant
        and (dtype not in (None, "bfloat16") or not cpu_formats(facts))
    ):
        # A recipe's CPU format computes in bf16: it yields to a --dtype and to CPUs without its kernels.
        why = (
            f"--dtype {dtype}" if dtype not in (None, "bfloat16") else "this CPU has neither bf16 instructions nor AVX2"
        )
        reasons.append(f"{recipe_override} ({quant}) skipped: it computes in bf16, and {why}")
        quant, tuned = None, {k: v for k, v in tuned.items() if k != "quant"}
    if quant is not None:
        _check_forced_quant(recipe, quant, kind, facts, cls)
    native = native_formats(kind, facts)
    candidates = _candidates(kind, facts, recipe, dtype, quant)
    estimates = [(d, q, estimate_bytes(recipe, d, q, kind, native)) for d, q in candidates]
    fitting = [c for c in estimates if c[2] is not None and (budget is None or c[2] <= budget)]
    forced = overrides.dtype is not None or overrides.quant is not None
    if fitting:
        chosen = fitting[0]
    elif estimates[0][2] is None or forced:
        chosen = estimates[0]
    else:
        raise _does_not_fit(recipe, estimates, budget, kind, cls, facts)
    dtype, quant, _ = chosen

    memory = estimate_memory(recipe, dtype, quant, kind, native)
    if memory is None:
        reasons.append(f"memory: {recipe.name} does not list its size, so fit was not checked")
    else:
        free = f"{gb(budget)} free" if budget is not None else "free memory unknown"
        parts = (
            ("weights", memory.weights),
            ("drafter", memory.drafter),
            ("KV cache", memory.kv_cache),
            ("prefill activations", memory.activations),
            ("runtime", memory.runtime),
        )
        host = "" if kind == "cpu" else " of host memory"
        reasons.append(
            f"memory: ~{gb(memory.total)} needed for a request of {memory.context_tokens:,} tokens "
            f"({', '.join(f'{name} {_size(size)}' for name, size in parts)}; the prefix store's own bound{host} is "
            f"on top: --cache-ram), {free}"
        )
        if budget is not None and memory.total > budget:
            notes.append(
                f"the forced settings need ~{gb(memory.total)} but {gb(budget)} is free: expect an out-of-memory error"
            )

    preferred_dtype, default_why = default_dtype(kind, facts)
    if quant.cpu_kernels and dtype != "bfloat16":
        raise DflashError(
            f"--quant {quant} computes in bfloat16: with {dtype} activations its kernels run 10-30x slower than "
            "unquantized weights",
            fix=f"drop --dtype (or pass --dtype bf16) with --quant {quant}, or drop --quant for {dtype} weights",
        )
    if overrides.dtype or "dtype" in tuned:
        dtype_why = "--dtype" if overrides.dtype else recipe_override
    elif dtype == preferred_dtype:
        dtype_why = default_why
    elif quant.cpu_kernels:
        dtype_why = f"the {quant} kernels take bf16 activations (fp32 ones are 10-30x slower)"
    else:
        dtype_why = f"{preferred_dtype} would not fit; {dtype} needs half the memory"
    reasons.append(f"dtype {dtype}: {dtype_why}")
    if kind == "cuda" and dtype == "bfloat16" and not has_native_bf16(facts):
        notes.append("bf16 on a GPU without native bf16 (pre-sm_80) is emulated and slow: --dtype fp16 is faster")

    weights = weights_format(recipe, dtype, quant, native)
    if overrides.quant or "quant" in tuned:
        quant_why = "--quant" if overrides.quant else recipe_override
    elif quant is Quant.NONE:
        quant_why = "the published weights fit, so no quantization error is paid"
    else:
        larger = [(weights_format(recipe, d, q, native), size) for d, q, size in estimates[: estimates.index(chosen)]]
        quant_why = f"the {larger[0][0]} weights do not fit (~{gb(larger[0][1] or 0)} in all)"
        quant_why += "".join(f", nor {weights} (~{gb(size or 0)})" for weights, size in larger[1:])
    detail = {
        "nf4": f"; bitsandbytes 4-bit NF4, double quant, {dtype} compute",
        "int4": "; weight-only 4-bit in groups of 32 (dflash's kernel, int8 activations, where the CPU has "
        "AVX512-VNNI or AVX2; else torch's packed CPU kernel), bf16 compute; the output head int8 and the embedding bf16",
        "int8": "; weight-only 8-bit per output channel (dflash's kernel, int8 activations, where the CPU has "
        "AVX512-VNNI or AVX2; else torch's packed CPU kernel), bf16 compute; the embedding stays bf16",
        "fp8": f"; the published FP8 checkpoint {recipe.checkpoints['fp8'].id if 'fp8' in recipe.checkpoints else ''}",
    }.get(quant, "")
    if quant is Quant.NF4 and recipe.expert_bytes:
        detail += f" (the {gb(recipe.expert_bytes)} of fused expert weights stay {dtype}: bitsandbytes skips them)"
    reasons.append(f"quant {quant}: {quant_why}{detail}")
    if recipe.checkpoint_precision != "bf16" and quant is Quant.NONE:
        stored = recipe.checkpoint_precision.upper()
        if weights == recipe.checkpoint_precision:
            reasons.append(f"weights {weights}: this GPU runs the published {stored} weights as they are")
        else:
            reasons.append(
                f"weights {weights}: transformers dequantizes the published {stored} weights here "
                f"({_native_hint(recipe.checkpoint_precision)})"
            )
    if quant is Quant.NF4 and kind != "cuda":
        notes.append(
            f"NF4 on {kind.upper()} is slow: bitsandbytes has no fast 4-bit kernels here and dequantizes every weight "
            "at each step (several times slower than unquantized); drop --quant nf4 if the weights fit"
        )

    block_size, block_why = _choose_block_size(recipe, overrides, tuned, cls)
    reasons.append(block_why)
    attn = overrides.attention or tuned.get("attn_implementation", "eager" if kind == "cpu" else "sdpa")
    if overrides.attention:
        attn_why = "--attention" + (
            " (a row's text may then depend on the rows beside it and the step's shape)"
            if attn == "sdpa" and kind == "cpu"
            else ""
        )
    elif "attn_implementation" in tuned:
        attn_why = recipe_override
    elif kind == "cpu":
        attn_why = (
            "on a CPU, eager attention gives each row the same numbers however many queries and keys a step holds "
            "(the same text alone or batched, streamed or not, with or without drafts); PyTorch's fused CPU kernel "
            "rounds a row by the step's shape (a bf16 or int4 Llama, Mistral, Qwen2 or Qwen3 target runs dflash's fused "
            "invariant kernel, as fast as sdpa: docs/benchmarks.md; other families' eager attention decodes about "
            "1.2x slower than sdpa: benchmarks/results/history.md, batch invariance)"
        )
    else:
        attn_why = (
            "PyTorch's fused attention, no extra package to install (a model transformers runs without an SDPA "
            "path, such as gpt-oss with its attention sinks, loads with eager attention)"
        )
    reasons.append(f"attention {attn}: {attn_why}")
    batch_size, batch_why = _choose_batch_size(overrides, memory, budget)
    reasons.append(batch_why)
    cache_ram, cache_why = _choose_cache_ram(facts, overrides)
    reasons.append(cache_why)
    # (only --cache-ram can be more than the RAM: the plan's own bound is a quarter of the free RAM)
    if facts.cpu_ram_total is not None and cache_ram * 2**20 > facts.cpu_ram_total:
        notes.append(
            f"--cache-ram {cache_ram} MiB is more than the {facts.cpu_ram_total // 2**20:,} MiB of RAM here: the "
            "prefix store would keep prefixes until memory runs out instead of dropping the least recently used "
            f"(by default it keeps a quarter of the free RAM, at most {CACHE_RAM_MIB:,} MiB)"
        )
    reasons += [f"warning: {note}" for note in notes]
    return Plan(
        device,
        dtype,
        quant,
        block_size,
        attn,
        cls.key,
        memory,
        budget,
        tuple(reasons),
        tuple(notes),
        native,
        weights,
        adaptive_block=overrides.block_size is None,
        batch_size=batch_size,
        cache_ram_mib=cache_ram,
    )


def _choose_cache_ram(facts: MachineFacts, overrides: PlanOverrides) -> tuple[int, str]:
    """The prefix store's bound: prefixes that no longer fit the slots, kept in host memory for a later request."""
    if overrides.cache_ram_mib is not None:
        return overrides.cache_ram_mib, f"prefix store {overrides.cache_ram_mib} MiB of host memory: --cache-ram"
    mib = CACHE_RAM_MIB
    if facts.cpu_ram_available is not None:
        mib = min(mib, facts.cpu_ram_available // 4 // 2**20)
    return mib, (
        f"prefix store {mib} MiB of host memory (prefixes beyond the slots): a quarter of the free RAM, at most "
        f"{CACHE_RAM_MIB}; --cache-ram N overrides, 0 keeps none"
    )


def _choose_batch_size(overrides: PlanOverrides, memory: MemoryEstimate | None, budget: int | None) -> tuple[int, str]:
    """Rows for `run` and `serve`: as many as have room beside the weights (the estimate already holds one), at
    most MAX_BATCH_ROWS. A row is its KV cache at the plan's context plus, on a hybrid target, its linear-attention
    state twice: the state itself and the copy of its start that a verify records for the rollback."""
    if overrides.batch_size is not None:
        batch, why = overrides.batch_size, "--batch-size"
    elif memory is None or budget is None or memory.kv_cache == 0:
        return MAX_BATCH_ROWS, f"batch {MAX_BATCH_ROWS} (run, serve): the KV cache size is unknown, so the default"
    else:
        rows = int(max(0, budget - memory.total) // memory.next_row) + 1
        batch = max(1, min(MAX_BATCH_ROWS, rows))
        if memory.state:
            room = f"room for {rows} rows at {PLAN_CONTEXT_TOKENS} tokens ({_size(memory.next_row)} each: KV "
            room += f"{_size(memory.kv_cache)} + recurrent state {_size(memory.state / 2)} x2, with the verify's copy)"
        else:
            room = f"room for the KV cache of {rows} rows at {PLAN_CONTEXT_TOKENS} tokens ({gb(memory.next_row)} each)"
        why = f"{room}, at most {MAX_BATCH_ROWS}; --batch-size overrides"
    if memory is not None and batch > 1:  # the buffers hold every row at the longest row's length
        why += f"; ~{gb(memory.with_rows(batch))} once a request reaches {memory.context_tokens:,} tokens"
    return batch, f"batch {batch} (run, serve): {why}"


def _size(n_bytes: float) -> str:
    """GB, or MB below 1 GB (a row's state is 50-160 MB, which GB at one decimal would round away)."""
    return gb(n_bytes) if n_bytes >= 1e9 else f"{n_bytes / 1e6:.0f} MB"


def _native_hint(fmt: str) -> str:
    """What a device needs to run a pre-quantized format as stored."""
    if fmt == "mxfp4":
        return "MXFP4 runs as stored on a CUDA GPU of compute capability 7.5+ with `pip install 'triton>=3.4' kernels`"
    return "FP8 runs as stored on a CUDA GPU of compute capability 8.9+"


def block_size_note(block_size: int | None, trained: int | None) -> str | None:
    """A note when the block in use is longer than the drafter was trained for (None when it is not)."""
    if block_size is None or trained is None or block_size <= trained:
        return None
    return (
        f"block {block_size} is longer than the {trained} the drafter was trained with: positions past {trained} "
        f"are almost never accepted, yet every verify step computes all {block_size} (slower); --block-size "
        f"{trained} or less"
    )


def _choose_block_size(
    recipe: Recipe, overrides: PlanOverrides, tuned: dict[str, Any], cls: GpuClass
) -> tuple[int | None, str]:
    if overrides.block_size is not None:
        return overrides.block_size, f"block size {overrides.block_size}: --block-size (every step)"
    adapts = (
        "; each step picks the size (1 = no drafting) that decodes fastest here, up to it (--block-size N fixes it)"
    )
    if "block_size" in tuned:
        return tuned["block_size"], f"block size {tuned['block_size']}: the recipe's override for {cls.key}{adapts}"
    if recipe.block_size is not None:
        return (
            recipe.block_size,
            f"block size {recipe.block_size}: the recipe (what the drafter was trained with){adapts}",
        )
    return None, f"block size: read from the drafter's config{adapts}"


def _does_not_fit(
    recipe: Recipe,
    estimates: list[tuple[str, str, int | None]],
    budget: int | None,
    kind: str,
    cls: GpuClass,
    facts: MachineFacts,
) -> DflashError:
    """The refusal, with the size of every option the planner weighed and why no smaller one exists."""
    native = native_formats(kind, facts)
    options = []
    for dtype, quant, estimate in estimates:
        weights = weights_format(recipe, dtype, quant, native)
        how = {"nf4": "even with NF4 4-bit weights", "fp8": "with the FP8 checkpoint"}.get(quant, f"in {weights}")
        if quant == "nf4" and recipe.expert_bytes:
            how += f" (bitsandbytes leaves the {gb(recipe.expert_bytes)} of fused expert weights in bf16)"
        options.append(f"~{gb(estimate or 0)} {how}")
    where = f"{gb(budget or 0)} RAM available" if kind == "cpu" else f"{gb(budget or 0)} free on the {cls.label} GPU"
    notes = []
    if kind == "cuda" and recipe.checkpoint_precision in PREQUANTIZED_FORMATS:
        fmt = recipe.checkpoint_precision
        if fmt not in native and fmt in recipe.weight_bytes:
            as_stored = recipe.weight_bytes[fmt]
            notes.append(f"its {fmt.upper()} weights as stored would take {gb(as_stored)}: {_native_hint(fmt)}")
    if kind == "cuda" and "fp8" in recipe.checkpoints and "fp8" not in native:
        notes.append(f"its FP8 checkpoint ({gb(recipe.weight_bytes['fp8'])}) needs compute capability 8.9+")
    nf4 = estimate_bytes(recipe, "bfloat16", "nf4", kind) if recipe.checkpoint_precision == "bf16" else None
    if kind == "cpu" and nf4 is not None and (budget is None or nf4 <= budget):
        fix = (
            "free some RAM, pick a smaller recipe (`dflash doctor` lists what fits), or force 4-bit weights "
            f"with --quant nf4 (~{gb(nf4)}, slow on CPU)"
        )
    elif kind == "cpu":
        fix = "free some RAM, or pick a smaller recipe (`dflash doctor` lists what fits)"
    else:
        fix = (
            f"close programs holding {kind.upper()} memory, pick a smaller recipe (`dflash doctor` lists what "
            f"fits), or serve it across GPUs: `dflash export vllm {recipe.name}`"
        )
    message = f"{recipe.name} needs {', '.join(options)}; this machine has {where}"
    if notes:
        message += " (" + "; ".join(notes) + ")"
    return DflashError(message, fix=fix)
