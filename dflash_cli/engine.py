"""One decode loop, as a generator of steps, for every frontend.

Each step drafts a block [last committed token, MASK x (B-1)] with the drafter, verifies the whole block
in one target forward, and commits the longest prefix the target agrees with plus one token of the
target's own. With `drafter=None` the same loop runs with a block of 1: plain autoregressive decoding,
so baseline and speculative numbers are like for like.

Lossless: a draft token is accepted only where the target's own choice (argmax, or its sample at
temperature > 0) equals it. With a one-hot proposal that is exact speculative sampling: the committed
token at each position is distributed exactly as the target's.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from dflash_cli.drafter import DFlashDrafter, DraftCache, capture_layers
from dflash_cli.errors import DflashError
from dflash_cli.params import SamplingParams


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    block_size: int = 1
    speculative: bool = False
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step, bonus included (1.0 for the baseline)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 1.0

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.acceptance_lengths).items()))

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first one, over the time after the first one (TTFT is reported apart)."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(tau=self.tau, histogram=self.histogram, decode_tokens_per_s=self.decode_tokens_per_s)
        return out


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


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `logits` [n, vocab]: argmax at temperature 0, else a draw from the filtered distribution."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p:
        probs = probs.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p * sorted_probs.sum(-1, keepdim=True)
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class TextStream:
    """Incremental detokenization with stop strings.

    Each push decodes only a short window of recent ids (the text of ids[prefix:] minus that of
    ids[prefix:read], as vLLM does), so a long reply costs linear time, and a character still missing
    bytes waits for its next token. Text that may yet turn out to start a stop string is held back.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[:read] are in `text`; ids[prefix:read] give the next decode its context
        self.text = ""
        self.emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _current(self, final: bool = False) -> str:
        """All text so far. Text up to a character still missing bytes is kept; the rest waits."""
        before = self._decode(self.ids[self.prefix : self.read])
        new = self._decode(self.ids[self.prefix :])[len(before) :]
        if final or not new.endswith("\ufffd"):
            self.text += new
            self.prefix, self.read = self.read, len(self.ids)
            return self.text
        return self.text + new.rstrip("\ufffd")

    def _find_stop(self, text: str) -> int | None:
        hits = [text.find(s, max(0, self.emitted - len(s))) for s in self.stop_strings]
        return min((at for at in hits if at != -1), default=None)

    def push(self, ids: list[int]) -> tuple[str, int | None]:
        """Add committed ids. Returns the new text safe to show, and None; or, when a stop string
        is hit, the text up to it and how many of `ids` it took to complete the stop string."""
        if self.tokenizer is None:
            return "", None
        self.ids.extend(ids)
        current = self._current()
        at = self._find_stop(current) if self.stop_strings else None
        if at is not None:
            # A verify step commits several tokens at once: keep only those up to the one that completes
            # the stop string, so token ids and counts are what one-token-at-a-time decoding gives.
            done = len(self.ids) - len(ids)
            # (the text as a one-token step would have seen it: a trailing partial character not yet there)
            used = next(
                k for k in range(1, len(ids) + 1)
                if self._find_stop(self._decode(self.ids[: done + k]).rstrip("\ufffd")) is not None
            )
            del self.ids[done + used :]
            self.text, self.read = current[:at], len(self.ids)
            return self.flush(), used
        safe = len(current) - self.hold
        if safe <= self.emitted:
            return "", None
        delta, self.emitted = current[self.emitted : safe], safe
        return delta, None

    def flush(self) -> str:
        """All text not yet shown (at the end of generation)."""
        if self.tokenizer is not None and self.read < len(self.ids):
            self._current(final=True)
        delta, self.emitted = self.text[self.emitted :], len(self.text)
        return delta


class PhaseClock:
    """Marks points in a step and measures between them without adding host syncs.

    On CUDA the marks are events, read after the step's one sync; elsewhere kernels run synchronously
    and a wall clock is exact.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start


def _crop(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def context_window(target: PreTrainedModel) -> int | None:
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return getattr(config, "max_position_embeddings", None)


@torch.inference_mode()
def generate(
    target: PreTrainedModel,
    drafter: DFlashDrafter | None,
    prompt_ids: Sequence[int],
    params: SamplingParams = SamplingParams(),
    *,
    block_size: int | None = None,
    tokenizer: Any = None,
) -> Iterator[Step]:
    """Decode from `prompt_ids`; yield a `Step` per committed chunk. The last step has a finish_reason."""
    device = target.get_input_embeddings().weight.device
    prompt_len = len(prompt_ids)
    if prompt_len == 0:
        raise DflashError("the prompt is empty: nothing to continue from", fix="give a prompt of at least one token")
    window = context_window(target)
    max_new = params.max_new_tokens
    if window is not None:
        if prompt_len >= window:
            raise DflashError(
                f"the prompt is {prompt_len} tokens, but the model's context window is {window}",
                fix="shorten the prompt (or the conversation: /clear in chat)",
            )
        max_new = min(max_new, window - prompt_len)
    block = 1 if drafter is None else (block_size or drafter.block_size)
    if block < 1:
        raise DflashError(f"block size must be >= 1, got {block}")
    stats = GenerationStats(prompt_tokens=prompt_len, block_size=block, speculative=drafter is not None)
    generator = None
    if params.seed is not None and params.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    stop_ids = set(params.stop_token_ids)
    text = TextStream(tokenizer, params.stop_strings)
    layer_ids = drafter.config.target_layer_ids if drafter is not None else []
    # Full-attention cache layers even for sliding-window targets: their masks still apply the window,
    # and sliding cache layers cannot be cropped back once the window is full.
    cache = DynamicCache()
    draft_cache = DraftCache(len(drafter.layers)) if drafter is not None else None

    def commit(ids: list[int], acceptance: int | None) -> Step:
        """Apply stop conditions to newly committed ids and make the step event."""
        finish = None
        for i, token in enumerate(ids):
            if token in stop_ids:
                ids, finish = ids[: i + 1], "stop"
                break
        if finish is None and stats.generated_tokens + len(ids) >= max_new:
            ids, finish = ids[: max_new - stats.generated_tokens], "length"
        delta, stop_string_at = text.push(ids)
        if stop_string_at is not None:
            ids, finish = ids[:stop_string_at], "stop"
        elif finish is not None:
            delta += text.flush()
        stats.generated_tokens += len(ids)
        if acceptance is not None:
            stats.acceptance_lengths.append(len(ids))
        return Step(ids, delta, None if acceptance is None else len(ids), finish, stats)

    started = time.perf_counter()
    # Prefill: the whole prompt once; only the last position's logits are needed.
    input_ids = torch.tensor([list(prompt_ids)], device=device)
    with capture_layers(target, layer_ids) as captured:
        out = target(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    features = captured[-1] if layer_ids else None
    token = sample_tokens(out.logits[:, -1], params, generator)
    first = int(token.item())
    stats.prefill_s = stats.ttft_s = time.perf_counter() - started
    step = commit([first], None)
    yield step
    if step.finish_reason:
        return

    decode_started = time.perf_counter()
    clock = PhaseClock(device)
    last = token  # [1] on device
    start = prompt_len  # position of `last`, also the number of tokens in the target cache
    while True:
        size = min(block, prompt_len + max_new - start)
        block_ids = last.new_full((1, size), drafter.mask_token_id if drafter is not None else 0)
        block_ids[0, 0] = last[0]
        t_draft = clock.mark()
        if drafter is not None and size > 1:
            block_ids[0, 1:] = drafter.propose(features, block_ids, start, draft_cache)[0]
        t_verify = clock.mark()
        positions = torch.arange(start, start + size, device=device)[None]
        with capture_layers(target, layer_ids) as captured:
            out = target(input_ids=block_ids, position_ids=positions, past_key_values=cache, use_cache=True)
        posterior = sample_tokens(out.logits[0], params, generator)
        # Draft j+1 stands while it equals the target's choice after position j; count the leading run.
        run = (block_ids[0, 1:] == posterior[:-1]).long().cumprod(dim=0).sum().view(1)
        t_end = clock.mark()
        # The step's one host sync: the accepted count and the target's tokens, in one transfer.
        host = torch.cat([run, posterior]).tolist()
        accepted = host[0]
        committed = host[1 : accepted + 2]  # accepted drafts equal the target's own tokens, then the bonus
        stats.draft_s += clock.seconds(t_draft, t_verify)
        stats.verify_s += clock.seconds(t_verify, t_end)
        start += accepted + 1
        _crop(cache, start)
        if layer_ids:
            # Features of the committed block positions; the bonus token's arrive with the next verify.
            features = captured[-1][:, : accepted + 1]
        last = posterior[accepted : accepted + 1]
        step = commit(committed, accepted + 1)
        stats.decode_s = time.perf_counter() - decode_started
        yield step
        if step.finish_reason:
            return


def collect(steps: Iterator[Step]) -> GenerationResult:
    """Drain a step generator into one result."""
    ids: list[int] = []
    text: list[str] = []
    step = None
    for step in steps:
        ids.extend(step.token_ids)
        text.append(step.text)
    assert step is not None and step.finish_reason is not None
    return GenerationResult(ids, "".join(text), step.finish_reason, step.stats)


def speculative_generate(
    target: PreTrainedModel,
    drafter: DFlashDrafter | None,
    input_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    stop_token_ids: Sequence[int] = (),
    seed: int | None = None,
    *,
    min_p: float = 0.0,
    tokenizer: Any = None,
    stop_strings: Sequence[str] = (),
) -> GenerationResult:
    """Generate from a list of prompt token ids; `drafter=None` is the baseline. Stable public API.

    Returns a `GenerationResult`: `.token_ids` (generated ids only), `.acceptance_lengths` (one per verify
    step, bonus token included), `.text` (when a tokenizer is given), `.finish_reason`, `.stats`.
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() > 1 and input_ids.shape[0] != 1:
            raise DflashError(f"speculative_generate decodes one sequence; got a batch of {input_ids.shape[0]}")
        input_ids = input_ids.reshape(-1).tolist()
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        stop_token_ids=tuple(stop_token_ids or ()),
        stop_strings=tuple(stop_strings),
    )
    return collect(generate(target, drafter, input_ids, params, block_size=block_size, tokenizer=tokenizer))
