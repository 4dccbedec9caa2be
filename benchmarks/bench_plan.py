"""Benchmark: the planner (jobs/plan.py) against measured peak memory per rank, for the SmolLM2 recipes.

    python benchmarks/bench_plan.py [key=value ...] [--runs eagle3:0:1 eagle3:2:2 ...] [--steps 3]
        [--out runs/bench/bench_plan.json]

Each run is RECIPE:ZERO_STAGE:RANKS. Its ranks are fresh processes joined like the `deepspeed` launcher joins them
(gloo on CPU, NCCL on CUDA); each builds the target, the drafter and the DeepSpeed engine as jobs/train.py does and
takes --steps optimizer steps of micro-batches of exactly micro_batch_size × max_length tokens with every position
counted (random ids and, offline, random cached features) — the batch the plan is for — with the loop's own calls
and variable lifetimes. Measured per rank, over the steps:

    tensors   peak bytes of live tensor storage (a dispatch-mode tracker on CPU; torch.cuda.max_memory_allocated on
              a GPU) — the quantity the plan predicts
    rss       peak resident memory above the process before the target loaded (VmHWM, reset after setup; glibc
              told to return freed blocks, MALLOC_MMAP_THRESHOLD_), on CPU only, against the plan of resident
              pages ("plan RSS": ZeRO 1-2's 5e8-element bucket counts only the gradients written into it)

key=value pairs override every run's recipe. The Medusa and draft-model runs use smaller micro-batches than their
recipes (kinds/: planning.bench_overrides): the plan scales with rows × vocabulary, and the recipes' own batches would
need ~10 GB per rank at SmolLM2's 49k vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from specdrafter.kinds import KINDS
from specdrafter.recipes import RECIPES_DIR

# One run per kind with a SmolLM2 recipe, shrunk to what this CPU trains in seconds (kinds/: planning.bench_overrides)
RECIPES = {k.name: str(RECIPES_DIR / k.training.recipe) for k in KINDS.values() if k.training and k.training.recipe}
OVERRIDES = {name: list(KINDS[name].planning.bench_overrides) for name in RECIPES}
DEFAULT_RUNS = [f"{name}:{zero}:{ranks}" for name in RECIPES for zero, ranks in ((0, 1), (0, 2), (2, 2))]
GIB = 2**30


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storage: every storage an op returns is counted once until it is freed."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.sizes = 0, 0, {}

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = id(storage), storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            weakref.finalize(storage, self._free, key)
        self.sizes[key] = size
        self.live += size - (old or 0)
        self.peak = max(self.peak, self.live)

    def _free(self, key) -> None:
        self.live -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.add(t)
        return out


# ------------------------------------------------------------------------------------------------ worker
def rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def worker(recipe: str, overrides, steps: int) -> dict:
    """One rank: set up as jobs/train.py does, then `steps` loop-faithful optimizer steps; peak memory."""
    import deepspeed

    from specdrafter.data.assets import load_target
    from specdrafter.jobs.recipe import load_recipe
    from specdrafter.jobs.train import deepspeed_config, lr_factor, lr_schedule, micro_batch_loss, param_groups, setup_distributed
    from specdrafter.kinds import build_drafter, feature_layers
    from specdrafter.train.batches import Batch

    cfg = load_recipe(recipe, overrides)
    t = cfg.train
    rank, world = setup_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(t.seed + rank)
    base = rss_kib()
    tracker = None if cuda else LiveTensorBytes()
    if tracker:
        tracker.__enter__()
    target, tokenizer = load_target(cfg.target.model, cfg.target.dtype.value,
                                    untested_architecture=cfg.target.untested_architecture)
    target.requires_grad_(False)
    target.to(device)
    if tracker:
        for tensor in list(target.parameters()) + list(target.buffers()):
            tracker.add(tensor)
    layers = feature_layers(cfg, target.config)
    drafter = build_drafter(cfg, target, None, tokenizer)
    use_bf16 = t.precision.value == "bf16" or (t.precision.value == "auto" and cuda)
    optimizer = torch.optim.AdamW(param_groups(drafter, t.lr), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    total = steps
    scheduler = lr_schedule(optimizer, lambda s: lr_factor(s, t.warmup_steps, total, t.min_lr_ratio), total)
    engine, _, _, _ = deepspeed.initialize(model=drafter.module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(t, use_bf16))
    B, L, V, d = t.micro_batch_size, t.max_length, target.config.vocab_size, target.config.hidden_size
    cache = getattr(torch, cfg.data.hidden_states.dtype.value)

    def make_batch():
        ids = torch.randint(0, V, (B, L))
        loss_mask = torch.ones(B, L, dtype=torch.long)
        features = {k: torch.randn(B, L, d).to(cache) for k in layers} if t.features.value == "offline" else None
        return Batch(ids, loss_mask, torch.ones(B, L, dtype=torch.long), features)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM: the peak below is the steps'
        tracker.peak = tracker.live
    for step in range(steps):  # jobs/train.py's inner loop, its calls and variable lifetimes
        for micro in range(t.grad_accum):
            batch = make_batch().to(device)
            loss, _ = micro_batch_loss(drafter, engine, target, batch, layers, t, device)
            engine.backward(loss)
            engine.step()
    if cuda:
        measured = {"tensors": torch.cuda.max_memory_allocated(device)}
    else:
        measured = {"tensors": tracker.peak, "rss": (rss_kib("VmHWM") - base) * 1024}
        tracker.__exit__(None, None, None)
    return {"rank": rank, "world": world, "loss": float(loss), **measured}


# ------------------------------------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, zero: int, ranks: int, steps: int, extra) -> list:
    """The ranks of one run as fresh processes; their JSON results."""
    overrides = [*OVERRIDES[name], f"train.zero_stage={zero}", *extra]
    port, procs = _free_port(), []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
               "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
        if not torch.cuda.is_available():
            env["DS_ACCELERATOR"] = "cpu"
        cmd = [sys.executable, str(Path(__file__).resolve()), *overrides, "--worker", RECIPES[name], "--steps", str(steps)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            tail = (err.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"error: {name} ZeRO {zero} × {ranks}: a rank failed (exit {p.returncode}): {tail}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def planned(name: str, zero: int, ranks: int, extra, resident: bool = False) -> int:
    """The plan of a run on this machine; `resident`: only the pages a CPU process touches (to compare with RSS)."""
    from specdrafter.jobs.plan import Setup, make_plan
    from specdrafter.jobs.recipe import load_recipe

    cfg = load_recipe(RECIPES[name], [*OVERRIDES[name], f"train.zero_stage={zero}", *extra])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return make_plan(cfg, RECIPES[name], Setup(ranks, ranks, device, resident)).total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides for every run")
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="RECIPE:ZERO:RANKS, RECIPE in " + ", ".join(RECIPES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/bench_plan.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one rank of a run: its recipe; overrides: the run's all
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.overrides, args.steps)))
        return
    rows = []
    header = (f"{'recipe':<8}{'ZeRO':>5}{'ranks':>6}{'plan GiB':>10}{'tensors GiB':>13}{'diff':>8}"
              f"{'plan RSS':>10}{'RSS GiB':>9}{'diff':>8}")
    print(header)
    for run in args.runs:
        name, zero, ranks = run.split(":")
        zero, ranks = int(zero), int(ranks)
        plan = planned(name, zero, ranks, args.overrides)
        plan_rss = planned(name, zero, ranks, args.overrides, resident=True)
        results = launch(name, zero, ranks, args.steps, args.overrides)
        tensors = max(r["tensors"] for r in results)
        rss = max((r.get("rss", 0) for r in results), default=0)
        row = {"recipe": name, "zero": zero, "ranks": ranks, "overrides": OVERRIDES[name] + args.overrides,
               "plan": plan, "tensors": tensors, "tensors_diff": plan / tensors - 1,
               "plan_rss": plan_rss, "rss": rss, "rss_diff": plan_rss / rss - 1 if rss else None}
        rows.append(row)
        rss_cols = f"{plan_rss / GIB:10.2f}{rss / GIB:9.2f}{row['rss_diff']:+8.0%}" if rss else f"{'-':>10}{'-':>9}{'-':>8}"
        print(f"{name:<8}{zero:>5}{ranks:>6}{plan / GIB:10.2f}{tensors / GIB:13.2f}{row['tensors_diff']:+8.0%}{rss_cols}",
              flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "device": "cuda" if torch.cuda.is_available() else "cpu",
                                          "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
