"""The lines of a prompts file whose answers an answer cache already holds, printed in order (the demo drafter's
training runs on them while the rest is still being answered; see benchmarks/train_demo_drafter.sh).

    python -m benchmarks.answered_prompts PROMPTS.jsonl ANSWERS.jsonl MAX_TOKENS [--device D --dtype T] > answered.jsonl

An answer counts as `dflash train` counts it: written by the target and numerics the demo's plan gives here (for
`dflash train`'s --device, --dtype and --distill-batch-size), for the same rendered prompt, up to MAX_TOKENS (its
--max-tokens).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.answered_prompts", description=__doc__)
    parser.add_argument("prompts", type=Path)
    parser.add_argument("answers", type=Path)
    parser.add_argument("max_tokens", type=int)
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--batch-size", type=int)
    args = parser.parse_args(argv)

    from dflash_cli.loading.session import open_session
    from dflash_cli.protocol.params import SamplingParams
    from dflash_cli.setup.options import RunOptions
    from dflash_cli.setup.planning import PlanOverrides
    from dflash_cli.training.distill import answer_key, encode, producer, read_answers
    from dflash_cli.training.prompts import load_prompts

    options = RunOptions(
        target="demo",
        sampling=SamplingParams(max_new_tokens=args.max_tokens),
        no_spec=True,
        overrides=PlanOverrides(device=args.device, dtype=args.dtype, batch_size=args.batch_size),
    )
    session = open_session(options, batching=True)
    done = read_answers(args.answers, producer(session), args.max_tokens)
    lines = args.prompts.read_text().splitlines()
    answered = 0
    for request, ids, params in encode(session, options, load_prompts(args.prompts)):
        if answer_key(ids, params.grammar) in done:
            print(lines[request.line - 1])
            answered += 1
    print(f"{answered} of {len(lines)} prompts answered in {args.answers}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
