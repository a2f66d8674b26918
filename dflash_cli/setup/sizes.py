"""Every byte count in one place: weights as loaded (per dtype; NF4 with its quantization data; a pre-quantized
checkpoint as stored), what running a recipe at a context costs (`memory_estimate`), and the bytes a decode step
reads. The planner, the loader's memory check, `pull`, `doctor`, the roofline and the GPU benchmark all count here,
so they agree on a model's size (tests/setup/test_sizes.py). Only the functions that inspect a loaded module touch torch, and they import nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_cli.setup.recipes import Recipe

BYTES_PER_ELEMENT = {"bfloat16": 2, "float16": 2, "float32": 4}
# NF4 (bitsandbytes, double quantization) stores 4 bits per weight and an 8-bit absmax per block of 64 weights, with
# a float32 absmax per 256 of those; and per tensor the float32 code tables of NF4 (16 entries) and of the 8-bit
# absmax (256 entries).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
NF4_BYTES_PER_TENSOR = (16 + 256) * 4
# CPU weight-only formats (engine.kernels.quantized): int4 stores 4 bits per weight and a bf16 scale and zero per group of
# 32; int8 one byte per weight, and a scale per output channel in the compute dtype (`ParameterCounts` counts them).
CPU_QUANT_BYTES_PER_PARAM = {"int4": 0.5 + 4 / 32, "int8": 1.0}
# The runtime beside the model, by device kind. A GPU: the CUDA (or Metal) context, library workspaces and allocator
# slack. The CPU: the process itself (Python, torch, transformers, the tokenizer, the server) and what the allocator
# keeps from loading: `dflash serve demo` holds 0.91 GB idle with 0.17 GB of weights and drafter.
RUNTIME_BYTES = {"cuda": 1_500_000_000, "mps": 1_500_000_000, "cpu": 750_000_000}
# Prompt rows one prefill forward computes (engine.target.attention.AttentionState.prefill_chunk, the same rule;
# tests/setup/test_sizes.py holds the two equal): at most PREFILL_CHUNK_TOKENS; with eager attention, which writes
# its scores [heads, chunk, context] out in float32 (and a softmax and a bf16 copy: 12 bytes each), as many as keep
# them near PREFILL_SCORES_BYTES, and at least MIN_PREFILL_CHUNK_TOKENS.
PREFILL_CHUNK_TOKENS = 512
MIN_PREFILL_CHUNK_TOKENS = 16
PREFILL_SCORES_BYTES = 256 * 2**20
EAGER_SCORE_BYTES = 3 * 4
# Headroom over the weights where no recipe sizes a model (an ad-hoc target): activations, the KV cache of a short
# context, allocator slack.
RUNTIME_OVERHEAD = 1.10


@dataclass(frozen=True)
class ParameterCounts:
    """A causal LM's parameters as transformers builds it, grouped by what the weight-only formats do with them."""

    linear: int  # weights of nn.Linear layers other than the output head: quantized (NF4, int8, int4)
    experts: int  # fused expert weights (3-D parameters outside Linear and convolution layers): left as they are
    other: int  # embeddings, the output head, norms, biases, routers, convolutions: left as they are (NF4)
    linear_tensors: int = 0  # how many weights `linear` holds (NF4 adds its code tables per tensor)
    head: int = 0  # the output head's weight when it is a plain nn.Linear (in `other`, or the embedding when tied)
    head_tied: bool = False  # the head's weight is the input embedding's (counted once, in `other`)
    head_outputs: int = 0  # that head's output channels (int8 holds a scale for each)
    # Of `linear`, the weights the CPU formats leave in the dtype (engine.kernels.quantized.quantizable: subclasses of
    # nn.Linear, such as a MoE router; for int4 also shapes its packing cannot take); and the output channels of
    # those int8 takes.
    int8_left: int = 0
    int4_left: int = 0
    int8_outputs: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.experts + self.other

    def nbytes(self, dtype: str, quant: str = "none") -> int:
        """Weight bytes once loaded as `dtype`, the linear layers quantized when `quant` is "nf4", "int4" or
        "int8". NF4 (bitsandbytes) leaves the output head in `dtype`; the CPU formats hold it in int8 whatever
        `quant`, a tied head as its own int8 copy beside the embedding (engine.kernels.quantized.quantize_target)."""
        dtype_bytes = BYTES_PER_ELEMENT[dtype]
        if quant == "nf4":
            quantized = self.linear * NF4_BYTES_PER_PARAM + self.linear_tensors * NF4_BYTES_PER_TENSOR
            return int(quantized + (self.experts + self.other) * dtype_bytes)
        if quant in CPU_QUANT_BYTES_PER_PARAM:
            packed = self.linear - (self.int4_left if quant == "int4" else self.int8_left)
            unquantized = self.total - packed - (0 if self.head_tied else self.head)
            scales = self.head_outputs + (self.int8_outputs if quant == "int8" else 0)  # int8's, per channel
            head = self.head * CPU_QUANT_BYTES_PER_PARAM["int8"]
            return int(packed * CPU_QUANT_BYTES_PER_PARAM[quant] + head + (unquantized + scales) * dtype_bytes)
        return self.total * dtype_bytes


def scaled_from_bf16(bf16_bytes: float, dtype: str) -> float:
    """A size the recipes list in bf16, in `dtype`."""
    return bf16_bytes * BYTES_PER_ELEMENT[dtype] / 2


def recipe_weight_bytes(recipe: Recipe, weights_in: str, dtype: str) -> int | None:
    """A recipe's target weights held in `weights_in` ("nf4", a pre-quantized format kept as stored, or the compute
    dtype) with compute dtype `dtype`, from the recipe's listed sizes (bf16 sizes, made with `ParameterCounts` by
    benchmarks/recipe_sizes.py); None when it lists none. NF4 counts the fused expert weights at the compute dtype:
    bitsandbytes leaves them as they are, and the listed NF4 size holds them in bf16. The CPU formats ("int4",
    "int8", which compute in bf16) take their listed size (`ParameterCounts.nbytes`), else the bf16 size (an upper
    bound: quantizing only shrinks)."""
    if weights_in == "nf4":
        weights = recipe.weight_bytes.get("nf4")
        if weights is not None and recipe.expert_bytes:
            weights += scaled_from_bf16(recipe.expert_bytes, dtype) - recipe.expert_bytes
    elif weights_in in recipe.weight_bytes and weights_in not in BYTES_PER_ELEMENT:
        weights = recipe.weight_bytes[weights_in]
    elif weights_in in CPU_QUANT_BYTES_PER_PARAM:
        weights = recipe.weight_bytes.get("bf16")
    else:
        weights = scaled_from_bf16(recipe.weight_bytes["bf16"], dtype) if "bf16" in recipe.weight_bytes else None
    return None if weights is None else int(weights)


@dataclass(frozen=True)
class MemoryEstimate:
    """What one row at `context_tokens` positions costs on the device, by part (bytes)."""

    context_tokens: int
    weights: int  # the target's, as held
    drafter: int
    kv_cache: int  # the K/V the state reserves: target and drafter, every position of the context
    activations: int  # the transient of the prefill's last chunk (`prefill_activation_bytes`)
    runtime: int  # RUNTIME_BYTES of the device
    # A hybrid target's linear-attention state of one row, twice (the state and the copy of its start a verify keeps
    # for the rollback): the runtime holds the first row's, each further row of a batch adds it (float32, not scaled).
    state: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.drafter + self.kv_cache + self.activations + self.runtime

    @property
    def next_row(self) -> int:
        """What each further row of a batch adds at this context: its KV cache and its state (a batch holds every
        row's K/V as long as its longest row)."""
        return self.kv_cache + self.state

    def with_rows(self, rows: int) -> int:
        """The total for a batch of `rows` rows."""
        return self.total + (rows - 1) * self.next_row


def prefill_chunk_tokens(heads: int, end: int, eager: bool) -> int:
    """Prompt rows one prefill forward takes when the row ends at `end` (the rule above)."""
    if not eager or not heads:
        return PREFILL_CHUNK_TOKENS
    fits = PREFILL_SCORES_BYTES // (EAGER_SCORE_BYTES * heads * end)
    return max(MIN_PREFILL_CHUNK_TOKENS, min(PREFILL_CHUNK_TOKENS, fits))


def prefill_activation_bytes(recipe: Recipe, dtype: str, context_tokens: int, eager: bool) -> int:
    """The largest transient of prefilling a `context_tokens` context in chunks (`prefill_chunk_tokens`): with
    `eager` attention, the last chunk's scores [heads, chunk, context] (float32, its softmax, a bf16 copy), one layer
    at a time; and its MLP's gate, up and product [chunk, mlp width] in `dtype`, whichever is larger (they are not
    alive together). 0 where the recipe does not list the target's heads and MLP width."""
    heads = recipe.attention_heads or 0
    chunk = min(prefill_chunk_tokens(heads, context_tokens, eager), context_tokens)
    scores = EAGER_SCORE_BYTES * heads * chunk * context_tokens if eager else 0
    mlp = 3 * chunk * (recipe.mlp_width or 0) * BYTES_PER_ELEMENT[dtype]
    return max(scores, mlp)


def memory_estimate(
    recipe: Recipe, weights: int | None, dtype: str, device_kind: str, context_tokens: int
) -> MemoryEstimate | None:
    """Memory to run one row of a recipe whose target holds `weights` bytes, in `dtype` on a `device_kind` device,
    at `context_tokens` positions (see `MemoryEstimate`). None when the weights are unknown. The prefix store
    (prefixes beyond the slots, in host memory) is not in it: its own bound, `--cache-ram`, sizes it."""
    if weights is None:
        return None
    return MemoryEstimate(
        context_tokens,
        weights,
        int(scaled_from_bf16(recipe.drafter_bytes or 0, dtype)) if recipe.drafter is not None else 0,
        int(scaled_from_bf16(recipe.kv_bytes_per_token or 0, dtype) * context_tokens),
        # the plan's attention: eager on the CPU (the same numbers for a row however a step is shaped), PyTorch's
        # fused kernels on a GPU
        prefill_activation_bytes(recipe, dtype, context_tokens, eager=device_kind == "cpu"),
        RUNTIME_BYTES[device_kind],
        2 * (recipe.state_bytes_per_row or 0),
    )


def recipe_stored_bytes(recipe: Recipe) -> int:
    """What a recipe's models take on disk (what fetching them downloads): the target's checkpoint as stored, and its
    drafter."""
    return recipe.weight_bytes.get(recipe.checkpoint_precision, 0) + (recipe.drafter_bytes or 0)


def tensor_bytes(tensor: Any) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def module_weight_bytes(module: Any, exclude: tuple[Any, ...] = ()) -> int:
    """Bytes of a loaded module's weights as they are held (NF4: the packed 4-bit data plus its quantization
    statistics, the nested ones of double quantization too; the CPU formats: the buffers each layer names in
    `weight_buffers`); each shared tensor once."""
    total = sum(tensor_bytes(getattr(m, name)) for m in module.modules() for name in getattr(m, "weight_buffers", ()))
    for param in {id(p): p for p in module.parameters()}.values():
        if any(param is e for e in exclude):
            continue
        total += tensor_bytes(param)
        state = getattr(param, "quant_state", None)
        if state is not None:
            total += tensor_bytes(state.absmax) + tensor_bytes(state.code)
            nested = getattr(state, "state2", None)
            if nested is not None:
                total += tensor_bytes(nested.absmax) + tensor_bytes(nested.code)
    return total


@dataclass(frozen=True)
class StepBytes:
    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def kv_bytes_per_token(config: Any, element_size: int) -> int:
    """K and V of one position in every layer of a transformers text config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element_size


def step_bytes(target: Any, context_tokens: int) -> StepBytes:
    """Bytes a one-token decode step of a loaded `target` reads with `context_tokens` positions of K/V behind it:
    every weight as held, except that an input embedding which is not also the output head is read for one row."""
    embedding = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is embedding  # a quantized head holds its own copy
    weights = module_weight_bytes(target)
    if not tied:
        weights -= tensor_bytes(embedding) - embedding.shape[-1] * embedding.element_size()
    per_token = kv_bytes_per_token(target.config.get_text_config(), embedding.element_size())
    return StepBytes(weights, per_token * context_tokens)
