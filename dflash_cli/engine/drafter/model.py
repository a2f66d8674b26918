"""The DFlash drafter bound to a target (a stack of Qwen3-style layers with no embedding and no lm_head of its
own: it borrows the target's). Hidden states of a few target layers are concatenated, projected by `fc` and normed
by `hidden_norm` once per call; that fused context is injected into the keys and values of every layer. Queries
come from the block only: one forward pass proposes a whole block. Formats and their semantics: `config`.

Sampling (T > 0) uses the same deterministic proposal (argmax; DFlash2: the selector's greedy chain) and the
engine's one rule: a draft stands only where the target's own sample equals it. That is rejection sampling
with a one-hot proposal, so every committed token is distributed exactly as the target's (the reference
instead samples its drafts and accepts against their distribution; both are lossless).
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash_cli.engine.compiled.jit import run_drafter
from dflash_cli.engine.drafter.cache import DraftCache, SlotsForward
from dflash_cli.engine.drafter.compiled_step import loaded_draft_step, unload
from dflash_cli.engine.drafter.config import DrafterConfig
from dflash_cli.engine.drafter.layers import CandidateSelector, DraftLayer, rotation
from dflash_cli.engine.kernels.quantized import Int8Linear
from dflash_cli.engine.sampling import greedy_tokens
from dflash_cli.engine.target.base import compute_dtype
from dflash_cli.errors import DflashError
from dflash_cli.protocol.drafters import DRAFT_VOCAB_FILE


class DFlashDrafter(nn.Module):
    """Drafter bound to a target: uses the target's input embeddings and lm_head (not saved with it)."""

    def __init__(self, config: DrafterConfig, target: PreTrainedModel | None = None) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.draft_vocab_size is not None:
            # The target ids it may propose, ascending: saved beside the weights (DRAFT_VOCAB_FILE), not among them,
            # so that the safetensors stay the published format that vLLM, SGLang and llama.cpp's converter read.
            vocab = torch.zeros(config.draft_vocab_size, dtype=torch.long)
            self.register_buffer("draft_vocab", vocab, persistent=False)
        with torch.device("cpu"):
            rope = Qwen3RotaryEmbedding(config.rope_config())
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self._inv_freq = rope.inv_freq.float()
        self._rope_scale = rope.attention_scaling
        # A tuple keeps the target's modules out of this module's parameters and state dict.
        self._target: tuple[PreTrainedModel, ...] = ()
        # The target head's rows of the draft vocabulary, taken once per head: (head, device, dtype, their product).
        self._vocab_head: tuple[nn.Module, torch.device, torch.dtype, Any] | None = None
        if target is not None:
            self.bind(target)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def bind(self, target: PreTrainedModel) -> None:
        check_compatible(self.config, target)
        if self.config.draft_vocab_size is not None and self.draft_vocab.device.type != "meta":
            scored = getattr(target.get_output_embeddings(), "out_features", self.config.vocab_size)
            if int(self.draft_vocab.max()) >= scored:
                raise DflashError(
                    f"the drafter's draft vocabulary reaches token {int(self.draft_vocab.max())}, but the target's "
                    f"lm_head scores {scored} tokens",
                    fix="pair the drafter with the target it was trained for",
                )
        self._target = (target,)

    def use_vocabulary(self, vocab: torch.Tensor) -> None:
        """Set the draft vocabulary (ascending target ids, config.draft_vocab_size of them): it is not among the
        weights that load_state_dict reads."""
        if tuple(vocab.shape) != (self.config.draft_vocab_size,):
            raise ValueError(
                f"a draft vocabulary of {self.config.draft_vocab_size} ids, got shape {tuple(vocab.shape)}"
            )
        self.draft_vocab = vocab.to(self.fc.weight.device, torch.long)
        self._vocab_head = None

    @property
    def target(self) -> PreTrainedModel:
        if not self._target:
            raise RuntimeError("drafter is not bound to a target; call drafter.bind(target)")
        return self._target[0]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # The embedding table's raw rows, as the reference takes them: a target whose embedding module scales
        # its output (Gemma) is not scaled here; only input_embedding_scale is applied.
        embeds = F.embedding(token_ids, self.target.get_input_embeddings().weight)
        return embeds * self.config.input_embedding_scale if self.config.input_embedding_scale != 1.0 else embeds

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's whole vocabulary; -inf outside a draft vocabulary, so no proposal leaves it."""
        head = self.target.get_output_embeddings()
        # As rows of a 2-D matrix: a 3-D slice such as hidden[:, 1:] keeps its parent's batch stride, and
        # CPU linear sends such inputs down a batched-matmul path about 10x slower than one GEMM.
        # In the target's activation dtype: a quantized head holds no float weight to ask.
        rows = hidden.reshape(-1, hidden.shape[-1]).to(compute_dtype(self.target))
        if self.config.draft_vocab_size is None:
            logits = self._scaled(head(rows))
            return logits.view(*hidden.shape[:-1], logits.shape[-1])  # (no -1: a block of one drafts 0 slots)
        if self._head_rows(head, rows.device, rows.dtype) is None:  # a head whose rows are not taken apart: masked
            logits = self._scaled(head(rows))
            outside = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            logits = logits.masked_fill(outside.index_fill_(0, self.draft_vocab, False), float("-inf"))
            return logits.view(*hidden.shape[:-1], logits.shape[-1])
        # Only the vocabulary's rows (the demo's head for 7 drafted rows: 0.37 against 1.43 ms on 2 cores).
        part = self.vocab_logits(rows)
        logits = part.new_full((rows.shape[0], head.out_features), float("-inf"))
        return logits.index_copy_(1, self.draft_vocab, part).view(*hidden.shape[:-1], head.out_features)

    def _head_rows(self, head: nn.Module, device: torch.device, dtype: torch.dtype) -> Any:
        """The product of the head's draft-vocabulary rows (a dense or int8 head), made once per head, device and
        dtype (a dense head's rows in `dtype`; a frozen head's: gradients reach the hidden states through it, never
        the head); None for other heads (4-bit on a GPU)."""
        if self._vocab_head is not None and self._vocab_head[:3] == (head, device, dtype):
            return self._vocab_head[3]
        product = None
        if isinstance(head, nn.Linear):
            weight = head.weight.detach().index_select(0, self.draft_vocab).to(dtype)
            bias = None if head.bias is None else head.bias.detach().index_select(0, self.draft_vocab).to(dtype)
            product = functools.partial(F.linear, weight=weight, bias=bias)
        elif isinstance(head, Int8Linear):
            product = head.rows(self.draft_vocab.to(next(head.buffers()).device))
        self._vocab_head = (head, device, dtype, product)
        return product

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary alone [..., draft_vocab_size] (all of the target's without one): what
        training's loss reads (the products over the whole vocabulary were most of a step) and drafting scores."""
        if self.config.draft_vocab_size is None:
            return self.logits(hidden)
        head = self.target.get_output_embeddings()
        # A dense head's rows in the dtype the product runs in: float32 where a training step runs in it (in bf16
        # they took a fifth of such a step on a CPU without AMX), autocast's under autocast; a quantized head reads
        # the target's activation dtype.
        dtype = compute_dtype(self.target)
        if isinstance(head, nn.Linear):
            kind = hidden.device.type
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype
        rows = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        product = self._head_rows(head, rows.device, rows.dtype)
        if product is None:
            return self.logits(hidden).index_select(-1, self.draft_vocab)
        return self._scaled(product(rows)).view(*hidden.shape[:-1], len(self.draft_vocab))

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap is not None and cap > 0 else logits

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != position_ids.device:  # moved once, not copied every step
            self._inv_freq = self._inv_freq.to(position_ids.device)
        return rotation(position_ids, self._inv_freq, self._rope_scale, dtype)

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target layer outputs [b, c, n*H] -> fused context [b, c, H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def forward(
        self,
        rows: torch.Tensor,
        block_size: int,
        position_ids: torch.Tensor,
        cache: DraftCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sequence (or a training batch of them): `rows` [b, c+q, H] = fused context (`fuse_context`), then
        the last `block_size` rows the block embeddings (`embed`), at `position_ids` [b, c+q] -> hidden [b, q, H].

        With a cache (one slot), the keys and values of the committed context are read from it and the new context
        rows are committed to it. `attention_mask` (bool, True = attend, [b|1, 1, q, keys]) is for training; each
        layer's own rule (causal, sliding window, on `position_ids`) is applied on top of it.
        """
        rotated = self.rope(position_ids, self.fc.weight.dtype)
        return self.run_layers(rows, block_size, position_ids, rotated, cache, attention_mask)

    def run_layers(
        self,
        rows: torch.Tensor,
        block_size: int,
        position_ids: torch.Tensor,
        rotated: tuple[torch.Tensor, torch.Tensor],
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` with the rotation's (cos, sin) at `position_ids` given (`rope`): the exported draft step
        (drafter.step) makes them from frequencies it holds as a buffer."""
        rows = rows.to(self.fc.weight.dtype)
        x = rows[:, -block_size:]
        cos, sin = rotated
        for layer in self.layers:
            x = layer(x, rows, cos, sin, position_ids, cache, attention_mask)
        if cache is not None:
            cache.length += rows.shape[1] - block_size
        return self.norm(x)

    def new_cache(self, capacity: int = 0, block_size: int | None = None, slots: int = 1) -> DraftCache:
        """An empty context cache for `slots` sequences (a single sequence: one), each with room for `capacity`
        positions, verified in blocks of up to `block_size` (default: the config's)."""
        return DraftCache(self.config, slots, capacity, block_size, self.fc.weight.device)

    def draft_hidden(
        self,
        features: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        starts: Sequence[int],
        cache: DraftCache,
        *,
        sizes: Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One drafting pass for n rows -> hidden of block slots 1..width-1 [n, width-1, H].

        Row i: its new context features[i] [1, c_i, F] (positions starts[i] - c_i .. starts[i] - 1), its block
        block_ids[i] = [last token, MASK...] at starts[i], of which the first sizes[i] are real (default: all; the
        rest padding, any id, whose hidden states are the caller's to drop), in slot slots[i] of `cache` (default:
        0 .. n-1). A one-slot cache holds a single sequence whose committed context ends where its new context
        starts (`cache.length`); with `cache.step` set (and no stored step) its calls after the first (which reads
        the whole prompt) run compiled. A cache of several slots drafts all its rows in one forward of the layers
        (`SlotsForward`). On a CPU with the drafter's stored steps loaded (engine.drafter.compiled_step), either runs them.
        """
        if cache.slots == 1:
            (context,), (start,) = features, starts
            exported = loaded_draft_step(self)
            if exported is not None:
                try:
                    return exported.one_sequence(context, block_ids, start, cache)[:, 1:]
                except Exception as error:  # (nothing written that the eager forward does not write again)
                    self._exported_failed(error)
            positions = torch.arange(start - context.shape[1], start + block_ids.shape[1], device=block_ids.device)
            rows = torch.cat([self.fuse_context(context), self.embed(block_ids).to(self.fc.weight.dtype)], dim=1)
            if cache.step is not None and cache.length > 0:
                return cache.step(self, block_ids, rows, positions[None], cache, notify=cache.notify)[:, 1:]
            return run_drafter(self, block_ids, rows, positions[None], cache)[:, 1:]
        sizes = [block_ids.shape[1]] * len(starts) if sizes is None else sizes
        slots = range(len(starts)) if slots is None else slots
        forward = SlotsForward(
            cache, [f.shape[1] for f in features], starts, sizes, slots, block_ids.shape[1], block_ids.device
        )
        packed = features[0] if len(features) == 1 else torch.cat(list(features), dim=1)
        exported = loaded_draft_step(self)
        if exported is not None:
            try:
                return exported.several(forward, packed, block_ids)[:, 1:]
            except Exception as error:  # (nothing written that the eager forward does not write again)
                self._exported_failed(error)
        rotated = self.rope(forward.positions[None], self.fc.weight.dtype)
        return self.run_rows(self.fuse_context(packed), block_ids, forward, rotated)[:, 1:]

    def run_rows(
        self,
        context: torch.Tensor,
        block_ids: torch.Tensor,
        forward: SlotsForward,
        rotated: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The forward over several slots (`draft_hidden`): the rows' new context packed and fused [1, C, H]
        (`fuse_context`), their blocks [n, w], the `forward` that writes and masks them, the rotation's (cos, sin) at
        its positions -> hidden of every block slot [n, w, H]."""
        x = self.embed(block_ids).to(context.dtype)
        cos, sin = rotated
        for layer in self.layers:
            x = layer(x, context, cos, sin, forward.query_positions, forward, None)
        return self.norm(x)

    def _exported_failed(self, error: Exception) -> None:
        """The drafter's stored steps refused a call: eager from now on, with a warning."""
        unload(self)
        warnings.warn(f"the exported draft step failed ({error}); running it eagerly", stacklevel=3)

    @torch.no_grad()
    def draft(
        self,
        features: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        starts: Sequence[int],
        cache: DraftCache,
        *,
        sizes: Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The drafter's logits for block slots 1..width-1 [n, width-1, V] (arguments: `draft_hidden`)."""
        return self.logits(self.draft_hidden(features, block_ids, starts, cache, sizes=sizes, slots=slots))

    @torch.no_grad()
    def propose(
        self,
        features: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        starts: Sequence[int],
        cache: DraftCache,
        *,
        sizes: Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
        constraints: Sequence[Any] | None = None,
    ) -> torch.Tensor:
        """The draft token ids for block slots 1..width-1 [n, width-1] (arguments: `draft_hidden`): what the engine
        verifies, at any temperature, whatever the format. Row i's proposal is its first sizes[i] - 1 (a proposal
        reads only the slots before it, so the padding changes nothing). `constraints[i]` (an engine.grammar
        GrammarState, or None) chooses row i's proposal from its logits under its grammar instead."""
        hidden = self.draft_hidden(features, block_ids, starts, cache, sizes=sizes, slots=slots)
        proposal = self.select(hidden, block_ids[:, 0])
        for i, grammar in enumerate(constraints or ()):
            if grammar is not None:  # (its real slots only: the padding's proposals are dropped)
                real = hidden.shape[1] if sizes is None else sizes[i] - 1
                proposal[i, :real] = grammar.draft(self.logits(hidden[i, :real]))
        return proposal

    def select(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of block slots 1..q-1 [n, q-1, H] and each block's first token [n] -> the proposal [n, q-1]."""
        if self.config.draft_vocab_size is None:
            return greedy_tokens(self.logits(hidden))
        # The argmax of the vocabulary's own logits, as target ids: the proposal `logits` would give (its ids ascend,
        # so the first of equal maxima is the same token) without a vocabulary-wide row to fill, copy into and scan.
        # (in the target's dtype, as `logits` scores: a dense head's rows would follow the drafter's)
        scores = self.vocab_logits(hidden.to(compute_dtype(self.target)))
        return self.draft_vocab[greedy_tokens(scores)].view(hidden.shape[:-1])

    def save_pretrained(self, directory: str | Path) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        config["dtype"] = str(self.fc.weight.dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        if self.config.draft_vocab_size is not None:
            (directory / DRAFT_VOCAB_FILE).write_text(json.dumps(self.draft_vocab.tolist()) + "\n")


class DFlash2Drafter(DFlashDrafter):
    """`DFlash2DraftModel`: convolutions in every layer (see `DraftLayer`) and the candidate selector."""

    def __init__(self, config: DrafterConfig, target: PreTrainedModel | None = None) -> None:
        super().__init__(config, target)
        self.candidate_selector = CandidateSelector(config)

    def select(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        return self.candidate_selector.greedy_chain(hidden, self.logits(hidden), anchor_ids)


def make_drafter(config: DrafterConfig, target: PreTrainedModel | None = None) -> DFlashDrafter:
    """The drafter module for the config's format."""
    return (DFlash2Drafter if config.is_dflash2 else DFlashDrafter)(config, target)


def check_compatible(config: DrafterConfig, target: PreTrainedModel) -> None:
    tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    if tcfg.hidden_size != config.hidden_size:
        raise DflashError(
            f"drafter hidden size {config.hidden_size} does not match the target's {tcfg.hidden_size}",
            fix="pair the drafter with the target it was trained for (see `dflash recipes list`)",
        )
    n_layers = tcfg.num_hidden_layers
    bad = [i for i in config.target_layer_ids if not 0 <= i < n_layers]
    if bad:
        raise DflashError(
            f"drafter reads target layers {bad}, but the target has {n_layers} layers",
            fix="pair the drafter with the target it was trained for",
        )
    vocab = target.get_input_embeddings().num_embeddings
    if not 0 <= config.mask_token_id < vocab:
        raise DflashError(
            f"drafter mask token id {config.mask_token_id} is outside the target's vocabulary ({vocab})",
            fix="pair the drafter with the target (and tokenizer) it was trained for",
        )
    head = target.get_output_embeddings()
    head_vocab = getattr(head, "out_features", vocab)
    if config.is_dflash2 and head_vocab > config.vocab_size:
        raise DflashError(
            f"the DFlash2 drafter's selector codebooks cover {config.vocab_size} tokens, but the target's lm_head "
            f"scores {head_vocab}",
            fix="pair the drafter with the target it was trained for",
        )
