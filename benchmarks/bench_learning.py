"""Learning-curve probe: how fast a drafter recipe learns, in drafter-only steps on cached target rows.

    python benchmarks/bench_learning.py RECIPE.yaml [key=value ...] [--batches 48] [--steps 150] [--every 50]
        [--out DIR] [--rows DIR] [--swap-context] [--drafter FOLDER]

The target runs once over the first `--batches` micro-batches of the recipe's training data and its held-out
conversations (features and teacher rows, cached in --out, so the next probe on the same data and layers starts at
once); then the recipe's drafter trains on those batches in turn with AdamW (its lr, warm-up and per-parameter lr
scales; no decay), and every `--every` steps prints held-out α̂ and top-1 per draft position at T = 1 and τ from
them (1 + Σ_k Π_{j≤k} α̂_j). A probe, not training: one thread, no DeepSpeed, no checkpoints — for comparing
settings (learning rates, initialisations, objectives) on the same rows in minutes. Writes learning.json to --out;
each curve point records `train_seconds`, the time spent in training steps so far (held-out evaluations excluded),
so settings whose steps cost differently compare at equal training time.

--swap-context: at the end, held-out α̂ once more with every held-out conversation's target features swapped for
another's (rolled by one inside its micro-batch — a micro-batch of one conversation stays as it is; where the other is
shorter, its padding rows), its own tokens kept. A drafter that reads the context falls towards what it can do
without; one that has learned little more than a bigram of its input tokens hardly moves. Stored as
`context_swapped` beside the last point's `alpha`.

--drafter FOLDER: start from a trained drafter's weights (a checkpoint's `drafter/` folder of this recipe's kind and
shape) instead of the recipe's initialisation; with --steps 0 the probe only scores it. A finished training run gets
the same readings as a probe: train it with the probe's `train.heldout` and seed, and its held-out conversations are
the probe's.

A DSpark drafter is also read with its Markov head off (W2 = 0 while scoring, so each draft is the backbone's U_j
alone), stored as `backbone_alone`: what the backbone carries, beside the total its bigram head adds to.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import List, Optional

import torch

from specdrafter.core.io import SpecdrafterError, atomic_write_json
from specdrafter.core.weights import read_safetensors
from specdrafter.data.assets import load_target
from specdrafter.jobs.recipe import load_recipe
from specdrafter.jobs.train import acceptance_sums, lr_factor, lr_schedule, param_groups
from specdrafter.kinds import build_drafter, feature_layers
from specdrafter.train.batches import TrainingData
from specdrafter.train.drafters import run_target
from specdrafter.train.objectives import Objective


def cached_rows(cfg, target, data, drafter, batches: int, folder: Path) -> dict:
    """{"train": [(Batch, TargetOutput)], "held": [...]}: the target's rows for the probe, computed once per data
    folder, layer set, batch count and teacher vocabulary."""
    tc, layers = cfg.train, feature_layers(cfg, target.config)
    ids = drafter.teacher_ids.tolist() if drafter.teacher_ids is not None else None
    facts = [str(Path(tc.data_dir).resolve()), cfg.target.model, layers, batches, tc.micro_batch_size, tc.max_length,
             tc.heldout, tc.seed, tc.data_tokens, ids]
    key = hashlib.sha256(json.dumps(facts).encode()).hexdigest()
    path = folder / f"rows-{key[:16]}.pt"
    if path.is_file():
        try:
            return torch.load(path, weights_only=False)  # our own file, written below
        except Exception as e:  # unreadable: computed again and replaced
            print(f"{path} is unreadable ({type(e).__name__}); computing the target rows again", flush=True)
    mb = tc.micro_batch_size

    def rows(indices):
        batch = data.batch(indices)
        with torch.no_grad():
            return batch, run_target(target, batch, layers, drafter.teacher_ids, tc.temperature, torch.float32)

    started = time.perf_counter()
    store = {"train": [rows(data.train[i * mb:(i + 1) * mb]) for i in range(min(batches, len(data.train) // mb))],
             "held": [rows(data.heldout[i:i + mb]) for i in range(0, len(data.heldout), mb)]}
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(store, tmp)
    tmp.replace(path)
    print(f"target rows cached in {time.perf_counter() - started:.0f} s → {path}", flush=True)
    return store


def swapped_context(rows):
    """The target's rows with each conversation's features replaced by the next one's in the micro-batch."""
    return dataclasses.replace(rows, features={k: v.roll(1, dims=0) for k, v in rows.features.items()})


def markov_head(module):
    """A DSpark drafter's Markov head, else None (DFlash, EAGLE, ...)."""
    return getattr(module, "markov_head", None)


@contextmanager
def backbone_alone(module):
    """The Markov head's bias switched off while scoring: logits_j = U_j + W2(W1[prev_j]) with W2 = 0."""
    w2 = markov_head(module).markov_w2.weight
    kept = w2.detach().clone()
    with torch.no_grad():
        w2.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            w2.copy_(kept)


def held_out(drafter, store: dict, swap: bool = False, markov: bool = True) -> tuple:
    """Per prediction: (α̂, top-1) over the held-out rows at T = 1, with fixed anchors (swap: `swapped_context`;
    markov False: `backbone_alone`)."""
    with nullcontext() if markov else backbone_alone(drafter.module):
        return _held_out(drafter, store, swap)


def _held_out(drafter, store: dict, swap: bool) -> tuple:
    drafter.module.eval()
    state = torch.get_rng_state()
    torch.manual_seed(1234)
    total = None
    with torch.no_grad():
        for batch, rows in store["held"]:
            rows = swapped_context(rows) if swap else rows
            sums = torch.stack([acceptance_sums(p, 1.0) for p in drafter.predictions(drafter.module, batch, rows)])
            total = sums if total is None else total + sums
    torch.set_rng_state(state)
    drafter.module.train()
    return (total[:, 0] / total[:, 2]).tolist(), (total[:, 1] / total[:, 2]).tolist()


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ 1")
    return int(text)


def whole(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ 0")
    return int(text)


def load_trained(drafter, folder: Path) -> None:
    """The weights of a trained drafter folder, every tensor of the recipe's drafter, into it (or one
    SpecdrafterError saying what does not fit)."""
    weights = read_safetensors(folder / "model.safetensors")
    own = drafter.module.state_dict()
    missing, unknown = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    shapes = [k for k in set(own) & set(weights) if own[k].shape != weights[k].shape]
    if missing or unknown or shapes:
        found = ([f"missing {', '.join(missing[:3])}"] if missing else []) + (
            [f"unknown {', '.join(unknown[:3])}"] if unknown else []) + (
            [f"{k} is {tuple(weights[k].shape)}, the recipe's {tuple(own[k].shape)}" for k in sorted(shapes)[:2]])
        raise SpecdrafterError(f"--drafter {str(folder)!r} is not this recipe's drafter: {'; '.join(found)}")
    drafter.module.load_state_dict(weights)


def setup(args):
    """The recipe, its drafter and the cached target rows, or a SpecdrafterError naming what is wrong."""
    cfg = load_recipe(args.recipe, args.overrides)
    tc = cfg.train
    target, tokenizer = load_target(cfg.target.model, "float32")
    target.requires_grad_(False)
    data = TrainingData(tc.data_dir, tokenizer, cfg.target.model, tc.max_length, tc.heldout, tc.seed,
                        data_tokens=tc.data_tokens)  # a prefix: the same rows however far the data job has got
    if not data.heldout:
        raise SpecdrafterError("recipe key 'train.heldout' is 0: the probe scores held-out conversations, keep at "
                               "least one out")
    if len(data.train) < tc.micro_batch_size:
        raise SpecdrafterError(f"the probe needs at least one micro-batch of {tc.micro_batch_size} training "
                               f"conversations ({len(data.train)} in {tc.data_dir})")
    torch.manual_seed(tc.seed)
    drafter = build_drafter(cfg, target, data, tokenizer)
    if args.drafter:
        load_trained(drafter, Path(args.drafter))
    return cfg, drafter, cached_rows(cfg, target, data, drafter, args.batches, Path(args.rows or args.out))


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--batches", type=positive, default=48)
    parser.add_argument("--steps", type=whole, default=150, help="0: score --drafter as it is")
    parser.add_argument("--every", type=positive, default=50)
    parser.add_argument("--out", default="runs/bench_learning")
    parser.add_argument("--rows", help="where the target's rows are cached (default --out): probes of several "
                                       "settings on the same data share them")
    parser.add_argument("--swap-context", action="store_true",
                        help="at the end, held-out α̂ with each conversation's target features swapped for another's")
    parser.add_argument("--drafter", help="start from this trained drafter folder (a checkpoint's drafter/)")
    args = parser.parse_args(argv)
    if args.steps == 0 and not args.drafter:
        parser.error("--steps 0 scores a trained drafter: give --drafter FOLDER")
    torch.set_num_threads(1)

    try:
        cfg, drafter, store = setup(args)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    tc, out = cfg.train, Path(args.out)
    tokens = sum(int(b.loss_mask.sum()) for b, _ in store["train"])
    print(f"{len(store['train'])} training batches ({tokens:,} target tokens), {len(store['held'])} held out", flush=True)

    optimizer = torch.optim.AdamW(param_groups(drafter, tc.lr), lr=tc.lr, weight_decay=0.0, betas=(0.9, 0.95))
    schedule = lr_schedule(optimizer, lambda s: lr_factor(s, tc.warmup_steps, 10 ** 9, 1.0), args.steps)
    objective, curve, started, training = Objective.of(tc), [], time.perf_counter(), 0.0

    def score(step: int, loss: Optional[float]) -> None:
        alpha, top1 = held_out(drafter, store)
        tau = 1 + sum(math.prod(alpha[:k + 1]) for k in range(len(alpha)))
        curve.append({"step": step, "loss": loss, "alpha": alpha, "top1": top1, "tau": tau,
                      "train_seconds": round(training, 3)})
        print(f"step {step}: loss {'-' if loss is None else f'{loss:.3f}'}  α̂ {' '.join(f'{a:.3f}' for a in alpha)}  "
              f"top-1 {' '.join(f'{t:.2f}' for t in top1)}  τ {tau:.2f}  ({time.perf_counter() - started:.0f} s)",
              flush=True)

    if args.steps == 0:
        score(0, None)
    for step in range(1, args.steps + 1):
        step_started = time.perf_counter()
        batch, rows = store["train"][(step - 1) % len(store["train"])]
        loss = sum(p.loss(objective)[0] for p in drafter.predictions(drafter.module, batch, rows))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.module.parameters(), tc.grad_clip)
        optimizer.step()
        schedule.step()
        training += time.perf_counter() - step_started
        if step % args.every == 0 or step == args.steps:
            score(step, loss.item())
    report = {"recipe": args.recipe, "overrides": args.overrides, "drafter": args.drafter, "train_tokens": tokens,
              "curve": curve}
    if args.swap_context:
        report["context_swapped"], _ = held_out(drafter, store, swap=True)
        print(f"step {args.steps}, context swapped: α̂ {' '.join(f'{a:.3f}' for a in report['context_swapped'])}  "
              f"(intact {' '.join(f'{a:.3f}' for a in curve[-1]['alpha'])})", flush=True)
    if markov_head(drafter.module) is not None:
        report["backbone_alone"], _ = held_out(drafter, store, markov=False)
        print(f"step {args.steps}, Markov head off: α̂ {' '.join(f'{a:.3f}' for a in report['backbone_alone'])}",
              flush=True)
        if args.swap_context:
            report["backbone_alone_context_swapped"], _ = held_out(drafter, store, swap=True, markov=False)
            print(f"step {args.steps}, Markov head off, context swapped: α̂ "
                  f"{' '.join(f'{a:.3f}' for a in report['backbone_alone_context_swapped'])}", flush=True)
    atomic_write_json(out / "learning.json", report)


if __name__ == "__main__":
    main()
