"""The target's step exported and compiled ahead of time (AOTInductor, engine.compiled.stored), stored in the dflash cache,
loaded in about a second at every later start.

The standard families' step (engine/target/standard.py) is exported with the rows, the block's length, the rows'
length and the buffers' capacity symbolic: one package serves a row or a batch's rows, every block size, prefill
chunk and context. Built by `dflash pull NAME --compile` or the first `--compile on` start (about 1.5 minutes for
the demo target on 2 cores, with a progress line), then found by every later start, `--compile auto` included; one
that no longer loads is built again by the next build request. Its products and attention (torch's and dflash's
kernels, engine.kernels.native) read torch's thread count at run time (the decode and prompt counts differ); inductor's
own small kernels run on one thread.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from dflash_cli.engine.compiled import stored
from dflash_cli.engine.compiled.jit import Notify
from dflash_cli.engine.compiled.stored import Package
from dflash_cli.engine.target import standard
from dflash_cli.engine.target.base import compute_dtype
from dflash_cli.engine.target.standard import StandardStep

_LOADED: weakref.WeakKeyDictionary[PreTrainedModel, ExportedStep] = weakref.WeakKeyDictionary()


class ExportedStep:
    """A loaded package, bound to one model's tensors: `(token_ids [R, q], positions [R, q], end, keys, values) ->
    (normed hidden [R, q, H], each layer's output [R, q, H])` (see `StandardStep`)."""

    def __init__(self, package: Package, step: StandardStep) -> None:
        self.package, self.path = package, package.path
        self.kv_heads, self.head_dim = step.kv_heads, step.head_dim  # the K/V buffers it takes

    @property
    def paths(self) -> list[Path]:
        """Its package's path, listed as the drafter's steps list theirs."""
        return [self.path]

    def __call__(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        end: int,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        span = torch.empty(end, dtype=torch.uint8)  # only its length is read
        # (AOTInductor reads inputs at its sample's strides: contiguous ones; a view of a wider tensor is not)
        return self.package(token_ids.contiguous(), positions.contiguous(), span, keys, values)


def package_path(target: PreTrainedModel) -> Path:
    """Where the target's package is, or goes (engine.compiled.stored.package_path)."""
    code = (standard, sys.modules[__name__])
    return stored.package_path(target.config.model_type, StandardStep(target), target.config.to_dict(), code)


def _sample(step: StandardStep, dtype: torch.dtype) -> tuple[Any, ...]:
    """Two rows of two tokens at different positions (sizes of 2: an exported dimension of size 1 is a constant)."""
    keys = [torch.zeros(2, step.kv_heads, 16, step.head_dim, dtype=dtype) for _ in step.target.model.layers]
    positions = torch.tensor([[3, 4], [1, 2]])
    return torch.tensor([[1, 2], [3, 4]]), positions, torch.empty(5, dtype=torch.uint8), keys, [k.clone() for k in keys]


def build(target: PreTrainedModel, path: Path) -> None:
    """Export `target`'s standard step and compile it into a package at `path`, tried on two rows of two tokens and
    on one row of one before it is stored."""
    from torch.export import Dim

    step = StandardStep(target)
    sample = _sample(step, compute_dtype(target))
    rows = {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}
    buffers = [{0: Dim.DYNAMIC, 2: Dim.DYNAMIC} for _ in sample[3]]

    def trial(package: Package) -> None:
        package(*sample)
        # and the commonest call, one row of one token (the sample's sizes of 2 were symbolic)
        package(
            sample[0][:1, :1], sample[1][:1, :1], sample[2][:4], [k[:1] for k in sample[3]], [v[:1] for v in sample[4]]
        )

    stored.build(step, sample, (rows, rows, {0: Dim.DYNAMIC}, buffers, buffers), path, trial)


def load(target: PreTrainedModel, path: Path) -> ExportedStep:
    """The package at `path` bound to `target`'s tensors."""
    step = StandardStep(target)
    return ExportedStep(stored.load(step, path), step)


def exported_step(target: PreTrainedModel, *, build_missing: bool, notify: Notify | None = None) -> ExportedStep | None:
    """`target`'s exported step, loaded from the cache, built first when missing and `build_missing` (a stored
    package that no longer loads is then built again); None where the target has none (`standard.unsupported`) or
    it is missing. Raises what building or loading raised, naming the package."""
    if target in _LOADED:
        return _LOADED[target]
    if standard.unsupported(target) is not None:
        return None
    message = "compiling the target's step once for this machine (1-3 minutes; stored in {})"
    path = package_path(target)
    loaded = stored.stored_or_built(
        path,
        lambda at: load(target, at),
        lambda at: build(target, at),
        build_missing=build_missing,
        notify=notify,
        message=message.format(path.parent),
    )
    if loaded is not None:
        _LOADED[target] = loaded
    return loaded


def loaded_step(target: PreTrainedModel) -> ExportedStep | None:
    """The exported step `exported_step` loaded for `target` in this process, if any."""
    return _LOADED.get(target)


def unload(target: PreTrainedModel) -> None:
    """Run `target` eagerly from now on (a step that failed)."""
    _LOADED.pop(target, None)
