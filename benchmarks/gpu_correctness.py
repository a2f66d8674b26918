"""Correctness on a device (issue 18, part 2): the golden sets, exactly, and the greedy identity rate in bf16 and
NF4 with what causes each mismatch. One invocation, one JSON document.

For every golden set in tests/fixtures (copies of shared/conformance, made with z-lab's reference, and the extra
sets made with it for rules the public ones do not show):

- float32, eager, and float32 compiled (`compile=True`: on CUDA the target's verify runs under CUDA graphs over
  whole-buffer attention, a path no CPU test takes): DFlash's tokens and acceptance lengths must be the
  reference's, and the baseline's tokens its greedy tokens;
- float32, the paths a single decode does not take (`check_paths`): every case of a block size decoded together as
  rows of one batch (one verify and one draft forward a step for all rows; eager), and each case decoded as the
  second turn of a conversation that continues the first case's (prefix reuse; compiled where the run compiles):
  the same tokens and acceptance lengths as a fresh decode, and for the rows the golden tokens; and decoding under a
  JSON schema (`check_grammar`): DFlash's tokens are the plain loop's under the same grammar, and parse;
- bfloat16 and NF4 (bitsandbytes, compute in bf16): DFlash against the baseline of the same precision, case by
  case. At a case's first mismatch it records the top-2 logit margin there and the rank of DFlash's token,
  recomputed in one forward over the prefix (a third rounding of the same logits): a margin of a few bf16 ulps is
  a near-tie that the block's different kernel shapes rounded the other way (expected outside float32); a wide
  margin would be a bug.

Usage on a GPU machine: `python -m benchmarks.gpu_correctness --output $OUT/correctness.json` (about a minute).
`--device cpu --precisions float32` runs the same checks here (tests/benchmarks/test_gpu_correctness.py, on one
set). The golden sets are read from the checkout's tests/fixtures (`--fixtures`).
The greedy identity rate on a real model over the bench prompt sets is `dflash bench demo --before-after --full
--dtype bfloat16 --json` (per prompt: identical, first_mismatch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_bench import environment, quantize_nf4  # (the loader's NF4 settings, layer by layer)
from dflash_cli.engine import SamplingParams, collect, generate
from dflash_cli.engine.loop import Batch
from dflash_cli.loading.models import load_drafter

ROOT = Path(__file__).resolve().parents[1]  # the checkout

FIXTURES = ROOT / "tests" / "fixtures"
PRECISIONS = ("float32", "bfloat16", "nf4")


def golden_sets(fixtures: Path) -> list[str]:
    return sorted(str(path.parent.relative_to(fixtures)) for path in fixtures.rglob("golden.json"))


def load_target(directory: Path, precision: str, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    from dflash_cli.loading.hub import quiet_transformers_progress

    dtype = torch.float32 if precision == "float32" else torch.bfloat16
    with quiet_transformers_progress():
        target = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    if precision == "nf4":
        quantize_nf4(target, torch.bfloat16)
    return target


def decode(target: Any, drafter: Any, prompt: list[int], tokens: int, block_size: int | None, compile: bool) -> Any:
    steps = generate(
        target, drafter, prompt, SamplingParams(max_new_tokens=tokens), block_size=block_size, compile=compile
    )
    return collect(steps)


@torch.inference_mode()
def mismatch_cause(target: Any, prompt: list[int], baseline: list[int], dflash: list[int]) -> dict[str, Any]:
    """Where DFlash first left the baseline, and how close the choice was there (one forward over the prefix)."""
    at = next(i for i, (a, b) in enumerate(zip(baseline, dflash)) if a != b)
    ids = torch.tensor([prompt + baseline[:at]], device=target.get_input_embeddings().weight.device)
    logits = target(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2)
    rank = int((logits > logits[dflash[at]]).sum())
    return {
        "position": at,
        "baseline_token": baseline[at],
        "dflash_token": dflash[at],
        "dflash_token_rank": rank,
        "top2_margin": float(top.values[0] - top.values[1]),
    }


def check_set(directory: Path, precision: str, device: str, compile_modes: list[bool]) -> dict[str, Any]:
    golden = json.loads((directory / "golden.json").read_text())
    target = load_target(directory / golden["target_dir"], precision, device)
    drafter = load_drafter(directory / golden["drafter_dir"], target)
    tokens = golden["max_new_tokens"]
    result: dict[str, Any] = {"precision": precision, "cases": len(golden["cases"])}
    for compile in compile_modes:
        mode = "compiled" if compile else "eager"
        started, failures, identical, causes = time.perf_counter(), [], 0, []
        for case in golden["cases"]:
            prompt, block = case["prompt_ids"], case.get("block_size")
            spec = decode(target, drafter, prompt, tokens, block, compile)
            base = decode(target, None, prompt, tokens, None, compile)
            if precision == "float32":  # the reference's own numbers, exactly
                wrong = [
                    what
                    for what, ok in (
                        ("tokens", spec.token_ids == case["new_token_ids"]),
                        ("acceptance", spec.acceptance_lengths == case["acceptance_lengths"]),
                        ("baseline", base.token_ids == case["greedy_new_token_ids"]),
                    )
                    if not ok
                ]
                if wrong:
                    failures.append({"prompt": prompt[:4], "block_size": block, "wrong": wrong})
            elif spec.token_ids == base.token_ids:
                identical += 1
            else:
                causes.append(mismatch_cause(target, prompt, base.token_ids, spec.token_ids))
        entry: dict[str, Any] = {"seconds": round(time.perf_counter() - started, 2)}
        if precision == "float32":
            entry.update(passed=not failures, failures=failures)
        else:
            entry.update(identical=identical, mismatches=causes)
        result[mode] = entry
    return result


def decode_rows(target: Any, drafter: Any, prompts: list[list[int]], tokens: int, block_size: int | None) -> list[Any]:
    """`prompts` decoded together, a row each, in one batch: each row's token ids."""
    batch = Batch(target, drafter, rows=len(prompts), block_size=block_size)
    out: list[list[int]] = [[] for _ in prompts]
    try:
        for i, prompt in enumerate(prompts):
            batch.add(prompt, SamplingParams(max_new_tokens=tokens), key=i)
        while not batch.idle:
            for row, step in batch.step():
                if isinstance(step, BaseException):
                    raise step
                out[row.key] += step.token_ids
    finally:
        batch.close()
    return out


def check_paths(directory: Path, device: str, compile: bool) -> dict[str, Any]:
    """float32: the golden tokens through batched rows (eager: compiled steps run one row) and through prefix reuse
    (compiled with `compile`: on CUDA, a whole-buffer state that keeps a conversation's K/V) (module docstring)."""
    golden = json.loads((directory / "golden.json").read_text())
    target = load_target(directory / golden["target_dir"], "float32", device)
    drafter = load_drafter(directory / golden["drafter_dir"], target)
    tokens, cases = golden["max_new_tokens"], golden["cases"]
    started, failures = time.perf_counter(), []
    sizes: dict[int | None, list[dict[str, Any]]] = {}
    for case in cases:
        sizes.setdefault(case.get("block_size"), []).append(case)
    for block, group in sizes.items():
        rows = decode_rows(target, drafter, [c["prompt_ids"] for c in group], tokens, block)
        failures += [
            {"path": "rows", "prompt": c["prompt_ids"][:4], "block_size": block}
            for c, ids in zip(group, rows)
            if ids != c["new_token_ids"]
        ]
    # Prefix reuse: the first case's conversation at the case's block size, then each case's prompt as a turn that
    # continues it. The state keeps the first turn's K/V (and the drafter its context), so the second turn prefills
    # only its own tokens; a fresh decode (prefix_cache off) of the same prompt must give the same tokens. (At the
    # same block size: a sliding drafter's ring is shaped by the block, and a new block size starts a new one.)
    for case in cases:
        params = SamplingParams(max_new_tokens=tokens)
        block = case.get("block_size")
        first = next(c for c in cases if c.get("block_size") == block)
        turn = first["prompt_ids"] + first["new_token_ids"]
        collect(
            generate(target, drafter, first["prompt_ids"], params, block_size=first.get("block_size"), compile=compile)
        )
        prompt = turn + case["prompt_ids"]
        reused = collect(generate(target, drafter, prompt, params, block_size=block, compile=compile))
        fresh = collect(
            generate(target, drafter, prompt, params, block_size=block, compile=compile, prefix_cache=False)
        )
        # (the same acceptance too: with its context kept, the drafter proposes what it would have without reuse)
        same = (reused.token_ids, reused.acceptance_lengths) == (fresh.token_ids, fresh.acceptance_lengths)
        if not same or not reused.stats.cached_tokens:
            failures.append({"path": "prefix", "prompt": case["prompt_ids"][:4], "cached": reused.stats.cached_tokens})
    try:
        failures += check_grammar(target, drafter, compile)
    except ImportError as error:  # (the grammar library or what it needs is not installed: the rest stands)
        failures.append({"path": "grammar", "error": f"{type(error).__name__}: {error}"})
    return {"seconds": round(time.perf_counter() - started, 2), "passed": not failures, "failures": failures}


GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},  # (bounded: a random model writes digits forever)
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


def check_grammar(target: Any, drafter: Any, compile: bool) -> list[dict[str, Any]]:
    """Decoding under a JSON schema (the grammar library's masks on the device's logits): DFlash gives the tokens of
    the same loop without a drafter, and JSON that parses. The golden target with the byte-level tokenizer the tests
    build (tests/helpers: its 320 tokens fit the target's vocabulary). A failure names the path "grammar"."""
    import sys

    from dflash_cli.protocol.params import Grammar

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from helpers.tiny_models import tiny_tokenizer
    finally:
        sys.path.remove(str(ROOT / "tests"))
    tokenizer = tiny_tokenizer()
    failures = []
    for prompt in ("Hello! How can I help", "The quick brown fox", "def add(a, b):"):
        ids = tokenizer(prompt)["input_ids"]
        params = SamplingParams(
            max_new_tokens=80,
            stop_token_ids=(tokenizer.eos_token_id,),
            grammar=Grammar("json_schema", json.dumps(GRAMMAR_SCHEMA)),
        )
        plain, spec = (
            collect(generate(target, d, ids, params, tokenizer=tokenizer, compile=compile)) for d in (None, drafter)
        )
        try:
            json.loads(spec.text)
            parses = True
        except json.JSONDecodeError:
            parses = False
        if spec.token_ids != plain.token_ids or not parses:
            failures.append({"path": "grammar", "prompt": prompt, "parses": parses, "text": spec.text[:80]})
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--precisions", default=",".join(PRECISIONS), help=f"comma-separated, of {', '.join(PRECISIONS)}"
    )
    parser.add_argument("--sets", help="comma-separated golden set names (default: all)")
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="also run compiled (auto: on CUDA only; compiling on a CPU takes minutes)",
    )
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--fixtures", type=Path, default=FIXTURES, help="where the golden sets are")
    args = parser.parse_args(argv)
    precisions = [p for p in args.precisions.split(",") if p]
    unknown = set(precisions) - set(PRECISIONS)
    if unknown:
        parser.error(f"unknown precision {', '.join(sorted(unknown))}: use {', '.join(PRECISIONS)}")
    known = golden_sets(args.fixtures)
    sets = args.sets.split(",") if args.sets else known
    missing = set(sets) - set(known)
    if missing:
        parser.error(f"no golden set {', '.join(sorted(missing))}: there are {', '.join(known)}")
    compiled = args.compile == "on" or (args.compile == "auto" and args.device.startswith("cuda"))
    results: dict[str, Any] = {"environment": environment(torch.device(args.device)), "runs": []}
    ok = True
    for precision in precisions:
        for name in sets:
            try:
                modes = [False, True] if compiled else [False]
                run = {"set": name, **check_set(args.fixtures / name, precision, args.device, modes)}
                if precision == "float32":
                    run["paths"] = check_paths(args.fixtures / name, args.device, compiled)
            except Exception as error:  # one broken precision (no NF4 kernels) must not hide the rest
                run = {"set": name, "precision": precision, "error": f"{type(error).__name__}: {error}"}
            results["runs"].append(run)
            ok &= "error" not in run and all(
                run[m].get("passed", True) for m in ("eager", "compiled", "paths") if m in run
            )
            print(json.dumps(run), flush=True)
    if args.output:
        args.output.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
