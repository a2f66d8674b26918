"""The one decode loop, for a batch of rows, and the single-generation generator of steps every frontend uses.

Each step drafts a block [last committed token, MASK x (B-1)] per row with the drafter, verifies every row's
block in one target forward, and commits, per row, the longest prefix the target agrees with plus one token of
the target's own (`sampling.accepted_drafts`). With `drafter=None` the same loop runs with a block of 1: plain
autoregressive decoding, so baseline and speculative numbers are like for like.

`Batch` runs the steps of its rows: each row (engine.row) is a `Generation` (limits, stop conditions, text stream,
stats, RNG, sampling params) in a slot of the `TargetState` (its K/V, length and captured features) and of the
drafter's cache; engine.scheduler decides which row decodes where. Rows join (prefilled into a free slot, alone)
and leave (a finished or cancelled row frees its slot at once) between steps: continuous batching. `generate` is
that loop with one row. One host sync per step: every row's accepted count and target tokens, in one transfer.

The drafter runs once per step for all drafting rows (`propose` over one `DraftCache` with a slot per row: one
forward over every row's new context rows and block); a batch of one row keeps a one-slot cache of its generation's
own (and the compiled draft step). The target's verify, the dominant cost, runs once per
step for all rows. A block policy (engine.policy) picks one block size
per step for all rows (1: a plain step, no drafting) and learns from the rows' pooled acceptance.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from dflash_cli.engine.compiled.jit import Notify, compiling_seconds
from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.engine.grammar import grammar_state
from dflash_cli.engine.kernels.layers import use_cpu_products
from dflash_cli.engine.policy import BlockPolicy, FixedBlock
from dflash_cli.engine.prefix import PrefixStore
from dflash_cli.engine.row import Generation, GenerationResult, Row, Step
from dflash_cli.engine.sampling import SamplingParams, accepted_drafts, sample_tokens
from dflash_cli.engine.scheduler import Scheduler
from dflash_cli.engine.stats import PhaseClock
from dflash_cli.engine.target import acquire_state, release_state
from dflash_cli.engine.target.attention import AttentionState
from dflash_cli.engine.target.base import batch_limit, context_window
from dflash_cli.errors import DflashError


class Batch:
    """Rows decoded together (see the module docstring). `rows`: the most that decode at once (1 for targets that
    cannot batch, `target.batch_limit`). `policy` picks each step's block size (engine.policy); without one, every
    step verifies `block_size` (default: the drafter's). Add generations with `add`, call `step` until `idle`, then
    `close`."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DFlashDrafter | None,
        *,
        rows: int = 1,
        block_size: int | None = None,
        tokenizer: Any = None,
        compile: bool = False,
        notify: Notify | None = None,
        policy: BlockPolicy | None = None,
        prefix_cache: bool = True,
        prefix_store: PrefixStore | None = None,
        decode_threads: int | None = None,
    ) -> None:
        self.target, self.drafter, self.tokenizer, self.notify = target, drafter, tokenizer, notify
        # CPU threads: prompts at torch's count now, decode steps at `decode_threads` (engine.decode_threads)
        self.prompt_threads = torch.get_num_threads()
        self.decode_threads = decode_threads or self.prompt_threads
        self.device = target.get_input_embeddings().weight.device
        self.vocab_size = target.config.get_text_config().vocab_size  # the logits' width (grammar bitmasks)
        for model in (target, drafter):  # the few-row products of decoding on a CPU (engine.kernels.layers)
            if model is not None:
                use_cpu_products(model)
        if drafter is None:
            policy = FixedBlock(1)
        elif policy is None:
            policy = FixedBlock(block_size or drafter.block_size)
        self.policy = policy  # one block size per step for every row, up to policy.max_size
        self.block = policy.max_size
        self.rows = 1 if batch_limit(target) is not None else max(1, rows)
        self.compile = compile and self.rows == 1  # compiled steps run one row
        # Several rows: one context cache for all, a slot per row (the drafter's layers run once per step); one row:
        # a one-slot cache of its generation's own, sized for it (and the compiled draft step).
        self.draft_slots = (
            drafter.new_cache(block_size=self.block, slots=self.rows) if drafter is not None and self.rows > 1 else None
        )
        self.state: AttentionState | None = None  # taken when the first row joins
        self.scheduler = Scheduler(
            self.rows,
            drafter,
            self.draft_slots,
            self.block,
            self.device,
            compile=self.compile,
            notify=notify,
            prefix_cache=prefix_cache,
            prefix_store=prefix_store,
        )
        self.clock = PhaseClock(self.device)

    @property
    def active(self) -> list[Row]:
        return self.scheduler.active

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    @property
    def room(self) -> int:
        """How many more rows can join now without waiting."""
        return self.scheduler.room

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, key: Any = None) -> Row:
        """Queue a generation; it joins at the next step with a free slot. Raises DflashError for a generation that
        cannot run (an empty prompt, one that fills the context window)."""
        generation = Generation(
            prompt_ids,
            params,
            block_size=self.block,
            speculative=self.drafter is not None,
            context_window=context_window(self.target),
            device=self.device,
            tokenizer=self.tokenizer,
            adaptive=not isinstance(self.policy, FixedBlock),
            grammar=grammar_state(params, self.tokenizer, block_size=self.block, vocab_size=self.vocab_size),
        )
        row = Row(generation, key)
        self.scheduler.queue(row)
        return row

    def cancel(self, row: Row) -> None:
        """Drop `row`: a waiting one leaves the queue, a decoding one frees its slot now (what it committed stays
        there for a later request with the same prefix)."""
        self.scheduler.cancel(row, self.state)

    def close(self) -> None:
        """Give the target state back (its buffers, and what its rows hold, stay for the next batch on this
        target)."""
        self.policy.finish()
        self._use_threads(self.prompt_threads)
        for row in self.active:  # between steps: each row's state is whole
            self.scheduler.free(row, self.state, keep=True)
        if self.state is not None:
            release_state(self.state)
            self.state = None

    @torch.inference_mode()
    def step(self) -> list[tuple[Row, Step | BaseException]]:
        """One step: admit the waiting rows that have a free slot (each prefilled alone: its first token, delivered
        before anything else runs), or else one draft + verify for every decoding row. Returns each row's step (or
        the exception that failed it), in order; a row whose step has a finish_reason, or that failed, has left."""
        prefilling = self.scheduler.joining
        self._use_threads(self.prompt_threads if prefilling else self.decode_threads)
        if prefilling:
            events: list[tuple[Row, Step | BaseException]] = []
            while self.scheduler.joining:
                events += self._leave([self.scheduler.join()], self._prefill)
            return events
        return self._leave(self.active, self._decode) if self.active else []

    def _leave(self, rows: list[Row], run: Any) -> list[tuple[Row, Step | BaseException]]:
        """`run(rows)` -> each row's step, or the exception that stopped it (a failing step fails its own rows, the
        batch goes on); the rows that finished or failed leave the batch."""
        try:
            outcome = run(rows)
        except Exception as error:
            if isinstance(error, torch.OutOfMemoryError) and self.device.type == "cuda":
                torch.cuda.empty_cache()  # the next step (or these rows retried alone) gets what this one held
            outcome = [error] * len(rows)
        for row, event in zip(rows, outcome):
            if isinstance(event, BaseException):  # its state may be half-written: nothing stays
                self.scheduler.free(row, self.state, keep=False)
            elif event.finish_reason is not None:
                self.scheduler.free(row, self.state, keep=True)
        return list(zip(rows, outcome))

    def _use_threads(self, count: int) -> None:
        """torch's CPU thread count for what runs next (a GPU batch leaves it alone)."""
        if self.device.type == "cpu" and torch.get_num_threads() != count:
            torch.set_num_threads(count)

    @contextlib.contextmanager
    def _decoding_threads(self) -> Iterator[None]:
        """The block runs at the decode thread count, then at the count before."""
        before = torch.get_num_threads()
        self._use_threads(self.decode_threads)
        try:
            yield
        finally:
            self._use_threads(before)

    def _reserve(self, generation: Generation, prompt: torch.Tensor) -> AttentionState:
        if self.state is None:
            state = acquire_state(self.target)
            layer_ids = tuple(self.drafter.config.target_layer_ids) if self.drafter is not None else ()
            try:
                state.reserve(
                    generation.end, self.block, layer_ids, rows=self.rows, compile=self.compile, notify=self.notify
                )
                with self._decoding_threads():  # (it times decode steps)
                    self.policy.prepare(state, self.drafter, prompt)  # before any row is in the state (may use row 0)
            except BaseException:  # this row fails; the next one reserves and prepares again
                release_state(state)
                raise
            self.state = state
        else:
            self.state.make_room(generation.end, self.block)
        return self.state

    def _prefill(self, rows: list[Row]) -> list[Step]:
        (row,) = rows
        generation, stats = row.generation, row.generation.stats
        prompt = torch.tensor([generation.prompt_ids], device=self.device)
        state = self._reserve(generation, prompt)
        started = time.perf_counter()
        self.scheduler.place(row, state)
        kept, unread = self.scheduler.resume(row, state)
        # Prefill: the prompt after the positions the slot kept; only the last position's logits are needed.
        logits = state.prefill(prompt[:, kept:], row.slot, kept)
        if generation.grammar is not None:
            generation.grammar.mask(logits)
        row.last = sample_tokens(
            logits, generation.params, generation.generator, generation.uniforms_at(len(generation.prompt_ids), 1)
        )
        row.last_id = int(row.last.item())
        stats.prefill_s = stats.ttft_s = time.perf_counter() - started
        row.ids = list(generation.prompt_ids)
        if self.drafter is not None:
            prefilled = state.features(len(row.ids) - kept, row.slot)
            row.pending = [prefilled] if unread is None else [unread, prefilled]
        row.decode_started = time.perf_counter()
        return [generation.commit([row.last_id], verified=False)]

    def _decode(self, rows: list[Row]) -> list[Step | BaseException]:
        state, drafter, clock = self.state, self.drafter, self.clock
        starts = [state.lengths[row.slot] for row in rows]  # the position of each row's `last`
        limits = [row.generation.block_at(start) for row, start in zip(rows, starts)]
        # One size for the step (the policy's); near its end a row's block shortens (as in the reference).
        chosen = self.policy.choose(max(limits), len(rows))
        sizes = [min(chosen, limit) for limit in limits]
        # Several rows share one width, and some states verify whole blocks regardless: the target is causal, so
        # slots after a row's real block change nothing before them.
        width = sizes[0] if len(rows) == 1 and not state.whole_blocks else self.policy.padded(chosen)
        block_ids = torch.full(
            (len(rows), width), drafter.mask_token_id if drafter is not None else 0, device=self.device
        )
        block_ids[:, 0] = torch.cat([row.last for row in rows])
        t_draft, compiled_before = clock.mark(), compiling_seconds()
        drafting, features = [], []  # the drafting rows' indices and new context features
        for i, (row, size) in enumerate(zip(rows, sizes)):
            if drafter is not None and size > 1:
                drafting.append(i)
                row.drafted = starts[i]
                features.append(row.pending[0] if len(row.pending) == 1 else torch.cat(row.pending, dim=1))
                row.pending.clear()
            elif drafter is not None:
                row.pending[-1] = row.pending[-1].clone()
        if drafting and self.draft_slots is None:  # one row: its own cache (and compiled step)
            (i,) = drafting
            # (the drafter sees the real block; [None] gives it the strides of a [1, size] tensor of its own)
            grammar = rows[i].generation.grammar  # (drafts chosen under the row's grammar: more of them stand)
            block_ids[i, 1 : sizes[i]] = drafter.propose(
                features,
                block_ids[i, : sizes[i]][None],
                [starts[i]],
                rows[i].draft_cache,
                **({"constraints": [grammar]} if grammar is not None else {}),
            )[0]
        elif drafting:  # one forward for every drafting row, blocks padded to the widest
            wide = max(sizes[i] for i in drafting)
            grammars = [rows[i].generation.grammar for i in drafting]
            blocks = block_ids[:, :wide] if len(drafting) == len(rows) else block_ids[drafting, :wide]
            proposals = drafter.propose(
                features,
                blocks,
                [starts[i] for i in drafting],
                self.draft_slots,
                sizes=[sizes[i] for i in drafting],
                slots=[rows[i].slot for i in drafting],
                **({"constraints": grammars} if any(grammars) else {}),
            )
            for proposal, i in zip(proposals, drafting):
                block_ids[i, 1 : sizes[i]] = proposal[: sizes[i] - 1]
        t_verify, compiled_drafting = clock.mark(), compiling_seconds()
        logits = state.verify(block_ids, [row.slot for row in rows])
        host_parts, posteriors = [], []
        failed: dict[int, Exception] = {}  # rows whose own part of the step failed: they leave, the others commit
        for i, (row, start, size) in enumerate(zip(rows, starts, sizes)):
            try:
                if row.generation.grammar is not None:  # each position under the grammar's state after the drafts
                    row.generation.grammar.mask(logits[i, :size], block_ids[i, 1:size].tolist())
                # (block slot j chooses the token at position start + 1 + j: that position's own uniform)
                uniforms = row.generation.uniforms_at(start + 1, size)
                posterior = sample_tokens(logits[i, :size], row.generation.params, row.generation.generator, uniforms)
                # Draft j+1 stands while it equals the target's choice after position j.
                accepted = accepted_drafts(block_ids[i, 1:size], posterior[:-1])
            except Exception as error:  # its sampling or grammar: its own failure (the step's layout stays)
                failed[i] = error
                posterior, accepted = block_ids[i, :size], block_ids.new_zeros(())
            host_parts += [accepted.view(1), posterior]
            posteriors.append(posterior)
        t_end = clock.mark()
        host = torch.cat(host_parts).tolist()  # the step's one host sync
        # A step that compiled a graph: the compiling is not drafting or verifying.
        compiled_after = compiling_seconds()
        draft_s = max(0.0, clock.seconds(t_draft, t_verify) - (compiled_drafting - compiled_before))
        verify_s = max(0.0, clock.seconds(t_verify, t_end) - (compiled_after - compiled_drafting))
        compiling = compiled_after - compiled_before
        # The rows' acceptance, pooled; a row cut short by its own end says nothing about the later positions.
        offsets = list(itertools.accumulate((size + 1 for size in sizes[:-1]), initial=0))  # (O(rows), not rows^2)
        full = [host[at] for i, (at, size) in enumerate(zip(offsets, sizes)) if size == chosen and i not in failed]
        if full:
            self.policy.observe(chosen, full[0] if len(full) == 1 else full, draft_s, verify_s, rows=len(sizes))
        steps: list[Step | BaseException] = []
        for i, (row, size, posterior, at) in enumerate(zip(rows, sizes, posteriors, offsets)):
            if i in failed:
                self.state.commit(1, row.slot)  # (a state that commits every row of a verify at once waits for it)
                steps.append(failed[i])
                continue
            try:
                steps.append(self._commit(row, host, at, size, posterior, (draft_s, verify_s, compiling)))
            except Exception as error:  # its stop conditions or grammar: its own failure, the others' steps stand
                steps.append(error)
        return steps

    def _commit(
        self, row: Row, host: list[int], at: int, size: int, posterior: torch.Tensor, times: tuple[float, ...]
    ) -> Step:
        """Commit `row`'s part of a verify step: its accepted count at host[at], then the target's tokens."""
        state, (draft_s, verify_s, compiling) = self.state, times
        accepted = host[at]
        committed = host[at + 1 : at + accepted + 2]  # accepted drafts equal the target's own tokens, then the bonus
        stats = row.generation.stats  # (each row waited for the whole step: its draft and verify times are the step's)
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.compile_s += compiling
        row.decode_started += compiling
        state.commit(accepted + 1, row.slot)
        row.ids += [row.last_id, *committed[:accepted]]  # the block's kept tokens, now in the state
        row.last_id = committed[accepted]
        if self.drafter is not None:
            # Features of the committed block positions; the bonus token's arrive with the next verify.
            row.pending.append(state.features(accepted + 1, row.slot))
        row.last = posterior[accepted : accepted + 1]
        step = row.generation.commit(committed, verified=True, block_size=size)
        stats.decode_s = time.perf_counter() - row.decode_started
        return step


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
    prefix_cache: bool = True,
    prefix_store: PrefixStore | None = None,
    decode_threads: int | None = None,
) -> Iterator[Step]:
    """Decode from `prompt_ids`; yield a `Step` per committed chunk. The last step has a finish_reason.

    The batch loop with one row. `compile`: run the target's and the drafter's steps compiled
    (engine.compiled.jit); `notify(message)` is a context manager shown while a step compiles for the first time.
    `policy` (engine.policy) picks each step's block size, up to its `max_size`; without one, every step verifies
    `block_size` (default: the drafter's). `prefix_cache`: continue from what the target's state holds of the
    prompt (the last generation's prompt and output: a conversation's earlier turns), see engine.prefix;
    `prefix_store` keeps more prefixes than the state's slot, in host memory. `decode_threads`: the CPU thread
    count of decode steps (engine.decode_threads; prompts run at torch's count).
    """
    batch = Batch(
        target,
        drafter,
        block_size=block_size,
        tokenizer=tokenizer,
        compile=compile,
        notify=notify,
        policy=policy,
        prefix_cache=prefix_cache,
        prefix_store=prefix_store,
        decode_threads=decode_threads,
    )
    batch.add(prompt_ids, params)
    try:
        while True:
            for _, step in batch.step():
                if isinstance(step, BaseException):
                    raise step
                yield step
                if step.finish_reason:
                    return
    finally:
        batch.close()


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
    # Each call prefills its whole prompt: the same arguments give the same output whatever ran before, in any
    # dtype (a reused prefix is exact in float32; in bf16 a near-tie may round differently).
    steps = generate(target, drafter, input_ids, params, block_size=block_size, tokenizer=tokenizer, prefix_cache=False)
    return collect(steps)
