"""Training-step benchmark: the cost of one training step of the recipe's drafter, online (the frozen target
computes features and logits in the step) and offline (features from the data job's cache), against the cost
of the target's own forward pass over the same batch — interleaved, medians of repeats, one process. The
`offline_step_baseline` arm is the step as it was before the draft-vocabulary teacher (full-vocabulary fp32
teacher rows, no autocast, shuffled batches), on the same conversations: `offline_speedup_over_baseline`.

    python benchmarks/bench_train.py recipes/smollm2-135m-eagle3.yaml [key=value ...] [--repeats 5] [--batches 3]

With `--ranks 1 2` it instead runs the real launcher, `deepspeed --num_accelerators N --module
specdrafter.jobs.train` (what launch/train_<kind>.py runs; DS_ACCELERATOR=cpu here; the machine's cores split
evenly between the ranks), for `--steps` optimizer steps at each N, and reports the training tokens/s of the last
step's record (evaluation and checkpointing come after it), scaling over 1 rank, and the wall time of each launch:

    python benchmarks/bench_train.py recipes/smollm2-135m-eagle3.yaml --ranks 1 2 --steps 12 [--out runs/bench-train]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdrafter.core.io import SpecdrafterError, atomic_write_json
from specdrafter.data.assets import load_target
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import build_drafter, feature_layers, kind_of
from specdrafter.train.batches import TrainingData
from specdrafter.train.drafters import run_target
from specdrafter.train.objectives import Objective


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", help="run the DeepSpeed launcher at these world sizes instead")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per launch (--ranks)")
    parser.add_argument("--out", default="runs/bench-train", help="run folders and bench_train_ranks.json (--ranks)")
    args = parser.parse_args(argv)
    if args.ranks:
        try:
            report = ranks_benchmark(args.recipe, args.overrides, args.ranks, args.steps, Path(args.out))
        except SpecdrafterError as e:
            sys.exit(f"error: {e}")
        print(json.dumps(report, indent=2))
        return
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        t = cfg.train
        target, tokenizer = load_target(cfg.target.model, cfg.target.dtype.value,
                                        untested_architecture=cfg.target.untested_architecture)
        target.requires_grad_(False)
        layers = feature_layers(cfg, target.config)
        offline = TrainingData(t.data_dir, tokenizer, cfg.target.model, t.max_length, t.heldout, t.seed, layers)
        drafter = build_drafter(cfg, target, offline, tokenizer)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    optimizer = torch.optim.AdamW([p for p in drafter.module.parameters() if p.requires_grad], lr=1e-6)
    objective = Objective.of(t)
    mb = t.micro_batch_size
    chosen = offline.epoch_order(0)[: args.batches * mb]  # one set of conversations for every arm
    cached = [offline.batch(chosen[i * mb:(i + 1) * mb]) for i in range(args.batches)]  # in shuffled order
    by_length = sorted(chosen, key=lambda i: len(offline.sequences[i]))  # what train.group_by_length batches together
    grouped = [offline.batch(by_length[i * mb:(i + 1) * mb]) for i in range(args.batches)] if t.group_by_length else cached
    online = [type(b)(b.input_ids, b.loss_mask, b.attention_mask) for b in cached]  # the same batches, no features

    def target_forward(batch):
        with torch.no_grad():
            target(input_ids=batch.input_ids, attention_mask=batch.attention_mask)

    def step(batch, teacher_ids=drafter.teacher_ids, precision=t.precision.value):
        """One optimizer step as jobs/train.py takes it (teacher rows, autocast)."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp_bf16"):
            out = run_target(target, batch, layers, teacher_ids, t.temperature)
            predictions = drafter.predictions(drafter.module, batch, out)
        loss = sum(p.loss(objective)[0] for p in predictions)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def baseline_step(batch):
        """The step before the draft-vocabulary teacher, autocast and length grouping: full-vocabulary fp32 teacher."""
        step(batch, None, "fp32")

    arms = {"target_forward": (target_forward, cached), "online_step": (step, online),
            "offline_step": (step, grouped), "offline_step_baseline": (baseline_step, cached)}
    times = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, (fn, batches) in arms.items():  # interleaved: a noisy machine slows every arm alike
            start = time.perf_counter()
            for batch in batches:
                fn(batch)
            times[name].append(time.perf_counter() - start)
    tokens = sum(b.num_tokens for b in cached)  # the same real tokens in every arm
    median = {name: statistics.median(v) for name, v in times.items()}
    report = {"drafter": cfg.drafter.kind, "micro_batch_size": mb, "precision": t.precision.value,
              "group_by_length": t.group_by_length, "tokens_per_repeat": tokens,
              "tokens_per_s": {name: round(tokens / s, 1) for name, s in median.items()},
              "online_step_over_target_forward": round(median["online_step"] / median["target_forward"], 3),
              "offline_step_over_target_forward": round(median["offline_step"] / median["target_forward"], 3),
              "offline_speedup_over_baseline": round(median["offline_step_baseline"] / median["offline_step"], 3)}
    print(json.dumps(report, indent=2))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_benchmark(recipe: str, overrides, ranks, steps: int, out: Path) -> dict:
    """Training tokens/s of the real DeepSpeed launch at each world size, one launch after another."""
    cfg = load_recipe(recipe, overrides)  # checks the recipe and the overrides before any launch
    kind = kind_of(cfg)
    if not kind.training:
        raise SpecdrafterError(f"recipe key 'drafter.kind': {kind.name} is not trainable")
    cores = os.cpu_count() or 1
    runs = {}
    for n in ranks:
        run_dir = out / f"ranks-{n}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(max(1, cores // n)))
        deepspeed = Path(sys.executable).with_name("deepspeed")  # the launcher of this interpreter's environment
        cmd = [str(deepspeed) if deepspeed.exists() else "deepspeed", "--num_accelerators", str(n),
               "--master_port", str(_free_port()), "--module", "specdrafter.jobs.train", recipe, *overrides,
               f"output_dir={run_dir}", f"train.max_steps={steps}", f"train.eval_every={steps}", f"train.save_every={steps}",
               "train.decode_check_every=0", "train.wandb.mode=disabled"]
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        metrics = run_dir / "metrics.jsonl"
        if done.returncode != 0 or not metrics.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SpecdrafterError(f"the {n}-rank launch failed (exit {done.returncode}): {tail[0]}")
        last = json.loads(metrics.read_text().splitlines()[-1])
        runs[n] = {"tokens_per_s": round(last["tokens_per_s"], 1), "wall_s": round(wall, 1),
                   "threads_per_rank": int(env["OMP_NUM_THREADS"])}
    base = runs[ranks[0]]["tokens_per_s"]
    report = {"drafter": cfg.drafter.kind, "features": cfg.train.features.value, "steps": steps,
              "micro_batch_size_per_rank": cfg.train.micro_batch_size, "zero_stage": cfg.train.zero_stage,
              "ranks": {str(n): {**r, f"speedup_over_{ranks[0]}_rank": round(r["tokens_per_s"] / base, 3)}
                        for n, r in runs.items()}}
    atomic_write_json(out / "bench_train_ranks.json", report)
    return report


if __name__ == "__main__":
    main()
