"""benchmarks/demo_prompts.py: the demo drafter's prompt files, rebuilt exactly, and its everyday requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import demo_prompts
from dflash_cli.training.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "dflash_cli" / "assets"


def texts(path: Path) -> list[str]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line.get("prompt") or line["messages"][-1]["content"] for line in lines]


@pytest.mark.slow
def test_the_shipped_files_are_rebuilt_exactly_from_a_checkout(tmp_path: Path) -> None:
    """`python -m benchmarks.demo_prompts DIR` from a checkout (no install needed) writes the shipped files byte for
    byte; held-out and bench prompts are never trained on."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.demo_prompts", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr
    assert "demo_prompts_eval.jsonl: 64 prompts" in done.stdout
    for name in ("demo_prompts_train.jsonl", "demo_prompts_eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (ASSETS / name).read_bytes(), name
    train, held_out = texts(ASSETS / "demo_prompts_train.jsonl"), texts(ASSETS / "demo_prompts_eval.jsonl")
    bench = [p for f in sorted((ASSETS / "bench_prompts").glob("*.jsonl")) for p in texts(f)]
    assert len(set(train)) == len(train) and len(bench) == 24
    assert not set(train) & set(held_out) and not set(train) & set(bench) and not set(held_out) & set(bench)


def test_everyday_requests_come_after_the_shipped_ones_in_every_kind(tmp_path: Path) -> None:
    """--everyday N adds N requests after the shipped training lines: distinct, never a held-out or bench prompt,
    each kind in its share (tools, JSON under a response_format, system prompts among them), and every line one
    `dflash train` reads."""
    demo_prompts.write_prompt_files(tmp_path, everyday=2000)
    shipped = (ASSETS / "demo_prompts_train.jsonl").read_text().splitlines()
    lines = (tmp_path / "demo_prompts_train.jsonl").read_text().splitlines()
    assert lines[: len(shipped)] == shipped and len(lines) == len(shipped) + 2000
    every = texts(tmp_path / "demo_prompts_train.jsonl")
    held_out = texts(ASSETS / "demo_prompts_eval.jsonl")
    bench = [p for f in sorted((ASSETS / "bench_prompts").glob("*.jsonl")) for p in texts(f)]
    assert len(set(every)) == len(every) and not set(every) & (set(held_out) | set(bench))
    added = [json.loads(line) for line in lines[len(shipped) :]]
    tools = sum("tools" in line for line in added)
    schemas = sum("response_format" in line for line in added)
    systems = sum(len(line.get("messages", ())) > 1 for line in added)
    assert 100 < tools < 400 and 150 < schemas < 500 and 300 < systems < 700, (tools, schemas, systems)
    requests = load_prompts(tmp_path / "demo_prompts_train.jsonl")
    assert sum(r.tools is not None for r in requests) == tools


def test_prose_requests_come_last_and_repeat_nothing(tmp_path: Path) -> None:
    """--prose N adds up to N open-ended prose requests after the everyday ones (N here, the pool being larger): none
    already in the file, held out or a bench prompt; no tools or response formats; a system prompt now and then;
    verbs agreeing with their subjects."""
    demo_prompts.write_prompt_files(tmp_path / "before", everyday=3000)
    demo_prompts.write_prompt_files(tmp_path / "after", everyday=3000, prose=4000)
    before = (tmp_path / "before" / "demo_prompts_train.jsonl").read_text().splitlines()
    lines = (tmp_path / "after" / "demo_prompts_train.jsonl").read_text().splitlines()
    assert lines[: len(before)] == before and len(lines) == len(before) + 4000
    every = texts(tmp_path / "after" / "demo_prompts_train.jsonl")
    held_out = texts(ASSETS / "demo_prompts_eval.jsonl")
    bench = [p for f in sorted((ASSETS / "bench_prompts").glob("*.jsonl")) for p in texts(f)]
    assert len(set(every)) == len(every) and not set(every) & (set(held_out) | set(bench))
    added = [json.loads(line) for line in lines[len(before) :]]
    assert not any("tools" in line or "response_format" in line for line in added)
    assert 700 < sum(len(line.get("messages", ())) > 1 for line in added) < 1300
    assert len(load_prompts(tmp_path / "after" / "demo_prompts_train.jsonl")) == len(lines)
    agreeing = demo_prompts.agreeing
    assert agreeing("What is {s}?", "fossils") == "What are fossils?"
    assert agreeing("Why is {s} important?", "stress") == "Why is stress important?"
    assert agreeing("How does {s} work?", "GPS") == "How does GPS work?"
    assert agreeing("How has {s} changed over time?", "bacteria") == "How have bacteria changed over time?"
