"""The training objective's tau of drafters on a run's stored answers and target features, on this machine.

`dflash train` reports tau over random anchors of its own batches, with the features it computed. This computes the
same figure (training.objective.dflash_loss: uniform anchors, the engine's acceptance rule) for any drafters over the
same samples and the features a run stored here, so a drafter trained elsewhere (a lent GPU) can be checked against
the numbers it trained to: the fifth GPU session's 2-layer drafter reported 2.64 there and gives 1.43 on this CPU's
features, where the CPU-trained drafter gives 1.84 (benchmarks/results/history.md). Decoding is slower than this
and counts steps, not anchors: `dflash bench --drafter DIR` gives the tau a user sees.

    python -m benchmarks.objective_tau RUN_DIR DRAFTER [DRAFTER ...] [--target demo] [--batches 12] [--block-size 8]

RUN_DIR is a `dflash train --output` directory whose `distill/` holds answers and the drafters' feature layers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.objective_tau", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a `dflash train --output` directory")
    parser.add_argument("drafters", type=Path, nargs="+")
    parser.add_argument("--target", default="demo")
    parser.add_argument("--batches", type=int, default=12, help="batches of 8 samples, the same for every drafter")
    parser.add_argument("--anchors", type=int, default=16)
    parser.add_argument("--block-size", type=int, help="default: each drafter's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--features",
        choices=["int4", "int8", "forward"],
        help="the stored features to read: the served engine's prefill (int4/int8: what `dflash train` stores for a "
        "target served with the CPU's kernels) or the training target's forward (older runs); default: the first "
        "the run holds, in that order",
    )
    args = parser.parse_args(argv)

    import torch

    from dflash_cli.loading.models import load_drafter
    from dflash_cli.training.data import make_batch
    from dflash_cli.training.distill import ANSWERS_FILE, Sample
    from dflash_cli.training.features import FeatureStore
    from dflash_cli.training.held_out import decoded_tau
    from dflash_cli.training.loop import open_target, serving_dtype, stored_features
    from dflash_cli.training.objective import dflash_loss
    from dflash_cli.training.options import TrainOptions

    distill = args.run / "distill"
    records = [json.loads(line) for line in (distill / ANSWERS_FILE).read_text().splitlines()]
    target, _ = open_target(args.target, "cpu", str(serving_dtype("cpu")).removeprefix("torch."))
    rows = []
    for path in args.drafters:
        drafter = load_drafter(str(path), target).float().eval()
        width = len(drafter.config.target_layer_ids) * target.config.hidden_size
        kinds = [args.features] if args.features else ["int4", "int8", "forward"]
        stores = [
            FeatureStore(distill, drafter.config.target_layer_ids, width, k.replace("forward", "")) for k in kinds
        ]
        store = next((s for s in stores if s.rows), stores[0])
        by_key: dict[str, Sample] = {}
        for record in records:  # (a prompt may have answers by several producers: the one its features are of)
            sample = Sample(record["key"], record["prompt_ids"], record["response_ids"])
            if sample.key not in by_key and len(sample.response_ids) >= 2 and not store.missing([sample]):
                by_key[sample.key] = sample
        samples = list(by_key.values())
        if not samples:
            print(f"{path}: no stored features of its layers in {distill}", file=sys.stderr)
            return 2
        store.attach(samples)
        pick = random.Random(args.seed)
        chosen = [pick.sample(samples, min(8, len(samples))) for _ in range(args.batches)]
        block = args.block_size or drafter.block_size
        gamma = TrainOptions(target="", prompts="", output="", block_size=block).loss_gamma
        taus = []
        for index, batch_samples in enumerate(chosen):
            batch = make_batch(batch_samples, args.anchors, block, drafter.mask_token_id, 0, random.Random(index))
            features = stored_features(batch_samples, batch.input_ids.shape[1], torch.device("cpu"))
            with torch.no_grad():
                taus.append(dflash_loss(drafter, features, batch, gamma)[1]["tau"])
        # What greedy decoding gets on the same answers (training.held_out): the mean over anchors weighs every
        # anchor alike, decoding steps over easy stretches (a looping answer) in few steps; 2026-11-28 a drafter
        # at objective 2.28 walked 1.76 on 64 training answers and decoded 1.41 held out.
        walked = decoded_tau(
            drafter, sorted({s.key: s for batch in chosen for s in batch}.values(), key=lambda s: s.key)
        )
        rows.append({"drafter": str(path), "samples": len(samples), "tau": sum(taus) / len(taus), "walked_tau": walked})
        print(
            f"{path}: objective tau {rows[-1]['tau']:.3f}, walked as decoding steps {walked:.3f} ({args.batches} "
            f"batches of {len(samples)} samples)"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
