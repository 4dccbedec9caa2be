"""Plan a training run before anything heavy loads: memory per GPU, disk, data, and recipe sanity at cluster scale.

    python launch/plan.py RECIPE.yaml [key=value ...] [--nodes N] [--gpus-per-node G]
    python -m specdrafter.train.plan RECIPE.yaml [key=value ...] [--nodes N] [--gpus-per-node G]   (the same)

The target and the drafter are built on the meta device (accelerate.init_empty_weights: no weights, no hub) from a
config: the converted SmolLM2 folder, a local model folder, or a hub id's public config.json shipped in
recipes/targets/<Name>.json. Memory per rank is counted term by term the way train/loop.py and DeepSpeed allocate it:

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
eval/bench_plan.py measures the same recipe against this plan (peak live tensor bytes and RSS on CPU,
torch.cuda.max_memory_allocated on a GPU).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from specdrafter.core.cli import cli
from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import RecipeError
from specdrafter.kinds import KINDS, kind_of
from specdrafter.recipes import RECIPES_DIR
from specdrafter.train.drafters import TEACHER_CHUNK
from specdrafter.train.memory import Counts, Setup, Shapes, activations, dtype_bytes, model_states, precision

TARGETS_DIR = RECIPES_DIR / "targets"
GIB = 2**30
DEFAULT_GPU_GB = 80.0
TEMPLATE_TOKENS = 32  # chat-template tokens per turn, for token estimates without a tokenizer


# ------------------------------------------------------------------------------------------------- configs
def target_config(name: str):
    """A model's config without its weights: the built-in SmolLM2 folder, a local folder, a shipped
    recipes/targets/<Name>.json, or (last) transformers' own lookup, which may use the hub cache or network."""
    from transformers import AutoConfig

    path = _config_path(name)
    try:
        return AutoConfig.from_pretrained(str(path) if path else name)
    except (OSError, ValueError) as e:
        shipped = TARGETS_DIR / f"{name.rstrip('/').split('/')[-1]}.json"
        raise SpecdrafterError(f"no config for model {name!r} ({str(e).splitlines()[0]}); put its config.json in "
                               f"{shipped.relative_to(RECIPES_DIR.parent)} or point the recipe at a local folder") from None


def _config_path(name: str) -> Optional[Path]:
    from specdrafter.core.recipe import BUILTIN_TARGETS
    from specdrafter.data.assets import SMOLLM2_DIR, cache_dir

    if name in BUILTIN_TARGETS:
        folder = cache_dir() / "models" / SMOLLM2_DIR
        if not (folder / "config.json").is_file():
            raise SpecdrafterError(f"the built-in target {name!r} is not converted yet: run python launch/fetch_assets.py")
        return folder
    local = Path(name).expanduser()
    if (local / "config.json").is_file():
        return local
    shipped = TARGETS_DIR / f"{name.rstrip('/').split('/')[-1]}.json"
    return shipped if shipped.is_file() else None


# ------------------------------------------------------------------------------------------- meta models
def meta_counts(cfg: DictConfig, tconf) -> Counts:
    """Build target and drafter on the meta device and count their parameters."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        target = AutoModelForCausalLM.from_config(tconf, dtype=getattr(torch, cfg.target.dtype.value))
        module, draft = _meta_drafter(cfg, target)
    for model in (target, module):  # tying is a no-op inside init_empty_weights: count tied embeddings once
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    params = list(module.parameters())
    trainable = [p.numel() for p in params if p.requires_grad]
    return Counts(sum(p.numel() for p in target.parameters()), sum(trainable),
                  sum(p.numel() for p in params if not p.requires_grad), max(trainable, default=0), draft)


def _meta_drafter(cfg: DictConfig, target):
    """(module, draft shapes or None): the recipe's kind builds its trainable module (kinds/: planner_module)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft's calls of deprecated transformers 5 names
        return kind_of(cfg).planner_module(cfg, target, target_config)


# --------------------------------------------------------------------------------------------------- plan
@dataclass
class Plan:
    recipe: str
    kind: str
    setup: Setup
    target: Shapes
    counts: Optional[Counts]
    terms: Dict[str, int]  # per rank, bytes
    budget_gb: float
    budget_source: str
    data: Dict[str, object]
    checks: List[Tuple[bool, str]]
    notes: List[str]

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.budget_gb * GIB

    def problems(self) -> List[str]:
        return [line for ok, line in self.checks if not ok]


def make_plan(cfg: DictConfig, recipe: str = "", setup: Optional[Setup] = None,
              budget_gb: Optional[float] = None) -> Plan:
    """The whole plan of a recipe; `budget_gb` overrides train.gpu_memory_gb (the launchers pass the device's)."""
    s = setup or Setup()
    tconf = target_config(cfg.target.model)
    T = Shapes.of(tconf)
    checks = recipe_checks(cfg, T, s)
    kind = cfg.drafter.kind.value
    counts, terms, notes = None, {}, []
    if KINDS[kind].trainable and not [line for ok, line in checks if not ok]:
        counts = meta_counts(cfg, tconf)
        terms, notes = memory_terms(cfg, tconf, counts, s)
    source = "this GPU" if budget_gb else ("train.gpu_memory_gb" if cfg.train.gpu_memory_gb else f"default {DEFAULT_GPU_GB:g}")
    budget = budget_gb or cfg.train.gpu_memory_gb or DEFAULT_GPU_GB
    data = data_facts(cfg, T, s)
    plan = Plan(recipe, kind, s, T, counts, terms, budget, source, data, checks, notes)
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


# ------------------------------------------------------------------------------------------------- checks
def recipe_checks(cfg: DictConfig, T: Shapes, s: Setup) -> List[Tuple[bool, str]]:
    """One line each: (ok, line). Run before anything loads; the launchers refuse the first failure."""
    kind = kind_of(cfg)
    out = []
    if kind.trainable:
        t = cfg.train
        fits = not T.positions or t.max_length <= T.positions
        out.append((fits, f"train.max_length {t.max_length} within the target's {T.positions or 'unbounded'} positions"
                    if fits else f"recipe key 'train.max_length' ({t.max_length}) exceeds the target's "
                    f"max_position_embeddings ({T.positions})"))
    out += kind.planner_checks(cfg, T, target_config)
    if kind.trainable:
        out += _offline_cache_check(cfg, T)
    out.append((s.world >= 1 and s.gpus_per_node >= 1, f"world size {s.world} ({s.nodes} node(s) × {s.gpus_per_node})"))
    return out


def _offline_cache_check(cfg: DictConfig, T: Shapes) -> List[Tuple[bool, str]]:
    if cfg.train.features.value != "offline" or not cfg.train.data_dir:
        return []
    stats = _read_json(Path(cfg.train.data_dir).expanduser() / "stats.json")
    if stats is None:
        return []
    cached, need = stats.get("hidden_state_layers") or [], kind_of(cfg).feature_layers(cfg, T.layers)
    missing = [k for k in need if k not in cached]
    return [(not missing, f"recipe key 'train.features': offline needs layers {need} but {cfg.train.data_dir} caches "
                          f"{cached}; set train.features=online or add them to the data job's data.hidden_states.layer_ids"
             if missing else f"cached layers {cached} cover {need}")]


def batch_checks(cfg: DictConfig, data: Dict[str, object], s: Setup) -> List[Tuple[bool, str]]:
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


def memory_check(plan: Plan) -> Tuple[bool, str]:
    total = plan.total / GIB
    if plan.fits:
        return True, f"memory {total:.1f} of {plan.budget_gb:g} GiB per GPU ({plan.budget_source})"
    name, size = max(plan.terms.items(), key=lambda kv: kv[1])
    fix = FIXES[name]
    if name in KINDS[plan.kind].memory_fixes:
        fix += ", " + KINDS[plan.kind].memory_fixes[name]
    return False, (f"does not fit: {total:.1f} GiB per GPU > {plan.budget_gb:g} GiB ({plan.budget_source}); biggest term "
                   f"{name} {size / GIB:.1f} GiB: change {fix}")


# --------------------------------------------------------------------------------------------------- data
def data_facts(cfg: DictConfig, T: Shapes, s: Setup) -> Dict[str, object]:
    """The data job behind train.data_dir (its stats.json when it ran, else its recipe's upper bound), the
    hidden-state cache's disk, and each node's share."""
    from specdrafter.data.regenerate import hidden_states_bytes

    facts: Dict[str, object] = {}
    data_dir = cfg.train.data_dir
    job, source = _data_job(cfg)
    d = job.data if job is not None else cfg.data
    facts["job"] = source
    stats = _read_json(Path(data_dir).expanduser() / "stats.json") if data_dir else None
    per_conv = min(d.max_turns * (d.max_prompt_tokens + d.max_new_tokens + TEMPLATE_TOKENS), T.positions or 10**12)
    if stats and stats.get("tokens"):
        facts.update(conversations=stats.get("conversations"), tokens=stats["tokens"], measured=True)
    else:
        facts.update(conversations=d.num_conversations, tokens=d.num_conversations * per_conv, measured=False,
                     per_conversation=per_conv)
    layers = list(d.hidden_states.layer_ids)
    cached = bool(layers)
    if not layers:
        layers = kind_of(cfg).feature_layers(cfg, T.layers)
    dtype = getattr(torch, d.hidden_states.dtype.value)
    facts.update(cache_layers=layers, cached=cached, cache_per_million=hidden_states_bytes(10**6, len(layers), T.hidden, dtype))
    facts["cache_total"] = hidden_states_bytes(int(facts["tokens"]), len(layers), T.hidden, dtype)
    facts["train_tokens"] = min(int(facts["tokens"]), int(facts["conversations"] or 0) * cfg.train.max_length)
    return facts


def _data_job(cfg: DictConfig) -> Tuple[Optional[DictConfig], str]:
    """The data job's recipe: the one it saved in train.data_dir, else a recipe in recipes/ writing there."""
    data_dir = cfg.train.data_dir
    if not data_dir:
        return None, "this recipe's data section (no train.data_dir)"
    saved = Path(data_dir).expanduser() / "recipe.yaml"
    candidates = [saved] if saved.is_file() else sorted(RECIPES_DIR.glob("*.yaml"))
    for path in candidates:
        job = _data_section(path, data_dir if path != saved else None)
        if job is not None:
            return job, str(path.relative_to(RECIPES_DIR.parent) if path.is_relative_to(RECIPES_DIR.parent) else path)
    return None, f"none found for {data_dir} (this recipe's data section)"


def _data_section(path: Path, output_dir: Optional[str]) -> Optional[DictConfig]:
    """The schema-merged data section of a recipe file (whose output_dir is `output_dir`, when given), or None."""
    from specdrafter.core.recipe import Recipe

    try:
        raw = OmegaConf.load(path)
        if output_dir is not None and (raw.get("output_dir") != output_dir or "data" not in raw):
            return None
        return OmegaConf.merge(OmegaConf.structured(Recipe), {"data": raw.get("data", {})})
    except Exception:  # a recipe that does not merge into the schema: no estimate from it
        return None


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------- output
def _gib(n: float) -> str:
    return f"{n / GIB:8.2f}"


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def format_plan(p: Plan, cfg: DictConfig) -> str:
    t, s = cfg.train, p.setup
    bf16, amp = precision(cfg, s.device)
    lines = [f"plan: {p.recipe} — {p.kind} on {cfg.target.model} ({cfg.target.dtype.value}), ZeRO {t.zero_stage}, "
             f"precision {t.precision.value} ({'bf16' if bf16 else 'fp32'} weights{', bf16 autocast' if amp else ''}), "
             f"{s.nodes} node(s) × {s.gpus_per_node} GPU(s) = world {s.world}" if KINDS[p.kind].trainable else
             f"plan: {p.recipe} — target {cfg.target.model}; drafter.kind={p.kind} trains nothing: data and disk only"]
    if p.counts:
        c = p.counts
        lines.append(f"target {c.target / 1e9:.3f} B parameters (frozen); drafter {c.trainable / 1e6:.1f} M trainable"
                     + (f", {c.frozen / 1e6:.1f} M frozen" if c.frozen else ""))
        lines.append(f"{'per rank':<52}{'GiB':>8}")
        for name, size in p.terms.items():
            lines.append(f"  {_label(name, cfg):<50}{_gib(size)}")
        lines.append(f"  {'total':<50}{_gib(p.total)}  of {p.budget_gb:g} ({p.budget_source})")
        lines += [f"  note: {n}" for n in p.notes]
    lines += _data_lines(p, cfg)
    lines += _node_lines(p, cfg)
    lines.append("checks")
    lines += [f"  {'ok  ' if ok else 'FAIL'} {line}" for ok, line in p.checks]
    return "\n".join(lines)


def _label(name: str, cfg: DictConfig) -> str:
    t = cfg.train
    if name == "activations":
        return f"activations ({t.micro_batch_size} × {t.max_length} tokens{kind_of(cfg).activation_label(cfg)})"
    return name


def _data_lines(p: Plan, cfg: DictConfig) -> List[str]:
    f = p.data
    how = "measured (stats.json)" if f["measured"] else f"at most: {f['conversations']} conversations × ≤ {f['per_conversation']}"
    cache = "cached by the data job" if f["cached"] else "not cached (online features); offline it would take"
    return ["data",
            f"  data job: {f['job']}",
            f"  tokens: {f['tokens']:,} ({how}); training reads ≤ {f['train_tokens']:,} "
            f"(train.max_length {cfg.train.max_length})",
            f"  hidden-state cache, layers {f['cache_layers']}: {cache} {_size(f['cache_per_million'])} per 1M tokens, "
            f"{_size(f['cache_total'])} for this data"]


def _node_lines(p: Plan, cfg: DictConfig) -> List[str]:
    s, f = p.setup, p.data
    lines = [f"per node ({s.gpus_per_node} GPU(s), {s.nodes} node(s))"]
    if p.counts:
        bt = dtype_bytes(cfg.target.dtype.value)
        host = s.gpus_per_node * (p.counts.target * bt + 16 * int(f["train_tokens"]))
        if cfg.train.features.value == "offline":
            host += s.gpus_per_node * int(f["cache_total"])
        lines.append(f"  GPU memory {s.gpus_per_node} × {p.total / GIB:.1f} GiB; host RAM ≥ {host / GIB:.1f} GiB (each rank "
                     "loads the target on the host and holds every "
                     f"conversation{' and the cache' if cfg.train.features.value == 'offline' else ''})")
    disk = 20 * int(f["tokens"]) + (int(f["cache_total"]) if cfg.train.features.value == "offline" else 0)
    lines.append(f"  disk: train.data_dir ≈ {_size(disk)} on every node (shards"
                 f"{' + hidden/' if cfg.train.features.value == 'offline' else ''}); output_dir on a filesystem all nodes share")
    if p.counts:
        ckpt = 16 * p.counts.trainable + 4 * p.counts.frozen
        lines.append(f"  checkpoints ≈ {_size(ckpt)} each × train.keep_checkpoints {cfg.train.keep_checkpoints} "
                     "(every rank writes its ZeRO partition)")
    return lines


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
    recipe check or a plan that does not fit in one SpecdrafterError line; rank 0 prints one summary line. Also
    binds the process to its GPU (LOCAL_RANK) before train/loop.py's first NCCL collective (DeepSpeed's engine
    binds it only later)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
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
