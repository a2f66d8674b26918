"""What rolling back a hybrid target's recurrent state costs, per verify step, as a fraction of the verify.

A Qwen3.5-9B-proportioned target (random weights; 3 Gated DeltaNet layers + 1 gated attention layer, hidden 2048,
FFN 6144, DeltaNet 8 QK / 16 V heads of 128, vocab 32768) verifies a block of B tokens after a 128-token prompt;
then each method puts the state back to n kept tokens, for n = 1, B/4, B/2, B-1. Four methods:

- replay   (shipped, engine/hybrid.py: LinearStateRollback): record the recurrence inputs during the verify, rerun
             the recurrence kernel over the n kept steps for all layers in one call, cut the conv window.
- rerun    (shipped fallback): copy the states before the verify; restore them and run the target over n tokens.
- mixer    (measured, not shipped): copy the states; restore them and rerun only the DeltaNet layers (projections,
             conv, recurrence) on their recorded inputs for n tokens.
- pertoken (measured, not shipped): run the verify's recurrence token by token, keeping the state after each
             token; keep the n-th (no work after the verify, a slower verify and B states of memory).

Costs are CPU time of this process (one thread: the machine's other load hardly moves it), medians over
`--repeats` rounds with the methods interleaved. Prints one row per (method, n): extra work / verify.

    python -m benchmarks.hybrid_rollback_bench [--dtype float32] [--block 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import transformers

from dflash_cli.engine.target import hybrid
from dflash_cli.engine.target.hybrid import RULE, LinearStateRollback, hybrid_cache

PROMPT = 128
SHAPE = dict(  # the target's configuration (Qwen3.5-9B proportions)
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    max_position_embeddings=4096,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def target(dtype: torch.dtype) -> transformers.PreTrainedModel:
    config = transformers.Qwen3_5TextConfig(**SHAPE)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def per_token_rule(query, key, value, g, beta, initial_state=None, use_qk_l2norm_in_kernel=False, **_):
    """The gated delta rule one token at a time, returning every intermediate state (the `pertoken` method)."""
    heads = value.shape[2]
    if query.shape[2] != heads:
        query = query.repeat_interleave(heads // query.shape[2], dim=2)
        key = key.repeat_interleave(heads // key.shape[2], dim=2)
    q, k, v, b, decay = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q / q.shape[-1] ** 0.5
    state, out, states = initial_state.float(), torch.empty_like(v), []
    for t in range(q.shape[2]):
        state = state * decay[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * b[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[..., None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(-2)
        states.append(state)
    return out.transpose(1, 2).to(query.dtype), torch.stack(states)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, block_size = target(getattr(torch, args.dtype)), args.block
    print(
        f"load {os.getloadavg()}; {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, {args.dtype}, "
        f"block {block_size}"
    )
    prompt = torch.randint(1, 32000, (1, PROMPT))
    block = torch.randint(1, 32000, (1, block_size))
    positions = torch.arange(PROMPT, PROMPT + block_size)[None]
    modules = hybrid._rule_modules(model)
    mixers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]

    def verify(cache) -> None:
        model(input_ids=block, position_ids=positions, past_key_values=cache, use_cache=True)

    def crop(cache, length: int) -> None:
        for layer in cache.layers:
            if hasattr(layer, "keys") and layer.get_seq_length() > length:
                layer.crop(length - layer.get_seq_length())

    def run(method: str, n: int) -> tuple[float, float]:
        """(verify time, extra time of the method) for one step keeping n tokens."""
        cache = hybrid_cache(model)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        rollback = LinearStateRollback(model, cache)
        clock = time.process_time
        t0 = clock()
        verify(cache)
        plain = clock() - t0
        cache = hybrid_cache(model)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        rollback = LinearStateRollback(model, cache)
        linear = rollback.layers
        inputs: dict[int, torch.Tensor] = {}
        hooks = []
        t0 = clock()
        if method in ("replay", "rerun"):
            if method == "rerun":
                rollback._modules = []  # no fast path: the general method
            with rollback.verifying():
                verify(cache)

            def rerun(k: int) -> None:
                crop(cache, PROMPT)
                model(
                    input_ids=block[:, :k],
                    position_ids=positions[:, :k],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )

            rollback.keep([n], block_size, lambda _row, k: rerun(k))
        elif method == "mixer":
            saved = rollback._copy_states()

            def keep_input(i: int):
                def hook(_module, args, kwargs):
                    inputs[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

                return hook

            hooks = [m.register_forward_pre_hook(keep_input(i), with_kwargs=True) for i, m in enumerate(mixers)]
            verify(cache)
            for layer, (convs, recurrents) in zip(linear, saved):
                layer.conv_states[0].copy_(convs[0])
                layer.recurrent_states[0].copy_(recurrents[0])
            for i, mixer in enumerate(mixers):
                mixer(inputs[i][:, :n], cache_params=cache)
        else:  # pertoken
            states: list[torch.Tensor] = []
            kernels = {module: getattr(module, RULE) for module in modules}

            def capture(*a, **kw):
                out, all_states = per_token_rule(*a, **kw)
                states.append(all_states)
                return out, all_states[-1]

            for module in modules:
                setattr(module, RULE, capture)
            with contextlib.ExitStack() as stack:
                stack.callback(lambda: [setattr(m, RULE, k) for m, k in kernels.items()])
                verify(cache)
            for layer, all_states in zip(linear, states):
                layer.keep_conv(torch.tensor([0]), torch.tensor([n]), block_size)
                layer.recurrent_states[0].copy_(all_states[n - 1])
        total = clock() - t0
        for hook in hooks:
            hook.remove()
        return plain, total - plain

    methods = ["replay", "rerun", "mixer", "pertoken"]
    kept = sorted({1, block_size // 4, block_size // 2, block_size - 1})
    rows: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):
            for n in kept:
                for method in methods:
                    result = run(method, n)
                    if repeat:  # the first round warms up
                        rows.setdefault((method, n), []).append(result)
    print(f"{'method':9s} {'n':>3s} {'verify ms':>10s} {'extra ms':>9s}  extra / verify (median, min-max)")
    for method in methods:
        for n in kept:
            results = rows[(method, n)]
            ratios = sorted(extra / plain for plain, extra in results)
            verify_ms = statistics.median(plain for plain, _ in results) * 1000
            extra_ms = statistics.median(extra for _, extra in results) * 1000
            print(
                f"{method:9s} {n:3d} {verify_ms:10.1f} {extra_ms:9.2f}  {statistics.median(ratios):.3f} "
                f"({ratios[0]:.3f}-{ratios[-1]:.3f})"
            )
    print(f"load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
