"""Training-step benchmark: the cost of one training step of the recipe's drafter, online (the frozen target
computes features and logits in the step) and offline (features from the data job's cache), against the cost
of the target's own forward pass over the same batch — interleaved, medians of repeats, one process.

    python -m eval.bench_train recipes/smollm2-135m-eagle3.yaml [key=value ...] [--repeats 5] [--batches 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from data.assets import load_target
from data.io import SpecdrafterError
from data.recipe import load_recipe
from train.batches import TrainingData
from train.drafters import build_drafter, needed_layers, run_target
from train.loop import prediction_loss


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        t = cfg.train
        target, tokenizer = load_target(cfg.target.model, cfg.target.dtype.value)
        target.requires_grad_(False)
        layers = needed_layers(cfg, target.config)
        offline = TrainingData(t.data_dir, tokenizer, cfg.target.model, t.max_length, t.heldout, t.seed, layers)
        drafter = build_drafter(cfg, target, offline, tokenizer)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    optimizer = torch.optim.AdamW([p for p in drafter.module.parameters() if p.requires_grad], lr=1e-6)
    order = offline.epoch_order(0)
    cached = [offline.batch(order[i * t.micro_batch_size:(i + 1) * t.micro_batch_size]) for i in range(args.batches)]
    online = [type(b)(b.input_ids, b.loss_mask, b.attention_mask) for b in cached]  # the same batches, no features

    def target_forward(batch):
        with torch.no_grad():
            target(input_ids=batch.input_ids, attention_mask=batch.attention_mask)

    def step(batch):
        out = run_target(target, batch, layers)
        loss = sum(p.weight * prediction_loss(p, t).total for p in drafter.predictions(drafter.module, batch, out))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    arms = {"target_forward": (target_forward, online), "online_step": (step, online), "offline_step": (step, cached)}
    times = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, (fn, batches) in arms.items():  # interleaved: a noisy machine slows every arm alike
            start = time.perf_counter()
            for batch in batches:
                fn(batch)
            times[name].append(time.perf_counter() - start)
    tokens = sum(b.num_tokens for b in cached)
    median = {name: statistics.median(v) for name, v in times.items()}
    report = {"drafter": drafter.kind, "micro_batch_size": t.micro_batch_size, "tokens_per_repeat": tokens,
              "tokens_per_s": {name: round(tokens / s, 1) for name, s in median.items()},
              "online_step_over_target_forward": round(median["online_step"] / median["target_forward"], 3),
              "offline_step_over_target_forward": round(median["offline_step"] / median["target_forward"], 3)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
