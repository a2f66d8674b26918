"""`dflash train` on a tiny random target: the objective, the data cache, checkpoints, resume and the CLI."""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import shutil
import signal
import threading
from dataclasses import asdict, replace
from io import StringIO
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.progress import Progress
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from typer.testing import CliRunner

from dflash_cli.cli.app import app
from dflash_cli.commands.train import interrupted_training_state, train
from dflash_cli.engine.sampling import accepted_drafts
from dflash_cli.engine.target.base import capture_target_features
from dflash_cli.errors import DflashError
from dflash_cli.loading.models import load_drafter
from dflash_cli.loading.session import open_session
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.setup import recipes
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import PlanOverrides
from dflash_cli.training import checkpoint as checkpoints
from dflash_cli.training import loop as training
from dflash_cli.training.data import block_attention_mask, make_batch
from dflash_cli.training.distill import ANSWERS_FILE, FOLLOW_UPS, Sample, distill
from dflash_cli.training.drafters import new_drafter, started_drafter
from dflash_cli.training.features import FeatureStore, ForwardFeatures, ServedFeatures
from dflash_cli.training.loop import open_target
from dflash_cli.training.objective import (
    decay_progress,
    dflash_loss,
    draft_vocabulary,
    drafted_hidden,
    fitted_horizon,
    learning_rate,
    vocabulary_positions,
    warmup_steps,
)
from dflash_cli.training.options import TrainOptions
from dflash_cli.training.prompts import load_prompts, split_prompts

PROMPTS = [
    "Hello!",
    "What is 2 + 2?",
    "Tell me about foxes.",
    "def add(a, b):",
    "Speculative decoding?",
    "Hi there",
    "Explain dogs.",
    "Why?",
]


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def options(tiny_qwen3_dir: Path, prompt_file: Path, output: Path, **overrides) -> TrainOptions:
    base = {
        "target": str(tiny_qwen3_dir),
        "prompts": str(prompt_file),
        "output": str(output),
        "block_size": 4,
        "feature_layers": 2,
        "steps": 6,
        "batch_size": 4,
        "lr": 3e-3,
        "warmup_steps": 2,
        "anchors_per_sequence": 4,
        "max_new_tokens": 12,
        "eval_prompts": 2,
        "checkpoint_every": 3,
    }
    return TrainOptions(**{**base, **overrides})


def test_block_mask_is_block_sparse() -> None:
    # Context of 5 positions; blocks of 2 at anchors 1 and 3. Block i sees context < anchor_i and itself only.
    expected = torch.tensor(
        [
            # ctx 0  1  2  3  4 | blk0 0 1 | blk1 0 1
            [1, 0, 0, 0, 0, 1, 1, 0, 0],
            [1, 0, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 1, 1],
            [1, 1, 1, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(block_attention_mask(5, [1, 3], 2), expected)


def test_batch_labels_positions_and_blocks() -> None:
    sample = Sample("a", prompt_ids=[10, 11, 12], response_ids=[20, 21, 22, 23])  # ids 10 11 12 20 21 22 23
    batch = make_batch([sample], anchors_per_sequence=2, block_size=3, mask_id=99, pad_id=0, rng=random.Random(0))
    anchors = sorted({int(p) for p in batch.position_ids[0, 7::3]})
    assert all(3 <= a <= 5 for a in anchors) and len(anchors) == 2  # inside the response, room for one label
    ids = sample.ids
    for i, a in enumerate(anchors):
        assert batch.block_ids[0, 3 * i : 3 * i + 3].tolist() == [ids[a], 99, 99]
        assert batch.position_ids[0, 7 + 3 * i : 10 + 3 * i].tolist() == [a, a + 1, a + 2]
        labels = [ids[a + k] if a + k < len(ids) else -100 for k in (1, 2)]
        assert batch.labels[0, i].tolist() == labels
        assert torch.equal(
            batch.attention_mask[0, 0, 3 * i : 3 * i + 3], block_attention_mask(7, anchors, 3)[3 * i : 3 * i + 3]
        )
    assert batch.position_ids[0, :7].tolist() == list(range(7))


def test_batch_rows_of_other_lengths_pad_and_leave_unused_blocks_inert() -> None:
    """A short answer has fewer anchors than slots: its unused blocks hold MASK only, no labels, positions 0..B-1,
    and see only themselves; the shorter row is padded, and no label reads past its own tokens."""
    long = Sample("a", prompt_ids=[10, 11], response_ids=[20, 21, 22, 23, 24, 25])
    short = Sample("b", prompt_ids=[12], response_ids=[30, 31])  # one anchor candidate: position 1
    batch = make_batch([long, short], anchors_per_sequence=3, block_size=3, mask_id=99, pad_id=0, rng=random.Random(3))
    width = len(long.ids)
    assert batch.input_ids[1].tolist() == short.ids + [0] * (width - len(short.ids))
    assert batch.block_ids[1].tolist() == [30, 99, 99] + [99] * 6
    assert batch.labels[1].tolist() == [[31, -100], [-100, -100], [-100, -100]]
    assert batch.position_ids[1, width:].tolist() == [1, 2, 3, 0, 1, 2, 0, 1, 2]
    unused = batch.attention_mask[1, 0, 3:]
    assert not unused[:, :width].any()
    assert unused[:, width:].tolist() == [[False] * 3 + [True] * 3 + [False] * 3] * 3 + [[False] * 6 + [True] * 3] * 3
    for i in range(3):  # the long row: every slot used, labels inside its tokens
        a = int(batch.position_ids[0, width + 3 * i])
        assert batch.labels[0, i].tolist() == [long.ids[a + k] if a + k < width else -100 for k in (1, 2)]


def test_distill_answers_through_the_engine_and_caches_answers_and_features(
    tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    """The answers are the served engine's greedy ones (float32 here: transformers' greedy on the same model), cached
    with what made them; the features, computed once into the store, are the target's forward's."""
    run = RunOptions(
        target=str(tiny_qwen3_dir),
        sampling=SamplingParams(max_new_tokens=6),
        no_spec=True,
        overrides=PlanOverrides(dtype="float32", batch_size=2),
    )
    session = open_session(run, batching=True)
    requests = load_prompts_from(PROMPTS[:3], tmp_path)
    with Progress(disable=True) as progress:
        first = distill(session, run, requests, tmp_path, progress)
    target, _ = open_target(str(tiny_qwen3_dir), "cpu", "float32")
    for sample in first:
        assert 1 <= len(sample.response_ids) <= 6
        logits = target(torch.tensor([sample.ids])).logits[0]  # greedy: the target's own continuation
        assert logits[len(sample.prompt_ids) - 1 : -1].argmax(-1).tolist() == sample.response_ids
    records = [json.loads(line) for line in (tmp_path / ANSWERS_FILE).read_text().splitlines()]
    assert {r["made_by"]["dtype"] for r in records} == {"float32"} and len(records) == 3
    lines = (tmp_path / ANSWERS_FILE).read_text()
    with Progress(disable=True) as progress:
        again = distill(session, run, requests, tmp_path, progress)
        assert (tmp_path / ANSWERS_FILE).read_text() == lines  # served from the cache, nothing regenerated
        assert [s.ids for s in again] == [s.ids for s in first]
        # Another plan's answers are kept, not used: bf16 writes its own.
        bf16 = RunOptions(
            target=str(tiny_qwen3_dir),
            sampling=SamplingParams(max_new_tokens=6),
            no_spec=True,
            overrides=PlanOverrides(dtype="bfloat16"),  # (not the default where a CPU lacks bf16 instructions)
        )
        distill(open_session(bf16, batching=True), bf16, requests, tmp_path, progress)
        assert len((tmp_path / ANSWERS_FILE).read_text().splitlines()) == 6

        store = FeatureStore(tmp_path, [0, 1], 2 * target.config.hidden_size)
        store.add(ForwardFeatures(target, [0, 1]), first, progress)
        store.attach(first)
        reopened = FeatureStore(tmp_path, [0, 1], 2 * target.config.hidden_size)
        assert not reopened.missing(again)  # a later run reads them
        reopened.attach(again)
    for sample, same in zip(first, again):
        _, full = capture_target_features(target, torch.tensor([sample.ids]), [0, 1])
        assert sample.features.shape == (len(sample.ids) - 1, 2 * target.config.hidden_size)
        torch.testing.assert_close(sample.features.float(), full[0, :-1], rtol=2e-2, atol=2e-2)
        assert torch.equal(same.features, sample.features)


def test_runs_sharing_a_feature_store_each_read_their_own_samples_features(
    tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    """Two runs that share one store (drafters trained side by side from one run's answers, as on a lent GPU) and
    opened it before either wrote: each adds its samples, and every sample reads its own features (the second
    writer read the first's index; before, it indexed its rows from row 0 and overwrote the first's index). Side by
    side in threads too: one writer at a time."""
    target, _ = open_target(str(tiny_qwen3_dir), "cpu", "float32")
    width = 2 * target.config.hidden_size
    rng = random.Random(5)
    samples = [
        Sample(f"k{i}", [rng.randrange(3, 200) for _ in range(rng.randrange(3, 9))],
               [rng.randrange(3, 200) for _ in range(rng.randrange(2, 12))])
        for i in range(12)
    ]  # fmt: skip
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first, second = FeatureStore(tmp_path / "a", [0, 1], width), FeatureStore(tmp_path / "a", [0, 1], width)
    with Progress(disable=True) as progress:
        first.add(ForwardFeatures(target, [0, 1]), samples[0::2], progress)
        second.add(
            ForwardFeatures(target, [0, 1]), samples[1::3], progress
        )  # (two of them the first's: stored already)
        with first.data.open("ab") as stopped:  # a writer stopped between its rows and its index
            stopped.write(b"\x7f" * 6 * width)
        extra = Sample("extra", [5, 6, 7], [8, 9, 10, 11])
        FeatureStore(tmp_path / "a", [0, 1], width).add(
            ForwardFeatures(target, [0, 1]), [extra], progress
        )  # writes over them
        threads = [FeatureStore(tmp_path / "b", [0, 1], width) for _ in range(2)]
        workers = [
            threading.Thread(target=s.add, args=(ForwardFeatures(target, [0, 1]), samples, progress)) for s in threads
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    for directory, wanted in (("a", samples[0::2] + samples[1::3] + [extra]), ("b", samples)):
        store = FeatureStore(tmp_path / directory, [0, 1], width)
        assert not store.missing(wanted)
        assert store.rows == sum(len(s.ids) - 1 for s in {s.key: s for s in wanted}.values())  # each stored once
        assert store.data.stat().st_size == store.rows * 2 * width
        copies = [Sample(s.key, s.prompt_ids, s.response_ids) for s in wanted]
        store.attach(copies)
        for sample in copies:
            _, full = capture_target_features(target, torch.tensor([sample.ids]), [0, 1])
            torch.testing.assert_close(sample.features.float(), full[0, :-1], rtol=2e-2, atol=2e-2)


def test_distill_answers_under_the_requests_constraints(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """A prompt that asks for JSON is answered under the grammar, as the server answers it, and cached apart from
    the same prompt asked without it."""
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "Give me JSON."}\n{"prompt": "Give me JSON.", "response_format": {"type": "json_object"}}\n'
    )
    run = RunOptions(target=str(tiny_qwen3_dir), sampling=SamplingParams(max_new_tokens=24), no_spec=True)
    session = open_session(run, batching=True)
    with Progress(disable=True) as progress:
        free, constrained = distill(session, run, load_prompts(path), tmp_path, progress)
    assert free.prompt_ids == constrained.prompt_ids and free.key != constrained.key
    text = session.tokenizer.decode(constrained.response_ids, skip_special_tokens=True)
    assert text.lstrip().startswith("{") and not session.tokenizer.decode(free.response_ids).lstrip().startswith("{")


def test_eval_every_draws_a_held_out_tau_curve(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    """Every --eval-every steps a history row walks the held-out answers and as many training answers (at least
    16), the same ones after a resume; a drafter that learns its training answers walks them further than held-out
    ones, so the two figures come from the two sets."""
    out = tmp_path / "run"
    log = StringIO()  # (not a terminal: a run in the background logs a line a checkpoint)
    result = train(options(tiny_qwen3_dir, prompt_file, out, steps=40, eval_every=20), Console(file=log))
    lines = [line for line in log.getvalue().splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 3/40: loss ") and " s a step" in lines[0], lines
    assert re.search(r"^step 20/40: .*held-out tau \d\.\d{3} \(training answers \d\.\d{3}\)", log.getvalue(), re.M)
    measured = [row for row in result.history if "eval_tau" in row]
    assert [row["step"] for row in measured] == [20] and result.eval_tau is not None
    # (a tiny model's few answers, learned by heart by the end)
    assert result.seen_tau is not None and result.seen_tau > result.eval_tau + 0.3, result
    seconds = [row["cpu_s"] for row in result.history if "cpu_s" in row]
    assert seconds == sorted(seconds) and seconds[0] > 0
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["history"] == result.history
    walked = json.loads((out / "walked_answers.json").read_text())
    assert len(walked) == len(set(walked)) == min(16, 8 - 2)  # (the prompt file's 8, 2 of them held out)
    more = tmp_path / "more.jsonl"  # (a run resumed with more answers: a new draw would pick others)
    more.write_text(
        prompt_file.read_text() + "".join(json.dumps({"prompt": f"Count to {n}."}) + "\n" for n in range(9))
    )
    again = train(options(tiny_qwen3_dir, more, out, steps=42, eval_every=20, resume=True), Console(file=log))
    assert json.loads((out / "walked_answers.json").read_text()) == walked and again.seen_tau is not None


def load_prompts_from(prompts: list[str], directory: Path) -> list:
    path = directory / "p.txt"
    path.write_text("\n".join(prompts) + "\n")
    return load_prompts(path)


def test_loss_goes_down(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    opts = options(tiny_qwen3_dir, prompt_file, tmp_path)
    target, _ = open_target(opts.target, "cpu", "float32")
    drafter = new_drafter(target, opts, mask_token_id=5)
    samples = [
        Sample("a", [1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7]),
        Sample("b", [4, 5], [11, 12, 13, 14, 11, 12, 13, 14]),
    ]
    batch = make_batch(samples, 4, opts.block_size, drafter.mask_token_id, 0, random.Random(0))
    _, features = capture_target_features(target, batch.input_ids, drafter.config.target_layer_ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss, stats = dflash_loss(drafter, features, batch, opts.loss_gamma)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(stats["loss"])
    # A random tiny target's lm_head (std 0.02) caps how peaked the logits get, so the floor is high.
    assert losses[-1] < 0.85 * losses[0]
    assert 1.0 <= stats["tau"] <= opts.block_size


def test_loss_gamma_weights_each_drafted_position(tiny_qwen3_dir: Path, prompt_file: Path) -> None:
    opts = options(tiny_qwen3_dir, prompt_file, Path("unused"))
    target, _ = open_target(opts.target, "cpu", "float32")
    drafter = new_drafter(target, opts, mask_token_id=5)
    samples = [Sample("a", [1, 2, 3], [7, 8, 9, 40, 8, 9, 7, 33, 9, 7]), Sample("b", [4, 5], [11, 12, 13, 14, 60])]
    batch = make_batch(samples, 4, opts.block_size, drafter.mask_token_id, 0, random.Random(0))
    _, features = capture_target_features(target, batch.input_ids, drafter.config.target_layer_ids)
    with torch.no_grad():
        logits = drafter.logits(drafted_hidden(drafter, features, batch))
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, -2), batch.labels.flatten().clamp_min(0), reduction="none"
        ).view(batch.labels.shape)
        counted = batch.labels != -100
        for gamma in (0.5, 4.0):
            weights = torch.exp(-torch.arange(opts.block_size - 1) / gamma) * counted
            loss, _ = dflash_loss(drafter, features, batch, gamma)
            assert float(loss) == pytest.approx(float((ce * weights).sum() / weights.sum()), rel=1e-5)
    assert options(tiny_qwen3_dir, prompt_file, Path("unused"), block_size=8).loss_gamma == 4.0  # the published one
    assert options(tiny_qwen3_dir, prompt_file, Path("unused"), gamma=1.5).loss_gamma == 1.5


def test_the_draft_vocabulary_is_the_answers_most_frequent_tokens() -> None:
    answers = [[7, 3, 3, 9], [3, 9, 5], [12, 7, 9]]  # 3 and 9 three times, 7 twice, 5 and 12 once
    assert draft_vocabulary(answers, 3).tolist() == [3, 7, 9]
    assert draft_vocabulary(answers, 4).tolist() == [3, 5, 7, 9]  # a tie goes to the lower id
    assert draft_vocabulary(answers, 100).tolist() == [3, 5, 7, 9, 12]  # no more than the answers hold
    assert draft_vocabulary(answers, 0) is None  # the whole vocabulary
    labels = torch.tensor([[3, 12, -100, 9, 0, 13]])
    assert vocabulary_positions(labels, torch.tensor([3, 7, 9, 12])).tolist() == [[0, 3, -100, 2, -100, -100]]


def test_the_loss_over_a_draft_vocabulary_is_what_decoding_proposes(tiny_qwen3_dir: Path, prompt_file: Path) -> None:
    opts = options(tiny_qwen3_dir, prompt_file, Path("unused"), block_size=6)
    target, _ = open_target(opts.target, "cpu", "float32")
    samples = [Sample("a", [1, 2, 3], [7, 8, 9, 40, 8, 9, 7, 33, 9, 7]), Sample("b", [4, 5], [11, 12, 13, 14, 60])]
    whole = new_drafter(target, opts, mask_token_id=5)
    batch = make_batch(samples, 4, opts.block_size, whole.mask_token_id, 0, random.Random(0))
    _, features = capture_target_features(target, batch.input_ids, whole.config.target_layer_ids)
    vocab_size = target.get_input_embeddings().num_embeddings

    def limited(vocab: torch.Tensor):
        drafter = new_drafter(target, opts, 5, vocab)
        drafter.load_state_dict(whole.state_dict())
        return drafter

    with torch.no_grad():
        loss, stats = dflash_loss(whole, features, batch, opts.loss_gamma)
        every = dflash_loss(limited(torch.arange(vocab_size)), features, batch, opts.loss_gamma)
        assert every[0] == pytest.approx(float(loss), rel=1e-6) and every[1] == pytest.approx(stats, rel=1e-6)
        # A vocabulary holding some labels and nothing else: acceptance as decoding gets it, from the masked
        # logits' proposal (labels outside the vocabulary are never proposed, so they end a block).
        vocab = torch.tensor([7, 8, 9, 11, 12, 13])
        drafter = limited(vocab)
        _, partial = dflash_loss(drafter, features, batch, opts.loss_gamma)
        proposed = drafter.logits(drafted_hidden(drafter, features, batch)).argmax(-1)
        assert torch.isin(proposed, vocab).all()
        used = batch.labels[:, :, 0] != -100
        assert partial["tau"] == pytest.approx(float((accepted_drafts(proposed, batch.labels)[used] + 1.0).mean()))


def test_held_out_tau_drafts_with_the_drafters_vocabulary(tiny_qwen3_dir: Path, prompt_file: Path) -> None:
    opts = options(tiny_qwen3_dir, prompt_file, Path("unused"))
    target, _ = open_target(opts.target, "cpu", "float32")
    drafter = new_drafter(target, opts, 5, torch.tensor([7, 8, 9, 11, 12, 13, 40]))
    served = training.serving_copy(drafter, target)
    assert torch.equal(served.draft_vocab, drafter.draft_vocab)
    hidden = torch.randn(2, 3, target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(served.logits(hidden), drafter.to(torch.bfloat16).float().logits(hidden))


@pytest.mark.parametrize("max_new_tokens", [48, 13])
def test_held_out_tau_walks_the_answer_as_greedy_decoding_steps_through_it(max_new_tokens: int) -> None:
    """held_out.step_lengths: every position of a stored answer drafted at once, then walked, gives the decode loop's
    acceptance lengths step for step (the trained conformance drafter, float32, its golden prompts), up to the last
    block before --max-tokens, which the decode loop drafts shorter (13: those steps may differ); drafters whose
    blocks would mix in one forward are refused."""
    from transformers import AutoModelForCausalLM

    from dflash_cli import speculative_generate
    from dflash_cli.training.held_out import decoded_tau, step_lengths
    from helpers.golden import FIXTURES

    golden = json.loads((FIXTURES / "qwen3-tiny" / "golden.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3-tiny" / "target", dtype=torch.float32).eval()
    drafter = load_drafter(FIXTURES / "qwen3-tiny" / "drafter", target)
    samples, decoded = [], []
    for case in golden["cases"]:
        result = speculative_generate(target, drafter, case["prompt_ids"], max_new_tokens)
        sample = Sample("k", case["prompt_ids"], result.token_ids)
        _, features = capture_target_features(target, torch.tensor([sample.ids]), drafter.config.target_layer_ids)
        sample.features = features[0, : len(sample.ids) - 1]
        walked, steps, at = step_lengths(drafter, sample), [], 0
        for length in result.acceptance_lengths:  # (the steps whose block fits before --max-tokens)
            if at + drafter.block_size > len(result.token_ids) - 1:
                break
            steps.append(length)
            at += length
        assert walked[: len(steps)] == steps and sum(walked) == sum(result.acceptance_lengths)
        if max_new_tokens == 48:
            assert walked == result.acceptance_lengths
        samples.append(sample)
        decoded += result.acceptance_lengths
    assert max(decoded) > 2  # (drafters that accept: the walk is not all ones)
    if max_new_tokens == 48:
        assert decoded_tau(drafter, samples) == pytest.approx(sum(decoded) / len(decoded))
    for other in ("qwen3-tiny-swa", "qwen3-tiny-dflash2"):
        with pytest.raises(ValueError, match="whole block"):
            step_lengths(load_drafter(FIXTURES / other / "drafter", target), samples[0])


def test_train_saves_a_loadable_drafter_and_resumes(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = train(options(tiny_qwen3_dir, prompt_file, out, steps=3))
    assert result.steps == 3 and result.eval_prompts == 2 and 1.0 <= result.eval_tau <= 4
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_tau"] == result.eval_tau
    target, _ = open_target(str(tiny_qwen3_dir), "cpu", "float32")
    drafter = load_drafter(out / "drafter", target)
    assert drafter.block_size == 4 and json.loads((out / "drafter" / "config.json").read_text())["dtype"] == "bfloat16"
    records = [json.loads(line) for line in (out / "distill" / ANSWERS_FILE).open()][2:]  # (the held-out two first)
    answered = sorted({token for r in records for token in r["prompt_ids"] + r["response_ids"]})
    assert drafter.draft_vocab.tolist() == answered  # (the default's 32,768 is more than these prompts hold)
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 3

    with pytest.raises(DflashError, match="--resume"):
        train(options(tiny_qwen3_dir, prompt_file, out, steps=5))
    saved = load_drafter(out / "checkpoint" / "drafter", target).state_dict()
    # (resumed with another --draft-vocab: the checkpoint's vocabulary stands, and a note says so)
    said = StringIO()
    resumed = train(options(tiny_qwen3_dir, prompt_file, out, steps=5, resume=True, draft_vocab=3), Console(file=said))
    assert "--draft-vocab 3 is not applied" in " ".join(said.getvalue().split())
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 5
    assert load_drafter(out / "checkpoint" / "drafter", target).draft_vocab.tolist() == answered
    assert resumed.steps == 5
    changed = load_drafter(out / "checkpoint" / "drafter", target).state_dict()
    assert any(not torch.equal(saved[k], changed[k]) for k in saved)  # two more steps ran from the saved state
    metrics = (out / "metrics.json").read_text()
    with pytest.raises(DflashError, match="already reached step 5") as finished:  # nothing left to run
        train(options(tiny_qwen3_dir, prompt_file, out, steps=5, resume=True))
    assert "raise --steps above 5" in finished.value.fix and (out / "metrics.json").read_text() == metrics
    # Stopped after its last step, before it was measured (Ctrl-C while measuring tau): resuming saves and measures.
    (out / "metrics.json").unlink()
    measured = train(options(tiny_qwen3_dir, prompt_file, out, steps=5, resume=True))
    assert measured.steps == 5 and measured.final_loss == resumed.final_loss and (out / "metrics.json").is_file()

    # A crash mid-save, between moving the previous checkpoint aside and moving the new one in: resume finds it.
    (out / "checkpoint").rename(out / "checkpoint.previous")
    assert train(options(tiny_qwen3_dir, prompt_file, out, steps=6, resume=True)).steps == 6
    assert (out / "checkpoint" / "trainer_state.json").is_file() and not (out / "checkpoint.previous").exists()
    # A crash after the new checkpoint moved in, before the previous one was removed: the next save still works.
    shutil.copytree(out / "checkpoint", out / "checkpoint.previous")
    assert train(options(tiny_qwen3_dir, prompt_file, out, steps=7, resume=True)).steps == 7
    assert not (out / "checkpoint.previous").exists()

    # Other data or objective: a note names each change (the drafter's shape is refused below).
    said = StringIO()
    train(options(tiny_qwen3_dir, prompt_file, out, steps=8, max_new_tokens=10, resume=True), Console(file=said))
    assert "resuming with other settings than the checkpoint's: --max-tokens 12 -> 10" in " ".join(
        said.getvalue().split()
    )
    same_file = Path(os.path.relpath(prompt_file))  # the same prompts by another path; where it runs, not a note
    said = StringIO()
    again = options(tiny_qwen3_dir, same_file, out, steps=9, max_new_tokens=10, resume=True, device="cpu", threads=1)
    train(again, Console(file=said))
    assert "other settings" not in said.getvalue()
    with pytest.raises(DflashError, match="other settings"):
        train(options(tiny_qwen3_dir, prompt_file, out, steps=10, block_size=6, resume=True))
    # Other target layers: refused before their features are computed.
    with pytest.raises(DflashError, match=r"reads target layers \[.*\]; --feature-layers 1 names"):
        train(options(tiny_qwen3_dir, prompt_file, out, steps=10, feature_layers=1, resume=True))
    assert len(list((out / "distill").glob("features-*.bin"))) == 1


def test_a_run_can_start_from_another_drafters_weights(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    train(options(tiny_qwen3_dir, prompt_file, first, steps=3, feature_layers=3, mask_token_id=7))
    trained = load_file(str(first / "drafter" / "model.safetensors"))
    target, _ = open_target(str(tiny_qwen3_dir), "cpu", "float32")

    # Its weights exactly, its shape and MASK token (the run's --feature-layers does not apply), the run's block
    # size and draft vocabulary (neither is among the weights).
    later = options(tiny_qwen3_dir, prompt_file, tmp_path / "later", feature_layers=1, block_size=6)
    vocab = torch.tensor([3, 5, 7, 9, 11])
    started = started_drafter(target, first / "drafter", later, vocab)
    assert {k: v.float() for k, v in trained.items()}.keys() == started.state_dict().keys()
    assert all(torch.equal(trained[k].float(), v) for k, v in started.state_dict().items())
    saved = json.loads((first / "drafter" / "config.json").read_text())
    assert (
        started.config.num_hidden_layers == 1
        and started.config.target_layer_ids == saved["dflash_config"]["target_layer_ids"]
    )
    assert started.mask_token_id == 7 and started.block_size == 6 and started.draft_vocab.tolist() == vocab.tolist()

    # A whole run started from it: its first steps move those weights (a fresh drafter would start elsewhere).
    said = StringIO()
    result = train(
        options(tiny_qwen3_dir, prompt_file, tmp_path / "later", steps=1, init_from=str(first / "drafter")),
        Console(file=said, width=400),
    )
    assert f"Starting from the drafter in {first / 'drafter'} (1 layer" in said.getvalue()
    after = load_file(str(Path(result.output) / "model.safetensors"))
    assert after.keys() == trained.keys()
    moved = max((after[k].float() - trained[k].float()).abs().max().item() for k in trained)
    assert 0 < moved < 0.05  # one small step away from the drafter it started from
    said = StringIO()
    resumed = options(tiny_qwen3_dir, prompt_file, tmp_path / "later", steps=2, resume=True, init_from="x")
    train(resumed, Console(file=said, width=400))
    assert "--init-from x is not applied" in said.getvalue()
    # Resumed again without the flag: still shaped as the drafter it started from, not as the flags say.
    again = train(options(tiny_qwen3_dir, prompt_file, tmp_path / "later", steps=3, resume=True))
    assert (
        again.steps == 3
        and json.loads((tmp_path / "later" / "drafter" / "config.json").read_text())["dflash_config"]
        == saved["dflash_config"]
    )

    # A drafter made for another target: refused before the target answers anything (a long distillation).
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(first / "drafter", elsewhere)
    config = json.loads((elsewhere / "config.json").read_text())
    (elsewhere / "config.json").write_text(json.dumps({**config, "hidden_size": 8}))
    with pytest.raises(DflashError, match="a drafter for another target .hidden_size 8"):
        train(options(tiny_qwen3_dir, prompt_file, tmp_path / "refused", init_from=str(elsewhere)))
    assert not (tmp_path / "refused" / "distill" / ANSWERS_FILE).exists()

    # A drafter made for another target, or whose weights its config does not describe: refused, saying which.
    other = tmp_path / "other"
    shutil.copytree(first / "drafter", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_target_layers": 99}))
    with pytest.raises(DflashError, match="a drafter for another target .num_target_layers 99"):
        started_drafter(target, other, later)
    (other / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2})
    )
    with pytest.raises(DflashError, match="drafter weights in .* do not match its config: missing .'layers.1"):
        started_drafter(target, other, later)


def test_more_layers_grow_the_drafter_a_run_starts_from(
    tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    first = tmp_path / "first"
    train(options(tiny_qwen3_dir, prompt_file, first, steps=3))
    target, _ = open_target(str(tiny_qwen3_dir), "cpu", "float32")
    one = started_drafter(target, first / "drafter", options(tiny_qwen3_dir, prompt_file, tmp_path / "x"))
    three = started_drafter(target, first / "drafter", options(tiny_qwen3_dir, prompt_file, tmp_path / "x", layers=3))

    # Its own layers exactly, two new ones on top that start by changing nothing: it drafts exactly as before.
    assert one.config.num_hidden_layers == 1 and three.config.num_hidden_layers == 3
    assert three.config.layer_types == ["full_attention"] * 3
    assert all(torch.equal(value, three.state_dict()[name]) for name, value in one.state_dict().items())
    assert three.layers[1].self_attn.q_proj.weight.abs().sum() > 0  # (the rest of a new layer is not zero)
    torch.manual_seed(1)
    features = torch.randn(2, 5, one.fc.in_features)
    blocks = one.embed(torch.randint(0, 50, (2, one.block_size)))
    positions = torch.arange(5 + one.block_size).expand(2, -1)
    with torch.no_grad():
        drafted = [d(torch.cat([d.fuse_context(features), blocks], 1), one.block_size, positions) for d in (one, three)]
    assert torch.equal(drafted[0], drafted[1])
    # ... and as decoding drafts, over its context cache, step after step.
    block = torch.full((1, one.block_size), one.mask_token_id)
    block[0, 0] = 3
    caches = [d.new_cache(32) for d in (one, three)]
    for start, context in ((0, features[:1]), (5, features[1:, :2])):
        with torch.no_grad():
            proposed = [d.propose([context], block, [start], cache) for d, cache in zip((one, three), caches)]
        assert torch.equal(proposed[0], proposed[1])
    # As many layers as it has: itself.
    same = started_drafter(target, first / "drafter", options(tiny_qwen3_dir, prompt_file, tmp_path / "x", layers=1))
    assert same.state_dict().keys() == one.state_dict().keys()
    # A drafter whose layers slide grows by sliding layers (its cache stays bounded).
    sliding = tmp_path / "sliding"
    shutil.copytree(first / "drafter", sliding)
    config = json.loads((sliding / "config.json").read_text())
    (sliding / "config.json").write_text(
        json.dumps({**config, "layer_types": ["sliding_attention"], "sliding_window": 4, "use_sliding_window": True})
    )
    grown_sliding = started_drafter(target, sliding, options(tiny_qwen3_dir, prompt_file, tmp_path / "x", layers=2))
    assert grown_sliding.config.layer_types == ["sliding_attention"] * 2

    # A whole run grows it, and resumes with its grown depth (naming another is refused before any work).
    said = StringIO()
    grown = options(
        tiny_qwen3_dir, prompt_file, tmp_path / "grown", steps=2, layers=3, init_from=str(first / "drafter")
    )
    train(grown, Console(file=said, width=400))
    assert "(3 layers, target layers" in said.getvalue() and "2 layers added on top" in said.getvalue()
    trained = load_file(str(tmp_path / "grown" / "drafter" / "model.safetensors"))
    assert trained["layers.2.self_attn.o_proj.weight"].abs().sum() > 0  # the added depth trains
    again = train(options(tiny_qwen3_dir, prompt_file, tmp_path / "grown", steps=3, resume=True))
    config = json.loads((tmp_path / "grown" / "drafter" / "config.json").read_text())
    assert again.steps == 3 and config["num_hidden_layers"] == 3
    with pytest.raises(DflashError, match="--layers 2: the checkpoint in .* has a drafter of 3 layers"):
        train(options(tiny_qwen3_dir, prompt_file, tmp_path / "grown", steps=4, layers=2, resume=True))
    state = json.loads((tmp_path / "grown" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 3

    # Fewer layers than the drafter it starts from: refused before the target answers anything.
    with pytest.raises(DflashError, match="--layers 2: the drafter in .* has 3 layers"):
        train(
            options(
                tiny_qwen3_dir, prompt_file, tmp_path / "y", layers=2, init_from=str(tmp_path / "grown" / "drafter")
            )
        )
    assert not (tmp_path / "y" / "distill" / ANSWERS_FILE).exists()


def test_a_resumed_run_keeps_its_checkpoints_depth(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    train(options(tiny_qwen3_dir, prompt_file, tmp_path, steps=2, layers=2))
    again = train(options(tiny_qwen3_dir, prompt_file, tmp_path, steps=3, resume=True))  # no --layers: its 2
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert again.steps == 3 and config["num_hidden_layers"] == 2
    with pytest.raises(DflashError, match="--layers 1: the checkpoint in .* has a drafter of 2 layers"):
        train(options(tiny_qwen3_dir, prompt_file, tmp_path, steps=4, layers=1, resume=True))


def test_a_cpu_with_bf16_instructions_trains_in_the_precision_it_measures_faster() -> None:
    cpu = training.StepPrecision(torch.device("cpu"), bf16_native=True)
    tried = []
    for bf16_s, fp32_s in ((1.9, 0.5), (1.0, 0.6), (1.1, 0.4)):  # (the first bf16 step warms up)
        for seconds in (bf16_s, fp32_s):
            tried.append(cpu.next())
            said = cpu.timed(tried[-1], seconds)
    assert tried == [True, False] * 3  # alternating, then the faster stays
    assert (
        said == "Step precision: float32, 0.50 s a step against 1.10 in bf16 autocast (measured over the first 6 steps)"
    )
    assert cpu.next() is False and cpu.timed(False, 9.0) is None  # decided once
    faster_bf16 = training.StepPrecision(torch.device("cpu"), bf16_native=True)
    for seconds in (0.3, 0.5) * 3:
        faster_bf16.timed(faster_bf16.next(), seconds)
    assert faster_bf16.next() is True
    # A GPU trains in bf16 and a CPU that emulates it in float32, without measuring.
    for device, native, expected in (("cuda", True, True), ("cpu", False, False)):
        other = training.StepPrecision(torch.device(device), bf16_native=native)
        assert other.next() is expected and other.timed(expected, 1.0) is None and other.next() is expected


def test_a_run_says_the_step_precision_it_measured(
    tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(training, "serving_dtype", lambda device: torch.bfloat16)  # as on a CPU with AVX512-BF16
    said = StringIO()
    train(options(tiny_qwen3_dir, prompt_file, tmp_path, steps=7, dtype="float32"), Console(file=said, width=400))
    assert re.search(r"Step precision: (float32|bf16 autocast), [\d.]+ s a step against [\d.]+ in", said.getvalue())


def test_a_resume_notes_the_loss_gamma_the_loss_uses() -> None:
    run = TrainOptions(target="t", prompts="p.jsonl", output="o", block_size=8, gamma=1.5)
    saved = asdict(run)
    assert checkpoints.resumed_with_changes(saved, run) == ""
    assert checkpoints.resumed_with_changes(saved, replace(run, gamma=None)) == "--loss-gamma 1.5 -> 4.0"
    assert (
        checkpoints.resumed_with_changes({**saved, "gamma": None}, replace(run, gamma=4.0)) == ""
    )  # the published one


def test_ctrl_c_keeps_the_steps_since_the_last_checkpoint(
    tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while making the fifth batch (checkpoints every 3 steps): the four whole steps are saved, not three."""
    calls, make = [], training.make_batch

    def interrupted_at_the_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return make(*args, **kwargs)

    monkeypatch.setattr(training, "make_batch", interrupted_at_the_fifth)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(options(tiny_qwen3_dir, prompt_file, out, steps=50, checkpoint_every=3))
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["history"][-1]["step"] == 4
    assert "a checkpoint at step 4" in interrupted_training_state(out)
    monkeypatch.setattr(training, "make_batch", make)
    assert train(options(tiny_qwen3_dir, prompt_file, out, steps=6, checkpoint_every=3, resume=True)).steps == 6
    # The CPU seconds count on across the stop (the curve's x axis): the row the stop added carries them.
    rows = json.loads((out / "checkpoint" / "trainer_state.json").read_text())["history"]
    assert rows[-1]["step"] == 6 and rows[-1]["cpu_s"] >= state["history"][-1]["cpu_s"] > 0

    # Ctrl-C in the middle of a save (removing the checkpoint it replaced): the interrupt's own save still works.
    remove, cut = checkpoints.shutil.rmtree, []

    def interrupted_once(path, *args, **kwargs):
        if str(path).endswith(".previous") and not cut:
            cut.append(path)
            raise KeyboardInterrupt
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(checkpoints.shutil, "rmtree", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        train(options(tiny_qwen3_dir, prompt_file, out, steps=20, checkpoint_every=3, resume=True))
    assert cut and json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 9
    assert not (out / "checkpoint.previous").exists()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_background_run_stopped_by_a_signal_keeps_its_steps(
    stop: signal.Signals, tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kill` (SIGTERM), or `kill -INT` of a run started in the background (`nohup dflash train ... &`, where the
    shell leaves SIGINT ignored), stops `dflash train` as Ctrl-C does: the steps since the last checkpoint are
    saved and it says how to go on. Both signals arrive while the fifth batch is made (checkpoints every 3)."""
    calls, make = [], training.make_batch

    def signalled_at_the_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), stop)
        return make(*args, **kwargs)

    monkeypatch.setattr(training, "make_batch", signalled_at_the_fifth)
    out = tmp_path / "run"
    args = ["train", "--target", str(tiny_qwen3_dir), "--prompts", str(prompt_file), "--output", str(out),
            "--steps", "50", "--checkpoint-every", "3", "--batch-size", "4", "--block-size", "4",
            "--feature-layers", "2", "--max-tokens", "8", "--eval-prompts", "2", "--threads", "1"]  # fmt: skip
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job's shell leaves it
    try:
        result = CliRunner().invoke(app, args)
    finally:
        signal.signal(signal.SIGINT, handlers[0])
    assert signal.getsignal(signal.SIGTERM) == handlers[1]  # (the command's own handler is gone with it)
    assert result.exit_code != 0 and "a checkpoint at step 4" in result.output, result.output
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 4


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_the_update_saves_the_step_it_completes(
    stop: signal.Signals, tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    """Ctrl-C (or `kill`) that lands inside optimizer.step() of the fifth step (checkpoints every 3): the update
    finishes and the checkpoint is that step, its optimizer state counting as many steps, not the third."""
    updates = []

    def signalled_in_the_fifth(optimizer, args, kwargs) -> None:
        updates.append(1)
        if len(updates) == 5:
            signal.raise_signal(stop)  # (a real signal, delivered while the update runs)

    out = tmp_path / "run"
    args = ["train", "--target", str(tiny_qwen3_dir), "--prompts", str(prompt_file), "--output", str(out),
            "--steps", "50", "--checkpoint-every", "3", "--batch-size", "4", "--block-size", "4",
            "--feature-layers", "2", "--max-tokens", "8", "--eval-prompts", "2", "--threads", "1"]  # fmt: skip
    hook = register_optimizer_step_post_hook(signalled_in_the_fifth)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        hook.remove()
    assert len(updates) == 5 and result.exit_code != 0 and "a checkpoint at step 5" in result.output, result.output
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 5 and state["history"][-1]["step"] == 5
    counted = {value for key, value in state["optimizer_scalars"].items() if key.endswith("/step")}
    assert counted == {5.0}


def test_a_checkpoint_line_shows_its_own_steps_figures(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    """A run in the background prints a line a checkpoint with the figures at that step: not the last history row's
    (one every 10 steps), which after a resume is the previous run's."""

    def lines(**overrides) -> dict[int, str]:
        out = StringIO()
        train(options(tiny_qwen3_dir, prompt_file, tmp_path / "run", **overrides), Console(file=out, width=300))
        said = re.findall(r"^step (\d+)/\d+: (.*)$", out.getvalue(), re.MULTILINE)
        return {int(step): figures for step, figures in said}

    first = lines(steps=6, checkpoint_every=6)
    resumed = lines(steps=12, checkpoint_every=2, resume=True)
    assert sorted(resumed) == [8, 10, 12] and "loss" in resumed[8]
    figures = [first[6], *resumed.values()]
    assert len(set(figures)) == len(figures), figures  # each step's own (its running loss, its time a step)


def test_follow_up_turns_add_answers_to_each_prompt(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    """--follow-ups 2: each training prompt's conversation is asked two follow-up questions after the target's own
    answer, and the target answers those too: three answers per prompt, cached like the first ones."""
    out = tmp_path / "run"
    train(options(tiny_qwen3_dir, prompt_file, out, steps=2, follow_ups=2, eval_prompts=2))
    records = [json.loads(line) for line in (out / "distill" / ANSWERS_FILE).read_text().splitlines()]
    first = len(PROMPTS) - 2  # (two held out: answered first, for held-out tau, with no follow-ups)
    assert len(records) == 3 * first + 2 and len({r["key"] for r in records}) == 3 * first + 2
    _, tokenizer = open_target(str(tiny_qwen3_dir), "cpu", "float32")
    held, records = records[:2], records[2:]
    assert sorted(p for r in held for p in PROMPTS[:2] if p in tokenizer.decode(r["prompt_ids"])) == sorted(PROMPTS[:2])
    answered = {tuple(r["prompt_ids"]): r["response_ids"] for r in records[:first]}
    follow = records[first:]
    for record in follow:  # the first turn and the target's answer to it, then one of the questions
        prompt = next(p for p in answered if tuple(record["prompt_ids"][: len(p)]) == p)
        text = tokenizer.decode(record["prompt_ids"][len(prompt) :])
        assert tokenizer.decode(answered[prompt], skip_special_tokens=True).strip() in text
        assert any(question in text for question in FOLLOW_UPS)
    questions = [next(q for q in FOLLOW_UPS if q in tokenizer.decode(r["prompt_ids"])) for r in follow]
    assert len(set(questions)) > 2  # rotated, not the same two for every prompt
    assert len(FOLLOW_UPS) == 8  # the CLI's --follow-ups maximum: each turn of a prompt asks another question


def test_train_minutes_bounds_the_training(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    """--train-minutes: training stops when the time is spent (here at once: after its first step), checkpointed
    there, and the result says how many steps ran; --resume goes on from it."""
    out = tmp_path / "run"
    result = train(options(tiny_qwen3_dir, prompt_file, out, steps=50, train_minutes=0.0))
    assert result.steps == 1 and result.history[-1]["step"] == 1
    row = result.history[-1]
    assert row["step_s"] > row["batch_s"] + row["features_s"] and row["batch_s"] > 0  # where a step's time went
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 1
    assert json.loads((out / "metrics.json").read_text())["steps"] == 1 and (out / "drafter").is_dir()
    assert train(options(tiny_qwen3_dir, prompt_file, out, steps=3, resume=True)).steps == 3


def test_the_learning_rate_decays_by_the_time_left_under_train_minutes() -> None:
    """Under --train-minutes the cosine ends where the clock will stop training, at the pace so far: a run cut by
    the time ends at the floor rate, not halfway down; --steps still bounds it."""
    opts = TrainOptions(target="t", prompts="p", output="o", steps=10_000, lr=1.0, warmup_steps=10)
    # 100 steps in 10 s, 20 s left: 200 more fit, the decay ends at step 300.
    assert fitted_horizon(100, 100, 10.0, 20.0, opts.steps) == 300
    assert fitted_horizon(100, 100, 10.0, 1e6, opts.steps) == opts.steps
    assert fitted_horizon(100, 100, 10.0, -1.0, opts.steps) == 100  # past the deadline: the next step is the last
    assert learning_rate(300, 1.0, 10, decay_progress(300, 10, 0.0, 300)) == pytest.approx(0.1)
    assert learning_rate(300, 1.0, 10, decay_progress(300, 10, 0.0, opts.steps)) > 0.99  # by --steps: near the peak
    halfway = decay_progress(155, 10, 0.0, 300)
    assert learning_rate(155, 1.0, 10, halfway) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(4, 1.0, 10, 0.0) == pytest.approx(0.5)  # warmup first, whatever the decay


def test_the_warmup_is_a_tenth_of_the_run() -> None:
    """From 1 step to at most 100: a short run reaches its peak rate; under --train-minutes, of the steps that fit."""
    opts = TrainOptions(target="t", prompts="p", output="o")
    assert [warmup_steps(opts, steps) for steps in (1, 5, 19, 20, 300, 2000, 100_000)] == [1, 1, 1, 2, 30, 100, 100]
    assert warmup_steps(replace(opts, warmup_steps=7), 2000) == 7


def test_a_short_run_reaches_its_peak_rate_and_decays(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    """--steps 5 with the default warmup: the first step is at --lr, and the rate decays from there every step."""
    rates = []

    def rate(optimizer, args, kwargs) -> None:
        rates.append(optimizer.param_groups[0]["lr"])

    hook = register_optimizer_step_pre_hook(rate)
    try:
        train(options(tiny_qwen3_dir, prompt_file, tmp_path / "run", steps=5, lr=1e-3, warmup_steps=None))
    finally:
        hook.remove()
    assert len(rates) == 5 and rates[0] == rates[1] == pytest.approx(1e-3)
    assert all(later < earlier for earlier, later in zip(rates[1:], rates[2:])) and rates[-1] < 0.5e-3


def test_a_resumed_run_goes_on_from_its_rate() -> None:
    """Resuming continues the decay where the checkpoint left it: by --steps exactly as an uninterrupted run, and
    under a new --train-minutes from that rate down to the floor, never back up to the peak."""
    w, steps = 10, 1000
    fresh = [decay_progress(s, w, 0.0, steps) for s in range(w, steps + 1)]
    saved = decay_progress(400, w, 0.0, steps)
    resumed = [decay_progress(s, 400, saved, steps) for s in range(400, steps + 1)]
    assert resumed == pytest.approx(fresh[400 - w :])
    # Resumed under a clock that fits 100 more steps: from the saved progress at once, to 1 at step 500.
    assert decay_progress(400, 400, saved, 500) == pytest.approx(saved)
    assert decay_progress(450, 400, saved, 500) == pytest.approx(saved + (1 - saved) / 2)
    assert decay_progress(500, 400, saved, 500) == 1.0 == decay_progress(900, 400, 1.0, 2000)


def test_a_checkpoint_records_its_decay_progress(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(options(tiny_qwen3_dir, prompt_file, out, steps=4, warmup_steps=1))
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["decay_progress"] == 1.0 and state["step"] == 4
    # Resumed with more --steps (stopped by the clock after one): at the floor already, it stays there; by the new
    # --steps alone it would be back at 3/7 + 4/7 * 1/4 of the way.
    resumed = options(tiny_qwen3_dir, prompt_file, out, steps=8, warmup_steps=1, train_minutes=0.0, resume=True)
    assert train(resumed).steps == 5
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["decay_progress"] == 1.0 and state["step"] == 5


def test_an_output_that_is_a_file_is_refused(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    with pytest.raises(DflashError, match="is a file") as refused:
        train(options(tiny_qwen3_dir, prompt_file, taken, steps=1))
    assert "directory" in refused.value.fix and taken.read_text() == "mine"


def test_bad_prompt_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(DflashError, match="bad.jsonl:2"):
        load_prompts(bad)
    with pytest.raises(DflashError, match="does not exist"):
        load_prompts(tmp_path / "missing.txt")


def test_cli_train_end_to_end(tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    args = [
        "train",
        "--target",
        str(tiny_qwen3_dir),
        "--prompts",
        str(prompt_file),
        "--output",
        str(out),
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--block-size",
        "4",
        "--feature-layers",
        "2",
        "--max-tokens",
        "8",
        "--eval-prompts",
        "2",
        "--threads",
        "1",
        "--mask-token-id",
        "7",
        "--loss-gamma",
        "1.5",
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "drafter" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 7
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["options"]["gamma"] == 1.5
    data = json.loads(result.stdout)
    assert data["steps"] == 3 and data["eval_prompts"] == 2
    assert "Threads: 1 thread: --threads" in result.stderr  # (the plan's line, as chat and run print it)
    assert data["chat_command"] == f"dflash chat --target {tiny_qwen3_dir} --drafter {out / 'drafter'}"
    assert (out / "drafter" / "model.safetensors").is_file() and (out / "metrics.json").is_file()

    again = CliRunner().invoke(app, args)  # the checkpoint exists: a clear error, not an overwrite
    assert again.exit_code == 1 and "--resume" in again.output

    # What Ctrl-C says: what the run kept, and the command's way on.
    answers = len((out / "distill" / ANSWERS_FILE).read_text().splitlines())
    said = interrupted_training_state(out)
    assert said.startswith(f"{answers} answers cached") and answers > 0
    assert "checkpoint at step 3" in said and "--resume" in said
    shutil.rmtree(out / "checkpoint")
    assert "no checkpoint yet: re-run the same command" in interrupted_training_state(out)


@pytest.fixture
def tiny_recipe(tiny_qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user recipe `tiny` for the tiny target, served with thinking off like the Qwen3 recipes."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "tiny.toml").write_text(
        f'name = "tiny"\ndescription = "t"\n[target]\nid = "{tiny_qwen3_dir}"\n'
        "[chat_template_kwargs]\nenable_thinking = false\n"
    )
    monkeypatch.setattr(recipes, "user_recipe_dir", lambda: folder)
    return "tiny"


def test_a_target_served_quantized_trains_unquantized(
    tiny_recipe: str, prompt_file: Path, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """A recipe whose CPU plan runs int4 weights (the demo's): the drafter's loss runs through the target's output
    head, which the packed int4/int8 kernels cannot differentiate, so training loads the target unquantized."""
    folder = tmp_path / "recipes"
    (folder / "tiny-int4.toml").write_text(
        f'name = "tiny-int4"\ndescription = "t"\n[target]\nid = "{tiny_qwen3_dir}"\n[gpu_overrides.cpu]\nquant = "int4"\n'
    )
    target, _ = open_target("tiny-int4", "cpu", "bfloat16")
    assert not [m for m in target.modules() if hasattr(m, "weight_buffers")]  # (engine.kernels.quantized's layers)
    out = tmp_path / "run"
    result = train(
        options(tiny_qwen3_dir, prompt_file, out, target="tiny-int4", steps=2, eval_prompts=0, feature_layers=1)
    )
    assert result.steps == 2 and math.isfinite(result.final_loss)

    # Its features are the served engine's (int4 kernels), the rows the drafter reads when it drafts, not the
    # dequantized training copy's: stored apart, under the served weights' name.
    layer_ids = json.loads((out / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    width = len(layer_ids) * target.config.hidden_size
    assert [p.name for p in (out / "distill").glob("features-*.bin")] == [
        "features-L" + "-".join(map(str, layer_ids)) + "-int4.bin"
    ]
    records = [json.loads(line) for line in (out / "distill" / ANSWERS_FILE).open()]
    stored = [Sample(r["key"], r["prompt_ids"], r["response_ids"]) for r in records if len(r["response_ids"]) >= 2]
    FeatureStore(out / "distill", layer_ids, width, "int4").attach(stored)
    served = open_session(RunOptions(recipe_name="tiny-int4", no_spec=True))
    source = ServedFeatures(served.target, layer_ids)
    try:
        for sample, rows in zip(stored, source.rows([s.ids for s in stored]), strict=True):
            assert torch.equal(sample.features, rows.to(torch.bfloat16))
    finally:
        source.close()
    forward = ForwardFeatures(target, layer_ids).rows([s.ids for s in stored])
    assert any(not torch.equal(s.features, rows.to(torch.bfloat16)) for s, rows in zip(stored, forward))

    # A run started from that drafter (its one target layer, where the flags name two) stores the features of
    # its layer, and so does its resume without the flag.
    later = tmp_path / "later"
    started = options(tiny_qwen3_dir, prompt_file, later, target="tiny-int4", steps=1, eval_prompts=0)
    train(replace(started, init_from=str(out / "drafter")))
    train(replace(started, steps=2, resume=True))
    assert layer_ids == [1] and started.feature_layers == 2
    assert [p.name for p in (later / "distill").glob("features-*.bin")] == [
        "features-L" + "-".join(map(str, layer_ids)) + "-int4.bin"
    ]


def test_prompts_are_rendered_as_the_recipe_serves_them(tiny_recipe: str, prompt_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(options(Path(tiny_recipe), prompt_file, out, target=tiny_recipe, steps=1, eval_prompts=0))
    _, tokenizer = open_target(tiny_recipe, "cpu", "float32")
    records = [json.loads(line) for line in (out / "distill" / ANSWERS_FILE).read_text().splitlines()]
    assert len(records) == len(PROMPTS)
    rendered = sorted(record["prompt_ids"] for record in records)
    messages = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    thinking_off = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, enable_thinking=False) for m in messages
    ]
    assert rendered == sorted(ids["input_ids"] for ids in thinking_off)
    thinking_on = [tokenizer.apply_chat_template(m, add_generation_prompt=True)["input_ids"] for m in messages]
    assert not set(map(tuple, rendered)) & set(map(tuple, thinking_on))


def test_train_ends_with_the_command_that_uses_the_drafter(tiny_recipe: str, prompt_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    args = [
        "train",
        "--target",
        tiny_recipe,
        "--prompts",
        str(prompt_file),
        "--output",
        str(out),
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--block-size",
        "4",
        "--feature-layers",
        "2",
        "--max-new-tokens",
        "4",
        "--eval-prompts",
        "2",
    ]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "tiny's target: cpu " in result.stderr  # the plan line names the recipe whose target answers, not "ad-hoc"
    use = f"dflash chat tiny --drafter {out / 'drafter'}"
    assert f"Use it: {use}" in result.stdout
    chat = CliRunner().invoke(app, [*use.split()[1:], "--prompt", "Hi", "--max-tokens", "3", "--stats"])
    assert (
        chat.exit_code == 0 and "(DFlash adaptive block ≤4: now " in chat.stderr
    )  # the printed command works as printed


def test_split_prompts_holds_out_the_first_n(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("a\nb\nc\n")
    train_part, held_out = split_prompts(path, None, 1)
    assert [r.messages[0]["content"] for r in held_out] == ["a"] and len(train_part) == 2
    few, one = split_prompts(path, None, 32)  # (the default's 32 would leave none: a quarter, at least one)
    assert [r.messages[0]["content"] for r in one] == ["a"] and len(few) == 2
    path.write_text("".join(f"p{i}\n" for i in range(9)))
    assert [len(part) for part in split_prompts(path, None, 9)] == [7, 2]
    path.write_text("a\n")
    with pytest.raises(DflashError, match="has 1 prompt: one is held out"):
        split_prompts(path, None, 3)
    path.write_text("a\nb\nc\n")
    everything, none = split_prompts(path, None, 0)
    assert len(everything) == 3 and none == []
    assert split_prompts(path, path, 2) == (everything, everything[:2])  # --eval-file: all of --prompts train


def test_loading_the_target_draws_no_tqdm_bars_into_our_progress(
    tiny_qwen3_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from transformers.utils import logging as hf_logging

    open_target(str(tiny_qwen3_dir), "cpu", "float32")
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # restored for whoever uses transformers next


def test_json_errors_never_read_at_at(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "unterminated}\n')
    with pytest.raises(DflashError, match=r"bad.jsonl:1: not valid JSON: Unterminated string starting at column 12"):
        load_prompts(bad)


def test_train_reads_prompt_files_like_run_and_bench(tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "hi", "id": "a"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert [(r.prompt, r.messages) for r in load_prompts(good)] == [
        ("hi", None),
        (None, ({"role": "user", "content": "yo"},)),
    ]
    # What a client asks for shapes the answer: tools and a response_format are taken (sampling is the flags').
    good.write_text(
        '{"prompt": "hi", "response_format": {"type": "json_object"}}\n'
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}\n'
    )
    constrained, tools = load_prompts(good)
    assert constrained.sampling["grammar"].kind == "json" and tools.tools.functions[0]["function"]["name"] == "f"
    for content, message in [
        ('{"prompt_ids": [1, 2]}\n', "p.jsonl:1: prompt_ids"),
        ('{"prompt": "a", "temperature": 0.5}\n', "sets temperature, but `dflash train`"),
        ('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n', 'p.jsonl:2: id "x" is already used'),
        ('{"text": "a"}\n', 'p.jsonl:1: a line needs exactly one of "prompt"'),
    ]:
        good.write_text(content)
        with pytest.raises(DflashError) as raised:
            load_prompts(good)
        assert message in raised.value.message
        assert "prompt_ids" not in raised.value.fix  # never suggests the token ids that train refuses


def test_a_run_refused_for_its_models_leaves_no_output_folder(
    tiny_qwen3_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "runs" / "x"
    with pytest.raises(DflashError, match="nope"):  # (offline: not a directory, not cached)
        train(options(tiny_qwen3_dir, prompt_file, out, init_from=str(tmp_path / "nope")), Console(file=io.StringIO()))
    assert not out.exists()


def test_a_text_file_of_prompts_reads_as_dflash_run_reads_one(tmp_path: Path) -> None:
    """`dflash train --prompts` and `dflash run` read a .txt alike (one reader): a line a user turn, blank lines
    skipped, a byte order mark dropped, a U+2028 inside a line kept in it; a file not UTF-8 is refused by line."""
    from dflash_cli.commands.run import read_requests
    from dflash_cli.training.prompts import load_prompts

    prompts = tmp_path / "p.txt"
    prompts.write_bytes("\ufeffWhat is 2+2?\n\nOne\u2028line\n".encode())
    trained, ran = load_prompts(prompts), read_requests(prompts).requests
    assert (
        [r.messages for r in trained]
        == [r.messages for r in ran]
        == [
            ({"role": "user", "content": "What is 2+2?"},),
            ({"role": "user", "content": "One\u2028line"},),
        ]
    )
    assert [r.id for r in trained] == ["p-1", "p-3"]
    prompts.write_bytes(b"fine\n\xff\n")
    with pytest.raises(DflashError, match="line 2: not UTF-8"):
        load_prompts(prompts)
