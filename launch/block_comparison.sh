#!/usr/bin/env bash
# EAGLE-3, DFlash and DSpark trained on the same regenerated SmolLM2 set and measured alike: the comparison in
# docs/results/block-comparison. Hours on a 2-core CPU (about 8); every step resumes, so rerun the script after an
# interruption.
#   nohup bash launch/block_comparison.sh > runs/block-comparison.log 2>&1 &
# Steps, one thread per process (one torch process per core is what this CPU does best):
#   data   the regenerated set, two workers sharing its shards
#   train  all on the same set, offline features; core A: DSpark, then DFlash; core B: EAGLE-3 (4 TTT steps)
#   eval   each drafter right after its training: MT-Bench, GSM8K, HumanEval; T 0 and 1; 8 prompts × 128 tokens
#   tf     core B, after EAGLE-3: DSpark on the teacher-forced set at the regenerated set's target tokens (online),
#          and its evaluation
#   bench  the quiet side-by-side decode benchmark of the three, both cores (run nothing else meanwhile)
#   report docs/results/block-comparison: the goals table, from the reports above
# STEPS="eval bench" bash launch/block_comparison.sh runs only those steps.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=runs/smollm2-135m
steps=${STEPS:-"data train eval tf bench report"}
say() { echo "[$(date -u +%H:%M:%S)] $*"; }
wants() { [[ " $steps " == *" $1 "* ]]; }

if wants data; then
  say "data: two workers on $runs/data-regen (logs $runs/regen-{0,1}.log)"
  for w in 0 1; do
    OMP_NUM_THREADS=1 python launch/generate_data.py recipes/smollm2-135m-data-regen.yaml data.workers=2 \
      data.worker=$w > "$runs/regen-$w.log" 2>&1 &
  done
  wait
fi
[[ -f $runs/data-regen/stats.json ]] || { say "the data job has not finished ($runs/data-regen/stats.json missing)"; exit 1; }

train() {  # train LAUNCHER NAME [OVERRIDE...]: recipes/smollm2-135m-NAME.yaml → $runs/NAME/drafter (skipped once there)
  local launcher=$1 name=$2; shift 2
  [[ -d $runs/$name/drafter ]] && { say "$name: trained already"; return; }
  say "training $name (log $runs/train-$name.log)"
  python launch/$launcher recipes/smollm2-135m-${name%-tf}.yaml "$@" > "$runs/train-$name.log" 2>&1
}
sets="[mtbench,gsm8k,humaneval]"
evaluate() {  # evaluate NAME: $runs/NAME/drafter → $runs/NAME/eval/report.md
  local name=$1 sweep="[]"
  [[ $name == eagle3-regen ]] && sweep="[7]"  # EAGLE-3 at its k = 4, and at the blocks' 7 on MT-Bench, T 0
  say "evaluating $name → $runs/$name/eval/report.md"
  python launch/eval_acceptance.py recipes/smollm2-135m-${name%-tf}.yaml checkpoint=$runs/$name/drafter \
    "eval.sets=$sets" eval.num_prompts=8 eval.max_new_tokens=128 "eval.temperatures=[0,1]" "eval.k_sweep=$sweep" \
    eval.repeats=1 > "$runs/eval-$name.log" 2>&1
}
tf() {  # the same drafter on ShareGPT's own answers, teacher-forced, as many target tokens as the regenerated set
  local tokens
  tokens=$(python -c "import json; print(json.load(open('$runs/data-regen/stats.json'))['response_tokens'])")
  train train_block.py dspark-tf output_dir=$runs/dspark-tf train.data_dir=$runs/data-tf \
    train.data_recipe=smollm2-135m-data-tf.yaml train.features=online train.data_tokens=$tokens
  evaluate dspark-tf
}
core_a() {
  if wants train; then train train_block.py dspark; fi
  if wants eval; then evaluate dspark; fi
  if wants train; then train train_block.py dflash; fi
  if wants eval; then evaluate dflash; fi
}
core_b() {
  if wants train; then train train_eagle.py eagle3-regen; fi
  if wants eval; then evaluate eagle3-regen; fi
  if wants tf; then tf; fi
}
if wants train || wants eval || wants tf; then
  export OMP_NUM_THREADS=1
  core_a & a=$!
  core_b & b=$!
  wait $a; wait $b
  unset OMP_NUM_THREADS
fi

bench() {  # bench NAME DTYPE OVERRIDE... -- ARMS...: one side-by-side run of the three drafters
  local name=$1 dtype=$2; shift 2
  local overrides=(); while [[ $1 != -- ]]; do overrides+=("$1"); shift; done; shift
  [[ -f $runs/$name/bench_decode.json ]] && { say "$name: measured already"; return; }
  say "decode benchmark $name, $dtype target → $runs/$name/bench_decode.md"
  python benchmarks/bench_decode.py recipes/smollm2-135m-dspark.yaml target.dtype=$dtype "${overrides[@]}" \
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

if wants report; then
  say "report → docs/results/block-comparison/README.md"
  python -m specdrafter.eval.compare --runs $runs --drafters eagle3-regen dflash dspark dspark-tf \
    --baseline eagle3-regen --candidate dspark --out docs/results/block-comparison
fi
say "done"
