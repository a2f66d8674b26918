"""Checkpoints: the drafter in the z-lab format plus the optimizer's state (safetensors and JSON, no pickle), saved so
that a crash at any moment leaves a whole checkpoint behind, and resumed from the learning rate where they stopped."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.errors import DflashError
from dflash_cli.training.distill import ANSWERS_FILE
from dflash_cli.training.options import CHECKPOINT_DIR, DISTILL_DIR, DRAFTER_DIR, TrainOptions, published_gamma


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
    "gamma": "--loss-gamma",
}


def resumed_with_changes(saved: dict[str, Any], options: TrainOptions) -> str:
    """The flags of what a run learns from (LEARNING_FLAGS) that a resumed run changed from its checkpoint's, as
    "--flag old -> new"; empty when none did. Paths compare resolved (p.jsonl is ./p.jsonl), the loss's gamma as the
    loss uses it (no --loss-gamma: the published one for the block size)."""
    now = asdict(options)

    def used(run: dict[str, Any], key: str) -> Any:
        if key == "gamma" and run[key] is None:
            return published_gamma(run.get("block_size", options.block_size))
        return run[key]

    def same(key: str) -> bool:
        if key == "prompts":
            return Path(saved[key]).resolve() == Path(now[key]).resolve()
        return used(saved, key) == used(now, key)

    return ", ".join(
        f"{flag} {used(saved, key)!r} -> {used(now, key)!r}"
        for key, flag in LEARNING_FLAGS.items()
        if key in saved and not same(key)
    )


def interrupted_training_state(output: Path) -> str:
    """What an interrupted `dflash train` into `output` kept, and how to go on."""
    answers = output / DISTILL_DIR / ANSWERS_FILE
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


def saved_vocabulary(directory: Path) -> torch.Tensor | None:
    """The draft vocabulary of the checkpoint's drafter (None: it proposes from the whole vocabulary)."""
    from dflash_cli.loading.checkpoint import read_draft_vocabulary, read_drafter_config

    drafter = directory / DRAFTER_DIR
    config = read_drafter_config(drafter)
    return None if config.draft_vocab_size is None else read_draft_vocabulary(drafter, config)


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
