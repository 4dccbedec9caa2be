#!/usr/bin/env bash
# EAGLE-3, DFlash and DSpark trained on the same regenerated SmolLM2 set and measured alike: the comparison in
# docs/results. Hours on a 2-core CPU (about 6); every step resumes, so rerun the script after an interruption.
#   nohup bash launch/block_comparison.sh > runs/block-comparison.log 2>&1 &
# Steps: the data job (two workers) → DSpark then DFlash on one core, EAGLE-3 on the other (one thread each) → each
# drafter's evaluation (MT-Bench, GSM8K, HumanEval; T 0 and 1; 8 prompts × 128 tokens), one at a time on both cores →
# the quiet side-by-side decode benchmark of the three. Run nothing else meanwhile: the last two steps time decoding.
# STEPS="eval bench" bash launch/block_comparison.sh runs only those steps.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=runs/smollm2-135m
steps=${STEPS:-"data train eval bench"}
say() { echo "[$(date -u +%H:%M:%S)] $*"; }
wants() { [[ " $steps " == *" $1 "* ]]; }

if wants data; then
  say "data: two workers on runs/smollm2-135m/data-regen (logs $runs/regen-{0,1}.log)"
  for w in 0 1; do
    OMP_NUM_THREADS=1 python launch/generate_data.py recipes/smollm2-135m-data-regen.yaml data.workers=2 \
      data.worker=$w > "$runs/regen-$w.log" 2>&1 &
  done
  wait
fi
[[ -f $runs/data-regen/stats.json ]] || { say "the data job has not finished ($runs/data-regen/stats.json missing)"; exit 1; }

if wants train; then
  say "training: DSpark then DFlash on one core, EAGLE-3 on the other (logs $runs/train-*.log)"
  (OMP_NUM_THREADS=1 python launch/train_block.py recipes/smollm2-135m-dspark.yaml > "$runs/train-dspark.log" 2>&1 &&
   OMP_NUM_THREADS=1 python launch/train_block.py recipes/smollm2-135m-dflash.yaml > "$runs/train-dflash.log" 2>&1) &
  OMP_NUM_THREADS=1 python launch/train_eagle.py recipes/smollm2-135m-eagle3-regen.yaml > "$runs/train-eagle3-regen.log" 2>&1 &
  wait
fi

sets="[mtbench,gsm8k,humaneval]"
if wants eval; then
  for kind in dspark dflash eagle3-regen; do
    sweep="[]"; [[ $kind == eagle3-regen ]] && sweep="[7]"  # EAGLE-3 at its k = 4, and at the blocks' 7 on MT-Bench, T 0
    say "evaluating $kind → $runs/$kind/eval/report.md"
    python launch/eval_acceptance.py recipes/smollm2-135m-$kind.yaml checkpoint=$runs/$kind/drafter "eval.sets=$sets" \
      eval.num_prompts=8 eval.max_new_tokens=128 "eval.temperatures=[0,1]" "eval.k_sweep=$sweep" eval.repeats=1 \
      > "$runs/eval-$kind.log" 2>&1
  done
fi

bench() {  # bench NAME DTYPE OVERRIDE... -- ARMS...: one side-by-side run of the three drafters
  local name=$1 dtype=$2; shift 2
  local overrides=(); while [[ $1 != -- ]]; do overrides+=("$1"); shift; done; shift
  say "decode benchmark $name, $dtype target → $runs/$name/bench_decode.md"
  python -m specdrafter.eval.bench_decode recipes/smollm2-135m-dspark.yaml target.dtype=$dtype "${overrides[@]}" \
    --eagle3 $runs/eagle3-regen/drafter --dflash $runs/dflash/drafter --dspark $runs/dspark/drafter \
    --sets mtbench gsm8k humaneval --prompts 4 --max-new-tokens 128 --repeats 3 --temperatures 0 1 \
    --arms "$@" --out "$runs/$name" > "$runs/$name.log" 2>&1
}
if wants bench; then
  # each drafter at the k its measured α, c and v(n) predict best; then DSpark at its γ = 7: fixed, confidence-sized, ASD
  bench bench-block-auto float32 inference.k=auto -- eagle3_chain dflash_chain dspark_chain
  bench bench-dspark float32 inference.k=7 -- dspark_chain dspark_confidence dspark_asd
  bench bench-block-auto-bf16 bfloat16 inference.k=auto -- eagle3_chain dflash_chain dspark_chain
fi
say "done"
