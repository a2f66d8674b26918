"""A training run from start to end: the answers (distill), the features (features), then steps of the DFlash
objective with checkpoints, and held-out tau (the held-out prompts' answers walked as decoding walks them: held_out)
every --eval-every steps and at the end; everything lands in `<output>/metrics.json`."""

from __future__ import annotations

import contextlib
import gc
import json
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dflash_cli.engine.drafter import DFlashDrafter, make_drafter
from dflash_cli.engine.target.base import compute_dtype
from dflash_cli.errors import DflashError
from dflash_cli.loading.checkpoint import read_drafter_config
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.setup.choices import Quant
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import PlanOverrides
from dflash_cli.setup.thread_count import apply_threads
from dflash_cli.training.checkpoint import (
    load_checkpoint,
    recover_checkpoint,
    resumed_with_changes,
    save_checkpoint,
    saved_vocabulary,
)
from dflash_cli.training.data import batches, make_batch
from dflash_cli.training.distill import Sample, distill, follow_ups
from dflash_cli.training.drafters import (
    describe_shape,
    feature_layer_ids,
    flag_layer_ids,
    init_drafter_dir,
    new_drafter,
    pick_mask_token,
    started_drafter,
    starting_config,
)
from dflash_cli.training.features import FeatureStore, ForwardFeatures, ServedFeatures
from dflash_cli.training.held_out import decoded_tau
from dflash_cli.training.objective import (
    decay_progress,
    dflash_loss,
    draft_vocabulary,
    fitted_horizon,
    learning_rate,
    warmup_steps,
)
from dflash_cli.training.options import (
    CHECKPOINT_DIR,
    DISTILL_DIR,
    DRAFTER_DIR,
    WALKED_FILE,
    TrainOptions,
    TrainResult,
)
from dflash_cli.training.prompts import split_prompts
from dflash_cli.wording import plural

COLUMNS = (
    TextColumn("{task.description}"),
    BarColumn(),
    MofNCompleteColumn(),
    TextColumn("{task.fields[info]}"),
    TimeElapsedColumn(),
    TimeRemainingColumn(),
)


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


def serving_dtype(device: str) -> torch.dtype:
    """What `dflash` runs the target in by default on `device` here (planning.make_plan's choice)."""
    from dflash_cli.setup.hardware import detect_machine
    from dflash_cli.setup.planning import default_dtype

    kind = torch.device(device).type
    return getattr(torch, default_dtype(kind, detect_machine())[0])


def _check_resume(options: TrainOptions, output: Path, console: Console) -> TrainOptions:
    """Refuse a resume with nothing to resume or nothing left to do, and a new run over a checkpoint; note the
    learning flags a resume changes. The options the run goes on with: a resumed run keeps its first run's
    --init-from (the drafter's shape came from there, not from the flags) and its checkpoint's depth."""
    checkpoint = output / CHECKPOINT_DIR
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
        if saved.get("options", {}).get("draft_vocab", 0) != options.draft_vocab:
            console.print(
                f"[yellow]note:[/] --draft-vocab {options.draft_vocab} is not applied: a resumed run keeps its "
                "checkpoint's vocabulary"
            )
        started_from = saved.get("options", {}).get("init_from")
        if options.init_from and options.init_from != started_from:
            console.print(
                f"[yellow]note:[/] --init-from {options.init_from} is not applied: a resumed run continues its "
                "checkpoint's weights"
            )
        kept = read_drafter_config(checkpoint / DRAFTER_DIR)
        if not started_from:  # (refused before the features of other layers are computed)
            named = flag_layer_ids(options, kept.num_target_layers)
            if named != kept.target_layer_ids:
                raise DflashError(
                    f"the checkpoint in {checkpoint} reads target layers {kept.target_layer_ids}; --feature-layers "
                    f"{options.feature_layers} names {named}",
                    fix="resume with the original run's --feature-layers (see its trainer_state.json), or choose "
                    "another --output",
                )
        # The drafter's depth is its checkpoint's (a grown one's included); naming another would not load.
        depth = kept.num_hidden_layers
        if options.layers not in (None, depth):
            raise DflashError(
                f"--layers {options.layers}: the checkpoint in {checkpoint} has a drafter of {plural(depth, 'layer')}",
                fix=f"drop --layers (a resumed run keeps its checkpoint's {depth}), or choose another --output",
            )
        return replace(options, init_from=started_from, layers=depth)
    return options


def answering_session(options: TrainOptions, console: Console) -> tuple[Any, RunOptions]:
    """The engine users get (its plan for --device/--dtype), as it answers the prompts: greedy, no drafter."""
    from dflash_cli.loading.session import open_session

    run = RunOptions(
        target=options.target,
        sampling=SamplingParams(max_new_tokens=options.max_new_tokens),
        no_spec=True,
        overrides=PlanOverrides(device=options.device, dtype=options.dtype, batch_size=options.distill_batch_size),
        threads=options.threads,
    )  # greedy: SamplingParams' default temperature
    return open_session(run, console, batching=True), run


def write_answers(
    session: Any, run: RunOptions, options: TrainOptions, requests: list[Any], held_out: list[Any], progress: Progress
) -> tuple[list[Sample], list[Sample]]:
    """The target's answers through the session's engine: the training samples and the held-out ones (never
    trained on: held-out tau walks them)."""
    directory = Path(options.output) / DISTILL_DIR
    # The held-out answers first: a few, and a run cut short while distilling (a device call's budget) has them.
    held = distill(session, run, held_out, directory, progress, "held-out answers") if held_out else []
    samples = distill(session, run, requests, directory, progress)
    if options.follow_ups:
        turns = follow_ups(requests, samples, session.tokenizer, options.follow_ups)
        samples += distill(session, run, turns, directory, progress, "follow-up turns")
    return samples, held


def served_features(
    session: Any, options: TrainOptions, checkpoint: Path, start: Path | None, samples: list[Sample], progress: Progress
) -> FeatureStore | None:
    """Where the target is served with the CPU's int4/int8 kernels (its training copy holds the weights
    dequantized), the samples' features from the served engine's prefill into a store named for its weights; None
    elsewhere (the training target computes them: it is what is served). `start`: the drafter a new run starts from."""
    plan = session.plan
    if torch.device(plan.device).type != "cpu" or plan.quant not in (Quant.INT4, Quant.INT8):
        return None
    config = session.target.config.get_text_config()
    layer_ids = feature_layer_ids(options, checkpoint, start, config)
    store = FeatureStore(
        Path(options.output) / DISTILL_DIR, layer_ids, len(layer_ids) * config.hidden_size, plan.quant.value
    )
    source = ServedFeatures(session.target, layer_ids)
    try:
        store.add(source, samples, progress)
    finally:
        source.close()
    return store


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
    requests, held_out = split_prompts(options.prompts, options.eval_prompts_file, options.eval_prompts)
    options = _check_resume(options, output, console)
    with Progress(*COLUMNS, console=console) as progress:
        session, run = answering_session(options, console)
        start, start_depth = None, 0
        if options.init_from and not options.resume:  # refused now, before the answers and features are made
            start = init_drafter_dir(options.init_from)
            start_depth = starting_config(start, session.target, options.layers).num_hidden_layers
        output.mkdir(parents=True, exist_ok=True)  # only now: a run refused above (its models too) leaves no folder
        samples, held = write_answers(session, run, options, requests, held_out, progress)
        samples = [s for s in samples if len(s.response_ids) >= 2]
        held = [s for s in held if len(s.response_ids) >= 2]
        if not samples:
            raise DflashError(
                "the target produced no usable responses (all shorter than 2 tokens)",
                fix="check the prompts and --max-tokens",
            )
        store = served_features(session, options, checkpoint, start, samples + held, progress)
        del session  # (before the training target loads: a large target is not held twice)
        gc.collect()
        dtype = options.dtype or str(serving_dtype(options.device)).removeprefix("torch.")
        target, tokenizer = open_target(options.target, options.device, dtype, console)
        # No more threads than free cores: oversubscribed, torch's thread pools spin against each other (on 2 cores,
        # two runs side by side trained 7-9x slower with two threads each than with one;
        # benchmarks/results/history.md).
        threads = apply_threads(options.threads)
        progress.console.print(f"[dim]Threads: {threads.reason}[/dim]")
        if threads.note:  # (more than the cores: as the session's plan notes say it)
            progress.console.print(f"  note: {threads.note}", style="yellow", markup=False, highlight=False)
        # A resumed run keeps its checkpoint's vocabulary (its answers may have grown since).
        vocab = (
            saved_vocabulary(checkpoint)
            if options.resume
            else draft_vocabulary((s.ids for s in samples), options.draft_vocab)
        )
        if options.resume and options.init_from:  # shaped as its checkpoint (load_checkpoint then loads it)
            drafter = started_drafter(target, checkpoint / DRAFTER_DIR, options, vocab)
        elif start is not None:
            drafter = started_drafter(target, start, options, vocab)
            added = drafter.config.num_hidden_layers - start_depth
            grown = f"; {plural(added, 'layer')} added on top" if added else ""
            progress.console.print(f"Starting from the drafter in {start} ({describe_shape(drafter.config)}{grown})")
        else:
            drafter = new_drafter(target, options, pick_mask_token(tokenizer, options.mask_token_id), vocab)
        drafter.to(target.get_input_embeddings().weight.device)  # (trains where the target's features are)
        if store is None:
            store = FeatureStore(output / DISTILL_DIR, drafter.config.target_layer_ids, drafter.fc.in_features)
            store.add(ForwardFeatures(target, store.layer_ids), samples + held, progress)
        assert store.layer_ids == drafter.config.target_layer_ids, (store.layer_ids, drafter.config.target_layer_ids)
        store.attach(samples + held)
        keep_features_on(drafter.fc.weight.device, samples + held)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=options.lr, weight_decay=0.0, betas=(0.9, 0.95))
        step, history, decayed = 0, [], None
        if options.resume:
            step, history, decayed = load_checkpoint(checkpoint, drafter, optimizer)
            progress.console.print(f"Resuming from step {step} ({checkpoint})")

        # The same walk over as many training answers: a held-out tau far below it says the held-out prompts ask
        # for another kind of text than most training ones, or the answers were learned by heart; prompts like the
        # held-out ones help, more steps less. 2026-11-28: the demo's stage B walked 2.20 on 64 training answers and
        # 1.53 on 40 held-out ones, 2.23 on unseen prompts of its generator, 1.58 on its own training explanations.
        seen = walked_training_answers(output / WALKED_FILE, samples, max(len(held), 16)) if held else []

        def walked_taus() -> dict[str, float]:
            copy = serving_copy(drafter, target)
            return {"eval_tau": decoded_tau(copy, held), "seen_tau": decoded_tau(copy, seen)} if held else {}

        started = time.perf_counter()
        stats, steps_done = _train_loop(
            drafter,
            samples,
            optimizer,
            options,
            (step, decayed),
            history,
            progress,
            checkpoint,
            tokenizer,
            walked_taus,
        )
        train_seconds = time.perf_counter() - started
        del samples  # (their features may fill a share of the GPU's memory that the measuring below wants)
        final = output / DRAFTER_DIR
        drafter.to(torch.bfloat16).save_pretrained(final)  # shipped in bf16, like the published drafters
        drafter.to(torch.float32)
        walked = walked_taus()
    result = TrainResult(
        str(final),
        steps_done,
        train_seconds,
        stats.get("loss", float("nan")),
        stats.get("tau", 1.0),
        walked.get("eval_tau"),
        len(held),
        history,
        walked.get("seen_tau"),
    )
    (output / "metrics.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return result


def _train_loop(
    drafter: DFlashDrafter,
    samples: list[Sample],
    optimizer: torch.optim.Optimizer,
    options: TrainOptions,
    resumed: tuple[int, float | None],
    history: list[dict[str, float]],
    progress: Progress,
    checkpoint: Path,
    tokenizer: Any,
    walked_taus: Callable[[], dict[str, float]],
) -> tuple[dict[str, float], int]:
    """Train from the step `resumed` names (with the decay progress saved there, if any) to options.steps, or until
    options.train_minutes have passed (a checkpoint is saved where it stops); returns the running figures and the
    step reached. Every --eval-every steps the history row also holds the CPU seconds so far and the walked tau held
    out and on as many training answers (`walked_taus`: eval_tau, seen_tau)."""
    step, start_progress = resumed
    started, first_step = time.perf_counter(), step
    cpu_before = next((row["cpu_s"] for row in reversed(history) if "cpu_s" in row), 0.0)
    cpu_started = time.process_time()
    deadline = None if options.train_minutes is None else started + 60 * options.train_minutes
    horizon = options.steps
    warmup = warmup_steps(options, horizon)
    start = max(step, warmup)  # where the decay starts
    if start_progress is None:  # a fresh run, or a checkpoint that did not record it: as --steps sets it
        start_progress = decay_progress(start, warmup, 0.0, options.steps)
    rng = random.Random(options.seed * 1_000_003 + step)  # a resumed run does not replay the same batches
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    task = progress.add_task("training", total=options.steps, completed=step, info="")
    running: dict[str, float] = {}
    precision = StepPrecision(torch.device(options.device), serving_dtype(options.device) == torch.bfloat16)
    order = batches(samples, options.batch_size, rng)
    saved_at = step
    device = drafter.fc.weight.device

    def save() -> None:
        nonlocal saved_at
        decayed = decay_progress(step, start, start_progress, horizon)
        save_checkpoint(checkpoint, drafter, optimizer, step, options, history, decayed)
        saved_at = step

    try:
        with InterruptsHeld() as interrupts:
            while step < options.steps:
                began = time.perf_counter()
                chosen = [samples[i] for i in next(order)]
                batch = make_batch(
                    chosen, options.anchors_per_sequence, options.block_size, drafter.mask_token_id, pad, rng
                )
                made = time.perf_counter()
                features = stored_features(chosen, batch.input_ids.shape[1], device)
                batch = batch.to(device)
                fed = time.perf_counter()
                if deadline is not None and step - first_step >= 20 and step % 10 == 0:
                    horizon = fitted_horizon(step, step - first_step, fed - started, deadline - fed, options.steps)
                    if step < warmup:  # a tenth of the run the clock allows, not of --steps (ending now, if past it)
                        warmup = start = max(step, warmup_steps(options, horizon))
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(
                        step, options.lr, warmup, decay_progress(step, start, start_progress, horizon)
                    )
                bf16 = precision.next()
                computing = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss, stats = dflash_loss(drafter, features, batch, options.loss_gamma)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
                with interrupts.held():  # (a whole step or none: the checkpoint is where Ctrl-C stopped it)
                    optimizer.step()
                    step += 1
                chosen_now = precision.timed(bf16, time.perf_counter() - computing)
                if chosen_now is not None:
                    progress.console.print(f"[dim]{chosen_now}[/dim]")
                # Where a slow run's time goes: seconds a step, making its batch (the host alone), and its features on the
                # device (stored ones copied; a copy also waits for the device's queue).
                stats |= {"step_s": time.perf_counter() - began, "batch_s": made - began, "features_s": fed - made}
                running = {k: 0.9 * running.get(k, v) + 0.1 * v for k, v in stats.items()}
                progress.update(
                    task,
                    completed=step,
                    info=f"loss {running['loss']:.3f} acc {running['acc']:.2f} tau~{running['tau']:.2f}",
                )
                out_of_time = deadline is not None and time.perf_counter() >= deadline and step < options.steps
                measure = options.eval_every and step % options.eval_every == 0 and step < options.steps
                if step % 10 == 0 or step == options.steps or out_of_time or measure:
                    row = {"step": step, **running, "cpu_s": cpu_before + time.process_time() - cpu_started}
                    if measure:
                        row |= walked_taus()
                    history.append(row)
                if step % options.checkpoint_every == 0 or step == options.steps or out_of_time or measure:
                    save()
                    if not progress.console.is_terminal:  # (a run in the background: a whole line a checkpoint)
                        # This step's figures: its history row where it has one (with held-out tau, if measured), else
                        # the running ones (history holds a row every 10 steps: its last may be an earlier step's, or
                        # the previous run's just after a resume).
                        row = history[-1] if history and history[-1]["step"] == step else running
                        progress.console.print(checkpoint_line(step, options.steps, row), soft_wrap=True)
                if out_of_time:
                    progress.update(
                        task, info=f"stopped at step {step}: --train-minutes {options.train_minutes:g} spent"
                    )
                    break
    except KeyboardInterrupt:
        # Ctrl-C keeps the steps since the last checkpoint: saved where the last whole step left the drafter and
        # optimizer (one that came mid-update waited for it: InterruptsHeld). The CLI then says how to --resume.
        if step > saved_at:
            recover_checkpoint(checkpoint)  # (if it came mid-save)
            if not history or history[-1]["step"] != step:  # (with its CPU seconds: a resume counts on from them)
                history.append({"step": step, **running, "cpu_s": cpu_before + time.process_time() - cpu_started})
            save()
        raise
    if not running and history:  # resumed at its last step (to save and measure): the checkpoint's figures stand
        running = {
            key: value for key, value in history[-1].items() if key not in ("step", "eval_tau", "seen_tau", "cpu_s")
        }
    return running, step


class InterruptsHeld:
    """Ctrl-C (SIGINT) and SIGTERM wait for a `held()` block to end, then stop the run as they would have: one that
    came inside optimizer.step() would leave some weights and moments updated and others not, no step to save, and
    the run would lose every step since its last checkpoint. Its handlers are set once for the whole loop (swapping
    them each step left windows where one signal could strand the other's); only signals with a Python handler
    (those that raise KeyboardInterrupt) are held, an ignored or default one stays as it is. Signals reach the main
    thread alone (and only it may set handlers): elsewhere nothing is held."""

    def __init__(self) -> None:
        self.before: dict[int, Callable[[int, Any], Any]] = {}
        self.holding, self.arrived = False, None

    def __enter__(self) -> InterruptsHeld:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handler = signal.getsignal(sig)
                if callable(handler):
                    self.before[sig] = handler
                    signal.signal(sig, self._signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self.before.items():
            signal.signal(sig, handler)

    def _signal(self, signum: int, frame: Any) -> None:
        if self.holding:
            self.arrived = self.arrived or signum
        else:
            self.before[signum](signum, frame)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            if self.arrived is not None:
                signum, self.arrived = self.arrived, None
                self.before[signum](signum, None)  # (its handler runs now, raising KeyboardInterrupt)


PRECISION_TRIAL_STEPS = 3  # steps timed in each precision (alternating) where a CPU could train in either


class StepPrecision:
    """Whether a training step runs its products in bf16 (autocast; master weights and the loss stay fp32) or in
    float32. bf16 on a GPU; float32 on a CPU that emulates bf16 (15x slower for this step on a 2-core EPYC without
    AVX512-BF16); on a CPU with bf16 instructions, by measurement: the first steps alternate and the faster stays.
    AMX multiplies bf16 several times faster than fp32, AVX512-BF16 alone need not: a demo step took 0.85 s in bf16
    autocast against 0.65 in fp32 on one core of a Xeon without AMX (benchmarks/results/history.md)."""

    def __init__(self, device: torch.device, bf16_native: bool) -> None:
        self.bf16 = bf16_native
        measure = bf16_native and device.type == "cpu"
        self.trial: dict[bool, list[float]] | None = {True: [], False: []} if measure else None

    def next(self) -> bool:
        """The next step's precision (True: bf16 autocast)."""
        if self.trial is None:
            return self.bf16
        return len(self.trial[True]) <= len(self.trial[False])

    def timed(self, bf16: bool, seconds: float) -> str | None:
        """A step's seconds in its precision; once both are measured, the choice (said once), else None."""
        if self.trial is None:
            return None
        self.trial[bf16].append(seconds)
        if min(len(times) for times in self.trial.values()) < PRECISION_TRIAL_STEPS:
            return None
        bf16_s, fp32_s = (statistics.median(self.trial[kind]) for kind in (True, False))
        self.bf16, self.trial = bf16_s < fp32_s, None
        kept, other = ("bf16 autocast", "float32") if self.bf16 else ("float32", "bf16 autocast")
        return (
            f"Step precision: {kept}, {min(bf16_s, fp32_s):.2f} s a step against {max(bf16_s, fp32_s):.2f} in "
            f"{other} (measured over the first {2 * PRECISION_TRIAL_STEPS} steps)"
        )


def walked_training_answers(path: Path, samples: list[Sample], count: int) -> list[Sample]:
    """The training answers walked beside the held-out ones: drawn once per run and their keys kept in `path`, so a
    resumed run whose answers have grown walks the same ones (those still among them)."""
    by_key = {sample.key: sample for sample in samples}
    if path.is_file():
        kept = [by_key[key] for key in json.loads(path.read_text()) if key in by_key]
        if kept:
            return kept
    chosen = random.Random(0).sample(samples, min(len(samples), count))
    path.write_text(json.dumps([sample.key for sample in chosen]) + "\n")
    return chosen


def checkpoint_line(step: int, steps: int, row: dict[str, float]) -> str:
    """One log line at a checkpoint: where the run is and how it learns (held-out tau when measured there)."""
    figures = [f"{key} {row[key]:.3f}" for key in ("loss", "acc", "tau") if key in row]
    if row.get("eval_tau") is not None:
        seen = f" (training answers {row['seen_tau']:.3f})" if row.get("seen_tau") is not None else ""
        figures.append(f"held-out tau {row['eval_tau']:.3f}{seen}")
    if "step_s" in row:
        figures.append(f"{row['step_s']:.2f} s a step")
    return f"step {step}/{steps}: " + ", ".join(figures)


def keep_features_on(device: torch.device, samples: list[Sample]) -> None:
    """Move the stored features onto a GPU once, when they take at most a quarter of its free memory (the training's
    own tensors come after), so that each step pads its batch there: on the host, 64 rows of 300-615 tokens are 220
    MiB a step to pad (0.2 s on one core of this VM; benchmarks/results/history.md) and copy from pageable memory. A
    CPU run reads them where they are (memory-mapped)."""
    if device.type != "cuda":
        return
    away = [s for s in samples if s.features.device != device]
    if away and sum(s.features.nbytes for s in away) <= torch.cuda.mem_get_info(device)[0] // 4:
        for sample in away:
            sample.features = sample.features.to(device)


def stored_features(batch: Sequence[Sample], width: int, device: torch.device) -> torch.Tensor:
    """The batch's target features [b, width, n*H], right-padded like its ids: padded where they are (on the GPU
    when keep_features_on moved them there) in their stored bf16, then copied once."""
    stored = torch.nn.utils.rnn.pad_sequence([s.features for s in batch], batch_first=True)
    stored = torch.nn.functional.pad(stored, (0, 0, 0, width - stored.shape[1]))
    return stored.to(device).float()


def serving_copy(drafter: DFlashDrafter, target: Any) -> DFlashDrafter:
    """The drafter as it is shipped and served: its weights rounded to bf16, then in the target's activation dtype,
    bound to the target, with its draft vocabulary (not among its weights)."""
    copy = make_drafter(drafter.config)
    copy.load_state_dict(drafter.state_dict())
    if drafter.config.draft_vocab_size is not None:
        copy.use_vocabulary(drafter.draft_vocab)
    copy.to(drafter.fc.weight.device, torch.bfloat16).to(compute_dtype(target)).eval()
    copy.bind(target)
    return copy
