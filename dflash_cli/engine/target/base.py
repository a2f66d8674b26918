"""What the loop sees of the target (`TargetState`: prefill, verify a block, commit n) and the facts about a
transformers causal LM every kind of state needs: its decoder layers, the layers' outputs the drafter reads, its
dtype, context window, and whether its forwards can take several rows."""

from __future__ import annotations

import contextlib
import math
import mmap
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from dflash_cli.engine.kernels.layers import EAGER
from dflash_cli.errors import DflashError


def cache_zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled cache buffer. On a CPU it is an anonymous memory map: its pages are the kernel's zero page until
    written, so a K/V buffer of 16 rows x 8k positions costs the pages its rows have written, not all of it (a
    `torch.zeros` writes every page at once: 2.9 GB held for 15 idle rows of `dflash serve demo`). (numpy's calloc
    would do too, but asks for huge pages on large arrays: one write then commits a whole row.)"""
    device = torch.device(device)
    count = math.prod(shape)
    if device.type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, count * dtype.itemsize)  # page-aligned; the tensor keeps the map alive
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


class TargetState(ABC):
    """The target's state for a batch of sequences, one per row (slot): `lengths[slot]` tokens committed in each
    (positions 0 .. length-1)."""

    lengths: list[int]
    # Per slot: what the loop keeps of the row that left it, for the next request there (engine.prefix.Held), or
    # None. Dropped with the buffers when they are allocated again.
    held: list[Any]

    @abstractmethod
    def prefill(self, token_ids: torch.Tensor, slot: int = 0, start: int = 0) -> torch.Tensor:
        """Run prompt tokens [1, P] into row `slot` at positions start .. start+P-1 (the row keeps its first `start`
        positions: `resumable`) and commit them; return the last position's logits [1, vocab]."""

    def resumable(self, slot: int, length: int) -> int:
        """How many of row `slot`'s committed positions, at most `length`, a prefill can continue from: all of
        them for K/V, which a length rewinds."""
        return length

    def hold(self, slot: int, held: Any) -> None:
        """Row `slot`'s generation has left it: `held` says what it holds for a later request."""
        self.held[slot] = held

    def forget(self, slot: int) -> None:
        """Row `slot` holds nothing a later request may reuse."""
        self.held[slot] = None

    @abstractmethod
    def verify(self, block_ids: torch.Tensor, slots: Sequence[int] = (0,)) -> torch.Tensor:
        """Run one block per row [n, q], row i of `slots` at positions lengths[slot] .. +q-1, without committing
        them; return their logits [n, q, vocab]."""

    @abstractmethod
    def commit(self, n: int, slot: int = 0) -> None:
        """Keep the first n positions of row `slot`'s last verified block; forget the rest."""

    @abstractmethod
    def features(self, n: int, slot: int = 0) -> torch.Tensor:
        """The drafter's context features of row `slot`'s first n positions in the last forward, [1, n, F]."""

    @property
    def whole_blocks(self) -> bool:
        """Whether verify wants every block at full size, even the shortened last ones (compiled steps keep one
        shape per block size; the target is causal, so padding after the real tokens changes nothing)."""
        return False


def target_decoder_layers(target: PreTrainedModel) -> nn.ModuleList:
    """The decoder layer stack of a transformers causal LM: `get_decoder().layers` (Qwen3, Llama and their kin),
    else the module list holding one module per decoder layer (Llama 4's `get_decoder()` is the model itself)."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    layers = getattr(base, "layers", None)
    if layers is None:
        count = target.config.get_text_config().num_hidden_layers
        layers = next((m for m in target.modules() if isinstance(m, nn.ModuleList) and len(m) == count), None)
    if layers is None:
        raise DflashError(
            f"cannot find the decoder layers of {type(target).__name__}",
            fix="use a transformers causal LM whose decoder keeps its layers in a module list",
        )
    return layers


@contextlib.contextmanager
def capture_layers(target: PreTrainedModel, layer_ids: list[int]) -> Iterator[list[torch.Tensor]]:
    """Record the outputs of the chosen decoder layers (only those) during forwards inside the `with` block.

    For training and distillation (batched, transformers' own `generate`); the decode loop captures through
    `AttentionState`'s hooks, installed once per state."""
    captured: list[torch.Tensor] = []
    layers = target_decoder_layers(target)
    slots: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            slots[index] = output[0] if isinstance(output, tuple) else output
            if len(slots) == len(layer_ids):
                captured.append(torch.cat([slots[i] for i in range(len(layer_ids))], dim=-1))
                slots.clear()

        return record

    handles = [layers[layer_id].register_forward_hook(hook(i)) for i, layer_id in enumerate(layer_ids)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def capture_target_features(
    target: PreTrainedModel, input_ids: torch.Tensor, layer_ids: list[int], **forward_kwargs: Any
) -> tuple[Any, torch.Tensor]:
    """Run the target once; return its outputs and the concatenated features of `layer_ids` [b, s, n*H]."""
    with capture_layers(target, layer_ids) as captured:
        outputs = target(input_ids=input_ids, **forward_kwargs)
    return outputs, captured[-1]


def compute_dtype(target: PreTrainedModel) -> torch.dtype:
    """The dtype activations flow in: the embedding's dtype (NF4 targets keep embeddings unquantized)."""
    return target.get_input_embeddings().weight.dtype


def context_window(target: PreTrainedModel) -> int | None:
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return getattr(config, "max_position_embeddings", None)


def batch_limit(target: PreTrainedModel) -> str | None:
    """Why `target` decodes one row at a time, or None when several rows can share its forwards."""
    attention = target.config._attn_implementation
    if attention not in (*SDPA_IMPLEMENTATIONS, *EAGER):
        return f"{attention} attention takes no per-row mask: one row at a time (sdpa and eager batch)"
    kinds = set(getattr(target.config.get_text_config(), "layer_types", None) or ()) - set(MASK_KINDS) - {LINEAR}
    if kinds:
        return f"layers of kind {', '.join(sorted(kinds))} have no per-row mask or state here: one row at a time"
    return None


# The attention implementation a whole-buffer state gives an SDPA target (attention.whole_buffer_attention): SDPA's
# attention, each K/V head read once and a step's keys in pieces.
WHOLE_BUFFER = "whole_buffer"  # (no "flash" in it: transformers reads any such name as flash attention)
SDPA_IMPLEMENTATIONS = ("sdpa", WHOLE_BUFFER)  # the same attention: SDPA's boolean masks, several rows at once
MASK_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
# Linear-attention layers (hybrid targets: engine/hybrid.py keeps their state per row) take no attention mask from
# a batched verify: a row's block is its real tokens then, at most, padding after them, which only the rows' kept
# counts cut off (transformers' 2-D padding mask for these layers zeroes inputs, and a zeroed input still decays a
# Mamba state: no padding may reach a kept token, and none does).
LINEAR = "linear_attention"
