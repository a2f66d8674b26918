"""The one decode loop, as a generator of steps, for every frontend.

Each step drafts a block [last committed token, MASK x (B-1)] with the drafter, verifies the whole block
in one target forward, and commits the longest prefix the target agrees with plus one token of the
target's own (`sampling.accepted_drafts`). With `drafter=None` the same loop runs with a block of 1:
plain autoregressive decoding, so baseline and speculative numbers are like for like.

The loop holds no per-request state of its own: limits, stop conditions, text, stats and RNG are the
`Request`'s; K/V, positions and captured features are the `TargetState`'s. One host sync per step: the
accepted count and the target's tokens, in one transfer.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

import torch
from transformers import PreTrainedModel

from dflash_cli.engine.compiled import Notify, compiled_draft_step
from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.engine.policy import BlockPolicy, FixedBlock
from dflash_cli.engine.request import GenerationResult, Request, Step
from dflash_cli.engine.sampling import SamplingParams, accepted_drafts, sample_tokens
from dflash_cli.engine.stats import PhaseClock
from dflash_cli.engine.target import TargetState, acquire_state, context_window, release_state
from dflash_cli.errors import DflashError


@torch.inference_mode()
def generate(
    target: PreTrainedModel,
    drafter: DFlashDrafter | None,
    prompt_ids: Sequence[int],
    params: SamplingParams = SamplingParams(),
    *,
    block_size: int | None = None,
    tokenizer: Any = None,
    compile: bool = False,
    notify: Notify | None = None,
    policy: BlockPolicy | None = None,
) -> Iterator[Step]:
    """Decode from `prompt_ids`; yield a `Step` per committed chunk. The last step has a finish_reason.

    `compile`: run the target's and the drafter's steps compiled (engine.compiled); `notify(message)` is a
    context manager shown while a step compiles for the first time. `policy` (engine.policy) picks each step's
    block size, up to its `max_size`; without one, every step verifies `block_size` (default: the drafter's).
    """
    device = target.get_input_embeddings().weight.device
    if drafter is None:
        policy = FixedBlock(1)
    elif policy is None:
        policy = FixedBlock(block_size or drafter.block_size)
    request = Request(
        prompt_ids, params, block_size=policy.max_size, speculative=drafter is not None,
        context_window=context_window(target), device=device, tokenizer=tokenizer,
        adaptive=not isinstance(policy, FixedBlock),
    )  # fmt: skip
    state = acquire_state(target)
    try:
        layer_ids = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        state.reserve(request.end, policy.max_size, layer_ids, compile=compile, notify=notify)
        yield from _decode(state, drafter, request, device, compile, notify, policy)
    finally:
        policy.finish()
        release_state(state)


def _decode(
    state: TargetState, drafter: DFlashDrafter | None, request: Request, device: torch.device, compile: bool,
    notify: Notify | None, policy: BlockPolicy,
) -> Iterator[Step]:
    params, stats = request.params, request.stats
    prompt = torch.tensor([request.prompt_ids], device=device)
    policy.prepare(state, drafter, prompt)
    started = time.perf_counter()
    # Prefill: the whole prompt once; only the last position's logits are needed.
    logits = state.prefill(prompt)
    token = sample_tokens(logits, params, request.generator)
    first = int(token.item())
    stats.prefill_s = stats.ttft_s = time.perf_counter() - started
    step = request.commit([first], verified=False)
    yield step
    if step.finish_reason:
        return

    draft_cache = None
    if drafter is not None:
        draft_cache = drafter.new_cache(request.end + request.block_size, request.block_size)
        if compile:
            draft_cache.step, draft_cache.notify = compiled_draft_step(device), notify
    # Context features the drafter has not read yet: the committed positions since its last draft (plain steps
    # add theirs, copied out of the block buffer the next verify overwrites).
    pending = [state.features(state.length)] if drafter is not None else []
    decode_started = time.perf_counter()
    clock = PhaseClock(device)
    last = token  # [1] on device: the newest committed token, not yet in the target's state
    while True:
        start = state.length  # the position of `last`
        # Near the end the block shortens (as in the reference); some states verify whole blocks regardless.
        size = policy.choose(request.block_at(start))
        width = policy.padded(size) if state.whole_blocks else size
        block_ids = last.new_full((1, width), drafter.mask_token_id if drafter is not None else 0)
        block_ids[0, 0] = last[0]
        t_draft = clock.mark()
        if drafter is not None and size > 1:
            features = pending[0] if len(pending) == 1 else torch.cat(pending, dim=1)
            pending.clear()
            # (the drafter sees the real block; [None] gives it the strides of a [1, size] tensor of its own)
            block_ids[0, 1:size] = drafter.propose(features, block_ids[0, :size][None], start, draft_cache)[0]
        elif drafter is not None:
            pending[-1] = pending[-1].clone()
        t_verify = clock.mark()
        posterior = sample_tokens(state.verify(block_ids)[:size], params, request.generator)
        # Draft j+1 stands while it equals the target's choice after position j.
        run = accepted_drafts(block_ids[0, 1:size], posterior[:-1]).view(1)
        t_end = clock.mark()
        host = torch.cat([run, posterior]).tolist()  # the step's one host sync
        accepted = host[0]
        committed = host[1 : accepted + 2]  # accepted drafts equal the target's own tokens, then the bonus
        draft_s, verify_s = clock.seconds(t_draft, t_verify), clock.seconds(t_verify, t_end)
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        policy.observe(size, accepted, draft_s, verify_s)
        state.commit(accepted + 1)
        if drafter is not None:
            # Features of the committed block positions; the bonus token's arrive with the next verify.
            pending.append(state.features(accepted + 1))
        last = posterior[accepted : accepted + 1]
        step = request.commit(committed, verified=True, block_size=size)
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
