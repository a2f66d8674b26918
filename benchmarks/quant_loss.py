"""What the CPU's weight-only formats (`--quant int4` / `int8`) cost in quality, against bf16 and float32.

The reference is the target in float32 (for the demo offline: its GGUF's Q4_1 weights, exactly). For each prompt
of the bench sets (math, code, chat, interleaved), its greedy continuation is the reference text; bf16, int4 and
int8 (bf16 compute) then read prompt + reference in one forward (teacher forcing), and we report for each:

- `argmax agreement`: the share of reference positions where its top token is the reference token (float32's own
  figure is given too: one long forward and token-by-token decoding may round a near-tie differently);
- `mean logprob diff`: the mean over those positions of log p_ref(token) - log p(token) (nats; > 0: it finds the
  reference less likely);
- `mean KL`: KL(p_ref || p) per position (nats);
- `identical greedy`: the share of prompts whose own greedy continuation equals the reference entirely.

    python -m benchmarks.quant_loss                     # the demo target, 24 prompts, 64 tokens each
    python -m benchmarks.quant_loss --prompts 6 --tokens 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dflash_cli.engine.loop import speculative_generate
from dflash_cli.setup.choices import Quant

CPU_FORMATS = [quant.value for quant in Quant if quant.cpu_kernels]


def load(recipe_name: str | None, target: str | None, quant: str, dtype: str = "bfloat16") -> tuple[Any, Any]:
    """The target and tokenizer as `dflash` loads them on this CPU in `dtype`, `quant` ("none", "int4", "int8"): for
    the demo offline under int4, straight from its GGUF's groups."""
    from dflash_cli.loading import models as loading
    from dflash_cli.setup.hardware import detect_machine
    from dflash_cli.setup.planning import PlanOverrides, make_plan
    from dflash_cli.setup.recipes import resolve_recipe

    recipe = resolve_recipe(recipe_name if target is None else None, None, target, None)
    plan = make_plan(detect_machine(), recipe, PlanOverrides(device="cpu", dtype=dtype, quant=quant))
    loaded = loading.load_models(recipe, plan, with_drafter=False)
    return loaded.target, loaded.tokenizer


def encoded_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    from dflash_cli.bench.prompts import load_prompt_set
    from dflash_cli.loading.session import apply_chat_template

    prompts = load_prompt_set("all")[:count]
    return [apply_chat_template(tokenizer, p.messages or [{"role": "user", "content": p.prompt}], {}) for p in prompts]


def position_logprobs(target: Any, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log p(. | prefix) at each continuation position, [len(continuation), vocab], in float32."""
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = target(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def compare(reference: torch.Tensor, other: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    picked_ref = reference.gather(1, tokens[:, None])[:, 0]
    picked = other.gather(1, tokens[:, None])[:, 0]
    kl = (reference.exp() * (reference - other)).sum(-1)
    return {
        "argmax_agreement": (other.argmax(-1) == tokens).float().mean().item(),
        "mean_logprob_diff": (picked_ref - picked).mean().item(),
        "mean_kl": kl.mean().item(),
    }


def measure(models: dict[str, Any], prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """The figures above, per model name (the first is the reference), averaged over prompts."""
    names = list(models)
    sums: dict[str, dict[str, float]] = {name: {} for name in names}
    identical = dict.fromkeys(names, 0)
    for prompt in prompts:
        greedy = {name: speculative_generate(model, None, prompt, tokens).token_ids for name, model in models.items()}
        reference = greedy[names[0]]
        expected = torch.tensor(reference)
        base = position_logprobs(models[names[0]], prompt, reference)
        for name, model in models.items():
            figures = compare(base, position_logprobs(model, prompt, reference), expected)
            for key, value in figures.items():
                sums[name][key] = sums[name].get(key, 0.0) + value
            identical[name] += greedy[name] == reference
    return {
        name: {
            **{k: v / len(prompts) for k, v in sums[name].items()},
            "identical_greedy": identical[name] / len(prompts),
        }
        for name in names
    }


def render(results: dict[str, Any], prompts: int, tokens: int) -> str:
    lines = [
        f"# {prompts} prompts x {tokens} tokens, against the float32 target's greedy continuation",
        "| weights | argmax agreement | mean logprob diff (nats) | mean KL (nats) | identical greedy |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['argmax_agreement']:.1%} | {r['mean_logprob_diff']:+.4f} | {r['mean_kl']:.4f} | "
            f"{r['identical_greedy']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--target", help="a model directory or repo id instead of the recipe's target")
    parser.add_argument("--prompts", type=int, default=24, help="how many bench prompts (default 24)")
    parser.add_argument("--tokens", type=int, default=64, help="reference tokens per prompt (default 64)")
    parser.add_argument("--quant", nargs="+", choices=CPU_FORMATS, default=CPU_FORMATS)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    reference, tokenizer = load(args.recipe, args.target, "none", "float32")
    models = {"fp32": reference, "bf16": load(args.recipe, args.target, "none")[0]}
    models |= {q: load(args.recipe, args.target, q)[0] for q in args.quant}
    prompts = encoded_prompts(tokenizer, args.prompts)
    results = measure(models, prompts, args.tokens)
    print(render(results, len(prompts), args.tokens))
    if args.json:
        args.json.write_text(json.dumps({"prompts": len(prompts), "tokens": args.tokens, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
