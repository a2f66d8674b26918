"""`dflash train`: distil a DFlash drafter for any causal LM target (the work is `dflash_cli.training`'s); what to
run with the drafter it made."""

from __future__ import annotations

import shlex

from dflash_cli.setup.recipes import recipe_for_target
from dflash_cli.training.checkpoint import interrupted_training_state
from dflash_cli.training.loop import train
from dflash_cli.training.options import TrainOptions, TrainResult

__all__ = ["TrainOptions", "TrainResult", "interrupted_training_state", "next_steps", "train"]


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
