"""`dflash train`: distil a DFlash drafter for any causal LM target.

1. Self-distillation: the target answers every prompt (greedy, chat template applied); the answers
   are cached in `<output>/distill/responses.jsonl`, so an interrupted run resumes where it stopped.
2. Training with the DFlash objective: per sequence, random anchors inside the response; each block
   is [anchor token, MASK x (B-1)] embedded with the frozen target embedding; a block attends to the
   target features strictly before its anchor and to itself (bidirectionally), never to other blocks;
   block slot k is labelled with the token at anchor+k; cross-entropy weighted by exp(-(k-1)/gamma).
3. Checkpoints (z-lab format + optimizer state, safetensors/JSON) every N steps and `--resume`.
4. tau on held-out prompts with the real decode loop; everything lands in `<output>/metrics.json`.
"""

from __future__ import annotations

import json
import math
import random
import shlex
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dflash_cli.commands.train_prompts import split_prompts
from dflash_cli.engine.drafter import DFlashDrafter, DrafterConfig
from dflash_cli.engine.sampling import accepted_drafts
from dflash_cli.engine.target.base import capture_layers, capture_target_features
from dflash_cli.errors import DflashError
from dflash_cli.setup.recipes import recipe_for_target
from dflash_cli.setup.threads import apply_threads

# Layout of --output: drafter/ (the result, z-lab format), checkpoint/ (drafter/ + optimizer state),
# distill/ (the target's answers and captured features), metrics.json.
DRAFTER_DIR, CHECKPOINT_DIR, DISTILL_DIR = "drafter", "checkpoint", "distill"
DISTILL_FILE = "responses.jsonl"
FEATURE_STORE_BYTES = 8 * 2**30  # store target features during distillation up to this size, else recompute
# What a user asks after the target's answer (`--follow-ups`): the second turn of a conversation, answered by the
# target like the first, so the drafter also learns how the target answers with a conversation behind it.
FOLLOW_UPS = (
    "Can you explain that more simply?",
    "Give me a concrete example.",
    "Summarize that in two sentences.",
    "What is a common mistake here?",
    "Why does that matter?",
    "Go on.",
    "How would you say that to a beginner?",
    "What should I read or try next?",
)


@dataclass
class TrainOptions:
    """Everything a training run depends on; saved with every checkpoint."""

    target: str
    prompts: str
    output: str
    layers: int = 1
    feature_layers: int = 5
    block_size: int = 8
    steps: int = 2000
    batch_size: int = 8
    lr: float = 6e-4
    warmup_steps: int = 100
    anchors_per_sequence: int = 16
    gamma: float | None = None
    max_new_tokens: int = 128
    distill_batch_size: int = 32
    follow_ups: int = 0  # follow-up turns distilled per prompt (FOLLOW_UPS): multi-turn data, more answers per prompt
    train_minutes: float | None = None  # stop training (checkpoint, then measure) after this long
    eval_prompts: int = 32
    eval_prompts_file: str | None = None
    checkpoint_every: int = 200
    resume: bool = False
    mask_token_id: int | None = None
    seed: int = 0
    device: str = "cpu"
    # The target's dtype while it writes answers and features. None: the dtype dflash serves it in on `device`
    # (bf16 on GPUs and on CPUs with AVX512-BF16/AMX, where it is 2-5x faster; fp32 on other CPUs, where bf16 is
    # emulated and several times slower). tau is always measured in the serving dtype (see evaluate_tau).
    dtype: str | None = None
    threads: int | None = None  # torch's CPU threads (None: the cores other processes leave free)

    @property
    def loss_gamma(self) -> float:
        """The published schedule: gamma about 7 for B=16, 4 for B=8, i.e. roughly B/2."""
        return self.gamma if self.gamma is not None else {16: 7.0, 8: 4.0}.get(self.block_size, self.block_size / 2)


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    features: torch.Tensor | None = None  # [len(ids) - 1, n*H] bf16, captured while the target generated

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


# ---------------------------------------------------------------- prompts and self-distillation


def encode_conversation(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any]) -> list[int]:
    """The prompt as `dflash chat` / `run` / `bench` encode it for this target (the recipe's chat template
    options included), so the drafter learns from exactly what it will be served; plain text without a template."""
    if getattr(tokenizer, "chat_template", None):
        from dflash_cli.loading.session import apply_chat_template

        return apply_chat_template(tokenizer, messages, template_kwargs)
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]


def self_distill(
    target: Any,
    tokenizer: Any,
    conversations: list[list[dict[str, str]]],
    out_dir: Path,
    max_new_tokens: int,
    batch_size: int,
    progress: Progress,
    feature_layer_ids: list[int] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    what: str = "self-distillation",
    store_bytes: int = FEATURE_STORE_BYTES,
) -> list[Sample]:
    """The target's greedy answers to every conversation, cached batch by batch in `out_dir/responses.jsonl` (which
    may hold other calls' answers too: a call reads its own).

    With `feature_layer_ids`, the target features of those layers are captured during generation (every
    token the target reads passes through them anyway) and stored beside the answers, so training
    needs no second target pass; unless they would exceed `store_bytes`, when training recomputes them.
    """
    from safetensors.torch import load_file, save_file

    template_kwargs = template_kwargs or {}
    encoded = [
        (_cache_key(c, template_kwargs), encode_conversation(tokenizer, c, template_kwargs)) for c in conversations
    ]
    if feature_layer_ids:
        tokens = sum(len(ids) for _, ids in encoded) + len(encoded) * max_new_tokens
        hidden = target.config.get_text_config().hidden_size
        if tokens * len(feature_layer_ids) * hidden * 2 > store_bytes:
            feature_layer_ids = None
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_path = out_dir / DISTILL_FILE
    done: dict[str, Sample] = {}
    wanted = {key for key, _ in encoded}
    if cache_path.exists():
        for line in cache_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by an interrupted run: regenerate it
                continue
            if record["key"] not in wanted:
                continue
            usable = record.get("features") and record.get("feature_layers") == feature_layer_ids
            done[record["key"]] = Sample(
                record["prompt_ids"], record["response_ids"], record["features"] if usable else None
            )
    files = {f for f in (s.features for s in done.values()) if f}
    names = {p.name for p in out_dir.glob("features-*.safetensors")}
    stored = {name: load_file(str(out_dir / name)) for name in files}
    for key, sample in done.items():
        sample.features = stored[sample.features][_digest(key)] if sample.features else None
    todo = sorted({k: ids for k, ids in encoded if k not in done}.items(), key=lambda kv: len(kv[1]))
    eos = _stop_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    device = target.get_input_embeddings().weight.device
    task = progress.add_task(what, total=len(encoded), completed=len(encoded) - len(todo), info="")
    with cache_path.open("a") as out:
        for i in range(0, len(todo), batch_size):
            batch = todo[i : i + batch_size]
            width = max(len(ids) for _, ids in batch)
            # Left padding: every prompt ends at the same column, so new tokens line up.
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch], device=device)
            attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch], device=device)
            with torch.inference_mode(), capture_layers(target, feature_layer_ids or []) as captured:
                generated = target.generate(
                    input_ids=input_ids,
                    attention_mask=attention,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                    eos_token_id=eos,
                )
            # Prefill rows, then one row per decode step: features of every token the target read.
            features = torch.cat(captured, dim=1) if feature_layer_ids else None
            name = f"features-{len(names):05d}.safetensors"
            tensors, records = {}, []
            for row, ((key, ids), new) in enumerate(zip(batch, generated[:, width:].tolist())):
                sample = Sample(ids, _cut_at_stop(new, eos))
                if features is not None:
                    left = width - len(ids)
                    sample.features = features[row, left : left + len(sample.ids) - 1].to(torch.bfloat16).contiguous()
                    tensors[_digest(key)] = sample.features
                done[key] = sample
                records.append(
                    {
                        "key": key,
                        "prompt_ids": ids,
                        "response_ids": sample.response_ids,
                        "features": name if features is not None else None,
                        "feature_layers": feature_layer_ids,
                    }
                )
            if tensors:
                save_file(tensors, str(out_dir / name))  # before the jsonl lines that point at it
                names.add(name)
            out.writelines(json.dumps(r) + "\n" for r in records)
            out.flush()
            progress.advance(task, len(batch))
    return [done[k] for k, _ in encoded]


def follow_up_conversations(
    conversations: list[list[dict[str, str]]], samples: list[Sample], tokenizer: Any, count: int
) -> list[list[dict[str, str]]]:
    """`count` second turns per answered conversation: the conversation, the target's answer, then a follow-up
    question (FOLLOW_UPS, a different one for each turn and rotated from one conversation to the next)."""
    out = []
    for i, (messages, sample) in enumerate(zip(conversations, samples)):
        answer = tokenizer.decode(sample.response_ids, skip_special_tokens=True).strip()
        if not answer:
            continue
        for j in range(count):
            question = FOLLOW_UPS[(i + j) % len(FOLLOW_UPS)]
            out.append([*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question}])
    return out


def _cache_key(conversation: list[dict[str, str]], template_kwargs: dict[str, Any]) -> str:
    """One cached answer per conversation as rendered: other template options (thinking on or off) are another
    prompt. Without options the key is the conversation alone, as in caches written before options counted."""
    if not template_kwargs:
        return json.dumps(conversation, sort_keys=True)
    return json.dumps({"messages": conversation, "chat_template_kwargs": template_kwargs}, sort_keys=True)


def _digest(key: str) -> str:
    import hashlib

    return hashlib.sha1(key.encode()).hexdigest()


def _stop_ids(target: Any, tokenizer: Any) -> list[int]:
    eos = target.generation_config.eos_token_id
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise DflashError("the target has no end-of-sequence token", fix="use a chat model with an eos_token_id")
    return ids


def _cut_at_stop(row: list[int], stop_ids: list[int]) -> list[int]:
    """Generated ids up to and including the first stop token (the drafter must learn to end answers)."""
    for i, token in enumerate(row):
        if token in stop_ids:
            return row[: i + 1]
    return row


# ---------------------------------------------------------------- the DFlash objective


def block_attention_mask(context_len: int, anchors: list[int] | torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [..., n*B, context_len + n*B] for anchors [..., n], True = may attend: block i sees context positions
    < anchors[i] and itself."""
    anchors = torch.as_tensor(anchors)
    n = anchors.shape[-1]
    rows = torch.arange(n * block_size) // block_size
    mask = torch.empty(*anchors.shape[:-1], n * block_size, context_len + n * block_size, dtype=torch.bool)
    mask[..., :context_len] = torch.arange(context_len) < anchors[..., rows, None]
    mask[..., context_len:] = rows[:, None] == rows[None, :]
    return mask


def sample_anchors(prompt_len: int, seq_len: int, count: int, rng: random.Random) -> list[int]:
    """Distinct anchors in the response: a block at anchor a predicts tokens a+1.. (so a <= seq_len-2).

    The first anchor candidate is the first response token: at inference the first block starts after the
    prefill has committed one token. Short responses give fewer anchors.
    """
    candidates = range(prompt_len, seq_len - 1)
    return sorted(rng.sample(candidates, min(count, len(candidates))))


@dataclass
class TrainingBatch:
    input_ids: torch.Tensor  # [b, S] right padded
    block_ids: torch.Tensor  # [b, n*B]: anchor token, then MASK
    labels: torch.Tensor  # [b, n, B-1]: tokens at anchor+1..anchor+B-1, -100 where absent
    position_ids: torch.Tensor  # [b, S + n*B]
    attention_mask: torch.Tensor  # [b, 1, n*B, S + n*B]

    def to(self, device: torch.device) -> TrainingBatch:
        return TrainingBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def make_batch(
    samples: list[Sample], anchors_per_sequence: int, block_size: int, mask_id: int, pad_id: int, rng: random.Random
) -> TrainingBatch:
    """A batch in a few whole-batch operations: per-row ones were thousands of small ops a step, which a busy or
    oversubscribed host turns into most of a GPU step's time."""
    rows = [s.ids for s in samples]  # (each a new list: Sample.ids joins prompt and response)
    width = max(len(ids) for ids in rows)
    n, B = anchors_per_sequence, block_size
    input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids in rows])
    # Unused anchor slots (short responses) sit at position 0 with all labels -100; they see only themselves,
    # which keeps SDPA finite.
    anchors = torch.zeros(len(samples), n, dtype=torch.long)
    used = torch.zeros(len(samples), n, dtype=torch.bool)
    for row, (sample, ids) in enumerate(zip(samples, rows)):
        chosen = sample_anchors(len(sample.prompt_ids), len(ids), n, rng)
        anchors[row, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        used[row, : len(chosen)] = True
    lengths = torch.tensor([len(ids) for ids in rows])
    slots = anchors[..., None] + torch.arange(B)  # [b, n, B]: the positions each block stands for
    tokens = input_ids.gather(1, slots.clamp(max=width - 1).flatten(1)).view_as(slots)
    block_ids = torch.full_like(slots, mask_id)  # the anchor's token, then MASK
    block_ids[..., 0] = torch.where(used, tokens[..., 0], mask_id)
    present = used[..., None] & (slots[..., 1:] < lengths[:, None, None])
    labels = torch.where(present, tokens[..., 1:], -100)
    positions = torch.cat([torch.arange(width).expand(len(samples), width), slots.flatten(1)], dim=1)
    masks = block_attention_mask(width, anchors, B)[:, None]
    return TrainingBatch(input_ids, block_ids.flatten(1), labels, positions, masks)


def dflash_loss(
    drafter: DFlashDrafter, features: torch.Tensor, batch: TrainingBatch, gamma: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted block cross-entropy, plus the accuracy and acceptance length the drafts would get."""
    B = drafter.block_size
    b, n = batch.labels.shape[:2]
    context, blocks = drafter.fuse_context(features), drafter.embed(batch.block_ids)
    hidden = drafter(
        torch.cat([context, blocks.to(context.dtype)], dim=1),
        blocks.shape[1],
        batch.position_ids,
        attention_mask=batch.attention_mask,
    )
    hidden = hidden.view(b, n, B, -1)[:, :, 1:]
    logits = drafter.logits(hidden).float()
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view(b, n, B - 1)
    valid = batch.labels != -100
    weights = torch.exp(-torch.arange(B - 1, dtype=torch.float32, device=ce.device) / gamma) * valid
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-6)
    with torch.no_grad():
        drafts = logits.argmax(-1)
        correct = (drafts == batch.labels) & valid
        blocks = valid[:, :, 0]
        # Acceptance length of a draft block: the engine's rule (labels of absent slots, -100, never match).
        accepted = accepted_drafts(drafts, batch.labels)[blocks].float() + 1
        stats = {
            "loss": float(loss),
            "acc": float(correct.sum() / valid.sum().clamp_min(1)),
            "tau": float(accepted.mean()) if accepted.numel() else 1.0,
        }
    return loss, stats


# ---------------------------------------------------------------- checkpoints


def learning_rate(step: int, options: TrainOptions, progress: float) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak; `progress` is how far the decay has gone (0 to 1)."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    return options.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def decay_progress(step: int, start: int, start_progress: float, horizon: int) -> float:
    """How far the decay has gone at `step`: from `start_progress` at `start` (the end of warmup, or where a run
    resumed) straight to 1 at `horizon` (--steps, or where --train-minutes will stop the run: fitted_horizon). A
    resumed run goes on from the rate it stopped at, never back up."""
    return min(1.0, start_progress + (1 - start_progress) * max(0, step - start) / max(1, horizon - start))


def save_checkpoint(
    directory: Path,
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    step: int,
    options: TrainOptions,
    history: list[dict[str, float]],
    progress: float,
) -> None:
    """Drafter in the z-lab format plus optimizer tensors (safetensors) and scalars (JSON, with the learning rate's
    decay `progress` at `step`): no pickle."""
    from safetensors.torch import save_file

    staging = directory.with_name(directory.name + ".tmp")
    if staging.exists():  # what a save interrupted mid-write left
        shutil.rmtree(staging)
    drafter.save_pretrained(staging / DRAFTER_DIR)
    names = {id(p): name for name, p in drafter.named_parameters()}
    tensors, scalars = {}, {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"{names[id(param)]}/{key}"] = value.detach().cpu().contiguous()
                else:
                    scalars[f"{names[id(param)]}/{key}"] = float(value)
    save_file(tensors, str(staging / "optimizer.safetensors"))
    state = {
        "step": step,
        "decay_progress": progress,
        "options": asdict(options),
        "optimizer_scalars": scalars,
        "history": history,
    }
    (staging / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n")
    previous = previous_checkpoint(directory)
    if directory.exists():
        directory.rename(previous)
    staging.rename(directory)  # a crash before this leaves the previous checkpoint (recover_checkpoint)
    if previous.exists():
        shutil.rmtree(previous)


# The flags of what a run learns from (its data and objective), by option: a resumed run that changes one gets a
# note. How long and where it runs may change freely; the drafter's shape is refused at load_checkpoint.
LEARNING_FLAGS = {
    "target": "--target",
    "prompts": "--prompts",
    "max_new_tokens": "--max-tokens",
    "follow_ups": "--follow-ups",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "anchors_per_sequence": "--anchors",
}


def resumed_with_changes(saved: dict[str, Any], options: TrainOptions) -> str:
    """The flags of what a run learns from (LEARNING_FLAGS) that a resumed run changed from its checkpoint's, as
    "--flag old -> new"; empty when none did. Paths compare resolved (p.jsonl is ./p.jsonl)."""
    now = asdict(options)

    def same(key: str) -> bool:
        if key == "prompts":
            return Path(saved[key]).resolve() == Path(now[key]).resolve()
        return saved[key] == now[key]

    return ", ".join(
        f"{flag} {saved[key]!r} -> {now[key]!r}"
        for key, flag in LEARNING_FLAGS.items()
        if key in saved and not same(key)
    )


def interrupted_training_state(output: Path) -> str:
    """What an interrupted `dflash train` into `output` kept, and how to go on."""
    answers = output / DISTILL_DIR / DISTILL_FILE
    kept = sum(1 for _ in answers.open("rb")) if answers.is_file() else 0
    state = output / CHECKPOINT_DIR / "trainer_state.json"
    if state.is_file():
        step = json.loads(state.read_text())["step"]
        return f"{kept} answers cached and a checkpoint at step {step} in {output}: re-run the command with --resume"
    return (
        f"{kept} answers cached in {answers.parent} (kept batch by batch) and no checkpoint yet: re-run the same "
        "command to go on from there"
    )


def previous_checkpoint(directory: Path) -> Path:
    """Where save_checkpoint sets the previous checkpoint aside while the new one moves in."""
    return directory.with_name(directory.name + ".previous")


def recover_checkpoint(directory: Path) -> None:
    """After a crash mid-save (save_checkpoint): put the previous checkpoint back if the new one never moved in, or
    remove it if the new one did (else the next save could not set the checkpoint aside)."""
    previous = previous_checkpoint(directory)
    if previous.exists() and not directory.exists():
        previous.rename(directory)
    elif previous.exists():
        shutil.rmtree(previous)


def load_checkpoint(
    directory: Path, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer
) -> tuple[int, list[dict[str, float]], float | None]:
    """Restore the drafter and optimizer; the step, history and decay progress saved (None: an older checkpoint)."""
    from safetensors.torch import load_file

    state = json.loads((directory / "trainer_state.json").read_text())
    saved = json.loads((directory / DRAFTER_DIR / "config.json").read_text())
    fresh = drafter.config.to_dict()
    changed = [k for k in fresh if saved.get(k) != fresh[k]]
    if changed:
        raise DflashError(
            f"the checkpoint in {directory} was trained with other settings ({', '.join(changed)} differ)",
            fix="resume with the flags of the original run (see its trainer_state.json), or choose another --output",
        )
    weights = load_file(str(directory / DRAFTER_DIR / "model.safetensors"))
    drafter.load_state_dict({k: v.to(drafter.fc.weight.dtype) for k, v in weights.items()})
    tensors = load_file(str(directory / "optimizer.safetensors"))
    params = dict(drafter.named_parameters())
    for key, value in state["optimizer_scalars"].items():
        name, slot = key.rsplit("/", 1)
        optimizer.state[params[name]][slot] = torch.tensor(value)
    for key, value in tensors.items():
        name, slot = key.rsplit("/", 1)
        optimizer.state[params[name]][slot] = value.to(params[name].device)
    return int(state["step"]), state["history"], state.get("decay_progress")


# ---------------------------------------------------------------- the run


@dataclass
class TrainResult:
    output: str
    steps: int
    train_seconds: float
    final_loss: float
    train_tau: float
    eval_tau: float | None
    eval_prompts: int
    history: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def new_drafter(target: Any, options: TrainOptions, mask_token_id: int) -> DFlashDrafter:
    tcfg = target.config.get_text_config()
    config = DrafterConfig.for_target(
        tcfg,
        layers=options.layers,
        block_size=options.block_size,
        mask_token_id=mask_token_id,
        feature_layers=options.feature_layers,
        vocab_size=target.get_input_embeddings().num_embeddings,
        rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=float(
            (getattr(tcfg, "rope_parameters", None) or {}).get("rope_theta", getattr(tcfg, "rope_theta", 1e6))
        ),
    )
    torch.manual_seed(options.seed)
    drafter = DFlashDrafter(config)
    for module in drafter.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    drafter.bind(target)
    return drafter


def pick_mask_token(tokenizer: Any, requested: int | None) -> int:
    """A token the drafter uses as MASK: the tokenizer's own, else the least chat-like special token.

    Vocabularies without a MASK token still carry pretraining-only special tokens that never occur in
    chat; the drafter learns what the id means from its position in the block, so any such id works.
    """
    if requested is not None:
        return requested
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    in_use = {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    special = [i for i in tokenizer.all_special_ids if i not in in_use]
    added = sorted(i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i not in in_use)
    spare = (added or special)[-1:]  # the last added special token: the most specialised one
    if not spare:
        raise DflashError(
            "the tokenizer has no spare special token to use as MASK",
            fix="pass --mask-token-id ID (a token that never appears in chat)",
        )
    return spare[0]


def target_template_kwargs(ref: str) -> dict[str, Any]:
    """The chat template options the target's recipe serves it with (none for a target no recipe uses)."""
    from dflash_cli.setup.recipes import adhoc_recipe

    return dict(adhoc_recipe(ref, None).chat_template_kwargs)


def open_target(ref: str, device: str, dtype: str, console: Console | None = None) -> tuple[Any, Any]:
    """The frozen target and its tokenizer, loaded as every command loads it (`loading.models.load_target`: the
    plan's precision and quantization, the memory check), except that a CPU target trains unquantized. `ref` is what
    `--target` takes everywhere: a recipe name (its target, with its offline source), a local directory or a repo
    id."""
    from dflash_cli.loading.models import load_target, load_tokenizer, resolve_ref
    from dflash_cli.setup.hardware import detect_machine
    from dflash_cli.setup.planning import PlanOverrides, make_plan
    from dflash_cli.setup.recipes import adhoc_recipe

    recipe = adhoc_recipe(ref, None)
    # On a CPU unquantized: the drafter's loss runs through the target's output head, and the CPU's packed int4/int8
    # kernels (the demo's default there) have no backward. (The demo's int4 weights are its GGUF's exactly, which the
    # unquantized copy holds dequantized: the same model.) NF4 on a GPU keeps the head dense: the plan's choice.
    cpu = torch.device(device).type == "cpu"
    plan = make_plan(detect_machine(), recipe, PlanOverrides(device=device, dtype=dtype, quant="none" if cpu else None))
    directory = resolve_ref(recipe.target, "target", console)
    return load_target(directory, plan, console=console), load_tokenizer(directory)


def train(options: TrainOptions, console: Console | None = None) -> TrainResult:
    console = console or Console(stderr=True)
    if options.block_size < 2:
        raise DflashError("--block-size must be at least 2 (the anchor plus one drafted token)")
    output = Path(options.output)
    if output.exists() and not output.is_dir():
        raise DflashError(
            f"--output {output} is a file", fix="name a directory for the run (it is created), e.g. runs/my-drafter"
        )
    checkpoint = output / CHECKPOINT_DIR
    recover_checkpoint(checkpoint)
    conversations, eval_conversations = split_prompts(options.prompts, options.eval_prompts_file, options.eval_prompts)
    resumable = (checkpoint / "trainer_state.json").exists()
    if resumable and not options.resume:
        raise DflashError(
            f"{output} already holds a training checkpoint",
            fix="pass --resume to continue it, or choose another --output",
        )
    if options.resume and not resumable:
        raise DflashError(f"nothing to resume: {checkpoint} has no checkpoint", fix="drop --resume to start a new run")
    if options.resume:
        saved = json.loads((checkpoint / "trainer_state.json").read_text())
        metrics = output / "metrics.json"
        measured = json.loads(metrics.read_text()).get("steps") if metrics.is_file() else None
        # Finished, and measured at that step: nothing left (it would "finish" in no time and overwrite metrics.json).
        # A run stopped after its last step, while saving or measuring, resumes to do those.
        if saved["step"] >= options.steps and measured == saved["step"]:
            raise DflashError(
                f"the run in {output} already reached step {saved['step']} (--steps {options.steps})",
                fix=f"raise --steps above {saved['step']} to train further; its drafter is in {output / DRAFTER_DIR}",
            )
        changed = resumed_with_changes(saved.get("options", {}), options)
        if changed:
            console.print(f"[yellow]note:[/] resuming with other settings than the checkpoint's: {changed}")
    template_kwargs = target_template_kwargs(options.target)
    output.mkdir(parents=True, exist_ok=True)  # only now: a run refused above leaves no empty folder behind
    dtype = options.dtype or str(serving_dtype(options.device)).removeprefix("torch.")
    target, tokenizer = open_target(options.target, options.device, dtype, console)
    # No more threads than free cores: oversubscribed, torch's thread pools spin against each other (on 2 cores, two
    # runs side by side trained 7-9x slower with two threads each than with one; docs/benchmarks.md).
    console.print(f"[dim]Threads: {apply_threads(options.threads).reason}[/dim]")
    drafter = new_drafter(target, options, pick_mask_token(tokenizer, options.mask_token_id))
    drafter.to(target.get_input_embeddings().weight.device)  # (trains where the target's features are)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as progress:

        def distill(turns: list[list[dict[str, str]]], **more: Any) -> list[Sample]:
            return self_distill(
                target,
                tokenizer,
                turns,
                output / DISTILL_DIR,
                options.max_new_tokens,
                options.distill_batch_size,
                progress,
                drafter.config.target_layer_ids,
                template_kwargs,
                **more,
            )

        samples = distill(conversations)
        if options.follow_ups:
            stored = sum(s.features.nbytes for s in samples if s.features is not None)
            samples += distill(
                follow_up_conversations(conversations, samples, tokenizer, options.follow_ups),
                what="follow-up turns",
                store_bytes=FEATURE_STORE_BYTES - stored,
            )
        samples = [s for s in samples if len(s.response_ids) >= 2]
        if not samples:
            raise DflashError(
                "the target produced no usable responses (all shorter than 2 tokens)",
                fix="check the prompts and --max-new-tokens",
            )
        keep_features_on(drafter.fc.weight.device, samples)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=options.lr, weight_decay=0.0, betas=(0.9, 0.95))
        step, history, decayed = 0, [], None
        if options.resume:
            step, history, decayed = load_checkpoint(checkpoint, drafter, optimizer)
            console.print(f"Resuming from step {step} ({checkpoint})")
        started = time.perf_counter()
        stats, steps_done = _train_loop(
            drafter, target, samples, optimizer, options, (step, decayed), history, progress, checkpoint, tokenizer
        )
        train_seconds = time.perf_counter() - started
    del samples  # (their features may fill a share of the GPU's memory that the measuring below wants)
    final = output / DRAFTER_DIR
    _save_final(drafter, final)
    eval_tau = None
    if eval_conversations:
        served = serving_dtype(options.device)
        if served != target.dtype:  # reload: casting the training copy back up would keep its rounding
            del target
            target, tokenizer = open_target(options.target, options.device, str(served).removeprefix("torch."), console)
        drafter.to(served).bind(target)
        eval_tau = evaluate_tau(
            target, drafter, tokenizer, eval_conversations, options.max_new_tokens, console, template_kwargs
        )
    result = TrainResult(
        str(final),
        steps_done,
        train_seconds,
        stats.get("loss", float("nan")),
        stats.get("tau", 1.0),
        eval_tau,
        len(eval_conversations),
        history,
    )
    (output / "metrics.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return result


def _batches(samples: list[Sample], batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless shuffled epochs of sample indices; each batch groups similar lengths to limit padding."""
    while True:
        order = list(range(len(samples)))
        rng.shuffle(order)
        chunks = [order[i : i + batch_size * 16] for i in range(0, len(order), batch_size * 16)]
        batches = []
        for chunk in chunks:
            chunk.sort(key=lambda i: len(samples[i].ids))
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        yield from batches


def _train_loop(
    drafter: DFlashDrafter,
    target: Any,
    samples: list[Sample],
    optimizer: torch.optim.Optimizer,
    options: TrainOptions,
    resumed: tuple[int, float | None],
    history: list[dict[str, float]],
    progress: Progress,
    checkpoint: Path,
    tokenizer: Any,
) -> tuple[dict[str, float], int]:
    """Train from the step `resumed` names (with the decay progress saved there, if any) to options.steps, or until
    options.train_minutes have passed (a checkpoint is saved where it stops); returns the running figures and the
    step reached."""
    step, start_progress = resumed
    started, first_step = time.perf_counter(), step
    deadline = None if options.train_minutes is None else started + 60 * options.train_minutes
    horizon, start = options.steps, max(step, options.warmup_steps)
    if start_progress is None:  # a fresh run, or a checkpoint that did not record it: as --steps sets it
        start_progress = decay_progress(start, options.warmup_steps, 0.0, options.steps)
    rng = random.Random(options.seed * 1_000_003 + step)  # a resumed run does not replay the same batches
    layer_ids = drafter.config.target_layer_ids
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    task = progress.add_task("training", total=options.steps, completed=step, info="")
    running: dict[str, float] = {}
    fast_bf16 = serving_dtype(options.device) == torch.bfloat16
    batches = _batches(samples, options.batch_size, rng)
    saved_at, updating = step, False

    def save() -> None:
        nonlocal saved_at
        decayed = decay_progress(step, start, start_progress, horizon)
        save_checkpoint(checkpoint, drafter, optimizer, step, options, history, decayed)
        saved_at = step

    try:
        while step < options.steps:
            began = time.perf_counter()
            indices = next(batches)
            chosen = [samples[i] for i in indices]
            batch = make_batch(
                chosen, options.anchors_per_sequence, options.block_size, drafter.mask_token_id, pad, rng
            )
            made = time.perf_counter()
            features = _features(target, batch.input_ids, chosen, layer_ids)
            batch = batch.to(features.device)
            fed = time.perf_counter()
            if deadline is not None and step - first_step >= 20 and step % 10 == 0:
                horizon = fitted_horizon(step, step - first_step, fed - started, deadline - fed, options.steps)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, options, decay_progress(step, start, start_progress, horizon))
            # bf16 autocast where bf16 is native: the lm_head over the whole vocabulary dominates a step, and bf16
            # matmuls run 2-3x faster on GPUs and on CPUs with AVX512-BF16/AMX; master weights and the loss stay fp32.
            # A CPU without them emulates bf16 (15x slower than fp32 for this step on a 2-core EPYC): no autocast.
            with torch.autocast(features.device.type, dtype=torch.bfloat16, enabled=fast_bf16):
                loss, stats = dflash_loss(drafter, features, batch, options.loss_gamma)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            updating = True
            optimizer.step()
            step, updating = step + 1, False
            # Where a slow run's time goes: seconds a step, making its batch (the host alone), and its features on the
            # device (stored ones copied, or the target's forward; a copy also waits for the device's queue).
            stats |= {"step_s": time.perf_counter() - began, "batch_s": made - began, "features_s": fed - made}
            running = {k: 0.9 * running.get(k, v) + 0.1 * v for k, v in stats.items()}
            progress.update(
                task,
                completed=step,
                info=f"loss {running['loss']:.3f} acc {running['acc']:.2f} tau~{running['tau']:.2f}",
            )
            out_of_time = deadline is not None and time.perf_counter() >= deadline and step < options.steps
            if step % 10 == 0 or step == options.steps or out_of_time:
                history.append({"step": step, **running})
            if step % options.checkpoint_every == 0 or step == options.steps or out_of_time:
                save()
            if out_of_time:
                progress.update(task, info=f"stopped at step {step}: --train-minutes {options.train_minutes:g} spent")
                break
    except KeyboardInterrupt:
        # Ctrl-C keeps the steps since the last checkpoint: saved where the last whole step left the drafter and
        # optimizer (if it came mid-update, the checkpoint before stands). The CLI then says how to --resume.
        if step > saved_at and not updating:
            recover_checkpoint(checkpoint)  # (if it came mid-save)
            if not history or history[-1]["step"] != step:
                history.append({"step": step, **running})
            save()
        raise
    if not running and history:  # resumed at its last step (to save and measure): the checkpoint's figures stand
        running = {key: value for key, value in history[-1].items() if key != "step"}
    return running, step


def fitted_horizon(step: int, steps_run: int, seconds_run: float, seconds_left: float, steps: int) -> int:
    """The step the learning rate's decay ends at under --train-minutes: where training stops at the pace so far
    (or at --steps, if that comes first), so that a run the clock stops has decayed its rate all the same."""
    return min(steps, step + int(steps_run / max(seconds_run, 1e-9) * max(0.0, seconds_left)))


def keep_features_on(device: torch.device, samples: list[Sample]) -> None:
    """Move the stored features read from the cache onto a GPU once, when they take at most a quarter of its free
    memory (the training's own tensors come after), so that each step pads its batch there: on the host, 64 rows of
    300-615 tokens are 220 MiB a step to pad (0.2 s on one core of this VM; docs/benchmarks.md) and copy from
    pageable memory. A CPU run keeps them where they are."""
    if device.type != "cuda":
        return
    away = [s for s in samples if s.features is not None and s.features.device != device]
    if away and sum(s.features.nbytes for s in away) <= torch.cuda.mem_get_info(device)[0] // 4:
        for sample in away:
            sample.features = sample.features.to(device)


def _features(target: Any, input_ids: torch.Tensor, batch: list[Sample], layer_ids: list[int]) -> torch.Tensor:
    """Target features [b, S, n*H] for a right-padded batch: stored ones when distillation captured them."""
    device = target.get_input_embeddings().weight.device
    if all(s.features is not None for s in batch):
        # Padded where they are (on the GPU when keep_features_on moved them there) in their stored dtype (bf16),
        # then copied once if on the host: per-row copies from pageable memory each waited for the device's queue.
        stored = torch.nn.utils.rnn.pad_sequence([s.features for s in batch], batch_first=True)
        stored = F.pad(stored, (0, 0, 0, input_ids.shape[1] - stored.shape[1]))
        return stored.to(device).float()
    with torch.no_grad():
        # Right padding and causal attention: real positions never see the pads, so no mask is needed.
        _, features = capture_target_features(
            target, input_ids.to(device), layer_ids, use_cache=False, logits_to_keep=1
        )
    return features


def _save_final(drafter: DFlashDrafter, directory: Path) -> None:
    """The shipped checkpoint in bfloat16, like the published drafters; the drafter keeps the rounded
    weights, so the tau measured next is the shipped checkpoint's."""
    drafter.to(torch.bfloat16).save_pretrained(directory)
    drafter.to(torch.float32)


def serving_dtype(device: str) -> torch.dtype:
    """What `dflash` runs the target in by default on `device` here (planning.make_plan's choice)."""
    from dflash_cli.setup.hardware import detect_machine
    from dflash_cli.setup.planning import default_dtype

    kind = torch.device(device).type
    return getattr(torch, default_dtype(kind, detect_machine())[0])


def evaluate_tau(
    target: Any,
    drafter: DFlashDrafter,
    tokenizer: Any,
    conversations: list[list[dict[str, str]]],
    max_new_tokens: int,
    console: Console,
    template_kwargs: dict[str, Any] | None = None,
) -> float:
    """Mean acceptance length over held-out prompts with the real decode loop (greedy)."""
    from dflash_cli.engine import speculative_generate

    stop = _stop_ids(target, tokenizer)
    lengths: list[int] = []
    drafter.eval()
    with Progress(
        TextColumn("tau on held-out prompts"), BarColumn(), MofNCompleteColumn(), console=console
    ) as progress:
        for messages in progress.track(conversations):
            result = speculative_generate(
                target,
                drafter,
                encode_conversation(tokenizer, messages, template_kwargs or {}),
                max_new_tokens,
                stop_token_ids=stop,
            )
            lengths += result.acceptance_lengths
    return sum(lengths) / max(1, len(lengths))


def next_steps(target: str, drafter_dir: str) -> dict[str, str]:
    """The commands that chat with and measure a trained drafter. A recipe given by name (`--target demo`) is used
    by name with `--drafter DIR`; a repo id or directory as `--target`."""
    known = recipe_for_target(target)
    model = (
        [known.name]
        if known is not None and target.strip().lower() != known.target.id.lower()
        else ["--target", target]
    )
    return {
        "chat_command": shlex.join(["dflash", "chat", *model, "--drafter", drafter_dir]),
        "bench_command": shlex.join(["dflash", "bench", *model, "--drafter", drafter_dir, "--before-after"]),
    }
