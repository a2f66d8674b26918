"""`dflash train`: train a DFlash drafter for a target by self-distillation."""

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from dflash_cli.cli.flags import JsonFlag, Threads, check_device, check_dtype, existing_file
from dflash_cli.cli.output import emit, err_console, show_trained
from dflash_cli.setup.recipes import resolve_recipe


def train(
    target: Annotated[
        str, typer.Option("--target", help="Model to draft for: recipe name, Hugging Face repo id or local directory.")
    ],
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts",
            metavar="FILE",
            callback=existing_file,
            help='Prompts: .txt (one a line) or .jsonl as `dflash run` reads it: {"prompt": ...} (a user turn, where `dflash run` reads plain completion) or {"messages": [...]}, optionally with "tools", "tool_choice" or "response_format" (answered as the server answers them) and an "id".',
        ),
    ],
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            metavar="DIR",
            help="Where the drafter, checkpoints, the target's cached answers and features, and metrics.json go.",
        ),
    ],
    layers: Annotated[
        int | None,
        typer.Option(
            min=1,
            show_default=False,
            help="Drafter decoder layers (published drafters use 5, 1-2 is enough for small targets; default: 1, "
            "--init-from's drafter's own, a resumed run's checkpoint's). With --init-from, more than its drafter has "
            "grows it (new layers on top that start by changing nothing); fewer is refused.",
        ),
    ] = None,
    feature_layers: Annotated[
        int, typer.Option(min=1, help="Target layers whose hidden states the drafter reads (evenly spaced).")
    ] = 5,
    block_size: Annotated[
        int,
        typer.Option(
            min=2,
            help="Tokens per draft block. 8 suits CPUs and small targets (verify cost grows with B); 16 suits GPUs.",
        ),
    ] = 8,
    draft_vocab: Annotated[
        int,
        typer.Option(
            min=0,
            help="Tokens the drafter may propose: the most frequent in the prompts and answers, at most as many as they "
            "hold (0: the target's whole vocabulary). Its loss runs over them alone: 3x faster a step on the demo at "
            "8192. A resumed run keeps its checkpoint's.",
        ),
    ] = 32768,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps.")] = 2000,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per step.")] = 8,
    lr: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Peak learning rate: reached after a linear warmup over a tenth of --steps (1 to 100 steps), then "
            "a cosine decay to a tenth of it at the last step.",
        ),
    ] = 6e-4,
    anchors: Annotated[
        int, typer.Option(min=1, help="Draft blocks per sequence per step (random anchors in the response).")
    ] = 16,
    loss_gamma: Annotated[
        float | None,
        typer.Option(
            "--loss-gamma",
            min=0.1,
            show_default=False,
            help="How fast the loss weight of a block's positions decays: exp(-(k-1)/GAMMA) for the k-th drafted token "
            "(default: the published 4 for --block-size 8, 7 for 16, else half the block). Smaller puts the weight on "
            "the first drafts: the ones that count while a drafter accepts under 2 tokens a step.",
        ),
    ] = None,
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens",
            "--max-new-tokens",
            min=2,
            help="Longest answer the target writes per prompt while distilling (--max-new-tokens: the older name).",
        ),
    ] = 128,
    eval_prompts: Annotated[
        int,
        typer.Option(
            min=0,
            help="Prompts held out to measure tau at the end: the first N of --eval-file, else of --prompts (a "
            "quarter of them where N would leave none to train on).",
        ),
    ] = 32,
    eval_every: Annotated[
        int,
        typer.Option(
            min=0,
            help="Also measure held-out tau every N steps, beside the same on as many training answers (a curve in "
            "metrics.json's history, with the CPU seconds so far; held-out far below the training figure: train on "
            "prompts more like the held-out ones); 0: at the end only.",
        ),
    ] = 0,
    eval_file: Annotated[
        str | None,
        typer.Option(
            "--eval-file",
            metavar="FILE",
            callback=existing_file,
            help="Held-out prompts for tau (same formats as --prompts).",
        ),
    ] = None,
    follow_ups: Annotated[
        int,
        typer.Option(
            min=0,
            max=8,
            help="Also distill N follow-up turns per prompt (one of 8 questions after the target's answer, answered by "
            "the target): multi-turn training data, N+1 answers per prompt.",
        ),
    ] = 0,
    distill_batch_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            show_default=False,
            help="Prompts the target answers at once while it writes the training answers, as `dflash run "
            "--batch-size` (default: the plan's; on a GPU try 256).",
        ),
    ] = None,
    train_minutes: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            show_default=False,
            help="Stop training after this many minutes, before --steps if need be (checkpointed where it stops). "
            "The learning rate's decay then ends where the time runs out, at the pace measured so far (and its "
            "warmup is a tenth of the steps that fit, where that is shorter).",
        ),
    ] = None,
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Save a resumable checkpoint every N steps.")] = 200,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Continue the checkpoint in --output (from the learning rate it stopped at, never higher)."
        ),
    ] = False,
    mask_token_id: Annotated[
        int | None,
        typer.Option(
            "--mask-token-id",
            min=0,
            metavar="ID",
            show_default=False,
            help="The token the drafter reads as MASK (a token that never appears in chat; default: the tokenizer's "
            "mask token, else its last spare special token).",
        ),
    ] = None,
    init_from: Annotated[
        str | None,
        typer.Option(
            "--init-from",
            metavar="DRAFTER",
            show_default=False,
            help="Start a new run from this drafter's weights instead of random ones: a recipe's name for its drafter "
            "(`demo`), a drafter directory (an earlier run's DIR/drafter) or a repo id. Its shape (layers, target "
            "layers, MASK token) is kept, so --feature-layers does not apply; --layers may add layers on top; "
            "--block-size and --draft-vocab apply. --resume goes on from the checkpoint, however it started. Train "
            "a published drafter further on your own prompts, or carry a run on where its checkpoint is gone.",
        ),
    ] = None,
    device: Annotated[str, typer.Option(callback=check_device, help="cpu, cuda or cuda:N.")] = "cpu",
    dtype: Annotated[
        str | None,
        typer.Option(
            callback=check_dtype,
            show_default=False,
            help="Target dtype while it writes answers and features and tau is measured (default: the one dflash serves it in here: "
            "bf16 on GPUs and on CPUs with AVX512-BF16/AMX or AVX2, where it is 2-5x faster; fp32 on other CPUs).",
        ),
    ] = None,
    threads: Threads = None,
    json_output: JsonFlag = False,
) -> None:
    """Train a DFlash drafter for a target model (self-distillation: the target writes the training answers).

    The target answers every prompt as `dflash run` would (the plan, quantization and compiled steps dflash serves it with here; greedy), and its features of every answer are computed once; both are cached in DIR, so an interrupted run keeps its data and a later run adds to it. Training saves a checkpoint every --checkpoint-every steps and where Ctrl-C stops it (--resume continues it, with a note if its data or objective flags changed; a run that reached --steps asks for more). Prompts are rendered with the chat template options of the target's recipe (Qwen3: thinking off), as chat serves them. The drafter lands in DIR/drafter in the z-lab format that dflash, vLLM and SGLang load; the closing message prints the command that uses it, e.g. `dflash chat demo --drafter runs/demo/drafter`.

    Example (the shipped demo drafter): `dflash train --target demo --prompts prompts.jsonl --output runs/demo --steps 1500`
    """
    from dflash_cli.training.prompts import split_prompts

    resolve_recipe(None, None, target, None)  # input mistakes fail here, before torch is imported
    split_prompts(prompts, eval_file, eval_prompts)
    from dflash_cli.commands.train import TrainOptions, interrupted_training_state, next_steps
    from dflash_cli.commands.train import train as run_training

    options = TrainOptions(
        target=target,
        prompts=prompts,
        output=output,
        layers=layers,
        feature_layers=feature_layers,
        block_size=block_size,
        draft_vocab=draft_vocab,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        anchors_per_sequence=anchors,
        gamma=loss_gamma,
        max_new_tokens=max_new_tokens,
        distill_batch_size=distill_batch_size,
        follow_ups=follow_ups,
        train_minutes=train_minutes,
        eval_prompts=eval_prompts,
        eval_every=eval_every,
        eval_prompts_file=eval_file,
        checkpoint_every=checkpoint_every,
        resume=resume,
        init_from=init_from,
        mask_token_id=mask_token_id,
        device=device,
        dtype=dtype,
        threads=threads,
    )
    try:
        with stops_save_a_checkpoint():
            result = run_training(options, err_console)
    except KeyboardInterrupt:
        err_console.print(f"interrupted: {escape(interrupted_training_state(Path(output)))}")
        raise
    steps = next_steps(target, result.output)
    summary = {**{k: v for k, v in result.to_dict().items() if k != "history"}, "chat_command": steps["chat_command"]}
    emit(summary, json_output, lambda: show_trained(result, steps))


@contextlib.contextmanager
def stops_save_a_checkpoint() -> Iterator[None]:
    """SIGTERM (`kill`, a scheduler's stop) stops training as Ctrl-C does, saving a checkpoint; and Ctrl-C does so
    even where the shell that started a background run left SIGINT ignored (`nohup ... &`, a script's `&`)."""

    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    before = {
        sig: signal.signal(sig, handler)
        for sig, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, stop))
    }
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
