#!/usr/bin/env bash
# GPU check: the SmolLM2 pipeline end to end on one CUDA device in bf16, in at most 8 minutes, into one report folder.
#
#   bash launch/gpu_check.sh [REPORT_DIR]        on the GPU machine (default runs/gpu-check)
#   bash launch/gpu_check.sh --prepare           here, with PyPI access: .gpu_check/ for a machine that has neither
#                                                the project's packages nor network (see below)
#
# Steps (each under its own timeout, 450 s in all; a failed step is recorded and the rest still run):
#   1. data job      recipes/smollm2-135m-data.yaml, small: 256 GSM8K conversations teacher-forced (their reference
#                    answers), bf16 target, hidden states of layers 2, 15, 27, 30 cached
#   2. plan          launch/plan.py for the training run below
#   3. train         EAGLE-3 through the `deepspeed` launcher (NCCL), train.precision=bf16, 60 steps
#   4. evaluate      launch/eval_acceptance.py on the run's checkpoints (MT-Bench, 4 prompts, T = 0 and 1)
#   5. decode bench  benchmarks/bench_decode.py with the trained head
#   6. memory        benchmarks/bench_plan.py: the plan against torch.cuda.max_memory_allocated (ZeRO 0 and 2)
# REPORT_DIR gets report.md (steps, times, GPU, the plan line, results) and logs.txt (every step's output).
# GPU_CHECK_TIME_SCALE=N multiplies every step's timeout: a dry run of the script on a CPU needs about 5.
#
# A device machine without network (the project's sandboxed H200s): run --prepare here, then on the machine
#   bash launch/gpu_check.sh "$OUT"          with .gpu_check carried (the device tool's `carry: [".gpu_check"]`)
# .gpu_check/ holds wheels of the packages such an image lacks (deepspeed, omegaconf, datasets, ...) and the small
# assets: prompt sets and SmolLM2's config and tokenizer. SmolLM2's weights (517 MB) exceed what such a machine
# accepts (64 MiB), so there the target gets random weights of the same shape, marked in the report: memory, NCCL,
# bf16 and every code path are exercised; acceptance and speedups are then meaningless.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}

prepare() {
  local dir=.gpu_check
  grep -qx '/.gpu_check/' .git/info/exclude 2>/dev/null || echo '/.gpu_check/' >> .git/info/exclude
  mkdir -p $dir/wheels $dir/cache/prompts $dir/cache/models/SmolLM2-135M-Instruct
  local cache
  cache=$($PY -c "from specdrafter.data.assets import ensure_prompt_set, ensure_smollm2, cache_dir; [ensure_prompt_set(s) for s in ('mtbench','gsm8k','humaneval')]; ensure_smollm2(); print(cache_dir())")
  cp "$cache"/prompts/{mtbench,gsm8k,humaneval}.jsonl $dir/cache/prompts/
  for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
    cp "$cache/models/SmolLM2-135M-Instruct/$f" $dir/cache/models/SmolLM2-135M-Instruct/ 2>/dev/null || true
  done
  # Pure-Python packages built here (sdists), binary ones for the machine's CPython 3.12 on x86-64 Linux.
  local ver
  ver() { $PY -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
  $PY -m pip wheel -q --no-deps -w $dir/wheels "deepspeed==$(ver deepspeed)" "antlr4-python3-runtime==$(ver antlr4-python3-runtime)"
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $dir/wheels \
    "omegaconf==$(ver omegaconf)" "datasets==$(ver datasets)" "dill==$(ver dill)" "multiprocess==$(ver multiprocess)" \
    "platformdirs==$(ver platformdirs)" "hjson==$(ver hjson)" "pydantic==$(ver pydantic)" "pydantic-core==$(ver pydantic-core)" \
    "annotated-types==$(ver annotated-types)" "typing-inspection==$(ver typing-inspection)"
  du -sh $dir
  echo "carry .gpu_check to the GPU machine and run: bash launch/gpu_check.sh \"\$OUT\""
}

if [ "${1:-}" = "--prepare" ]; then prepare; exit $?; fi

REPORT=$(mkdir -p "${1:-runs/gpu-check}" && cd "${1:-runs/gpu-check}" && pwd)
RUN=${GPU_CHECK_RUN:-/tmp/gpu-check-run}
rm -rf "$RUN" && mkdir -p "$RUN"
LOG=$REPORT/logs.txt
: > "$LOG"
STEPS=()
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
START=$SECONDS

if [ -d .gpu_check/wheels ] && ! $PY -c "import deepspeed, omegaconf, datasets" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu_check/wheels/*.whl >> "$LOG" 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
if ! $PY -c "import specdrafter.core" 2>/dev/null; then  # the project is not installed there: map its folders
  mkdir -p /tmp/site/specdrafter                             # onto the `specdrafter` namespace, as pyproject.toml does
  for pkg in core models data train inference kinds jobs eval export recipes; do ln -sfn "$ROOT/$pkg" "/tmp/site/specdrafter/$pkg"; done
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
WEIGHTS="converted SmolLM2-135M-Instruct"
if [ -d .gpu_check/cache ]; then
  export SPECDRAFTER_CACHE=$RUN/cache
  cp -r .gpu_check/cache "$SPECDRAFTER_CACHE"
  MODEL=$SPECDRAFTER_CACHE/models/SmolLM2-135M-Instruct
  if [ ! -f "$MODEL/model.safetensors" ]; then  # the real weights did not travel: random ones of the same shape
    WEIGHTS="RANDOM weights of SmolLM2-135M's shape (acceptance and speedups meaningless)"
    $PY - "$MODEL" >> "$LOG" 2>&1 <<'EOF'
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
folder = sys.argv[1]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
model.save_pretrained(folder)
json.dump({"identical": True, "random_weights": True}, open(f"{folder}/conversion_check.json", "w"))
EOF
  fi
fi

# step NAME SECONDS COMMAND...: run under a timeout, log it, record status and time
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" >> "$LOG"
  timeout --kill-after=10 "$((limit * ${GPU_CHECK_TIME_SCALE:-1}))" "$@" >> "$LOG" 2>&1
  local rc=$?
  local status=ok
  [ $rc -eq 0 ] || status="FAILED (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"
  STEPS+=("| $name | $status | $((SECONDS - t0)) |")
  echo "=== $name: $status in $((SECONDS - t0)) s" >> "$LOG"
  return $rc
}

DEEPSPEED=$(command -v deepspeed || echo "$PY -m deepspeed.launcher.runner")
DATA=$RUN/data
EAGLE=$RUN/eagle3
TRAIN=(recipes/smollm2-135m-eagle3.yaml output_dir=$EAGLE train.data_dir=$DATA train.precision=bf16 train.max_steps=60
       train.eval_every=30 train.save_every=30 train.heldout=8 train.wandb.mode=disabled)

step "data job" 90 $PY launch/generate_data.py recipes/smollm2-135m-data.yaml output_dir=$DATA target.dtype=bfloat16 \
  data.prompts=gsm8k "data.exclude=[mtbench,humaneval]" data.responses=dataset data.num_conversations=256 data.shard_size=128
step "plan" 45 $PY launch/plan.py "${TRAIN[@]}" --gpus-per-node 1
step "train (deepspeed, NCCL, bf16)" 120 $DEEPSPEED --num_gpus 1 launch/train_eagle.py "${TRAIN[@]}"
step "evaluate" 75 $PY launch/eval_acceptance.py recipes/smollm2-135m-eagle3.yaml checkpoint=$EAGLE \
  output_dir=$EAGLE train.data_dir=$DATA "eval.sets=[mtbench]" eval.num_prompts=4 eval.max_new_tokens=32 \
  "eval.temperatures=[0,1]" "eval.k_sweep=[1,2,4]" eval.output_dir=$RUN/eval
step "decode bench" 60 $PY benchmarks/bench_decode.py recipes/smollm2-135m-generate.yaml --eagle3 $EAGLE/drafter \
  --sets mtbench --prompts 2 --max-new-tokens 32 --repeats 1 --temperatures 0 --out $RUN/bench
step "memory: plan vs max_memory_allocated" 90 $PY benchmarks/bench_plan.py --runs eagle3:0:1 eagle3:2:1 medusa:0:1 \
  draft:0:1 --steps 3 --out $REPORT/bench_plan.json

# ------------------------------------------------------------------------------------------------- report
{
  echo "# GPU check"
  echo
  echo "- when: $(date -u +%FT%TZ); total $((SECONDS - START)) s (budget 480 s)"
  echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'nvidia-smi absent')"
  echo "- torch: $($PY -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())' 2>&1 | tail -1)"
  echo "- deepspeed: $($PY -c 'import deepspeed; print(deepspeed.__version__)' 2>&1 | tail -1); transformers: $($PY -c 'import transformers; print(transformers.__version__)' 2>&1 | tail -1)"
  echo "- target: $WEIGHTS"
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---|"
  printf '%s\n' "${STEPS[@]}"
  echo
  echo "## Plan (launcher's check and launch/plan.py)"
  echo '```'
  grep -h "^plan:" "$LOG" | head -3
  sed -n '/^=== plan:/,/^=== plan: /p' "$LOG" | grep -E "^\s+(total|activations|target weights|teacher logits)" | head -8
  echo '```'
  echo
  echo "## Training (last metrics)"
  echo '```'
  tail -n 2 "$EAGLE/metrics.jsonl" 2>/dev/null || echo "no metrics.jsonl"
  echo '```'
  echo
  echo "## Memory: plan vs torch.cuda.max_memory_allocated"
  echo '```'
  sed -n '/^=== memory/,/^=== memory/p' "$LOG" | grep -E "^(recipe|eagle3|medusa|draft) " || echo "no table"
  echo '```'
  echo
  echo "## Evaluation"
  sed -n '1,40p' "$RUN/eval/report.md" 2>/dev/null || echo "no report.md"
  echo
  echo "## Decode benchmark"
  sed -n '1,30p' "$RUN/bench/bench_decode.md" 2>/dev/null || echo "no bench_decode.md"
} > "$REPORT/report.md"
cp "$EAGLE/metrics.jsonl" "$REPORT/" 2>/dev/null
echo "report: $REPORT/report.md"
