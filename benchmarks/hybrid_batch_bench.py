"""A small hybrid target decoded in batches of 1 and 4 rows: aggregate tok/s, and the rollback's share of a step.

The target is random (Qwen3.5-shaped: 3 Gated DeltaNet layers + 1 gated attention layer; or Bamba-shaped: Mamba-2
layers around an attention layer, the snapshot-and-rerun rollback), and so is the drafter (the engine's own
DFlashDrafter at random weights): nearly every draft is rejected, so every row of every step rolls back (its
kept count is 1), the worst case for the rollback. The same requests (random prompts of 16-48 tokens, 24 new
tokens each) run through `engine.Batch` at each row count, the row counts interleaved per round, so the machine's
load falls on both alike; the ratio is taken within a round. The rollback's share: time inside
`LinearStateRollback.keep` over the decode steps' time (the recording during the verify is not separated).

    python -m benchmarks.hybrid_batch_bench [--family qwen3_5|bamba] [--rows 1 4] [--requests 8] [--rounds 3]
                                          [--block 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from unittest import mock

import torch
import transformers

from dflash_cli.engine import Batch, SamplingParams
from dflash_cli.engine.drafter import DrafterConfig, make_drafter
from dflash_cli.engine.target.hybrid import LinearStateRollback

COMMON = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def target(family: str) -> transformers.PreTrainedModel:
    if family == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(
            **COMMON,
            num_hidden_layers=4,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
        )
    else:
        config = transformers.BambaConfig(
            **COMMON,
            num_hidden_layers=4,
            attn_layer_indices=[2],
            mamba_n_heads=16,
            mamba_d_head=64,
            mamba_d_state=64,
            mamba_n_groups=1,
            mamba_chunk_size=16,
        )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def drafter(model: transformers.PreTrainedModel, block: int):
    tc = model.config.get_text_config()
    config = DrafterConfig.for_target(
        tc,
        layers=1,
        block_size=block,
        mask_token_id=tc.vocab_size - 1,
        intermediate_size=2 * tc.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=tc.hidden_size // 4,
        max_position_embeddings=4096,
    )
    torch.manual_seed(1)
    return make_drafter(config, model).float().eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["qwen3_5", "bamba"], default="qwen3_5")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = target(args.family)
    draft = drafter(model, args.block)
    generator = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(1, 4000, (int(n),), generator=generator).tolist()
        for n in torch.randint(16, 49, (args.requests,), generator=generator)
    ]
    params = SamplingParams(max_new_tokens=24)
    rollback = {"s": 0.0}
    keep = LinearStateRollback.keep

    def timed_keep(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return keep(self, *a, **kw)
        finally:
            rollback["s"] += time.perf_counter() - t0

    def run(rows: int) -> tuple[float, float, float, list[list[int]]]:
        batch = Batch(model, draft, rows=rows, block_size=args.block)
        for i, prompt in enumerate(prompts):
            batch.add(prompt, params, key=i)
        out: list[list[int]] = [[] for _ in prompts]
        rollback["s"], decode_s, tokens = 0.0, 0.0, 0
        t0 = time.perf_counter()
        while not batch.idle:
            joining = batch.scheduler.joining
            s0 = time.perf_counter()
            for row, step in batch.step():
                out[row.key] += step.token_ids
                tokens += len(step.token_ids)
            if not joining:
                decode_s += time.perf_counter() - s0
        total = time.perf_counter() - t0
        batch.close()
        return tokens / total, rollback["s"] / decode_s, decode_s, out

    print(
        f"{args.family}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, fp32, block {args.block}, "
        f"{args.requests} requests x 24 tokens, {args.threads} thread(s); load average before: {os.getloadavg()}"
    )
    # the engine's rollback timed for this run only (put back after: the process may go on, as in the tests)
    with torch.inference_mode(), mock.patch.object(LinearStateRollback, "keep", timed_keep):
        run(args.rows[-1])  # warm-up
        results: dict[int, list[tuple[float, float]]] = {}
        texts = {}
        for round_ in range(1, args.rounds + 1):
            base = None
            for rows in args.rows:
                tok_s, share, _, out = run(rows)
                texts.setdefault(rows, out)
                base = base or tok_s
                results.setdefault(rows, []).append((tok_s / base, share))
                print(
                    f"round {round_} rows {rows}: {tok_s:.1f} tok/s ({tok_s / base:.2f}x rows {args.rows[0]}), "
                    f"rollback {share:.1%} of decode step time",
                    flush=True,
                )
    for rows, values in results.items():
        print(
            f"rows {rows}: median {statistics.median(r for r, _ in values):.2f}x, rollback share median "
            f"{statistics.median(s for _, s in values):.1%}"
        )
    same = all(texts[rows] == texts[args.rows[0]] for rows in texts)
    print(
        f"every request's tokens the same at every row count: {'yes' if same else 'NO'}; load average after: {os.getloadavg()}"
    )

    return 0


if __name__ == "__main__":
    sys.exit(main())
