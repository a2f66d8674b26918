"""The target's step exported and compiled ahead of time (AOTInductor), stored in the dflash cache, loaded in
about a second at every later start.

`torch.compile` on a CPU traces and lowers the target at every start (one to several minutes on 2 cores), so a
CPU run could not have compiled steps by default. Here the standard families' step (engine/target/standard.py) is
exported once with `torch.export` (the rows, the block's length, the rows' length and the buffers' capacity
symbolic: one package serves a row or a batch's rows, every block size, prefill chunk and context) and compiled
to a shared library by AOTInductor. The package holds code only, no weights: at load the model's own tensors are
handed to it (`user_managed`), so the weights are held once and any checkpoint of the same shapes uses the same
package.

A package is keyed by what its code depends on (`package_key`): torch's and transformers' versions, the CPU's
instruction-set flags (its code is built for this CPU), the model's config, the type, shape and dtype of every
tensor the step reads, and the code traced into it. Built by `dflash pull NAME --compile` or the first `--compile
on` start (about 1.5 minutes for the demo target on 2 cores, with a progress line), tried on the model before it
is stored, then found by every later start, `--compile auto` included; one that no longer loads is built again by
the next build request. Its products and attention (torch's and dflash's kernels, engine.cpu_kernels) read torch's
thread count at run time (the decode and prompt counts differ); inductor's own small kernels run on one thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
import warnings
import weakref
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
import transformers
from torch import nn
from transformers import PreTrainedModel

from dflash_cli.engine import cpu_kernels, kernels, quantized
from dflash_cli.engine.compiled import Notify, compile_cache_dir, use_compile_cache
from dflash_cli.engine.quantized import GROUP_SIZE, Int4Linear
from dflash_cli.engine.target import standard
from dflash_cli.engine.target.base import compute_dtype
from dflash_cli.engine.target.standard import StandardStep

_LOADED: weakref.WeakKeyDictionary[PreTrainedModel, ExportedStep] = weakref.WeakKeyDictionary()
# inductor's settings for a package: code only (the model's tensors are handed over at load); bf16 rounded where
# eager rounds it (a block's rows then equal one-token steps); its own kernels (norms, rotations, activations) on
# one thread: they touch a few rows, and a parallel region each costs more than it saves (the products' kernels run
# on torch's threads; a demo bf16 step 9.9 against 11.2 ms)
PACKAGE_OPTIONS = {
    "aot_inductor.package_constants_in_so": False,
    "emulate_precision_casts": True,
    "cpp.threads": 1,
}


class ExportedStep:
    """A loaded package, bound to one model's tensors: `(token_ids [1, q], end, keys, values) -> (normed hidden
    [q, H], each layer's output [q, H])` (see `StandardStep`)."""

    def __init__(self, runner: Any, path: Path, step: StandardStep) -> None:
        self.runner, self.path = runner, path
        self.kv_heads, self.head_dim = step.kv_heads, step.head_dim  # the K/V buffers it takes
        # the runner's own call parses its input and output specs from JSON at every call (a quarter of a
        # millisecond a step); the flat inputs are ours to order, so parse the output spec once
        self._outputs = pytree.treespec_loads(runner.loader.get_call_spec()[1])

    def __call__(
        self, token_ids: torch.Tensor, positions: torch.Tensor, end: int, keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
        span = torch.empty(end, dtype=torch.uint8)  # only its length is read
        flat = self.runner.loader.boxed_run([token_ids, positions, span, *keys, *values])
        return pytree.tree_unflatten(flat, self._outputs)


def package_key(target: PreTrainedModel) -> str:
    """What a package's code depends on (see the module docstring), as a hex digest."""
    # the code traced into the graph: the step, this module, the quantized layers, the CPU products and, where the
    # process has them, dflash's kernels (a package calls them)
    modules = (standard, sys.modules[__name__], quantized, kernels, cpu_kernels)
    code = b"".join(Path(module.__file__).read_bytes() for module in modules)
    if cpu_kernels.available():
        code += cpu_kernels.SOURCE.read_bytes()
    step = StandardStep(target)
    # engine.kernels' Linear subclasses (F.linear or dflash's op inside) hold a Linear's tensors: one kind
    kinds = {
        name: "Linear" if isinstance(m, nn.Linear) else type(m).__name__
        for name, m in step.named_modules(remove_duplicate=False)
    }
    tensors = [
        (name, kinds[name.rpartition(".")[0]], str(tensor.dtype), tuple(tensor.shape))
        for name, tensor in [
            *step.named_parameters(remove_duplicate=False),
            *step.named_buffers(remove_duplicate=False),
        ]
    ]
    config = target.config.to_dict()
    config.pop("_name_or_path", None)  # where the checkpoint lies: any copy of the same shapes shares the package
    facts = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": [platform.machine(), cpu_kernels.cpu_flag_line()],
        "config": config,
        "tensors": tensors,
        "code": hashlib.sha256(code).hexdigest(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def package_path(target: PreTrainedModel) -> Path:
    return compile_cache_dir() / "exported" / f"{target.config.model_type}-{package_key(target)}.pt2"


def stored_steps() -> list[Path]:
    """Every package stored on this machine (`dflash doctor` lists them)."""
    return sorted((compile_cache_dir() / "exported").glob("*.pt2"))


def _sample(step: StandardStep, dtype: torch.dtype) -> tuple[Any, ...]:
    """Two rows of two tokens at different positions (sizes of 2: an exported dimension of size 1 is a constant)."""
    keys = [torch.zeros(2, step.kv_heads, 16, step.head_dim, dtype=dtype) for _ in step.target.model.layers]
    positions = torch.tensor([[3, 4], [1, 2]])
    return torch.tensor([[1, 2], [3, 4]]), positions, torch.empty(5, dtype=torch.uint8), keys, [k.clone() for k in keys]


def build(target: PreTrainedModel, path: Path) -> None:
    """Export `target`'s standard step and compile it into a package at `path`: written whole and tried on the model
    (two rows of two tokens, one row of one) before it is renamed into place, so a stored package is one that loads
    and runs."""
    from torch.export import Dim

    use_compile_cache()
    step = StandardStep(target).eval()
    sample = _sample(step, compute_dtype(target))
    rows = {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}
    buffers = [{0: Dim.DYNAMIC, 2: Dim.DYNAMIC} for _ in sample[3]]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations while it exports: not our users'
        program = torch.export.export(
            step, sample, dynamic_shapes=(rows, rows, {0: Dim.DYNAMIC}, buffers, buffers), strict=False
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
        os.close(fd)
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=temporary, inductor_configs=PACKAGE_OPTIONS)
            trial = load(target, Path(temporary))
            trial(sample[0], sample[1], 5, sample[3], sample[4])
            # and the commonest call, one row of one token (the sample's sizes of 2 were symbolic)
            trial(sample[0][:1, :1], sample[1][:1, :1], 4, [k[:1] for k in sample[3]], [v[:1] for v in sample[4]])
            os.replace(temporary, path)
        finally:
            Path(temporary).unlink(missing_ok=True)


def load(target: PreTrainedModel, path: Path) -> ExportedStep:
    """The package at `path` bound to `target`'s tensors."""
    step = StandardStep(target)
    runner = torch._inductor.aoti_load_package(str(path))
    tensors = dict(step.named_parameters(remove_duplicate=False))
    tensors.update(step.named_buffers(remove_duplicate=False))
    names = runner.get_constant_fqns()
    # The only constants the package makes itself: the group size each int4 product takes as a tensor (inductor's
    # CPU lowering of _weight_int4pack_mm_for_cpu adds them, named constantN).
    made = [name for name in names if name not in tensors]
    int4 = sum(isinstance(module, Int4Linear) for module in step.modules())
    if len(made) != int4 or not all(name.startswith("constant") for name in made):
        raise RuntimeError(f"the package at {path} wants {len(made)} constants the model lacks ({int4} int4 layers)")
    constants = {name: tensors[name].detach() for name in names if name in tensors}
    constants.update({name: torch.tensor(GROUP_SIZE) for name in made})
    runner.load_constants(constants, check_full_update=True, user_managed=True)
    return ExportedStep(runner, path, step)


def exported_step(target: PreTrainedModel, *, build_missing: bool, notify: Notify | None = None) -> ExportedStep | None:
    """`target`'s exported step, loaded from the cache, built first when missing and `build_missing` (a stored
    package that no longer loads is then built again); None where the target has none (`standard.unsupported`) or
    it is missing. Raises what building or loading raised, naming the package."""
    if target in _LOADED:
        return _LOADED[target]
    if standard.unsupported(target) is not None:
        return None
    path = package_path(target)
    if path.exists():
        try:
            _LOADED[target] = loaded = load(target, path)
            return loaded
        except Exception as error:  # a package of another build of this torch, a broken file: anything
            if not build_missing:
                raise RuntimeError(
                    f"{error} (package {path}: delete it, or build it again with --compile on)"
                ) from error
            path.unlink()
    elif not build_missing:
        return None
    message = f"compiling the target's step once for this machine (1-3 minutes; stored in {path.parent})"
    with notify(message) if notify is not None else nullcontext():
        build(target, path)
    _LOADED[target] = loaded = load(target, path)
    return loaded


def loaded_step(target: PreTrainedModel) -> ExportedStep | None:
    """The exported step `exported_step` loaded for `target` in this process, if any."""
    return _LOADED.get(target)


def unload(target: PreTrainedModel) -> None:
    """Run `target` eagerly from now on (a step that failed)."""
    _LOADED.pop(target, None)
