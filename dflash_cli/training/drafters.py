"""The drafter a training run trains: a new one shaped by the run's flags, or one started from another drafter's
weights (--init-from), and the target layers it reads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dflash_cli.engine.drafter import DFlashDrafter, DrafterConfig, default_target_layer_ids
from dflash_cli.errors import DflashError
from dflash_cli.training.options import DRAFTER_DIR, TrainOptions
from dflash_cli.wording import plural


def new_drafter(
    target: Any, options: TrainOptions, mask_token_id: int, vocab: torch.Tensor | None = None
) -> DFlashDrafter:
    """A drafter shaped by `options` for the target, its layers initialised at random; `vocab`: the target ids it
    may propose (objective.draft_vocabulary), None for all of them."""
    tcfg = target.config.get_text_config()
    config = DrafterConfig.for_target(
        tcfg,
        layers=options.layers if options.layers is not None else 1,
        block_size=options.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=flag_layer_ids(options, tcfg.num_hidden_layers),
        vocab_size=target.get_input_embeddings().num_embeddings,
        draft_vocab_size=None if vocab is None else len(vocab),
        rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=float(
            (getattr(tcfg, "rope_parameters", None) or {}).get("rope_theta", getattr(tcfg, "rope_theta", 1e6))
        ),
    )
    torch.manual_seed(options.seed)
    drafter = DFlashDrafter(config)
    randomize_linears(drafter)
    if vocab is not None:
        drafter.use_vocabulary(vocab)
    drafter.bind(target)
    return drafter


def starting_config(directory: Path, target: Any, layers: int | None = None) -> DrafterConfig:
    """The config of the drafter in `directory` that a run starts from (--init-from), checked to fit the target:
    a classic DFlash drafter made for its hidden size, layer count and vocabulary, with no more layers than
    `layers` (--layers; None: any)."""
    from dflash_cli.loading.checkpoint import read_drafter_config

    config = read_drafter_config(directory)
    if config.is_dflash2:
        raise DflashError(
            f"--init-from {directory}: a DFlash2 drafter; dflash trains classic DFlash drafters only",
            fix="start from a classic DFlash drafter, or drop --init-from to train one from scratch",
        )
    tcfg = target.config.get_text_config()
    theirs = {
        "hidden_size": tcfg.hidden_size,
        "num_target_layers": tcfg.num_hidden_layers,
        "vocab_size": target.get_input_embeddings().num_embeddings,
    }
    clash = [
        f"{name} {getattr(config, name)} (the target's {value})"
        for name, value in theirs.items()
        if getattr(config, name) != value
    ]
    if clash:
        raise DflashError(
            f"--init-from {directory}: a drafter for another target ({', '.join(clash)})",
            fix="start from a drafter made for this target (its recipe's, or one `dflash train` wrote), or drop "
            "--init-from",
        )
    if layers is not None and layers < config.num_hidden_layers:
        raise DflashError(
            f"--layers {layers}: the drafter in {directory} has {plural(config.num_hidden_layers, 'layer')}, and a "
            "run keeps the layers it starts from",
            fix=f"drop --layers (or pass {config.num_hidden_layers} or more: more grows it), or drop --init-from to "
            "train a new drafter",
        )
    return config


def started_drafter(
    target: Any, directory: Path, options: TrainOptions, vocab: torch.Tensor | None = None
) -> DFlashDrafter:
    """A drafter started from the weights of the drafter in `directory` (--init-from, or the checkpoint of a run
    that started so): its layers, the target layers it reads and its MASK token, with the run's block size and
    draft vocabulary (neither is among the weights). --layers above its own grows it: new layers on top whose
    output projections start at zero, so the grown drafter drafts exactly as the one it starts from and the run
    trains the added depth from there (not from a random drafter's tau of about 1)."""
    from dflash_cli.loading.models import drafter_weights

    config = starting_config(directory, target, options.layers)
    config = replace(config, block_size=options.block_size, draft_vocab_size=None if vocab is None else len(vocab))
    weights = drafter_weights(directory, config)
    kept = config.num_hidden_layers
    layers = options.layers if options.layers is not None else kept
    # (the top layer's kind: a drafter of sliding layers keeps a bounded cache)
    config = replace(
        config, num_hidden_layers=layers, layer_types=[*config.layer_types, *config.layer_types[-1:] * (layers - kept)]
    )
    drafter = DFlashDrafter(config)
    if layers > kept:
        torch.manual_seed(options.seed)
        for layer in drafter.layers[kept:]:
            randomize_linears(layer)
            for output in (layer.self_attn.o_proj, layer.mlp.down_proj):
                for tensor in (output.weight, output.bias):
                    if tensor is not None:
                        torch.nn.init.zeros_(tensor)
    added = {
        name for name in drafter.state_dict() if name.startswith(tuple(f"layers.{i}." for i in range(kept, layers)))
    }
    missing, unexpected = drafter.load_state_dict(
        {name: value.float() for name, value in weights.items()}, strict=False
    )
    assert not unexpected and set(missing) == added, (missing, unexpected)
    if vocab is not None:
        drafter.use_vocabulary(vocab)
    drafter.bind(target)
    return drafter


def randomize_linears(module: torch.nn.Module) -> None:
    """A new drafter's (or a new layer's) linear weights: normal, std 0.02."""
    for linear in module.modules():
        if isinstance(linear, torch.nn.Linear):
            torch.nn.init.normal_(linear.weight, std=0.02)


def init_drafter_dir(ref: str) -> Path:
    """Where --init-from's drafter is: a recipe's drafter by the recipe's name or alias (`--init-from demo`), else a
    drafter directory or Hugging Face repo id."""
    from dflash_cli.loading.hub import resolve_model_dir
    from dflash_cli.loading.models import resolve_ref
    from dflash_cli.setup.recipes import recipe_for_target

    known = recipe_for_target(ref)
    if known is not None and ref.strip().lower() in (known.name, *known.aliases):
        if known.drafter is None:
            raise DflashError(
                f"--init-from {ref}: the recipe has no drafter", fix="name a drafter directory or repo id"
            )
        return resolve_ref(known.drafter, "drafter")
    return resolve_model_dir(ref, what="drafter")


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


def feature_layer_ids(options: TrainOptions, checkpoint: Path, start: Path | None, target_config: Any) -> list[int]:
    """The target layers the run's drafter reads: its checkpoint's when resumed, those of the drafter it starts from
    (`start`, --init-from's), else --feature-layers of them evenly spaced (as new_drafter shapes it)."""
    from dflash_cli.loading.checkpoint import read_drafter_config

    if options.resume:
        return read_drafter_config(checkpoint / DRAFTER_DIR).target_layer_ids
    if start is not None:
        return read_drafter_config(start).target_layer_ids
    return flag_layer_ids(options, target_config.num_hidden_layers)


def flag_layer_ids(options: TrainOptions, target_layers: int) -> list[int]:
    """The target layers --feature-layers names: that many of the target's, evenly spaced."""
    return default_target_layer_ids(target_layers, min(options.feature_layers, target_layers))


def describe_shape(config: DrafterConfig) -> str:
    """A drafter's shape as the run's flags would set it."""
    return (
        f"{plural(config.num_hidden_layers, 'layer')}, target layers "
        f"{config.target_layer_ids}, MASK token {config.mask_token_id}"
    )
