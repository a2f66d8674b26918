"""The drafter's steps exported and compiled ahead of time (engine.compiled.stored), stored in the dflash cache beside
the target's and loaded with it.

An eager draft step runs a few hundred small ops in Python for a layer or two (the demo drafter's step of a 4-token
block: 1.7 ms, of which its products and the head over the drafted rows are about 1.1); here the fused context,
the block's embeddings, the rotation, every layer and the final norm are one call, with every length symbolic (new
context, block, rows, buffers, the attended prefix), so one package serves every step and the first call over the
whole prompt. The proposal (the head over the drafted rows, argmax or DFlash2's selector chain, a grammar's choice)
stays outside: it is what the eager step runs.

Two packages, one per forward kind (engine.drafter.cache): `DraftStep`, one sequence over a one-slot cache whose
layers attend by position to a full buffer (`DraftCache.update`'s forward), and `RowsDraftStep`, the forward over
several slots (`SlotsForward`'s), which also serves one sequence of a drafter with sliding layers: the host work
(positions, which ring rows a call writes) stays with `SlotsForward` and comes in as tensors.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_cli.engine.compiled import stored
from dflash_cli.engine.compiled.jit import Notify
from dflash_cli.engine.compiled.stored import Package
from dflash_cli.engine.drafter import cache as cache_module
from dflash_cli.engine.drafter import layers
from dflash_cli.engine.drafter.cache import SlotsForward
from dflash_cli.engine.drafter.layers import rotation
from dflash_cli.engine.kernels.layers import one_row_runs_twice, use_cpu_products

if TYPE_CHECKING:
    from dflash_cli.engine.drafter.cache import DraftCache

# A DFlashDrafter (engine.drafter.model, which imports this module: typed here by its base class)
Drafter = nn.Module

_LOADED: weakref.WeakKeyDictionary[nn.Module, ExportedDraftStep] = weakref.WeakKeyDictionary()


def unsupported(drafter: Drafter) -> str | None:
    """Why `drafter` has no exported steps (None: it has them)."""
    if drafter.fc.weight.device.type != "cpu":
        return "not on a CPU"
    return None


def _rings(drafter: Drafter) -> bool:
    """Whether some layer keeps a ring of rows (a sliding window): its one sequence runs the rows' step."""
    return any(drafter.config.layer_window(i) is not None for i in range(drafter.config.num_hidden_layers))


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


class _StepModule(nn.Module):
    """What both steps hold: the drafter (its products switched as the engine runs them, so traced as they will run),
    the target's embedding it borrows and its rotation's frequencies (named here: handed over at load)."""

    def __init__(self, drafter: Drafter) -> None:
        super().__init__()
        why = unsupported(drafter)
        if why is not None:
            raise ValueError(f"no exported step for this drafter: {why}")
        use_cpu_products(drafter)
        self.drafter = drafter
        self.embedding = drafter.target.get_input_embeddings()
        self.register_buffer("inv_freq", drafter._inv_freq, persistent=False)
        # bf16 products on MKL (no dflash kernels): a one-row product runs as two in eager (engine.kernels.layers), so the
        # context's last row runs twice here (a traced product cannot branch on the row count)
        self.extra = int(one_row_runs_twice(drafter))

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """`DFlashDrafter.fuse_context`, rounded as the eager forward rounds it at any context length."""
        if not self.extra:
            return self.drafter.fuse_context(features)
        return self.drafter.fuse_context(torch.cat([features, features[:, -1:]], dim=1))[:, :-1]

    def rotated(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotation(positions, self.inv_freq, self.drafter._rope_scale, self.drafter.fc.weight.dtype)


class DraftStep(_StepModule):
    """`(features [1, c, F], block_ids [1, q], first [1], span [end], keys, values) -> hidden [1, q, H]`: one
    sequence's new context (positions first .. first+c-1) and block (then q more), its K/V written into `keys[l]` /
    `values[l]` ([1, kv heads, capacity, head dim] per layer) at those positions, each query attending to the
    positions before `end` (`span`'s length, past the block) by its layer's rule: `DFlashDrafter.forward` over a
    one-slot `DraftCache` of full layers."""

    def __init__(self, drafter: Drafter) -> None:
        if _rings(drafter):
            raise ValueError("no exported step of one sequence for a drafter with sliding layers (the rows' step)")
        super().__init__(drafter)

    def forward(
        self,
        features: torch.Tensor,
        block_ids: torch.Tensor,
        first: torch.Tensor,
        span: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        drafter = self.drafter
        rows = torch.cat([self.fused(features), drafter.embed(block_ids).to(drafter.fc.weight.dtype)], dim=1)
        positions = (torch.arange(rows.shape[1], device=rows.device) + first)[None]
        writes = _BufferWrites(keys, values, positions, span.shape[0])
        return drafter.run_layers(rows, block_ids.shape[1], positions, self.rotated(positions), writes)


class _Buffers:
    """The part of a `DraftCache` a forward over several slots reads, inside the step: its buffers as handed in."""

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        windows: list[int | None],
        ring_positions: torch.Tensor,
    ) -> None:
        self.keys, self.values, self.windows, self.ring_positions = keys, values, windows, ring_positions

    def buffers(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]


class _RowWrites(SlotsForward):
    """`SlotsForward` inside the step: what its host work computed comes in as tensors (no `__init__` of its own
    runs); writing, taking each row's keys and the masks are its own methods."""

    def __init__(
        self,
        cache: _Buffers,
        positions: torch.Tensor,
        token_slots: torch.Tensor,
        starts: torch.Tensor,
        limits: torch.Tensor,
        rows: torch.Tensor,
        width: Any,
        end: Any,
        ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        self.cache, self.width, self.end = cache, width, end
        self.positions, self.token_slots, self.limits, self.rows = positions, token_slots, limits, rows
        self.query_positions = starts[:, None] + torch.arange(width, device=starts.device)
        self.ring_tokens, self.ring_slots, self.ring_at = ring
        self.masks = {}


class RowsDraftStep(_StepModule):
    """`(features [1, C, F], block_ids [n, w], context_positions [C], context_slots [C], starts [n], limits [n],
    rows [n], span [end], ring_tokens, ring_slots, ring_at [Tr], ring_positions [slots, ring], keys, values) ->
    hidden [n, w, H]`: `DFlashDrafter.run_rows` over several slots of a `DraftCache` (`keys[l]` / `values[l]`
    [slots, kv heads, capacity or ring, head dim]): row i (slot rows[i]) has its block at starts[i] .. + w - 1, of
    which its queries see the keys before limits[i]; the packed context rows sit at `context_positions` of slots
    `context_slots`; a ring's writes (`ring_*`, unused without sliding layers) as `SlotsForward` computed them."""

    def __init__(self, drafter: Drafter) -> None:
        super().__init__(drafter)
        self.windows = [drafter.config.layer_window(i) for i in range(drafter.config.num_hidden_layers)]

    def forward(
        self,
        features: torch.Tensor,
        block_ids: torch.Tensor,
        context_positions: torch.Tensor,
        context_slots: torch.Tensor,
        starts: torch.Tensor,
        limits: torch.Tensor,
        rows: torch.Tensor,
        span: torch.Tensor,
        ring_tokens: torch.Tensor,
        ring_slots: torch.Tensor,
        ring_at: torch.Tensor,
        ring_positions: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        drafter, width = self.drafter, block_ids.shape[1]
        block_positions = (starts[:, None] + torch.arange(width, device=starts.device)).reshape(-1)
        positions = torch.cat([context_positions, block_positions])
        token_slots = torch.cat([context_slots, rows[:, None].expand(-1, width).reshape(-1)])
        writes = _RowWrites(
            _Buffers(keys, values, self.windows, ring_positions),
            positions,
            token_slots,
            starts,
            limits,
            rows,
            width,
            span.shape[0],
            (ring_tokens, ring_slots, ring_at),
        )
        return drafter.run_rows(self.fused(features), block_ids, writes, self.rotated(positions[None]))


class ExportedDraftStep:
    """The drafter's loaded packages, bound to its tensors (and its target's embedding): `one` (None for a drafter
    with sliding layers) and `rows`. `one_sequence` runs a one-slot `DraftCache`, which it grows and moves as the
    eager forward does; `several` the slots of a `SlotsForward` (and one sequence of a drafter with sliding layers)."""

    def __init__(self, one: Package | None, rows: Package, drafter: Drafter) -> None:
        self.one, self.rows = one, rows
        self.paths = [package.path for package in (one, rows) if package is not None]
        config = drafter.config
        # the buffers the layers write (allocated on a cache's first write, as the eager forward would)
        self._like = torch.empty(1, config.num_key_value_heads, 0, config.head_dim, dtype=drafter.fc.weight.dtype)

    def one_sequence(
        self, features: torch.Tensor, block_ids: torch.Tensor, start: int, cache: DraftCache
    ) -> torch.Tensor:
        """Hidden of every block slot [1, q, H] for the new context `features` [1, c, F] ending at `start` and the
        block `block_ids` [1, q] from there; the cache then holds the context (its length moves to `start`)."""
        end = start + block_ids.shape[1]
        if self.one is None:  # sliding layers: the rows' step over the cache's one slot
            forward = SlotsForward(
                cache, [features.shape[1]], [start], [block_ids.shape[1]], [0], end - start, block_ids.device
            )
            hidden = self.several(forward, features, block_ids)
        else:
            cache.make_room(end)
            buffers = [cache.buffers(i, self._like) for i in range(len(cache.keys))]
            # (AOTInductor reads inputs at the strides of its sample: contiguous ones; a view of a wider block is not)
            hidden = self.one(
                features.contiguous(),
                block_ids.contiguous(),
                torch.tensor([start - features.shape[1]]),
                torch.empty(end, dtype=torch.uint8),  # only its length is read
                [keys for keys, _ in buffers],
                [values for _, values in buffers],
            )
        cache.length = start
        return hidden

    def several(self, forward: SlotsForward, features: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Hidden of every block slot [n, w, H] for `forward`'s rows (its host work done: room made, ring rows
        placed) with their new context rows packed in `features` [1, C, F]."""
        return self.rows(*_rows_inputs(forward, features, block_ids, self._like))


def _rows_inputs(
    forward: SlotsForward, features: torch.Tensor, block_ids: torch.Tensor, like: torch.Tensor
) -> tuple[Any, ...]:
    """`RowsDraftStep`'s inputs for `forward` (its cache's buffers allocated from `like` where they are not yet)."""
    cache, context, device = forward.cache, features.shape[1], block_ids.device
    buffers = [cache.buffers(i, like) for i in range(len(cache.keys))]
    rows = forward.rows
    if isinstance(rows, slice):
        rows = torch.arange(rows.start, rows.stop, device=device)
    if cache.ring is not None:
        ring = (forward.ring_tokens, forward.ring_slots, forward.ring_at, cache.ring_positions)
    else:  # (unused inputs)
        unused = torch.zeros(1, dtype=torch.long, device=device)
        ring = (unused, unused, unused, unused[None])
    # (AOTInductor reads inputs at the strides of its sample: contiguous ones; a view of a wider block is not)
    return (
        features.contiguous(),
        block_ids.contiguous(),
        forward.positions[:context],
        forward.token_slots[:context],
        forward.query_positions[:, 0].contiguous(),
        forward.limits,
        rows,
        torch.empty(forward.end, dtype=torch.uint8),  # only its length is read
        *ring,
        [keys for keys, _ in buffers],
        [values for _, values in buffers],
    )


KINDS = ("drafter", "draftrows")  # the packages' kinds (their names' prefix): one sequence, several rows


def _steps(drafter: Drafter) -> dict[str, _StepModule]:
    """The drafter's step modules by kind (`KINDS`): no one-sequence step for a drafter with sliding layers."""
    steps: dict[str, _StepModule] = {"draftrows": RowsDraftStep(drafter)}
    if not _rings(drafter):
        steps["drafter"] = DraftStep(drafter)
    return dict(sorted(steps.items()))


def _package_path(kind: str, step: _StepModule) -> Path:
    """Where the drafter's package of `kind` is, or goes (engine.compiled.stored.package_path)."""
    drafter = step.drafter
    code = (sys.modules[__name__], layers, cache_module, sys.modules[type(drafter).__module__])
    return stored.package_path(kind, step, drafter.config.to_dict(), code)


def _sample_sizes(drafter: Drafter) -> tuple[int, int]:
    """A sample cache's capacity and its verify block: sizes that keep every symbolic size of a sample apart (equal
    sizes at export would be taken for one), a ring (`window - 1 + 2 * block` rows) longer than all the others."""
    windows = [w for i in range(drafter.config.num_hidden_layers) if (w := drafter.config.layer_window(i))]
    block = max(3, (25 - (max(windows) - 1)) // 2 + 1) if windows else 3
    return 16, block


def _build_one(step: DraftStep, path: Path) -> None:
    """Export the one-sequence step and compile it into a package at `path`, tried before it is stored on a later
    step (3 context rows, a block of 2 at position 4) and on one context row with a block of 3."""
    from torch.export import Dim

    drafter = step.drafter
    config, dtype = drafter.config, drafter.fc.weight.dtype
    width = len(config.target_layer_ids) * config.hidden_size
    capacity = _sample_sizes(drafter)[0]
    buffers = [
        torch.zeros(1, config.num_key_value_heads, capacity, config.head_dim, dtype=dtype) for _ in step.drafter.layers
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
    keys = [{2: Dim.DYNAMIC}] * len(buffers)
    shapes = (dynamic, dynamic, None, {0: Dim.DYNAMIC}, keys, keys)

    def trial(package: Package) -> None:
        package(*sample)
        block = torch.tensor([[1, config.mask_token_id, config.mask_token_id]])
        package(sample[0][:, :1], block, torch.tensor([7]), torch.empty(11, dtype=torch.uint8), sample[4], sample[5])

    stored.build(step, sample, shapes, path, trial)


def _build_rows(step: RowsDraftStep, path: Path) -> None:
    """Export the rows' step and compile it into a package at `path`, tried before it is stored on the sample (two
    rows of three slots, blocks of 4, 5 context rows) and on one row with a block of 2 after one context row."""
    from torch.export import Dim

    drafter = step.drafter
    config, dtype = drafter.config, drafter.fc.weight.dtype
    cache = cache_module.DraftCache(config, 3, *_sample_sizes(drafter))
    width = len(config.target_layer_ids) * config.hidden_size
    like = torch.empty(1, config.num_key_value_heads, 0, config.head_dim, dtype=dtype)
    features = torch.randn(1, 5, width).to(dtype)
    block = torch.tensor([[1] + [config.mask_token_id] * 3, [2] + [config.mask_token_id] * 3])
    forward = SlotsForward(cache, [3, 2], [6, 4], [4, 3], [2, 0], 4, block.device)
    sample = _rows_inputs(forward, features, block, like)
    rings = cache.ring is not None
    rows = {0: Dim.DYNAMIC}
    tokens = {0: Dim.DYNAMIC}
    buffers = [{0: Dim.DYNAMIC, 2: Dim.DYNAMIC}] * len(cache.keys)
    shapes = (
        {1: Dim.DYNAMIC},
        {0: Dim.DYNAMIC, 1: Dim.DYNAMIC},
        tokens,
        tokens,
        rows,
        rows,
        rows,
        {0: Dim.DYNAMIC},
        *((tokens, tokens, tokens, {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}) if rings else (None, None, None, None)),
        buffers,
        buffers,
    )

    def trial(package: Package) -> None:
        package(*sample)
        one = SlotsForward(cache, [1], [9], [2], [1], 2, block.device)
        package(*_rows_inputs(one, features[:, :1], block[:1, :2], like))

    stored.build(step, sample, shapes, path, trial)


def build(kind: str, step: _StepModule, path: Path) -> None:
    """Export the drafter's step of `kind` (`KINDS`) and compile it into a package at `path`."""
    if isinstance(step, DraftStep):
        _build_one(step, path)
    else:
        assert isinstance(step, RowsDraftStep), kind
        _build_rows(step, path)


def exported_draft_step(
    drafter: Drafter, *, build_missing: bool, notify: Notify | None = None
) -> ExportedDraftStep | None:
    """`drafter`'s exported steps, loaded from the cache, each built first when missing and `build_missing` (a
    stored package that no longer loads is then built again); None where it has none (`unsupported`) or one is
    missing. Raises what building or loading raised, naming the package."""
    if drafter in _LOADED:
        return _LOADED[drafter]
    if unsupported(drafter) is not None:
        return None
    found = {}
    for kind, step in _steps(drafter).items():
        path = _package_path(kind, step)
        what = "one sequence's" if kind == "drafter" else "rows'"
        package = stored.stored_or_built(
            path,
            lambda at, step=step: stored.load(step, at),
            lambda at, kind=kind, step=step: build(kind, step, at),
            build_missing=build_missing,
            notify=notify,
            message=f"compiling the drafter's {what} step once for this machine (about 10 s; stored in {path.parent})",
        )
        if package is None:
            return None
        found[kind] = package
    _LOADED[drafter] = loaded = ExportedDraftStep(found.get("drafter"), found["draftrows"], drafter)
    return loaded


def loaded_draft_step(drafter: nn.Module) -> ExportedDraftStep | None:
    """The exported step `exported_draft_step` loaded for `drafter` in this process, if any."""
    return _LOADED.get(drafter)


def unload(drafter: nn.Module) -> None:
    """Run `drafter` eagerly from now on (a step that failed)."""
    _LOADED.pop(drafter, None)
