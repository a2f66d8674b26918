"""Structured output under speculation: tau and tokens/s with and without a grammar, and the grammar's cost.

Each JSON-producing prompt (a chat message and a JSON schema) runs in four modes, back to back, through the same
session: `text` (DFlash, no grammar), `schema` (DFlash under the schema's grammar, drafts chosen under it too),
`schema, raw drafts` (the same, the drafter's own proposals) and `schema, no drafter` (constrained plain
decoding). `grammar ms/step`: the time the grammar's masks, draft choices and commits took per decode step, and
its share of the step (draft + verify). Also checks that the constrained modes give the same text (they must:
the drafts only change speed) and that every constrained reply validates against its schema.

    python -m benchmarks.grammar_bench [--recipe demo] [--max-tokens 96] [--rounds 1] [-- FLAGS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PROMPTS: list[tuple[str, dict[str, Any]]] = [
    (
        "Give a JSON record for a fictional person: name, age and city.",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
            "required": ["name", "age", "city"],
            "additionalProperties": False,
        },
    ),
    (
        "Describe France as JSON with its name, capital and main languages.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "capital": {"type": "string"},
                "languages": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "capital", "languages"],
            "additionalProperties": False,
        },
    ),
    (
        "List three fruits and their colors as JSON.",
        {
            "type": "object",
            "properties": {
                "fruits": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"fruit": {"type": "string"}, "color": {"type": "string"}},
                        "required": ["fruit", "color"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["fruits"],
            "additionalProperties": False,
        },
    ),
    (
        "Write a to-do item as JSON: a title, a priority from 1 to 5 and whether it is done.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                "done": {"type": "boolean"},
            },
            "required": ["title", "priority", "done"],
            "additionalProperties": False,
        },
    ),
]
MODES = ("text", "schema", "schema, raw drafts", "schema, no drafter")


@contextmanager
def grammar_clock() -> Iterator[list[float]]:
    """Seconds spent in the grammar's per-step work (masks, draft choices, commits), summed into the list."""
    from dflash_cli.engine.grammar import GrammarState

    spent = [0.0]
    originals = {name: getattr(GrammarState, name) for name in ("mask", "draft", "accept")}

    def timed(method: Any) -> Any:
        def run(self: Any, *args: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(self, *args)
            finally:
                spent[0] += time.perf_counter() - started

        return run

    for name, method in originals.items():
        setattr(GrammarState, name, timed(method))
    try:
        yield spent
    finally:
        for name, method in originals.items():
            setattr(GrammarState, name, method)


def raw_drafts(drafter: Any) -> Any:
    """The drafter, proposing as it would without a grammar (its constraints dropped)."""

    class RawDrafts(type(drafter)):
        def propose(self, *args: Any, constraints: Any = None, **kwargs: Any) -> Any:
            return super().propose(*args, **kwargs)

    copy = object.__new__(RawDrafts)
    copy.__dict__ = drafter.__dict__
    return copy


def run_mode(session: Any, options: Any, mode: str, message: str, schema: dict[str, Any], max_tokens: int) -> dict:
    from dflash_cli.engine import collect, generate
    from dflash_cli.protocol.requests import read_body

    body: dict[str, Any] = {"messages": [{"role": "user", "content": message}], "max_tokens": max_tokens}
    if mode != "text":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    request = read_body(body, "/v1/chat/completions")
    params = session.request_params(options, request)
    ids = session.encode_request(request)
    drafter = None if mode == "schema, no drafter" else session.drafter
    if mode == "schema, raw drafts":
        drafter = raw_drafts(drafter)
    policy = session._policy(drafter, None, False)
    with grammar_clock() as spent:
        result = collect(
            generate(
                session.target,
                drafter,
                ids,
                params,
                block_size=session.block_size,
                tokenizer=session.tokenizer,
                policy=policy,
            )
        )
    stats = result.stats
    return {
        "text": result.text,
        "tokens": len(result.token_ids),
        "steps": len(stats.acceptance_lengths),
        "decode_s": stats.decode_s,
        "step_s": stats.draft_s + stats.verify_s,
        "grammar_s": spent[0],
        "tau": stats.tau,
    }


def main(argv: list[str] | None = None) -> int:
    import jsonschema

    from dflash_cli.loading.session import open_session
    from dflash_cli.setup.options import RunOptions
    from dflash_cli.setup.planning import PlanOverrides

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default=None, help="float32: the constrained modes' texts must be identical")
    args = parser.parse_args(argv)
    options = RunOptions(recipe_name=args.recipe, threads=args.threads, overrides=PlanOverrides(dtype=args.dtype))
    session = open_session(options)
    session.ensure_drafter()
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    same = valid = 0
    for _ in range(args.rounds):
        for message, schema in PROMPTS:
            results = {mode: run_mode(session, options, mode, message, schema, args.max_tokens) for mode in MODES}
            for mode, result in results.items():
                rows[mode].append(result)
            constrained = [results[mode]["text"] for mode in MODES[1:]]
            same += len(set(constrained)) == 1
            try:
                jsonschema.validate(json.loads(constrained[0]), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass  # (a reply cut by --max-tokens is not complete JSON)
    total = len(PROMPTS) * args.rounds
    print(
        f"{args.recipe}: {session.plan_line()}; {len(PROMPTS)} JSON prompts x {args.rounds} round(s), "
        f"--max-tokens {args.max_tokens}"
    )
    print("| mode | tokens | tau | decode tok/s | vs text | grammar ms/step | grammar share of step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for mode in MODES:
        runs = rows[mode]
        tokens = sum(r["tokens"] for r in runs)
        steps = sum(r["steps"] for r in runs)
        rate = tokens / sum(r["decode_s"] for r in runs)
        base = base or rate
        tau = statistics.fmean(r["tau"] for r in runs)
        grammar_ms = 1000 * sum(r["grammar_s"] for r in runs) / max(steps, 1)
        share = sum(r["grammar_s"] for r in runs) / sum(r["step_s"] for r in runs)
        print(f"| {mode} | {tokens} | {tau:.2f} | {rate:.1f} | {rate / base:.2f}x | {grammar_ms:.2f} | {share:.1%} |")
    print(
        f"the constrained modes give the same text on {same}/{total} prompts (all of them in float32); "
        f"{valid}/{total} replies are complete and validate (the rest were cut by --max-tokens)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
