"""One generation's own state, apart from the models (`Generation`: limits, stop conditions, text stream, stats and RNG),
and the row of a batch that decodes it (`Row`: its slot and where its decoding stands).

Nothing here touches a model, so the loop keeps no per-generation state in locals or closures, and several
generations can later step together (each with its own row of target state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dflash_cli.engine.grammar import GrammarState
from dflash_cli.engine.stats import GenerationStats
from dflash_cli.engine.text import TextStream
from dflash_cli.errors import DflashError
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.protocol.requests import prompt_too_long

if TYPE_CHECKING:
    from dflash_cli.engine.drafter import DraftCache


@dataclass
class Step:
    """What one iteration of the loop committed."""

    token_ids: list[int]
    text: str
    acceptance_length: int | None
    finish_reason: str | None
    stats: GenerationStats


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats

    @property
    def acceptance_lengths(self) -> list[int]:
        return self.stats.acceptance_lengths


class Generation:
    """A prompt and everything that decides when its generation ends and what it reports.

    `max_new` is `params.max_new_tokens` capped by the context window; positions run from 0 (the first prompt
    token) to `end` - 1 (the last token this generation may produce).
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        block_size: int,
        speculative: bool,
        context_window: int | None,
        device: torch.device,
        tokenizer: Any = None,
        adaptive: bool = False,
        grammar: GrammarState | None = None,
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        if not self.prompt_ids:
            raise DflashError(
                "the prompt is empty: nothing to continue from", fix="give a prompt of at least one token"
            )
        if block_size < 1:
            raise DflashError(f"block size must be >= 1, got {block_size}")
        self.max_new = params.max_new_tokens
        if context_window is not None:
            if len(self.prompt_ids) >= context_window:
                raise DflashError(
                    prompt_too_long(len(self.prompt_ids), context_window),
                    fix="shorten the prompt (or the conversation: /clear in chat)",
                )
            self.max_new = min(self.max_new, context_window - len(self.prompt_ids))
        self.params = params
        self.grammar = grammar  # the output constraint's state over the committed tokens (engine.grammar)
        self.block_size = block_size
        self.stop_ids = frozenset(params.stop_token_ids)
        self.text = TextStream(tokenizer, params.stop_strings)
        self.stats = GenerationStats(
            prompt_tokens=len(self.prompt_ids), block_size=block_size, speculative=speculative, adaptive=adaptive
        )
        self.generator: torch.Generator | None = None
        self.uniforms: torch.Tensor | None = None  # one per position from the first new token (sampling.sample_tokens)
        if params.temperature > 0:
            if params.seed is not None:
                self.generator = torch.Generator(device=device).manual_seed(params.seed)
            # up to `end` and a block past it (a compiled step verifies whole blocks at the end)
            count = self.max_new + block_size
            self.uniforms = torch.rand(count, generator=self.generator, dtype=torch.float64, device=device)
        self.finish_reason: str | None = None

    @property
    def end(self) -> int:
        """One past the last position this generation may fill: prompt plus the most new tokens."""
        return len(self.prompt_ids) + self.max_new

    def uniforms_at(self, start: int, n: int) -> torch.Tensor | None:
        """The sampling uniforms of the n positions from `start` (None at temperature 0)."""
        first = start - len(self.prompt_ids)
        return None if self.uniforms is None else self.uniforms[first : first + n]

    def block_at(self, start: int) -> int:
        """The largest block to verify at position `start`: the block size, shortened near the end (as the
        reference does)."""
        return min(self.block_size, self.end - start)

    def commit(self, ids: list[int], *, verified: bool, block_size: int | None = None) -> Step:
        """Apply the stop conditions to newly committed ids and make the step event. `verified`: the ids came
        from a verify step (the prefill's first token has no acceptance length) of `block_size` tokens."""
        finish = None
        # The limit first: a stop token a block commits past it is one plain decoding never makes.
        if self.stats.generated_tokens + len(ids) >= self.max_new:
            ids, finish = ids[: self.max_new - self.stats.generated_tokens], "length"
        for i, token in enumerate(ids):
            if token in self.stop_ids:
                ids, finish = ids[: i + 1], "stop"
                break
        if self.grammar is not None:
            ids = ids[: self.grammar.accept(ids)]
            if self.grammar.terminated:  # the constrained output is complete (its end token included)
                finish = "stop"
        delta, stop_string_at = self.text.push(ids)
        if stop_string_at is not None:
            ids, finish = ids[:stop_string_at], "stop"
        elif finish is not None:
            delta += self.text.flush()
        self.stats.generated_tokens += len(ids)
        if verified:
            self.stats.acceptance_lengths.append(len(ids))
            self.stats.block_sizes.append(block_size or self.block_size)
        self.finish_reason = finish
        return Step(ids, delta, len(ids) if verified else None, finish, self.stats)


@dataclass(eq=False)
class Row:
    """One sequence of a batch: its generation and where its decoding stands. `key` is the caller's handle."""

    generation: Generation
    key: Any = None
    slot: int | None = None  # None: waiting to join
    last: torch.Tensor | None = None  # [1] on device: the newest committed token, not yet in the target's state
    # Context features the drafter has not read yet: the committed positions since its last draft (plain steps add
    # theirs, copied out of the block buffer the next verify overwrites).
    pending: list[torch.Tensor] = field(default_factory=list)
    draft_cache: DraftCache | None = None
    drafted: int = 0  # the drafter's cache holds the context of positions 0 .. drafted-1
    ids: list[int] = field(default_factory=list)  # the token ids at the row's committed positions in the target
    last_id: int = 0  # `last` on the host
    decode_started: float = 0.0
