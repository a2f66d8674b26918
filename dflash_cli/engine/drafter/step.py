"""The drafter's step of one sequence exported and compiled ahead of time (engine.packages), stored in the dflash
cache beside the target's and loaded with it.

An eager draft step runs a few hundred small ops in Python for a layer or two (the demo drafter's step of a 4-token
block: 1.7 ms, of which its products and the head over the drafted rows are about 1.1); here the fused context,
the block's embeddings, the rotation, every layer and the final norm are one call, with the context's length, the
block's length, the buffers' capacity and the attended prefix symbolic, so one package serves every step and the
first call over the whole prompt. The proposal (the head over the drafted rows, argmax or DFlash2's selector chain,
a grammar's choice) stays outside: it is what the eager step runs.

Covered: drafters whose layers attend by position to a full buffer (the classic format and DFlash2's layers,
causal or not); a sliding layer's ring (its rows' positions are data) runs eagerly (`unsupported`), and so does a
batch's forward over several slots (`SlotsForward`).
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_cli.engine import packages
from dflash_cli.engine.compiled import Notify
from dflash_cli.engine.drafter import cache as cache_module
from dflash_cli.engine.drafter import layers
from dflash_cli.engine.drafter.layers import rotation
from dflash_cli.engine.kernels import use_cpu_products
from dflash_cli.engine.packages import Package

if TYPE_CHECKING:
    from dflash_cli.engine.drafter.cache import DraftCache

# (the drafter's module, engine.drafter.model, imports this one: a DFlashDrafter is typed by its base here)
DFlashDrafter = nn.Module

_LOADED: weakref.WeakKeyDictionary[nn.Module, ExportedDraftStep] = weakref.WeakKeyDictionary()


def unsupported(drafter: DFlashDrafter) -> str | None:
    """Why `drafter` has no exported step (None: it has one)."""
    if any(drafter.config.layer_window(i) is not None for i in range(drafter.config.num_hidden_layers)):
        return "sliding-window layers (a ring of rows whose positions are data)"
    if drafter.fc.weight.device.type != "cpu":
        return "not on a CPU"
    return None


class _BufferWrites:
    """What a layer's attention reads as the cache of one sequence, inside the step: it writes the call's rows at
    their positions into the buffers handed in, and gives back the prefix up to the block's end (as
    `DraftCache.update` does for full layers)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: torch.Tensor, end: Any) -> None:
        self.keys, self.values, self.positions, self.end = keys, values, positions, end
        self.length = 0  # moved by the drafter's forward; the caller moves the real cache's

    def update(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        buffer_k, buffer_v = self.keys[layer_idx], self.values[layer_idx]
        at = (
            torch.zeros(1, 1, 1, dtype=torch.long, device=keys.device),
            torch.arange(keys.shape[1], device=keys.device)[None, :, None],
            self.positions[:, None, :],
        )
        buffer_k.index_put_(at, keys)
        buffer_v.index_put_(at, values)
        return buffer_k[:, :, : self.end], buffer_v[:, :, : self.end], None


class DraftStep(nn.Module):
    """`(features [1, c, F], block_ids [1, q], first [1], span [end], keys, values) -> hidden [1, q, H]`: one
    sequence's new context (positions first .. first+c-1) and block (then q more), its K/V written into `keys[l]` /
    `values[l]` ([1, kv heads, capacity, head dim] per layer) at those positions, each query attending to the
    positions before `end` (`span`'s length, past the block) by its layer's rule: `DFlashDrafter.forward` over a
    one-slot `DraftCache`."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        why = unsupported(drafter)
        if why is not None:
            raise ValueError(f"no exported step for this drafter: {why}")
        use_cpu_products(drafter)  # the products the engine runs (engine.kernels), traced as they will run
        self.drafter = drafter
        self.embedding = drafter.target.get_input_embeddings()  # (borrowed: named here, so handed over at load)
        self.register_buffer("inv_freq", drafter._inv_freq, persistent=False)

    def forward(
        self, features: torch.Tensor, block_ids: torch.Tensor, first: torch.Tensor, span: torch.Tensor,
        keys: list[torch.Tensor], values: list[torch.Tensor],
    ) -> torch.Tensor:  # fmt: skip
        drafter = self.drafter
        rows = torch.cat([drafter.fuse_context(features), drafter.embed(block_ids).to(drafter.fc.weight.dtype)], dim=1)
        positions = (torch.arange(rows.shape[1], device=rows.device) + first)[None]
        rotated = rotation(positions, self.inv_freq, drafter._rope_scale, drafter.fc.weight.dtype)
        writes = _BufferWrites(keys, values, positions, span.shape[0])
        return drafter.run_layers(rows, block_ids.shape[1], positions, rotated, writes)


class ExportedDraftStep:
    """A loaded package bound to one drafter's tensors (and its target's embedding): `DraftStep` over a one-slot
    `DraftCache`, which it grows and moves as the eager forward does."""

    def __init__(self, package: Package, drafter: DFlashDrafter) -> None:
        self.package, self.path = package, package.path
        config = drafter.config
        # the buffers the layers write (allocated on a cache's first write, as the eager forward would)
        self._like = torch.empty(1, config.num_key_value_heads, 0, config.head_dim, dtype=drafter.fc.weight.dtype)

    def __call__(self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache) -> torch.Tensor:
        """Hidden of every block slot [1, q, H] for the new context `features` [1, c, F] ending at `start` and the
        block `block_ids` [1, q] from there; the cache then holds the context (its length moves to `start`)."""
        end = start + block_ids.shape[1]
        cache.make_room(end)
        buffers = [cache.buffers(i, self._like) for i in range(len(cache.keys))]
        hidden = self.package(
            features,
            block_ids,
            torch.tensor([start - features.shape[1]]),
            torch.empty(end, dtype=torch.uint8),  # only its length is read
            [keys for keys, _ in buffers],
            [values for _, values in buffers],
        )
        cache.length = start
        return hidden


def package_path(drafter: DFlashDrafter) -> Path:
    """Where the drafter's package is, or goes (engine.packages.package_path)."""
    code = (sys.modules[__name__], layers, cache_module, sys.modules[type(drafter).__module__])
    return packages.package_path("drafter", DraftStep(drafter), drafter.config.to_dict(), code)


def build(drafter: DFlashDrafter, path: Path) -> None:
    """Export `drafter`'s step and compile it into a package at `path`, tried before it is stored on a later step
    (3 context rows, a block of 2 at position 4) and on one context row with a block of 3."""
    from torch.export import Dim

    step = DraftStep(drafter)
    config, dtype = drafter.config, drafter.fc.weight.dtype
    width = len(config.target_layer_ids) * config.hidden_size
    # sizes that differ from one another: equal symbolic sizes at export would be taken for one
    buffers = [
        torch.zeros(1, config.num_key_value_heads, 16, config.head_dim, dtype=dtype) for _ in step.drafter.layers
    ]
    sample = (
        torch.randn(1, 3, width).to(dtype),
        torch.tensor([[1, config.mask_token_id]]),
        torch.tensor([4]),
        torch.empty(9, dtype=torch.uint8),
        buffers,
        [b.clone() for b in buffers],
    )
    dynamic = {1: Dim.DYNAMIC}
    shapes = (
        dynamic,
        dynamic,
        None,
        {0: Dim.DYNAMIC},
        [{2: Dim.DYNAMIC}] * len(buffers),
        [{2: Dim.DYNAMIC}] * len(buffers),
    )

    def trial(package: Package) -> None:
        package(*sample)
        block = torch.tensor([[1, config.mask_token_id, config.mask_token_id]])
        package(sample[0][:, :1], block, torch.tensor([7]), torch.empty(11, dtype=torch.uint8), sample[4], sample[5])

    packages.build(step, sample, shapes, path, trial)


def load(drafter: DFlashDrafter, path: Path) -> ExportedDraftStep:
    """The package at `path` bound to `drafter`'s tensors."""
    return ExportedDraftStep(packages.load(DraftStep(drafter), path), drafter)


def exported_draft_step(
    drafter: DFlashDrafter, *, build_missing: bool, notify: Notify | None = None
) -> ExportedDraftStep | None:
    """`drafter`'s exported step, loaded from the cache, built first when missing and `build_missing` (a stored
    package that no longer loads is then built again); None where it has none (`unsupported`) or it is missing.
    Raises what building or loading raised, naming the package."""
    if drafter in _LOADED:
        return _LOADED[drafter]
    if unsupported(drafter) is not None:
        return None
    message = "compiling the drafter's step once for this machine (about a minute; stored in {})"
    path = package_path(drafter)
    loaded = packages.stored_or_built(
        path,
        lambda at: load(drafter, at),
        lambda at: build(drafter, at),
        build_missing=build_missing,
        notify=notify,
        message=message.format(path.parent),
    )
    if loaded is not None:
        _LOADED[drafter] = loaded
    return loaded


def loaded_draft_step(drafter: nn.Module) -> ExportedDraftStep | None:
    """The exported step `exported_draft_step` loaded for `drafter` in this process, if any."""
    return _LOADED.get(drafter)


def unload(drafter: nn.Module) -> None:
    """Run `drafter` eagerly from now on (a step that failed)."""
    _LOADED.pop(drafter, None)
