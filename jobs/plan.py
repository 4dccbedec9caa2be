"""Plan a training run before anything heavy loads: memory per GPU, disk, data, and recipe sanity at cluster scale.

    python launch/plan.py RECIPE.yaml [key=value ...] [--nodes N] [--gpus-per-node G]
    python -m specdrafter.jobs.plan RECIPE.yaml [key=value ...] [--nodes N] [--gpus-per-node G]   (the same)

The target and the drafter are built on the meta device (accelerate.init_empty_weights: no weights, no hub) from a
config: the converted SmolLM2 folder, a local model folder, or a hub id's public config.json shipped in
recipes/targets/<Name>.json. Memory per rank is counted term by term the way jobs/train.py and DeepSpeed allocate it:

    target weights      every rank holds the frozen target in target.dtype
    drafter weights     DeepSpeed's flat weights (bf16 with train.precision=bf16, else fp32) and their fp32
                        master / partition copies, frozen weights too
    gradients           ZeRO 0: all of them, from the backward to the step; ZeRO 1-3: the kept ones (a partition
                        from ZeRO 2 on) and the one in flight
    optimizer state     AdamW moments, partitioned from ZeRO 1 on
    reduce bucket       ZeRO 1-2's 5e8-element gradient bucket, during the backward
    activations         one micro-batch of micro_batch_size × max_length tokens, every position counted (the worst
                        batch): the drafter's saved tensors (all EAGLE-3 TTT steps), its logits, the distillation loss's
                        [rows, vocabulary] tensors and the previous micro-step's predictions, which the loop still holds
    teacher logits      the target's rows kept for the loss, or its peak while train.drafters.teacher_rows visits the
                        vocabulary TEACHER_CHUNK rows at a time, when that moment is the peak

Each moment of a micro-step (teacher, forward, loss, backward, bucket, step) is summed; the largest is the plan.
benchmarks/bench_plan.py measures the same recipe against this plan (peak live tensor bytes and RSS on CPU,
torch.cuda.max_memory_allocated on a GPU).

This module assembles the plan (Plan, make_plan, the data facts) and runs it (preflight, the command line); the
parts live beside it:
    train/model_configs.py   a model's config without its weights (target_config)
    train/memory.py          the byte model: the terms above, per rank, and the kinds' activation terms
    jobs/plan_checks.py     the recipe, batch and memory checks, one (ok, line) each
    jobs/plan_report.py     the plan as text (format_plan)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import Recipe, RecipeError
from specdrafter.data.shards import hidden_states_bytes
from specdrafter.jobs.cli import cli
from specdrafter.jobs.plan_checks import batch_checks, data_stats, memory_check, recipe_checks
from specdrafter.jobs.plan_report import format_plan
from specdrafter.kinds import KINDS, kind_of, layers_read
from specdrafter.models.targets import language_model_only, serving_cache_bytes
from specdrafter.recipes import RECIPES_DIR
from specdrafter.train.drafters import TEACHER_CHUNK
from specdrafter.train.memory import GIB, Counts, Plan, Setup, Shapes, activations, dtype_bytes, model_states
from specdrafter.train.model_configs import target_config

DEFAULT_GPU_GB = 80.0
TEMPLATE_TOKENS = 32  # chat-template tokens per turn, for token estimates without a tokenizer


# ------------------------------------------------------------------------------------------- meta models
def meta_counts(cfg: DictConfig, tconf) -> Counts:
    """Build target and drafter on the meta device and count their parameters."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        target = language_model_only(AutoModelForCausalLM.from_config(tconf, dtype=getattr(torch, cfg.target.dtype.value)))
        module, draft = _meta_drafter(cfg, target)
    for model in (target, module):  # tying is a no-op inside init_empty_weights: count tied embeddings once
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    params = list(module.parameters())
    trainable = [p.numel() for p in params if p.requires_grad]
    return Counts(sum(p.numel() for p in target.parameters()), sum(trainable),
                  sum(p.numel() for p in params if not p.requires_grad), max(trainable, default=0), draft,
                  active_parameters(target, tconf))


def active_parameters(target, tconf) -> int:
    """The parameters one token's forward multiplies by (what a MoE's model card calls active): a routed experts
    tensor ([experts, ...] under `.experts.`: Qwen3-MoE, gpt-oss, DeepSeek-V3, Mixtral in transformers 5) counts
    num_experts_per_tok of its rows; shared experts, routers, attention and the LM head count whole; the input
    embedding is a lookup and counts nothing unless it is tied to the LM head."""
    top_k = getattr(tconf.get_text_config(), "num_experts_per_tok", None)
    lookup = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    skip = None if head is not None and head.weight is lookup else lookup
    total = 0
    for name, p in target.named_parameters():
        if p is skip:
            continue
        routed = top_k and ".experts." in f".{name}" and p.dim() >= 2
        total += p.numel() * top_k // p.shape[0] if routed else p.numel()
    return total


def _meta_drafter(cfg: DictConfig, target):
    """(module, draft shapes or None): the recipe's kind builds its trainable module (kinds/: planner_module)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft's calls of deprecated transformers 5 names
        kind = kind_of(cfg)
        return kind.planning.module(cfg, target, target_config, kind.training)


# --------------------------------------------------------------------------------------------------- plan
def make_plan(cfg: DictConfig, recipe: str = "", setup: Optional[Setup] = None,
              budget_gb: Optional[float] = None) -> Plan:
    """The whole plan of a recipe; `budget_gb` overrides train.gpu_memory_gb (the launchers pass the device's)."""
    s = setup or Setup()
    tconf = target_config(cfg.target.model)
    T = Shapes.of(tconf)
    checks = recipe_checks(cfg, T, s)
    kind = cfg.drafter.kind
    counts, terms, notes = None, {}, []
    if KINDS[kind].training and not [line for ok, line in checks if not ok]:
        counts = meta_counts(cfg, tconf)
        terms, notes = memory_terms(cfg, tconf, counts, s)
    source = "this GPU" if budget_gb else ("train.gpu_memory_gb" if cfg.train.gpu_memory_gb else f"default {DEFAULT_GPU_GB:g}")
    budget = budget_gb or cfg.train.gpu_memory_gb or DEFAULT_GPU_GB
    data = data_facts(cfg, T, s)
    contexts = sorted({c for c in (4096, 32768, T.positions) if 0 < c <= max(T.positions, 4096)})
    serving = {c: serving_cache_bytes(tconf, c) for c in contexts}
    plan = Plan(recipe, kind, s, T, counts, terms, budget, source, data, checks, notes, serving)
    if terms:
        plan.checks += batch_checks(cfg, data, s) + [memory_check(plan)]
    return plan


def memory_terms(cfg: DictConfig, tconf, c: Counts, s: Setup) -> Tuple[Dict[str, int], List[str]]:
    """Per-rank terms at the planned peak (they sum to it), and notes: which moment peaks, the teacher's own peak."""
    st = model_states(cfg, c, s)
    act = activations(cfg, tconf, c, s, kind_of(cfg))
    phase, at_peak = act.peak(st)
    terms = {"target weights": dtype_bytes(cfg.target.dtype.value) * c.target, "drafter weights": st.weights,
             "gradients": st.grads_kept + at_peak.get("gradients", 0), "optimizer state": st.optimizer}
    if at_peak.get("reduce bucket"):
        terms["reduce bucket"] = at_peak["reduce bucket"]
    terms["activations"] = at_peak["activations"]
    terms["teacher logits"] = at_peak["teacher logits"]
    notes = [f"peak: during the {PHASES[phase]}",
             f"teacher rows: {act.logits / GIB:.2f} GiB kept for the loss, "
             f"{(act.features + max(act.teacher_peak, act.logits)) / GIB:.2f} "
             f"GiB peak while the target and train.drafters.teacher_rows run (TEACHER_CHUNK {TEACHER_CHUNK} vocabulary rows)",
             f"gradients {(st.grads_kept + st.grads_backward) / GIB:.2f} GiB in all; reduce bucket {st.bucket / GIB:.2f} GiB"
             if st.bucket else f"gradients {(st.grads_kept + st.grads_backward) / GIB:.2f} GiB from the backward to the step"]
    return terms, notes + act.notes


PHASES = {"teacher": "next micro-step's teacher (the previous one's tensors still held)",
          "forward": "drafter's forward (the previous micro-step's predictions still held)",
          "loss": "loss", "backward": "backward", "bucket": "backward, once ZeRO's reduce bucket is allocated",
          "step": "optimizer step"}


# --------------------------------------------------------------------------------------------------- data
def data_facts(cfg: DictConfig, T: Shapes, s: Setup) -> Dict[str, object]:
    """The data job behind train.data_dir (its stats.json when it ran, else its recipe's upper bound), the
    hidden-state cache's disk, and each node's share."""
    facts: Dict[str, object] = {}
    d, facts["job"] = data_job(cfg)
    stats = data_stats(cfg)
    per_conv = min(d.max_turns * (d.max_prompt_tokens + d.max_new_tokens + TEMPLATE_TOKENS), T.positions or 10**12)
    if stats and stats.get("tokens"):
        facts.update(conversations=stats.get("conversations"), tokens=stats["tokens"], measured=True)
    else:
        facts.update(conversations=d.num_conversations, tokens=d.num_conversations * per_conv, measured=False,
                     per_conversation=per_conv)
    layers = list(d.hidden_states.layer_ids)
    cached = bool(layers)
    if not layers:
        layers = layers_read(cfg, T.layers)
    dtype = getattr(torch, d.hidden_states.dtype.value)
    facts.update(cache_layers=layers, cached=cached, cache_per_million=hidden_states_bytes(10**6, len(layers), T.hidden, dtype))
    facts["cache_total"] = hidden_states_bytes(int(facts["tokens"]), len(layers), T.hidden, dtype)
    facts["train_tokens"] = min(int(facts["tokens"]), int(facts["conversations"] or 0) * cfg.train.max_length)
    return facts


def data_job(cfg: DictConfig) -> Tuple[DictConfig, str]:
    """(the data section of the data job behind train.data_dir, where it comes from): the recipe.yaml the job saved
    there once it ran, else the recipe train.data_recipe names, else this recipe's own data section."""
    data_dir, named = cfg.train.data_dir, cfg.train.data_recipe
    saved = Path(data_dir).expanduser() / "recipe.yaml" if data_dir else None
    if saved is not None and saved.is_file():
        section = _data_section(saved)
        if section is not None:
            return section, _shown(saved)
    if named:
        path = data_recipe_path(named)
        section = _data_section(path)
        if section is None:
            raise RecipeError(f"recipe key 'train.data_recipe': {named!r} is not a readable recipe with a data section")
        return section, _shown(path)
    return cfg.data, "this recipe's data section" + (" (no train.data_dir)" if not data_dir else "")


def data_recipe_path(name: str) -> Path:
    """train.data_recipe's file: a path, else a recipe shipped in recipes/ (specdrafter.recipes) of that name."""
    for path in (Path(name).expanduser(), RECIPES_DIR / name):
        if path.is_file():
            return path
    raise RecipeError(f"recipe key 'train.data_recipe': no recipe {name!r} (neither a file nor one in recipes/)")


def _data_section(path: Path) -> Optional[DictConfig]:
    """The schema-merged data section of a recipe file, or None (a damaged or older recipe: no estimate from it)."""
    try:
        raw = OmegaConf.load(path)
        if "data" not in raw:
            return None
        return OmegaConf.merge(OmegaConf.structured(Recipe), {"data": raw.data}).data
    except Exception:
        return None


def _shown(path: Path) -> str:
    """A shipped recipe as recipes/NAME (the same in a checkout and an installed package), any other as given."""
    return str(path.relative_to(RECIPES_DIR.parent)) if path.is_relative_to(RECIPES_DIR.parent) else str(path)


# ---------------------------------------------------------------------------------------------- launchers
def check_training_recipe(cfg: DictConfig) -> None:
    """What a training run checks before anything heavy loads (the launchers also with --print-config): a data job
    to train on, and `check_against_target`."""
    if not cfg.train.data_dir:
        raise RecipeError("recipe key 'train.data_dir' is required: the output_dir of a data job (launch/generate_data.py)")
    check_against_target(cfg)


def check_against_target(cfg: DictConfig) -> None:
    """The recipe checks that need only the target's config.json (`recipe_checks`: train.max_length, the kind's
    layers and vocabulary), before any weights load; the first failure is one RecipeError line."""
    problems = [line for ok, line in recipe_checks(cfg, Shapes.of(target_config(cfg.target.model)), Setup()) if not ok]
    if problems:
        raise RecipeError(problems[0])


def preflight(cfg: DictConfig) -> Optional[Plan]:
    """The launchers' check before anything heavy loads: on CUDA only (on CPU it does nothing). Refuses a failing
    recipe check or a plan that does not fit in one SpecdrafterError line; rank 0 prints one summary line."""
    if not torch.cuda.is_available():
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or min(world, torch.cuda.device_count()))
    device_gb = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory / GIB
    try:
        plan = make_plan(cfg, setup=Setup(world, max(local, 1), "cuda"),
                         budget_gb=None if cfg.train.gpu_memory_gb else device_gb)
    except SpecdrafterError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"plan: skipped ({e})", flush=True)
        return None
    problems = plan.problems()
    if problems:
        raise SpecdrafterError(f"{problems[0]} (launch/plan.py prints the whole plan)")
    if os.environ.get("RANK", "0") == "0":
        name, size = max(plan.terms.items(), key=lambda kv: kv[1]) if plan.terms else ("-", 0)
        print(f"plan: {plan.total / GIB:.1f} of {plan.budget_gb:.0f} GiB per GPU ({plan.budget_source}; biggest: {name} "
              f"{size / GIB:.1f} GiB)", flush=True)
    return plan


# ------------------------------------------------------------------------------------------------- command line
def print_plan(cfg: DictConfig, recipe: str, flags: Dict[str, Optional[int]]) -> None:
    """The plan on --nodes × --gpus-per-node GPUs (default: 8 per node for a hub target, 1 for the built-in one);
    a failed check is raised after the whole plan is printed."""
    gpus = flags["--gpus-per-node"] or (1 if cfg.target.model == "smollm2-135m-instruct" else 8)
    plan = make_plan(cfg, recipe, Setup(world=flags["--nodes"] * gpus, gpus_per_node=gpus, device="cuda"))
    print(format_plan(plan, cfg))
    if plan.problems():
        raise SpecdrafterError(plan.problems()[0])


def main(argv: Optional[List[str]] = None) -> None:
    cli(print_plan, argv, flags={"--nodes": 1, "--gpus-per-node": None})


if __name__ == "__main__":
    main()
