"""The planner's checks, one (ok, line) each: the recipe against the target's config and the data job's cache (before
anything loads), the global batch against the data, and the plan's memory against the budget. A failing line names
the recipe key to change; the launchers refuse the first failure (jobs/plan.py:preflight)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from omegaconf import DictConfig

from specdrafter.kinds import KINDS, kind_of, layers_read
from specdrafter.train.memory import GIB, Plan, Setup, Shapes
from specdrafter.train.model_configs import target_config

Check = Tuple[bool, str]


def recipe_checks(cfg: DictConfig, T: Shapes, s: Setup) -> List[Check]:
    """One line each: (ok, line). Run before anything loads; the launchers refuse the first failure."""
    kind, out = kind_of(cfg), []
    if kind.training:
        t = cfg.train
        fits = not T.positions or t.max_length <= T.positions
        out.append((fits, f"train.max_length {t.max_length} within the target's {T.positions or 'unbounded'} positions"
                    if fits else f"recipe key 'train.max_length' ({t.max_length}) exceeds the target's "
                    f"max_position_embeddings ({T.positions})"))
    out += kind.planning.checks(cfg, T, target_config) if kind.planning else []
    if kind.training:
        out += _offline_cache_check(cfg, T)
    out.append((s.world >= 1 and s.gpus_per_node >= 1, f"world size {s.world} ({s.nodes} node(s) × {s.gpus_per_node})"))
    return out


def _offline_cache_check(cfg: DictConfig, T: Shapes) -> List[Check]:
    if cfg.train.features.value != "offline":
        return []
    stats = data_stats(cfg)
    if stats is None:
        return []
    cached, need = stats.get("hidden_state_layers") or [], layers_read(cfg, T.layers)
    missing = [k for k in need if k not in cached]
    return [(not missing, f"recipe key 'train.features': offline needs layers {need} but {cfg.train.data_dir} caches "
                          f"{cached}; set train.features=online or add them to the data job's data.hidden_states.layer_ids"
             if missing else f"cached layers {cached} cover {need}")]


def data_stats(cfg: DictConfig) -> Optional[dict]:
    """The stats.json the data job wrote in train.data_dir, or None before it ran (or when it is damaged: the plan
    then estimates from the data recipe)."""
    if not cfg.train.data_dir:
        return None
    path = Path(cfg.train.data_dir).expanduser() / "stats.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def batch_checks(cfg: DictConfig, data: Dict[str, object], s: Setup) -> List[Check]:
    t = cfg.train
    conversations = data.get("conversations")
    step = t.micro_batch_size * t.grad_accum * s.world
    if not conversations:
        return [(True, f"global batch {t.micro_batch_size} × {t.grad_accum} × {s.world} ranks = {step} conversations")]
    train = int(conversations) - t.heldout
    per_epoch = train // (t.micro_batch_size * s.world) // t.grad_accum
    ok = per_epoch >= 1
    return [(ok, f"global batch {step} conversations ({t.micro_batch_size} × {t.grad_accum} × {s.world} ranks): "
                 f"{per_epoch} steps per epoch of {train} training conversations" if ok else
             f"recipe keys 'train.micro_batch_size' / 'train.grad_accum': {train} training conversations make less than "
             f"one optimizer step of {t.micro_batch_size} × {t.grad_accum} × {s.world} ranks")]


FIXES = {"target weights": "target.dtype=bfloat16, or GPUs with more memory",
         "drafter weights": "train.zero_stage=3 (or more GPUs at ZeRO 3)",
         "gradients": "train.zero_stage=2 and more GPUs",
         "optimizer state": "train.zero_stage (higher) and more GPUs",
         "reduce bucket": "train.zero_stage=0 (the bucket is ZeRO 1-2's)",
         "activations": "train.micro_batch_size or train.max_length (lower)",
         "teacher logits": "train.micro_batch_size or train.max_length (lower)"}


def memory_check(plan: Plan) -> Check:
    total = plan.total / GIB
    if plan.fits:
        return True, f"memory {total:.1f} of {plan.budget_gb:g} GiB per GPU ({plan.budget_source})"
    name, size = max(plan.terms.items(), key=lambda kv: kv[1])
    fix = "change " + FIXES[name]
    if name == "target weights" and plan.counts and plan.terms[name] <= 2 * plan.counts.target:  # bf16 already
        fix = "every rank holds the whole frozen target, already at 2 bytes a weight: use GPUs with more memory"
    fixes = KINDS[plan.kind].planning.memory_fixes
    if name in fixes:
        fix += ", " + fixes[name]
    return False, (f"does not fit: {total:.1f} GiB per GPU > {plan.budget_gb:g} GiB ({plan.budget_source}); biggest term "
                   f"{name} {size / GIB:.1f} GiB: {fix}")
