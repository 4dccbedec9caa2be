#!/bin/bash
# DSpark ablations: each row of settings.txt is one learning-curve probe (benchmarks/bench_learning.py) of
# the main job's DSpark recipe on the main job's teacher-forced data, 300 drafter-only steps, one thread on one core,
# one probe at a time; the target's rows are computed once and shared (--rows). A finished row is skipped on a rerun.
#   python launch/generate_data.py recipes/smollm2-135m-data.yaml target.dtype=float32 \
#     "data.hidden_states.layer_ids=[2,9,15,21,27,28,30]"            # ~10 min on one thread
#   benchmarks/dspark_ablations/run.sh [OUT=runs/probe37] [CORE=1]
#   python benchmarks/dspark_ablations/table.py runs/probe37          # the Markdown table of every finished row
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/probe37}
CORE=${CORE:-1}
mkdir -p "$OUT"
while read -r name args; do
  [ -z "$name" ] && continue
  [ -f "$OUT/$name/learning.json" ] && continue
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 taskset -c "$CORE" python benchmarks/bench_learning.py recipes/smollm2-135m-dspark.yaml \
    train.data_dir=runs/smollm2-135m/data train.data_recipe=smollm2-135m-data.yaml train.heldout=16 $args \
    --steps 300 --every 100 --swap-context --out "$OUT/$name" --rows "$OUT/rows" > "$OUT/$name.log" 2>&1
done < benchmarks/dspark_ablations/settings.txt
