"""The training loop under DeepSpeed, for every drafter kind.

    train(cfg):  setup(cfg) → Run          the target, the data, the drafter under DeepSpeed, a checkpoint to resume
                 train_step(run, step)      grad_accum micro-batches: target pass, predictions, loss, backward, step
                 evaluate(...)              held-out metrics every train.eval_every steps
                 checkpoint(run, bar)       every train.save_every steps (+ a decode check through the real loop)
                 finish(run)                publish <output_dir>/drafter

The loss of a micro-batch is `micro_batch_loss` → `Prediction.loss` (train/drafters.py) → train/objectives.py.

Launch with `deepspeed [--num_accelerators 2] launch/train_eagle.py RECIPE key=value ...` (on CPU with
DS_ACCELERATOR=cpu; gloo) or `python launch/train_eagle.py ...` for one process. Rerunning the same command
resumes from the newest complete checkpoint with the same data order, so the final weights equal an
uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

# DeepSpeed picks its accelerator at import time: on a machine without CUDA it must be told to use the CPU.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")

import sys

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from specdrafter.core.io import (  # noqa: E402
    TRAINER_STATE,
    SpecdrafterError,
    atomic_write_text,
    checkpoint_problem,
    complete_checkpoints,
    discard_damaged_checkpoints,
    first_line,
    publish_dir,
    temp_dir_beside,
    write_checkpoint_state,
)
from specdrafter.core.recipe import Recipe, load_saved_recipe, save_recipe  # noqa: E402
from specdrafter.data.assets import load_target  # noqa: E402
from specdrafter.jobs.cli import cli  # noqa: E402
from specdrafter.jobs.decode import decode_check  # noqa: E402
from specdrafter.jobs.plan import check_training_recipe, preflight  # noqa: E402
from specdrafter.kinds import build_drafter, feature_layers, kind_of, trainable_by  # noqa: E402
from specdrafter.train.batches import TrainingData  # noqa: E402
from specdrafter.train.drafters import Prediction, run_target  # noqa: E402
from specdrafter.train.objectives import Objective, acceptance  # noqa: E402

log = logging.getLogger("specdrafter")

# Recipe keys that may change between a checkpoint and its resumption (they do not change the trained weights
# of the steps already taken).
# A larger max_steps / epochs continues on the schedule of the new total (cosine over all steps); rerunning the
# same command reproduces an uninterrupted run exactly.
RESUMABLE_CHANGES = ("train.max_steps", "train.epochs", "train.eval_every", "train.save_every", "train.keep_checkpoints",
                     "train.wandb", "inference", "train.warm_start", "train.gpu_memory_gb", "target.device",
                     "train.data_recipe")


# ----------------------------------------------------------------------------------------------- setup
def setup_distributed() -> tuple[int, int]:
    """Join the process group the `deepspeed` launcher set up, or make a world of one for plain `python`."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():  # this rank's GPU before the first NCCL collective (DeepSpeed's engine binds it later)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        clear_stale_build_locks()
        with contextlib.redirect_stdout(io.StringIO()):  # on a CPU it prints "DeepSpeed shm_comm built successfully"
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
        release_shm_segment()
    return dist.get_rank(), dist.get_world_size()


def release_shm_segment() -> None:
    """Unlink this rank's DeepSpeed CPU all-reduce segment once every rank has mapped it.

    DeepSpeed's CPU backend (ranks all on one machine) puts a 67 MB segment per rank in /dev/shm and never
    unlinks it, so each run, finished or killed, would leave its segments behind in RAM-backed tmpfs, run after run,
    until the machine runs out of memory. Every rank maps all peers' segments before `init_distributed` returns, so
    after a barrier the names can go; the mappings stay valid and the memory is freed when the last rank exits,
    however it exits."""
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), dist.get_rank())
    segment = Path("/dev/shm") / name
    if segment.exists():
        dist.barrier()
        segment.unlink(missing_ok=True)


STALE_BUILD_LOCK_S = 900  # DeepSpeed's CPU ops compile in about half a minute on 2 cores; a lock this old is orphaned


def clear_stale_build_locks(now: Optional[float] = None) -> List[Path]:
    """Remove the JIT-build locks a killed run left behind, with one line each; returns what it removed.

    DeepSpeed compiles its CPU all-reduce op (deepspeed_shm_comm, and cpu_adam with offload) through torch's
    cpp_extension the first time a process group starts. torch guards each build with a bare lock *file*: a process
    that finds it waits, polling, until it is gone. A run killed mid-build (kill -9, a scheduler's time limit, a
    timeout around it) leaves the file, and every later run on the machine then hangs at start-up, silently and
    forever. No build takes anywhere near STALE_BUILD_LOCK_S, so an older lock has no owner left."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time() if now is None else now
    removed = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:  # TORCH_EXTENSIONS_DIR/op, or <cache>/py311_cpu/op
        try:
            age = now - lock.stat().st_mtime
            if age > STALE_BUILD_LOCK_S:
                lock.unlink()
                removed.append(lock)
                log.warning("removed %s: a build lock left %d min ago by a run killed while it compiled", lock,
                            age // 60)
        except OSError:  # gone meanwhile (its build finished), or not ours to remove: torch waits on it as before
            continue
    return removed


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(drafter, lr: float) -> List[dict]:
    """The trainable parameters, grouped by learning rate: a drafter may scale some (drafter.lr_scales:
    {parameter-name prefix: factor}) and hold some at lr 0 for a first share of the run (drafter.lr_holds:
    {prefix: share}, `lr_schedule`)."""
    scales, holds = getattr(drafter, "lr_scales", {}), getattr(drafter, "lr_holds", {})
    groups: Dict[tuple, list] = {}
    for name, p in drafter.module.named_parameters():
        if p.requires_grad:
            scale = next((f for prefix, f in scales.items() if name.startswith(prefix)), 1.0)
            hold = next((h for prefix, h in holds.items() if name.startswith(prefix)), 0.0)
            groups.setdefault((scale, hold), []).append(p)
    return [{"params": ps, "lr": lr * scale, "hold": hold} for (scale, hold), ps in groups.items()]


def lr_schedule(optimizer: torch.optim.Optimizer, factor, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Each group's lr × factor(step), and 0 for its first round(hold × total) steps (param_groups)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [
        lambda s, held=round(g.get("hold", 0.0) * total): factor(s) if s >= held else 0.0
        for g in optimizer.param_groups])


def deepspeed_config(tc: DictConfig, bf16: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": tc.micro_batch_size, "gradient_accumulation_steps": tc.grad_accum,
            "gradient_clipping": tc.grad_clip, "zero_optimization": {"stage": tc.zero_stage},
            "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True,  # torch's AdamW
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def autocast(tc: DictConfig, device: torch.device):
    """bf16 autocast of the teacher's lm_head and the drafter's forward with train.precision=amp_bf16: weights,
    gradients and optimizer stay fp32; the loss upcasts the logits to fp32 itself."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=tc.precision.value == "amp_bf16")


# ------------------------------------------------------------------------------------------ objectives
@torch.no_grad()
def acceptance_sums(pred: Prediction, temperature: float) -> torch.Tensor:
    """[Σ α̂, Σ top-1 agreement, count] over the masked positions: α̂ at the serving temperature
    (train/objectives.py:acceptance), top-1 whether the draft's most likely token is the target's."""
    alpha = acceptance(pred.target_logits, pred.draft_logits, temperature, pred.target_lse, pred.draft_ids)  # [N]
    draft_top = pred.draft_logits.argmax(-1)  # [N]
    if pred.target_lse is not None:  # draft-vocabulary target rows: the target's top is a draft token on loss_rows
        top1 = (pred.loss_rows & (draft_top == pred.target_logits.argmax(-1))).float()  # [N]
    else:
        draft_top = pred.draft_ids[draft_top] if pred.draft_ids is not None else draft_top
        top1 = (draft_top == pred.target_logits.argmax(-1)).float()  # [N]
    return torch.stack([alpha.sum(), top1.sum(), torch.tensor(float(len(alpha)), device=alpha.device)])


# --------------------------------------------------------------------------------------------- checkpoints
def resume_checkpoint(root: Path, rank: int, world: int) -> Optional[Path]:
    """The newest complete checkpoint whose files match the checksums it recorded. Rank 0 moves a damaged newer one
    aside (<name>.damaged), one line each; one without checksums resumes unverified (core/io.py: checkpoint_problem)."""
    if rank == 0:
        for line in discard_damaged_checkpoints(root):
            log.warning(line)
    if world > 1:
        dist.barrier()  # every rank then sees the same checkpoints
    found = complete_checkpoints(root)
    return found[-1] if found else None


def load_deepspeed_state(engine, folder: Path, what: str = "", module_only: bool = False) -> dict:
    """engine.load_checkpoint of a checkpoint folder, anything wrong with it as one line naming it."""
    try:
        path, state = engine.load_checkpoint(str(folder.parent), tag=folder.name, load_module_only=module_only)
    except Exception as e:  # a checkpoint without checksums, damaged: torch / DeepSpeed cannot read it
        raise SpecdrafterError(f"{what}checkpoint {folder} cannot be loaded ({first_line(e)}); move it aside (e.g. "
                               f"rename it to {folder.name}.damaged) to start from the one before") from None
    if path is None or (not module_only and "step" not in (state or {})):
        raise SpecdrafterError(f"{what}checkpoint {folder} holds no DeepSpeed training state (*_model_states.pt)")
    return state


def recipe_differences(saved: DictConfig, cfg: DictConfig) -> List[str]:
    def flat(c):
        return {k: v for k, v in _flatten(OmegaConf.to_container(c, resolve=True, enum_to_str=True)).items()}
    a, b, defaults = flat(saved), flat(cfg), flat(OmegaConf.structured(Recipe))
    # A key the saved recipe lacks, at its default, is no change: the scaling curve's early runs (docs/results/scaling.md)
    # resume under the schema of every later key whenever launch/scaling.py rebuilds its report.
    added = {k for k in set(b) - set(a) if b[k] == defaults.get(k)}
    keys = sorted(k for k in (set(a) | set(b)) - added if a.get(k) != b.get(k) and not k.startswith(RESUMABLE_CHANGES))
    return [f"{k} ({a.get(k)!r} → {b.get(k)!r})" for k in keys]


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    tokens: int = 0  # tokens of this rank's batches, prompts and answers alike (attention_mask), padding excluded
    seconds: float = 0.0  # wall-clock time of this rank's optimizer steps, summed over resumptions (not evals or saves)
    last_metrics: Optional[Dict[str, float]] = None


# ------------------------------------------------------------------------------------------------- train
@dataclass
class Run:
    """Everything one training run holds between its steps (what `setup` builds)."""
    cfg: DictConfig
    rank: int
    world: int
    out: Path  # output_dir
    device: torch.device
    target: torch.nn.Module
    tokenizer: object
    layers: List[int]  # target layers the drafter reads
    data: TrainingData
    drafter: object  # train/drafters.py: one of DRAFTERS
    engine: object  # the DeepSpeed engine around drafter.module
    scheduler: torch.optim.lr_scheduler.LambdaLR
    per_epoch: int  # micro-batches per rank per epoch
    total: int  # optimizer steps of the whole run
    progress: Progress
    last_good: Optional[Path]  # the newest complete checkpoint
    logger: Optional["WandbLogger"]
    started: tuple = (0.0, 0)  # (perf_counter, tokens) when this process began training: its tokens/s

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"


def train(cfg: DictConfig) -> Dict[str, float]:
    """Train the recipe's drafter to the end (resuming from the newest complete checkpoint); the last held-out metrics.
    The recipe is checked against the target's config.json here, once per training, before anything loads."""
    check_training_recipe(cfg)
    run = setup(cfg)
    bar = tqdm(total=run.total, initial=run.progress.step, disable=run.rank != 0, desc=f"train {run.cfg.drafter.kind}",
               unit="step")
    for step in range(run.progress.step, run.total):
        record = train_step(run, step)
        if run.progress.step % cfg.train.eval_every == 0 or run.progress.step == run.total:
            run.progress.last_metrics = evaluate(run.engine, run.drafter, run.data, run.target, run.layers, cfg.train,
                                                 run.rank, run.world, run.device)
            record.update(run.progress.last_metrics)
            write_metrics(run, record)
        if run.logger:
            run.logger.log(record)
        bar.set_postfix(_postfix(record, run.progress.last_metrics))
        bar.update(1)
        if run.progress.step % cfg.train.save_every == 0 or run.progress.step == run.total:
            checkpoint(run, bar)
    bar.close()
    return finish(run)


def setup(cfg: DictConfig) -> Run:
    """The process group, the target, the data, the drafter under DeepSpeed, and the state of a checkpoint to resume."""
    tc = cfg.train
    rank, world = setup_distributed()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    out = Path(cfg.output_dir).expanduser()

    resume = resume_checkpoint(out / "checkpoints", rank, world)
    if resume is not None:
        differences = recipe_differences(load_saved_recipe(resume / "recipe.yaml"), cfg)
        if differences:
            raise SpecdrafterError(f"{resume} was made by a different recipe: {', '.join(differences)}; use another "
                                   f"output_dir (with train.warm_start={resume} to start from its weights)")

    torch.manual_seed(tc.seed)
    use_bf16 = tc.precision.value == "bf16" or (tc.precision.value == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    target, tokenizer = load_target(cfg.target.model, cfg.target.dtype.value,
                                    untested_architecture=cfg.target.untested_architecture,
                                    chat_template_kwargs=cfg.target.chat_template_kwargs)
    target.requires_grad_(False)
    target.to(device)
    layers = feature_layers(cfg, target.config)
    data = TrainingData(tc.data_dir, tokenizer, cfg.target.model, tc.max_length, tc.heldout, tc.seed,
                        layers if tc.features.value == "offline" else (), tc.data_tokens)
    drafter = build_drafter(cfg, target, data, tokenizer)

    per_epoch = len(data.train) // (tc.micro_batch_size * world)
    if per_epoch < tc.grad_accum:
        raise SpecdrafterError(f"{len(data.train)} training conversations make less than one optimizer step of "
                               f"{tc.micro_batch_size} × {tc.grad_accum} × {world} ranks; lower train.micro_batch_size or "
                               "train.grad_accum")
    total = tc.max_steps or tc.epochs * per_epoch // tc.grad_accum
    optimizer = torch.optim.AdamW(param_groups(drafter, tc.lr), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    scheduler = lr_schedule(optimizer, lambda s: lr_factor(s, tc.warmup_steps, total, tc.min_lr_ratio), total)
    engine, _, _, _ = deepspeed.initialize(model=drafter.module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(tc, use_bf16))
    progress = Progress()
    if resume is not None:
        state = load_deepspeed_state(engine, resume)
        progress = Progress(state["step"], state["tokens"], state.get("seconds", 0.0), state.get("metrics"))
        torch.set_rng_state(state["rng"])
        log.info(f"resuming from {resume} (step {progress.step} of {total})")
    elif tc.warm_start:
        warm = Path(tc.warm_start).expanduser()
        problem = checkpoint_problem(warm) if (warm / TRAINER_STATE).is_file() else None
        if problem:
            raise SpecdrafterError(f"recipe key 'train.warm_start': checkpoint {warm} is damaged ({problem})")
        load_deepspeed_state(engine, warm, "recipe key 'train.warm_start': ", module_only=True)
        log.info(f"warm start: drafter weights from {warm}")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_recipe(cfg, out)
    return Run(cfg, rank, world, out, device, target, tokenizer, layers, data, drafter, engine, scheduler, per_epoch,
               total, progress, resume, WandbLogger(cfg, out) if rank == 0 else None,
               (time.perf_counter(), progress.tokens))


def train_step(run: Run, step: int) -> Dict[str, float]:
    """One optimizer step: grad_accum micro-batches of this rank's share of the data (fixed by the global micro-batch
    counter, so a resumed run reads what an uninterrupted one would). Returns the step's record for the logs."""
    tc = run.cfg.train
    step_began = time.perf_counter()
    names: List[str] = []  # the drafter's predictions, in the order micro_batch_loss returns them
    if hasattr(run.drafter, "at_step"):  # a loss that follows the run's progress (Domino's decaying base share)
        run.drafter.at_step(step, run.total)
    logged = []  # per micro-batch [1 + P]: its loss and each prediction's objective, detached, read once per step
    for micro in range(tc.grad_accum):
        g = step * tc.grad_accum + micro  # global micro-batch counter: fixes the data, whatever was resumed
        epoch, i = divmod(g, run.per_epoch)
        order = run.data.epoch_order(epoch, tc.micro_batch_size * run.world if tc.group_by_length else 1)
        start = (i * run.world + run.rank) * tc.micro_batch_size
        batch = run.data.batch(order[start:start + tc.micro_batch_size]).to(run.device)
        loss, totals = micro_batch_loss(run.drafter, run.engine, run.target, batch, run.layers, tc, run.device)
        names = list(totals)
        logged.append(torch.stack([loss.detach(), *(value.detach() for value in totals.values())]))
        if not _all_finite(loss, run.device):
            raise SpecdrafterError(f"the loss is {float(loss)} at step {step + 1}: training stopped; the last good "
                                   f"checkpoint is {run.last_good or 'none (no checkpoint was written yet)'}")
        run.engine.backward(loss)
        run.engine.step()
        run.progress.tokens += batch.num_tokens
    total_loss, parts = 0.0, {f"loss/{name}": 0.0 for name in names}
    for micro_loss, *objectives in torch.stack(logged).tolist():  # [grad_accum, 1 + P]: one device sync per step
        total_loss += micro_loss / tc.grad_accum
        for name, value in zip(names, objectives):
            parts[f"loss/{name}"] += value / tc.grad_accum
    run.progress.step = step + 1
    run.progress.seconds += time.perf_counter() - step_began
    began, tokens_then = run.started
    speed = (run.progress.tokens - tokens_then) * run.world / max(time.perf_counter() - began, 1e-9)
    return {"step": run.progress.step, "lr": run.scheduler.get_last_lr()[0], "tokens_per_s": speed,
            "loss": total_loss, **parts}


def write_metrics(run: Run, record: dict) -> None:
    if run.rank == 0:
        with open(run.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def checkpoint(run: Run, bar) -> None:
    """Save a checkpoint; every `decode_check_every` saves (and at the end), decode with it through the real loop."""
    tc = run.cfg.train
    run.last_good = save_checkpoint(run.engine, run.drafter, run.cfg, run.checkpoints, run.progress, run.tokenizer,
                                    run.rank)
    saves = run.progress.step // tc.save_every
    if run.rank == 0 and tc.decode_check_every and (saves % tc.decode_check_every == 0 or run.progress.step == run.total):
        check = {"step": run.progress.step, **decode_check(run.cfg, run.last_good / "drafter", run.target, run.tokenizer)}
        write_metrics(run, check)
        if run.logger:
            run.logger.log(check)
        bar.write(f"step {run.progress.step}: through the decoding loop τ = {check['decode/tau']:.2f}, "
                  f"α = {check['decode/alpha']:.3f}")


def finish(run: Run) -> Dict[str, float]:
    """Publish the newest drafter at <output_dir>/drafter (a stable path) and close the logger."""
    if run.rank == 0 and run.last_good is not None:
        tmp = temp_dir_beside(run.out / "drafter")
        shutil.copytree(run.last_good / "drafter", tmp, dirs_exist_ok=True)
        publish_dir(tmp, run.out / "drafter")
        alpha = (run.progress.last_metrics or {}).get("alpha/mean")
        log.info(f"training: {run.cfg.drafter.kind}, step {run.progress.step} of {run.total}"
                 + (f", held-out α̂ {alpha:.3f}" if alpha is not None else "") + f" → {run.out / 'drafter'}")
    if run.logger:
        run.logger.finish()
    return run.progress.last_metrics or {}


def micro_batch_loss(drafter, engine, target, batch, layers, tc: DictConfig, device):
    """One micro-batch's training loss: the target's rows, the drafter's predictions, Σ of their
    `Prediction.loss`. Returns (loss, {prediction name: its objective})."""
    with autocast(tc, device):
        target_out = run_target(target, batch, layers, drafter.teacher_ids, tc.temperature, param_dtype(engine))
        predictions = drafter.predictions(engine.module, batch, target_out)
    objective = Objective.of(tc)
    loss, totals = 0.0, {}
    for pred in predictions:
        share, totals[pred.name] = pred.loss(objective)  # train/drafters.py:Prediction.loss
        loss = loss + share
    return loss, totals


def param_dtype(engine) -> torch.dtype:
    return next(engine.module.parameters()).dtype


def _all_finite(loss: torch.Tensor, device) -> bool:
    bad = torch.tensor([0.0 if torch.isfinite(loss).all() else 1.0], device=device)
    dist.all_reduce(bad)  # every rank stops together
    return bad.item() == 0


def _postfix(record: dict, metrics: Optional[dict]) -> dict:
    post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
    if metrics:
        post["α̂"] = f"{metrics.get('alpha/mean', 0):.3f}"
    return post


@torch.no_grad()
def evaluate(engine, drafter, data: TrainingData, target, layers, tc: DictConfig, rank: int, world: int,
             device=torch.device("cpu")) -> Dict[str, float]:
    """Held-out simulated acceptance α̂ and top-1 agreement per head / TTT step, summed over all ranks."""
    engine.module.eval()
    sums: Dict[str, torch.Tensor] = {}
    mine = data.heldout[rank::world]
    batches = [mine[i:i + tc.micro_batch_size] for i in range(0, len(mine), tc.micro_batch_size)]
    for indices in batches or [[]]:
        if not indices:  # a rank without held-out conversations still joins the collective below
            continue
        batch = data.batch(indices).to(device)
        with autocast(tc, device):
            teacher = run_target(target, batch, layers, drafter.teacher_ids, tc.temperature, param_dtype(engine))
            predictions = drafter.predictions(engine.module, batch, teacher)
        for p in predictions:
            sums[p.name] = sums.get(p.name, torch.zeros(3)) + acceptance_sums(p, tc.temperature).cpu()
    names = drafter.prediction_names
    stacked = torch.stack([sums.get(n, torch.zeros(3)) for n in names]).to(device)  # [P, 3]
    dist.all_reduce(stacked)
    stacked = stacked.cpu()
    engine.module.train()
    metrics = {}
    for n, (a, top1, count) in zip(names, stacked.tolist()):
        metrics[f"alpha/{n}"] = a / max(count, 1)
        metrics[f"top1/{n}"] = top1 / max(count, 1)
    metrics["alpha/mean"] = sum(metrics[f"alpha/{n}"] for n in names) / len(names)
    return metrics


def save_checkpoint(engine, drafter, cfg: DictConfig, root: Path, progress: Progress, tokenizer, rank: int) -> Path:
    """DeepSpeed state (exact resume) + the drafter in its HF-loadable form + the recipe; trainer_state.json is
    written last, so a checkpoint without it (a killed save) is never resumed from."""
    tag = f"step-{progress.step:06d}"
    folder = root / tag
    if folder.exists() and rank == 0:
        shutil.rmtree(folder)  # a partial save of the same step from a killed run
    dist.barrier()
    state = {"step": progress.step, "tokens": progress.tokens, "seconds": progress.seconds, "rng": torch.get_rng_state(),
             "metrics": progress.last_metrics}
    engine.save_checkpoint(str(root), tag=tag, client_state=state)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=cfg.train.zero_stage == 3):
        if rank == 0:
            drafter.save(engine.module, folder / "drafter", tokenizer)
    if rank == 0:
        atomic_write_text(folder / "recipe.yaml", OmegaConf.to_yaml(cfg))
        write_checkpoint_state(folder, {"step": progress.step, "tokens": progress.tokens, "seconds": round(progress.seconds, 2),
                                        "drafter": cfg.drafter.kind, "metrics": progress.last_metrics})
        for old in complete_checkpoints(root)[:-cfg.train.keep_checkpoints]:
            shutil.rmtree(old)
    dist.barrier()
    return folder


class WandbLogger:
    """wandb on rank 0; `offline` (the default) needs no account: `wandb sync <output_dir>/wandb/...` uploads."""

    def __init__(self, cfg: DictConfig, out: Path):
        self.run = None
        if cfg.train.wandb.mode.value == "disabled":
            return
        import wandb  # an optional heavy import: only when logging is on

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=cfg.train.wandb.project, name=cfg.train.wandb.name or out.name, dir=str(out),
                              mode=cfg.train.wandb.mode.value, resume="allow", id=_run_id(out),
                              config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))

    def log(self, record: dict) -> None:
        if self.run:
            self.run.log(record, step=record["step"])

    def finish(self) -> None:
        if self.run:
            self.run.finish()


def _run_id(out: Path) -> str:
    """One wandb run per output folder, so a resumed training continues the same run."""
    path = out / "wandb_run_id"
    if not path.exists():
        import uuid
        atomic_write_text(path, uuid.uuid4().hex[:12])
    return path.read_text().strip()


# ------------------------------------------------------------------------------------------------ the command
def train_command(trainer: Optional[str] = None) -> None:
    """`script.py RECIPE.yaml [key=value ...]`, under `deepspeed` or as one process; reruns resume. The recipe's
    drafter kind must be one of the training family `trainer` (kinds/: training.trainer; launch/train_<trainer>.py), or any
    trainable kind when None."""
    kinds = trainable_by(trainer)
    script = f"launch/train_{trainer}.py" if trainer else "python -m specdrafter.jobs.train"

    def check(cfg: DictConfig) -> None:
        kind = kind_of(cfg)
        if kind not in kinds:
            trains = " or ".join(k.name for k in kinds) or "no drafter kind"
            raise SpecdrafterError(f"recipe key 'drafter.kind' is {kind.name}, but {script} trains {trains}")
        if "--print-config" in sys.argv:  # what a run would refuse (train() checks it when it runs)
            check_training_recipe(cfg)

    def main(cfg: DictConfig) -> None:
        preflight(cfg)  # on CUDA: the memory plan before anything loads (CPU: nothing)
        train(cfg)
    cli(main, check=check)


if __name__ == "__main__":  # python -m specdrafter.jobs.train (eval/scaling.py, benchmarks/bench_train.py)
    train_command()
