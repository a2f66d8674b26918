"""Steps compiled ahead of time: a module exported with `torch.export` and compiled by AOTInductor into a package
of code only, stored in the dflash cache, bound to a model's own tensors at load (in about a second).

`torch.compile` on a CPU traces and lowers a model at every start (one to several minutes on 2 cores), so a CPU run
could not have compiled steps by default. A step module here (the target's, engine/target/standard.py; the
drafter's, engine/drafter/compiled_step.py) takes tensors in and gives tensors out, with its sizes symbolic (rows, block,
context, buffers), so one package serves every call. The package holds no weights: at load the module's own tensors
are handed to it (`user_managed`), so the weights are held once and any checkpoint of the same shapes shares it.

A package is keyed by what its code depends on (`package_path`): torch's and transformers' versions, the CPU's
instruction-set flags (its code is built for this CPU), the model's config, the type, shape and dtype of every
tensor the step reads, whether this process runs dflash's CPU kernels, and the code traced into it. Built, tried on the model and only then renamed into place
(`build`), so a stored package is one that loads and runs; the packages of earlier builds of the same kind of step go
then (`prune`: no dflash like this one would load them again).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree
import transformers
from torch import nn

from dflash_cli.engine.compiled.jit import Notify, compile_cache_dir, use_compile_cache
from dflash_cli.engine.kernels import layers, native, quantized
from dflash_cli.engine.kernels.quantized import GROUP_SIZE, Int4Linear

T = TypeVar("T")
# inductor's settings for a package: code only (the model's tensors are handed over at load); bf16 rounded where
# eager rounds it (a block's rows then equal one-token steps); its own kernels (norms, rotations, activations) on
# one thread: they touch a few rows, and a parallel region each costs more than it saves (the products' kernels run
# on torch's threads; a demo bf16 step 9.9 against 11.2 ms)
PACKAGE_OPTIONS = {
    "aot_inductor.package_constants_in_so": False,
    "emulate_precision_casts": True,
    "cpp.threads": 1,
}


def packages_dir() -> Path:
    return compile_cache_dir() / "exported"


def stored_packages() -> list[Path]:
    """Every package stored on this machine (`dflash doctor` lists them)."""
    return sorted(packages_dir().glob("*.pt2"))


class Package:
    """A loaded package bound to a step module's tensors: `package(*inputs)` -> the step's outputs."""

    def __init__(self, runner: Any, path: Path) -> None:
        self.runner, self.path = runner, path
        # the runner's own call parses its input and output specs from JSON at every call (a quarter of a
        # millisecond a step); the flat inputs are ours to order, so parse the output spec once
        self._outputs = pytree.treespec_loads(runner.loader.get_call_spec()[1])

    def __call__(self, *inputs: torch.Tensor | list[torch.Tensor]) -> Any:
        flat = [tensor for item in inputs for tensor in (item if isinstance(item, list) else [item])]
        return pytree.tree_unflatten(self.runner.loader.boxed_run(flat), self._outputs)


def package_path(prefix: str, step: nn.Module, config: dict[str, Any], code: Iterable[ModuleType]) -> Path:
    """Where the package of `step` is, or goes: `{prefix}-{build}-{model}.pt2`, keyed by what its code depends on
    (see the module docstring); `code`: the modules traced into it besides this one, the quantized layers and the
    CPU products. The build part (versions, CPU, code) says which packages this dflash could ever load again
    (`prune`); the model part, which model's."""
    modules = (*code, sys.modules[__name__], quantized, layers, native)
    source = b"".join(Path(module.__file__).read_bytes() for module in modules) + native.SOURCE.read_bytes()
    built = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": [platform.machine(), native.cpu_flag_line()],
        "code": hashlib.sha256(source).hexdigest(),
    }
    # engine.kernels.layers' Linear subclasses (F.linear or dflash's op inside) hold a Linear's tensors: one kind
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
    config = {key: value for key, value in config.items() if key != "_name_or_path"}  # any copy of the same shapes
    # whether its products and attention call dflash's kernels: a choice of this process (DFLASH_CPU_KERNELS=0, a
    # failed build), so packages of both kinds are one build's and `prune` keeps both
    model = {"config": config, "tensors": tensors, "cpu_kernels": native.loaded_tier()}
    return packages_dir() / f"{prefix}-{_digest(built, 8)}-{_digest(model, 16)}.pt2"


def _digest(facts: dict[str, Any], length: int) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:length]


def prune(path: Path) -> list[Path]:
    """Delete the packages of `path`'s prefix that another build made (other versions, code or CPU flags: no
    dflash like this one loads them again) and those named before builds were named, and the scratch directories
    of builds killed over an hour ago; return the packages. Packages of other models from this build stay."""
    prefix, build, _ = path.stem.split("-")
    stale = [
        other
        for other in path.parent.glob(f"{prefix}-*.pt2")
        if other != path and (len(parts := other.stem.split("-")) != 3 or parts[1] != build)
    ]
    for other in stale:
        other.unlink(missing_ok=True)
    for scratch in path.parent.glob(".building-*"):
        if time.time() - scratch.stat().st_mtime > 3600:
            shutil.rmtree(scratch, ignore_errors=True)
    return stale


def build(
    step: nn.Module,
    sample: tuple[Any, ...],
    dynamic_shapes: tuple[Any, ...],
    path: Path,
    trial: Callable[[Package], None],
) -> None:
    """Export `step` over `sample` and compile it into a package at `path`: written whole and tried (`trial(package)`,
    which runs it on the calls that matter) before it is renamed into place."""
    use_compile_cache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations while it exports: not our users'
        program = torch.export.export(step.eval(), sample, dynamic_shapes=dynamic_shapes, strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        # built in a directory of its own: a build that is killed leaves no file the stored packages' glob finds
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".building-") as scratch:
            temporary = str(Path(scratch) / path.name)
            torch._inductor.aoti_compile_and_package(program, package_path=temporary, inductor_configs=PACKAGE_OPTIONS)
            trial(load(step, Path(temporary)))
            os.replace(temporary, path)
        prune(path)


def stored_or_built(
    path: Path,
    load: Callable[[Path], T],
    build: Callable[[Path], None],
    *,
    build_missing: bool,
    notify: Notify | None,
    message: str,
) -> T | None:
    """`load(path)`, the stored package bound to its model; built first (`build(path)`, with `notify(message)` shown)
    when missing and `build_missing`, else None. A stored package that no longer loads is built again when
    `build_missing`, else what loading raised is raised again, naming the package."""
    if path.exists():
        try:
            return load(path)
        except Exception as error:  # a package of another build of this torch, a broken file: anything
            if not build_missing:
                raise RuntimeError(
                    f"{error} (package {path}: delete it, or build it again with --compile on)"
                ) from error
            path.unlink()
    elif not build_missing:
        return None
    with notify(message) if notify is not None else nullcontext():
        build(path)
    return load(path)


def load(step: nn.Module, path: Path) -> Package:
    """The package at `path` bound to `step`'s tensors."""
    runner = torch._inductor.aoti_load_package(str(path))
    tensors = dict(step.named_parameters(remove_duplicate=False))
    tensors.update(step.named_buffers(remove_duplicate=False))
    names = runner.get_constant_fqns()
    # The only constants the package makes itself: the group size each int4 product takes as a tensor (inductor's
    # CPU lowering of _weight_int4pack_mm_for_cpu adds them, named constantN).
    made = [name for name in names if name not in tensors]
    int4 = sum(isinstance(module, Int4Linear) and not module.native for module in step.modules())
    if len(made) != int4 or not all(name.startswith("constant") for name in made):
        raise RuntimeError(f"the package at {path} wants {len(made)} constants the model lacks ({int4} int4 layers)")
    constants = {name: tensors[name].detach() for name in names if name in tensors}
    constants.update({name: torch.tensor(GROUP_SIZE) for name in made})
    runner.load_constants(constants, check_full_update=True, user_managed=True)
    return Package(runner, path)
