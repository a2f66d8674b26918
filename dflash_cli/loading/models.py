"""Build the models of a recipe on the planned device: target (transformers), tokenizer, drafter (ours).

Every checkpoint is checked before a byte of it is loaded: config.json parses, the architecture is one
transformers knows natively (no remote code), every safetensors shard is present and whole (header and size),
and the planned memory fits what the device has free. Weights load only from safetensors.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.filesize import decimal as format_bytes

from dflash_cli.errors import DflashError
from dflash_cli.loading.checkpoint import (
    Checkpoint,
    corrupt_file_error,
    read_checkpoint,
    read_draft_vocabulary,
    read_drafter_config,
    read_drafter_weights,
)
from dflash_cli.loading.hub import (
    display_name,
    quiet_transformers_progress,
    resolve_model_dir,
)
from dflash_cli.loading.streaming import cannot_stream, load_quantized_target
from dflash_cli.progress import working
from dflash_cli.setup.choices import PREQUANTIZED_FORMATS, Quant
from dflash_cli.setup.sizes import (
    RUNTIME_OVERHEAD,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from dflash_cli.engine.drafter import DFlashDrafter, DrafterConfig
    from dflash_cli.setup.planning import Plan
    from dflash_cli.setup.recipes import ModelRef, Recipe

VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")  # or a sentencepiece / tiktoken `*.model`


@dataclass
class LoadedModels:
    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None  # None: the target directory has no vocabulary files
    drafter: DFlashDrafter | None
    target_dir: Path
    drafter_dir: Path | None
    target_source: str | None = None  # where the target's weights came from, when there was a choice (--explain)


def available_memory(device: str) -> int:
    """Bytes free on `device`: the CUDA allocator's free memory, else the system's available RAM."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    import psutil  # an accelerate dependency

    return psutil.virtual_memory().available


def check_memory(needed: int, plan: Plan, what: str, nf4_needed: int | None = None) -> None:
    """Refuse before loading when `needed` bytes do not fit in what `plan.device` has free. `nf4_needed`, when
    known, is what the same load would need with NF4 weights: suggested only where it really is smaller."""
    free = available_memory(plan.device)
    if needed <= free:
        return
    fixes = []
    moe_note = ""
    if plan.quant is Quant.NONE and nf4_needed is None:
        fixes.append("`--quant nf4` (4-bit weights)")
    elif plan.quant is Quant.NONE and nf4_needed < 0.6 * needed:
        fixes.append(f"`--quant nf4` (4-bit weights: about {format_bytes(nf4_needed)})")
    elif plan.quant is Quant.NONE:
        moe_note = (
            f" (NF4 would still need about {format_bytes(nf4_needed)}: bitsandbytes leaves fused expert weights "
            "unquantized)"
        )
    fixes.append("a smaller recipe (`dflash recipes` lists them with their sizes)")
    if plan.device.startswith("cuda"):
        fixes.append("closing other programs that hold GPU memory (`nvidia-smi` lists them)")
    else:
        fixes.append("closing other programs")
    raise DflashError(
        f"{what} needs about {format_bytes(needed)} on {plan.device} ({plan.dtype}"
        f"{', nf4' if plan.quant is Quant.NF4 else ''}) but only {format_bytes(free)} is free{moe_note}; "
        "refusing to start rather than run out of memory halfway",
        fix="try " + ", or ".join(fixes),
    )


def _check_architecture(checkpoint: Checkpoint) -> Any:
    """The transformers config of a causal LM transformers implements natively, else a DflashError."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = checkpoint.config.get("model_type")
    architectures = checkpoint.config.get("architectures") or [model_type]
    try:
        config = AutoConfig.from_pretrained(checkpoint.path)
    except (ValueError, KeyError):
        config = None
    if config is None or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        import transformers

        remote = " (it ships its own modeling code, which dflash never runs)" if "auto_map" in checkpoint.config else ""
        raise DflashError(
            f"{checkpoint.path}: architecture {', '.join(map(str, architectures))} (model_type {model_type!r}) is "
            f"not a causal language model that transformers {transformers.__version__} implements{remote}",
            fix="upgrade transformers (`pip install -U transformers`) if the model is newer, or pick a supported "
            "recipe (`dflash recipes`)",
        )
    return config


@contextlib.contextmanager
def _loading_display(console: Console | None, message: str) -> Iterator[None]:
    """A rich spinner while a model loads (on a terminal), and never transformers' tqdm bars."""
    with quiet_transformers_progress(), working(console, message, piped=False):
        yield


def load_target(
    model_dir: Path,
    plan: Plan,
    *,
    console: Console | None = None,
    check_free_memory: bool = True,
    checkpoint: Checkpoint | None = None,
) -> PreTrainedModel:
    """The target model from `model_dir` in `plan`'s dtype, quantization and device; eval mode, grads off.

    With a console, a spinner names the model while it loads. `check_free_memory=False` skips the memory check
    (load_models checks target and drafter together); `checkpoint`: the directory's, if the caller read it already.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    checkpoint = checkpoint or read_checkpoint(model_dir)
    config = _check_architecture(checkpoint)
    name = display_name(model_dir)
    size = checkpoint.nbytes(plan.dtype, plan.quant, plan.native_formats)
    if check_free_memory:
        nf4 = None if checkpoint.prequantized else int(checkpoint.nbytes(plan.dtype, Quant.NF4) * RUNTIME_OVERHEAD)
        check_memory(plan.estimated_bytes or int(size * RUNTIME_OVERHEAD), plan, name, nf4)
    kwargs: dict[str, Any] = dict(
        config=config, dtype=plan.torch_dtype, device_map={"": plan.device}, use_safetensors=True
    )
    attention, note = attention_implementation(config, plan.attn_implementation)
    if attention:
        kwargs["attn_implementation"] = attention
    if note and console is not None:
        console.print(f"[dim]{note}[/dim]")
    prequantized = checkpoint.prequantized
    kept = prequantized in PREQUANTIZED_FORMATS and prequantized in plan.native_formats
    if prequantized in PREQUANTIZED_FORMATS:
        if plan.quant is Quant.NF4:
            raise DflashError(
                f"{name} is published pre-quantized ({prequantized}); bitsandbytes NF4 cannot quantize it again",
                fix="drop --quant nf4: it then loads as published, or dequantized to bf16 where this device has "
                "no kernels for it",
            )
        if not kept:  # say so explicitly: transformers would do it anyway, with a warning about missing kernels
            kwargs["quantization_config"] = _dequantizing_config(prequantized)
    if plan.quant is Quant.NF4:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            # the plan's dtype: bf16 on current GPUs, fp16 where bf16 is missing, float32 on CPU
            bnb_4bit_compute_dtype=plan.torch_dtype,
            bnb_4bit_use_double_quant=True,
        )
    weights = prequantized if kept else (plan.quant.value if plan.quant.quantizes_on_load else plan.dtype)
    message = f"loading {name} ({format_bytes(size)}, {weights} weights) on {plan.device}"
    # int4 / int8 weights are quantized as each tensor is read, so no bf16 copy of the model is ever held; a
    # checkpoint that cannot be read so loads whole and is quantized after
    whole = cannot_stream(checkpoint.config, config) if plan.quant.cpu_kernels else None
    streamed = plan.quant.cpu_kernels and whole is None
    if whole is not None and console is not None:
        console.print(f"[dim]{name} loads whole in {plan.dtype}, then is quantized to {plan.quant}: {whole}[/dim]")
    try:
        with _loading_display(console, message), quiet_bitsandbytes_import():
            if streamed:
                model = load_quantized_target(
                    model_dir, checkpoint.weight_files, config, plan.quant, plan.torch_dtype, attention
                )
            else:
                model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except SafetensorError as exc:
        raise corrupt_file_error(f"a weight file in {model_dir}", f"safetensors: {exc}") from None
    except ImportError as exc:  # bitsandbytes / accelerate missing or too old for nf4
        raise DflashError(
            f"cannot load {name} with quantization {plan.quant}: {exc}", fix="pip install -U bitsandbytes accelerate"
        ) from None
    if plan.quant.cpu_kernels and not streamed:
        from dflash_cli.engine.kernels.quantized import quantize_target

        with _loading_display(console, f"quantizing {name} to {plan.quant}"):
            quantize_target(model, plan.quant, plan.torch_dtype)
    if plan.quant.cpu_kernels:
        from dflash_cli.engine.kernels.quantized import share_inputs

        share_inputs(model)
    note = kernel_note(model, plan.device)
    if note and console is not None:
        console.print(f"[dim]{note}[/dim]")
    if kept and prequantized == "mxfp4" and not any("Mxfp4" in type(m).__name__ for m in model.modules()):
        # transformers checks its kernels once more and may still dequantize; then the plan's size was too low
        if console is not None:
            console.print(
                f"[yellow]warning:[/] transformers dequantized the MXFP4 weights of {name} to {plan.dtype} "
                f"(about {format_bytes(checkpoint.nbytes(plan.dtype))}); check `pip install 'triton>=3.4' kernels`"
            )
    model.eval()
    model.requires_grad_(False)
    return model


class _KernelFallbackFilter:
    """Drops transformers' "falling back to its reference PyTorch implementation" warnings, which it prints on the
    first forward of a layer (in the middle of a chat answer); `load_target` says it once, at load, instead."""

    def filter(self, record: Any) -> bool:
        return "falling back to its reference PyTorch implementation" not in record.getMessage()


@contextlib.contextmanager
def quiet_bitsandbytes_import() -> Iterator[None]:
    """bitsandbytes' import logs a warning about an optional CPU kernel package (`kernels`) before the plan's own
    note on NF4 off CUDA says what matters to the user (doctor checks the install)."""
    import logging

    bnb_logger = logging.getLogger("bitsandbytes")
    level = bnb_logger.level
    bnb_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        bnb_logger.setLevel(level)


def kernel_note(model: PreTrainedModel, device: str) -> str | None:
    """A note when the target has layers with optional fast kernels (Gated DeltaNet: flash-linear-attention and
    causal-conv1d) that are not installed; transformers then runs its PyTorch reference, correct but slower."""
    import importlib.util
    import logging
    import sys

    modules = {sys.modules[type(module).__module__] for module in model.modules()}
    if not any(hasattr(module, "torch_chunk_gated_delta_rule") for module in modules):
        return None
    handlers = logging.getLogger("transformers").handlers
    for handler in handlers:
        if not any(isinstance(f, _KernelFallbackFilter) for f in handler.filters):
            handler.addFilter(_KernelFallbackFilter())
    missing = [
        name
        for name, module in (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))
        if importlib.util.find_spec(module) is None
    ]
    if not missing or not device.startswith("cuda"):  # their kernels are CUDA (triton) only
        return None
    return (
        f"Gated DeltaNet layers run transformers' PyTorch reference kernels: `pip install {' '.join(missing)}` "
        "for the fast ones"
    )


def attention_implementation(config: Any, requested: str | None) -> tuple[str | None, str | None]:
    """The attention to load the target with, and a note when it differs from the plan's: models without an
    SDPA path in transformers (gpt-oss: its attention sinks) load with eager attention instead."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if requested != "sdpa":
        return requested, None
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None or getattr(model_class, "_supports_sdpa", True):
        return requested, None
    return "eager", f"attention eager: {model_class.__name__} has no SDPA path in transformers (eager is exact)"


def _dequantizing_config(method: str) -> Any:
    """The quantization config that loads a pre-quantized checkpoint dequantized to the plan's dtype."""
    from transformers import FineGrainedFP8Config, Mxfp4Config

    return Mxfp4Config(dequantize=True) if method == "mxfp4" else FineGrainedFP8Config(dequantize=True)


def has_vocabulary(model_dir: Path) -> bool:
    return any((model_dir / f).is_file() for f in VOCABULARY_FILES) or any(model_dir.glob("*.model"))


def load_tokenizer(model_dir: Path, recipe: Recipe | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer (and chat template) shipped with the target; the recipe's template options are applied
    when prompts are encoded (session.py), not here."""
    from transformers import AutoTokenizer

    name = recipe.target.id if recipe is not None else display_name(model_dir)
    fix = (
        "re-run `dflash pull` to fetch tokenizer.json / tokenizer_config.json, or pass a model directory that "
        "includes its tokenizer"
    )
    # transformers builds an empty one-token tokenizer from a directory without vocabulary files: check first
    if not has_vocabulary(model_dir):
        raise DflashError(f"cannot load the tokenizer of {name}: {model_dir} has no vocabulary file", fix=fix)
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as exc:
        raise DflashError(f"cannot load the tokenizer of {name} from {model_dir}: {exc}", fix=fix) from None


def load_drafter(path_or_repo_id: str | Path, target: PreTrainedModel, *, revision: str | None = None) -> DFlashDrafter:
    """Load a DFlash or DFlash2 drafter (local directory or Hugging Face repo id) bound to a loaded target.

    The drafter runs in the target's compute dtype on the target's device.
    """
    import torch

    from dflash_cli.engine.drafter import make_drafter
    from dflash_cli.engine.target.base import compute_dtype

    directory = resolve_model_dir(str(path_or_repo_id), revision=revision, what="drafter")
    config = read_drafter_config(directory)
    state = drafter_weights(directory, config)
    with torch.device("meta"):
        drafter = make_drafter(config)
    device = target.get_input_embeddings().weight.device
    dtype = compute_dtype(target)
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.draft_vocab_size is not None:
        drafter.use_vocabulary(read_draft_vocabulary(directory, config))
    drafter.to(device=device, dtype=dtype)
    drafter.bind(target)
    return drafter.eval()


def drafter_weights(directory: Path, config: DrafterConfig) -> dict[str, torch.Tensor]:
    """The weights of the drafter in `directory`, checked to be exactly those its `config` describes."""
    import torch

    from dflash_cli.engine.drafter import make_drafter

    state = read_drafter_weights(directory)
    for name in ("predecessor_codebook", "successor_codebook"):  # also accept an nn.Embedding-style save
        key = f"candidate_selector.{name}"
        if key + ".weight" in state and key not in state:
            state[key] = state.pop(key + ".weight")
    with torch.device("meta"):
        expected = set(make_drafter(config).state_dict())
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise DflashError(
            f"drafter weights in {directory} do not match its config: "
            f"missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}",
            fix="check that config.json and the safetensors come from the same checkpoint",
        )
    return state


def resolve_ref(ref: ModelRef, what: str, console: Console | None = None) -> Path:
    """The local directory of a recipe's model: a path, a `package:` asset, a HF snapshot, or a GGUF fallback."""
    if ref.gguf_fallback:
        from dflash_cli.loading.gguf import ensure_target_with_gguf_fallback

        return ensure_target_with_gguf_fallback(ref.id, ref.gguf_fallback, console)
    # ModelRef.path is the local directory a ref names (including `package:` assets), None for a repo id
    location = str(ref.path) if ref.path is not None else ref.id
    return resolve_model_dir(location, revision=ref.revision, what=what)


def target_ref(recipe: Recipe, plan: Plan) -> ModelRef:
    """The checkpoint the plan runs: the recipe's target, or its published FP8 copy under `--quant fp8`."""
    return recipe.checkpoints.get(plan.quant.value, recipe.target)


def load_models(
    recipe: Recipe, plan: Plan, *, with_drafter: bool = True, console: Console | None = None
) -> LoadedModels:
    """Fetch (or find) and load everything `recipe` runs with under `plan`, checking memory once up front. An int4
    plan reads a target whose source is a Q4_0/Q4_1 GGUF straight from it (`loading.gguf.load_int4_target`)."""
    ref = target_ref(recipe, plan)
    gguf, source = None, None
    if plan.quant is Quant.INT4 and ref.gguf_fallback:
        from dflash_cli.loading.gguf import converted_dir, int4_gguf_source

        gguf, source = int4_gguf_source(ref.id, ref.gguf_fallback, console)
    target_dir = converted_dir(ref.id) if gguf is not None else resolve_ref(ref, "target", console)
    drafter_dir = resolve_ref(recipe.drafter, "drafter") if with_drafter and recipe.drafter is not None else None
    drafter_bytes = read_checkpoint(drafter_dir).nbytes(plan.dtype) if drafter_dir is not None else 0
    if gguf is not None:
        check_memory(
            plan.estimated_bytes or int((gguf.stat().st_size + drafter_bytes) * RUNTIME_OVERHEAD), plan, ref.id
        )
        target = load_gguf_target(gguf, target_dir, plan, console)
        return _with_tokenizer_and_drafter(recipe, target, target_dir, drafter_dir, console, source)
    checkpoint = read_checkpoint(target_dir)
    needed = plan.estimated_bytes or int(
        (checkpoint.nbytes(plan.dtype, plan.quant, plan.native_formats) + drafter_bytes) * RUNTIME_OVERHEAD
    )
    # the drafter is never quantized
    nf4 = (
        None
        if checkpoint.prequantized
        else int((checkpoint.nbytes(plan.dtype, Quant.NF4) + drafter_bytes) * RUNTIME_OVERHEAD)
    )
    check_memory(needed, plan, f"{recipe.target.id}" + (" with its drafter" if drafter_dir else ""), nf4)
    target = load_target(target_dir, plan, console=console, check_free_memory=False, checkpoint=checkpoint)
    return _with_tokenizer_and_drafter(recipe, target, target_dir, drafter_dir, console, source)


def load_gguf_target(gguf: Path, config_dir: Path, plan: Plan, console: Console | None = None) -> PreTrainedModel:
    """The target read from a Q4_0/Q4_1 GGUF straight into the int4 layers of `plan`; eval mode, grads off."""
    from dflash_cli.engine.kernels.quantized import share_inputs
    from dflash_cli.loading.gguf import load_int4_target

    size = gguf.stat().st_size
    with _loading_display(console, f"loading {gguf.name} ({format_bytes(size)}, int4 weights) on {plan.device}"):
        model = load_int4_target(gguf, config_dir, plan.torch_dtype)
        share_inputs(model)
    attention, _ = attention_implementation(model.config, plan.attn_implementation)
    if attention is not None:  # the plan's attention, as `load_target` loads with it (eager on a CPU)
        model.set_attn_implementation(attention)
    model.eval()
    model.requires_grad_(False)
    return model


def _with_tokenizer_and_drafter(
    recipe: Recipe,
    target: PreTrainedModel,
    target_dir: Path,
    drafter_dir: Path | None,
    console: Console | None,
    source: str | None,
) -> LoadedModels:
    """A loaded target with its tokenizer (from `target_dir`) and drafter."""
    # A target without vocabulary files still decodes token ids (`dflash bench --prompts` with prompt_ids, the
    # conformance pair); what needs text asks Session.require_tokenizer, which says what is missing.
    tokenizer = load_tokenizer(target_dir, recipe) if has_vocabulary(target_dir) else None
    if target.device.type == "cpu":  # (before a stored step binds its tensors' addresses)
        from dflash_cli.engine.kernels.memory import in_huge_pages

        try:
            in_huge_pages(target)
        except (RuntimeError, OSError) as error:  # only a speed-up: the model as loaded runs the same
            warnings.warn(f"the target's weights stay in 4 KB pages ({error})", stacklevel=2)
    drafter = None
    if drafter_dir is not None:
        with _loading_display(console, f"loading drafter {recipe.drafter.id}"):
            drafter = load_drafter(str(drafter_dir), target)
    return LoadedModels(target, tokenizer, drafter, target_dir, drafter_dir, source)
