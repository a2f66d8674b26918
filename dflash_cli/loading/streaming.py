"""A target read from its safetensors tensor by tensor into int4 / int8 layers: no bf16 copy of the model exists.

`from_pretrained` then `engine.kernels.quantized.quantize_target` holds the whole model in bf16 before quantizing it: a 27 B
model takes 54 GB on the way to 19 GB. Here the model is built with empty weights (accelerate's
`init_empty_weights`: parameters on the meta device, buffers such as the rotary frequencies computed), and each
checkpoint tensor is read alone, renamed and converted by the family's own transformers conversion mapping (the
`model.language_model.` prefix of a Qwen3.5 checkpoint, per-expert MoE weights fused), cast to its parameter's
dtype, and a linear's weight is quantized as it arrives, with the rules of `quantize_target` (the output head int8,
a tied one as its own copy of the embedding). The peak is the quantized model and a tensor or two; the model is
`quantize_target`'s of `from_pretrained`'s bit for bit (tests/loading/test_streaming.py).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from dflash_cli.errors import DflashError
from dflash_cli.loading.checkpoint import StoredTensor, corrupt_file_error, safetensors_header

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

# safetensors' type names, as torch names them
STORED_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
}


def cannot_stream(checkpoint_config: dict[str, Any], config: Any) -> str | None:
    """Why the checkpoint whose config.json is `checkpoint_config` (`config` as transformers reads it) cannot be read
    tensor by tensor into quantized layers (it then loads whole and is quantized after); None when it can."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    quantization = checkpoint_config.get("quantization_config")
    if isinstance(quantization, dict):  # its stored tensors need transformers' dequantization on load
        return f"it is published pre-quantized ({quantization.get('quant_method')})"
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if getattr(model_class, "_keep_in_fp32_modules_strict", None):  # from_pretrained reads some weights as float32
        return f"{model_class.__name__} keeps some weights in float32"
    return None


def load_quantized_target(
    model_dir: Path, weight_files: list[Path], config: Any, kind: str, dtype: torch.dtype, attention: str | None
) -> PreTrainedModel:
    """The causal LM of `config` with the checkpoint `weight_files` of `model_dir` read into `kind` ("int4" |
    "int8") layers computing in `dtype`, with `attention` (None: transformers' default); grads off, eval mode."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    from dflash_cli.engine.kernels.quantized import Int8Linear, quantizable

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, **({"attn_implementation": attention} if attention else {})
        )
    model.config.name_or_path = model.name_or_path = str(model_dir)  # as from_pretrained names them
    model.tie_weights()  # outside the context: init_empty_weights makes each parameter anew, tied ones apart
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    tied_head = next(f"{name}.weight" for name, module in model.named_modules() if module is head) if tied else None
    expected = model.state_dict()
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    with contextlib.ExitStack() as files:
        tensors = []
        for path in weight_files:
            opened = files.enter_context(path.open("rb"))
            tensors += [(key, opened, stored) for key, stored in safetensors_header(path).items()]
        # Each parameter gathers the checkpoint tensors it is made of (one, or a layer's experts to fuse), in the
        # order from_pretrained gathers them; each is read only when its parameter is made.
        loads: dict[str, Any] = {}
        for key, opened, stored in sorted(tensors, key=lambda item: dot_natural_key(item[0])):
            name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
            if name not in expected and key in expected:
                name, pattern = rename_source_key(key, [], [], model.base_model_prefix, expected)
            if name not in expected or name == tied_head:
                continue  # not this model's (a vision tower, an MTP layer), as from_pretrained skips it; a tied head
            if pattern is None:
                transform, pattern = loads.setdefault(name, WeightRenaming(key, name)), key
            else:
                transform = loads.setdefault(name, copy.deepcopy(by_pattern[pattern]))
            transform.add_tensor(name, key, pattern, _reader(opened, stored, expected[name].dtype))
        for name, transform in loads.items():
            for target, values in transform.convert(name, model=model, config=model.config).items():
                _place(model, target, values[0] if isinstance(values, list) else values, kind, dtype, head)
    model.tie_weights()  # each parameter the checkpoint holds once for two (a tied head: the embedding), as loaded
    if tied and quantizable(head, "int8"):  # quantize_target's int8 copy of a tied head
        model.set_output_embeddings(Int8Linear.from_weight(head.weight.detach(), dtype, head.bias))
    unread = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if unread:
        raise DflashError(
            f"the checkpoint in {model_dir} has no weights for {', '.join(unread[:4])}"
            + (f" and {len(unread) - 4} more" if len(unread) > 4 else ""),
            fix="delete it and re-run `dflash pull`, or point at a complete copy of the model",
        )
    if model.can_generate():  # as from_pretrained reads it (the end-of-text tokens): its file, else config.json
        try:
            model.generation_config = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            model.generation_config = GenerationConfig.from_pretrained(
                model_dir, config_file_name="config.json", _from_model_config=True
            )
    model.eval()
    model.requires_grad_(False)
    return model


def _reader(opened: BinaryIO, stored: StoredTensor, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """Reads `stored` from the file `opened` in `dtype` when called (transformers' conversion ops call their
    inputs). Plain reads, not a memory map: the pages of a mapped file would count to the process until it closes."""

    def read() -> torch.Tensor:
        import torch

        if stored.dtype not in STORED_DTYPES:
            raise DflashError(
                f"{opened.name} holds a tensor of type {stored.dtype}, which dflash does not read",
                fix="load it without --quant int4 / int8",
            )
        data = torch.empty(stored.end - stored.begin, dtype=torch.uint8)
        view, done = memoryview(data.numpy()), 0
        opened.seek(stored.begin)
        while done < len(view):  # one read call returns at most about 2 GB
            count = opened.readinto(view[done:])
            if not count:
                raise corrupt_file_error(f"file {opened.name}", "it ends inside a tensor")
            done += count
        return data.view(getattr(torch, STORED_DTYPES[stored.dtype])).reshape(stored.shape).to(dtype)

    return read


def _place(model: Any, name: str, value: torch.Tensor, kind: str, dtype: torch.dtype, head: Any) -> None:
    """Put tensor `value` where parameter or buffer `name` is; a quantizable linear's weight goes into an int4 / int8
    layer in the linear's place (the output head int8, whatever `kind`)."""
    from torch import nn

    from dflash_cli.engine.kernels.memory import give_back_freed_memory
    from dflash_cli.engine.kernels.quantized import Int4Linear, Int8Linear, quantizable

    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    if getattr(module, attribute).shape != value.shape:
        raise DflashError(
            f"{name} is {tuple(value.shape)} in the checkpoint but {tuple(getattr(module, attribute).shape)} in the "
            "model its config.json describes",
            fix="check that config.json and the safetensors come from the same model",
        )
    layer_kind = "int8" if module is head else kind
    if attribute == "weight" and quantizable(module, layer_kind):
        layer = Int8Linear if layer_kind == "int8" else Int4Linear
        bias = module.bias  # read already, or still on the meta device: then its tensor comes next
        model.set_submodule(module_name, layer.from_weight(value, dtype, bias))
        del value
        give_back_freed_memory()
    elif attribute in module._buffers:
        module._buffers[attribute] = value
    else:
        setattr(module, attribute, nn.Parameter(value, requires_grad=False))
