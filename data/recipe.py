"""Recipes: OmegaConf YAML validated against one typed schema, with `key=value` overrides.

A recipe file names only the sections its job needs; every other key keeps the schema default. Anything
wrong with a recipe (unknown key, wrong type, missing value, nonexistent path) is reported in one line that
names the key before any model or dataset loads.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from data.io import SpecdrafterError, atomic_write_text

BUILTIN_TARGETS = ("smollm2-135m-instruct",)
PROMPT_SETS = ("mtbench", "humaneval", "gsm8k", "sharegpt")


class RecipeError(SpecdrafterError):
    pass


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Overlong(Enum):
    skip = "skip"  # drop prompts that do not fit (counted)
    truncate = "truncate"  # keep their first tokens (counted)


@dataclass
class TargetConfig:
    # A built-in offline asset (smollm2-135m-instruct), a local Hugging Face model folder, or a hub id
    # such as meta-llama/Llama-3.1-8B-Instruct on a machine with hub access.
    model: str = "smollm2-135m-instruct"
    dtype: DType = DType.float32


@dataclass
class HiddenStatesConfig:
    # Target layers whose *input* hidden states are cached for offline EAGLE training (vLLM's convention:
    # id k = input to decoder layer k; id num_hidden_layers = the last layer's output before the final norm; data/features.py). Empty = off.
    layer_ids: List[int] = field(default_factory=list)
    dtype: DType = DType.bfloat16
    batch_size: int = 8


@dataclass
class DataConfig:
    prompts: str = "sharegpt"  # a built-in prompt set or a JSONL file of {"turns": [...]} / {"prompt": ...}
    num_conversations: int = 64
    min_prompt_tokens: int = 4
    max_prompt_tokens: int = 384
    overlong: Overlong = Overlong.skip
    exclude: List[str] = field(default_factory=lambda: ["mtbench", "humaneval", "gsm8k"])
    max_new_tokens: int = 256
    temperature: float = 0.7  # 0 = greedy
    top_p: float = 0.95
    batch_size: int = 16
    shard_size: int = 32
    seed: int = 0
    hidden_states: HiddenStatesConfig = field(default_factory=HiddenStatesConfig)


class DrafterKind(Enum):
    self_draft = "self_draft"  # the target's first `num_layers` layers + norm + lm_head (training-free baseline)
    draft_model = "draft_model"  # a small causal LM sharing the target's tokenizer
    medusa = "medusa"  # Medusa heads on the target's last hidden state
    eagle3 = "eagle3"  # an EAGLE-3 head on three target layers
    eagle1 = "eagle1"  # an EAGLE-1 head on the target's last-layer feature


class VerifierKind(Enum):
    exact = "exact"  # greedy at temperature 0, exact speculative sampling above
    asd = "asd"  # approximate speculative decoding (temperature 0 only)
    typical = "typical"  # Medusa typical acceptance over a static tree (lossy)


@dataclass
class LoraConfig:
    r: int = 0  # LoRA rank; 0 = train every weight
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class MedusaConfig:
    num_heads: int = 4
    num_layers: int = 1  # ResBlocks per head
    decay: float = 0.8  # head h's loss weight is decay**h
    # 1 = Medusa-1 (backbone frozen); 2 = Medusa-2: the backbone is fine-tuned jointly through LoRA (drafter.lora),
    # distilled towards the original target so that what is served stays the target; loss = backbone + heads_weight·heads
    stage: int = 1
    heads_weight: float = 0.2
    backbone_lr_ratio: float = 0.1  # Medusa-2: the backbone adapter's learning rate ÷ train.lr


@dataclass
class EagleConfig:
    # Target layers fused by the head (id k = input to layer k); empty = {2, L//2, L-3} (EAGLE-3's default).
    aux_layer_ids: List[int] = field(default_factory=list)
    ttt_steps: int = 7  # training-time-test steps
    step_decay: float = 0.8  # step j's loss weight is step_decay**j
    draft_vocab_size: int = 0  # most frequent target tokens of the training data; 0 = the full vocabulary
    feature_weight: float = 1.0  # EAGLE-1: SmoothL1 feature regression
    ce_weight: float = 0.1  # EAGLE-1: weight of the distillation objective


@dataclass
class DrafterConfig:
    kind: DrafterKind = DrafterKind.self_draft
    # Inference: the trained drafter's folder (a checkpoint's `drafter/` or an export) or a draft model's hub id.
    # Training a draft model: optional initial weights (else the target's first `num_layers` layers).
    path: Optional[str] = None
    num_layers: int = 6  # self_draft, and a draft model initialised from the target's first num_layers layers
    layers: List[int] = field(default_factory=list)  # draft model: which target layers to copy instead, e.g. [0, 1, 28, 29]
    lora: LoraConfig = field(default_factory=LoraConfig)
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)


class FeatureMode(Enum):
    online = "online"  # the frozen target computes features and logits for every batch, in the same process
    offline = "offline"  # read the hidden states cached by the data job (data.hidden_states.layer_ids)


class Precision(Enum):
    auto = "auto"  # bf16 on a GPU, fp32 on CPU
    fp32 = "fp32"
    bf16 = "bf16"


class WandbMode(Enum):
    offline = "offline"  # logs to <output_dir>/wandb; `wandb sync` uploads later
    online = "online"
    disabled = "disabled"


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: str = "specdrafter"
    name: Optional[str] = None  # default: the output folder's name


@dataclass
class TrainConfig:
    data_dir: Optional[str] = None  # the data job's output_dir (shards/ + hidden/)
    features: FeatureMode = FeatureMode.online
    # Distillation objective: weights over tv, fkl, rkl, jsd, soft_ce (ALGORITHMS.md §7), at `temperature`
    # (match the temperature the drafter will serve at). Empty = {soft_ce: 1}. Entries merge across the recipe
    # and overrides, so switch with e.g. train.objective.soft_ce=0 train.objective.tv=1.
    objective: Dict[str, float] = field(default_factory=dict)
    temperature: float = 1.0
    jsd_beta: float = 0.5
    max_length: int = 2048  # tokens per conversation (longer ones are cut)
    epochs: int = 1
    max_steps: int = 0  # optimizer steps; 0 = as many as `epochs` take
    micro_batch_size: int = 4  # conversations per rank per forward
    grad_accum: int = 1
    lr: float = 1e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    zero_stage: int = 0
    precision: Precision = Precision.auto
    heldout: int = 16  # conversations kept out of training for the held-out metrics
    eval_every: int = 50  # optimizer steps between held-out metrics
    save_every: int = 50  # optimizer steps between checkpoints
    keep_checkpoints: int = 2
    seed: int = 0
    warm_start: Optional[str] = None  # a checkpoint folder whose drafter weights initialise a new run
    # Every N checkpoints (and at the last), decode a couple of prompts of eval.sets[0] with the saved drafter
    # through the real loop and log τ and α (decode/tau, decode/alpha); 0 = off.
    decode_check_every: int = 0
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ASDConfig:
    budget: float = 8.0
    gate: float = 0.25
    max_mismatches: int = 2


@dataclass
class DynamicTreeConfig:
    total_tokens: int = 0  # EAGLE-2 dynamic tree of this many draft tokens (EAGLE-3 head or draft model); 0 = off
    depth: int = 5
    top_k: int = 8
    # verify only as many of the total_tokens best candidates as maximise the predicted speedup, from the learnt
    # acceptance per draft probability, the draft cost and v(n) (inference/autotune.TreeSizeTuner); false = all
    auto_size: bool = True


@dataclass
class TypicalConfig:
    eps: float = 0.09
    delta: float = 0.3


@dataclass
class InferenceConfig:
    prompt: str = "Explain speculative decoding in two sentences."
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # Draft tokens per cycle (chain): a number, or auto — chosen every cycle from the measured per-position
    # acceptance, draft cost and verification cost curve (inference/autotune.py), up to k_max.
    k: Union[int, str] = "auto"
    k_max: int = 8
    tree: List[List[int]] = field(default_factory=list)  # static tree choice paths, e.g. [[0],[1],[0,0]]; empty = chain
    dynamic_tree: DynamicTreeConfig = field(default_factory=DynamicTreeConfig)
    verifier: VerifierKind = VerifierKind.exact
    asd: ASDConfig = field(default_factory=ASDConfig)
    typical: TypicalConfig = field(default_factory=TypicalConfig)
    seed: int = 0


class EvalVerifier(Enum):
    chain = "chain"  # exact chain speculative decoding with block length inference.k (greedy at T = 0)
    tree = "tree"  # exact tree verification: inference.tree (static) or inference.dynamic_tree (EAGLE-2)
    typical = "typical"  # Medusa typical acceptance over inference.tree (lossy)
    asd = "asd"  # approximate speculative decoding at T = 0: inference.asd and every setting of eval.asd_sweep


@dataclass
class EvalConfig:
    # What to evaluate: a training checkpoint (…/checkpoints/step-N), a drafter folder (a checkpoint's drafter/ or
    # an export), or a run's output_dir — then every checkpoint of the run. `checkpoint=` on the command line is
    # short for eval.checkpoint=.
    checkpoint: Optional[str] = None
    sets: List[str] = field(default_factory=lambda: ["mtbench", "gsm8k", "humaneval"])  # names, JSONL files or datasets folders
    num_prompts: int = 8  # first N prompts of each set (first turns)
    max_new_tokens: int = 64
    temperatures: List[float] = field(default_factory=lambda: [0.0, 0.7, 1.0])
    verifiers: List[EvalVerifier] = field(default_factory=lambda: [EvalVerifier.chain])
    k_sweep: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 6])  # measured speedup vs k: newest checkpoint, first set, T = 0
    asd_sweep: List[List[float]] = field(default_factory=lambda: [[4, 0.25, 1], [16, 0.5, 2]])  # [budget, gate, max_mismatches]
    output_dir: Optional[str] = None  # default: <run>/eval beside the checkpoints
    wandb: bool = False  # also log the cells and plots to wandb (mode and project: train.wandb)


@dataclass
class Recipe:
    output_dir: str = MISSING
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def load_recipe(path: str | os.PathLike, overrides: List[str] = ()) -> DictConfig:
    """Merge schema defaults ← YAML file ← `key=value` overrides; validate; return a typed DictConfig."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    schema = OmegaConf.structured(Recipe)
    try:
        from_file = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends: keep the first line only
        raise RecipeError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise RecipeError(f"override {bad[0]!r} is not of the form key=value")
    try:
        cfg = OmegaConf.merge(schema, from_file, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        raise RecipeError(_explain(e, schema)) from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise RecipeError(f"recipe key {missing[0]!r} is required but has no value (set it in the YAML or as {missing[0]}=...)")
    _check_values(cfg)
    return cfg


def _explain(e: OmegaConfBaseException, schema: DictConfig) -> str:
    key = e.full_key or "?"
    first_line = (e.msg or str(e)).splitlines()[0] if (e.msg or str(e)) else type(e).__name__
    if isinstance(e, ConfigKeyError):
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(schema, parent) if parent else schema
        valid = [f"{parent}.{k}" if parent else k for k in node.keys()] if isinstance(node, DictConfig) else []
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (valid keys here: {', '.join(valid)})"
        return f"unknown recipe key {key!r}{hint}"
    return f"recipe key {key!r}: {first_line}"


def _check_values(cfg: DictConfig) -> None:
    d = cfg.data
    positive = {"data.num_conversations": d.num_conversations, "data.max_new_tokens": d.max_new_tokens,
                "data.batch_size": d.batch_size, "data.shard_size": d.shard_size,
                "data.max_prompt_tokens": d.max_prompt_tokens, "data.hidden_states.batch_size": d.hidden_states.batch_size}
    for key, value in positive.items():
        if value <= 0:
            raise RecipeError(f"recipe key {key!r} must be positive, got {value}")
    if d.min_prompt_tokens > d.max_prompt_tokens:
        raise RecipeError(f"recipe key 'data.min_prompt_tokens' ({d.min_prompt_tokens}) exceeds data.max_prompt_tokens ({d.max_prompt_tokens})")
    if d.temperature < 0:
        raise RecipeError(f"recipe key 'data.temperature' must be >= 0, got {d.temperature}")
    if not 0 < d.top_p <= 1:
        raise RecipeError(f"recipe key 'data.top_p' must be in (0, 1], got {d.top_p}")
    if any(k < 0 for k in d.hidden_states.layer_ids):
        raise RecipeError(f"recipe key 'data.hidden_states.layer_ids' must be non-negative, got {list(d.hidden_states.layer_ids)}")
    for name in d.exclude:
        if name not in PROMPT_SETS[:-1]:
            raise RecipeError(f"recipe key 'data.exclude': unknown evaluation set {name!r} (valid: mtbench, humaneval, gsm8k)")
    if d.prompts not in PROMPT_SETS and not Path(d.prompts).expanduser().is_file():
        raise RecipeError(f"recipe key 'data.prompts': {d.prompts!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor an existing file")
    inf = cfg.inference
    checks = {"inference.k": (inf.k == "auto" or (isinstance(inf.k, int) and inf.k >= 1), "auto or >= 1"),
              "inference.k_max": (inf.k_max >= 1, ">= 1"), "inference.max_new_tokens": (inf.max_new_tokens >= 1, ">= 1"),
              "inference.temperature": (inf.temperature >= 0, ">= 0"), "inference.top_k": (inf.top_k >= 0, ">= 0"),
              "inference.top_p": (0 < inf.top_p <= 1, "in (0, 1]"),
              "drafter.num_layers": (cfg.drafter.num_layers >= 1, ">= 1")}
    for key, (ok, rule) in checks.items():
        if not ok:
            raise RecipeError(f"recipe key {key!r} must be {rule}, got {OmegaConf.select(cfg, key)}")
    if inf.verifier.value == "typical" and (cfg.drafter.kind.value != "medusa" or not inf.tree):
        raise RecipeError("recipe key 'inference.verifier': typical acceptance needs drafter.kind=medusa and a static inference.tree")
    if inf.tree and inf.dynamic_tree.total_tokens:
        raise RecipeError("recipe keys 'inference.tree' and 'inference.dynamic_tree.total_tokens': choose a static or a dynamic tree, not both")
    if inf.verifier.value == "asd" and inf.temperature > 0:
        raise RecipeError("recipe key 'inference.verifier': asd is defined for greedy decoding only (set inference.temperature=0)")
    if cfg.drafter.path and _looks_local(cfg.drafter.path) and not Path(cfg.drafter.path).expanduser().is_dir():
        raise RecipeError(f"recipe key 'drafter.path': drafter folder {cfg.drafter.path!r} does not exist")
    _check_training(cfg)
    model = cfg.target.model
    if model not in BUILTIN_TARGETS and _looks_local(model) and not Path(model).expanduser().is_dir():
        raise RecipeError(f"recipe key 'target.model': model folder {model!r} does not exist")


OBJECTIVES = ("tv", "fkl", "rkl", "jsd", "soft_ce")  # train/objectives.py


def _check_training(cfg: DictConfig) -> None:
    t, dr = cfg.train, cfg.drafter
    unknown = [name for name in t.objective if name not in OBJECTIVES]
    if unknown:
        raise RecipeError(f"recipe key 'train.objective.{unknown[0]}': unknown objective (valid: {', '.join(OBJECTIVES)})")
    if t.objective and not any(w != 0 for w in t.objective.values()):
        raise RecipeError("recipe key 'train.objective' needs at least one non-zero weight")
    checks = {"train.temperature": (t.temperature > 0, "> 0"), "train.jsd_beta": (0 < t.jsd_beta < 1, "in (0, 1)"),
              "train.max_length": (t.max_length >= 2, ">= 2"), "train.epochs": (t.epochs >= 1, ">= 1"),
              "train.max_steps": (t.max_steps >= 0, ">= 0"), "train.micro_batch_size": (t.micro_batch_size >= 1, ">= 1"),
              "train.grad_accum": (t.grad_accum >= 1, ">= 1"), "train.lr": (t.lr > 0, "> 0"),
              "train.warmup_steps": (t.warmup_steps >= 0, ">= 0"), "train.min_lr_ratio": (0 <= t.min_lr_ratio <= 1, "in [0, 1]"),
              "train.grad_clip": (t.grad_clip >= 0, ">= 0"), "train.zero_stage": (t.zero_stage in (0, 1, 2, 3), "0, 1, 2 or 3"),
              "train.heldout": (t.heldout >= 0, ">= 0"), "train.eval_every": (t.eval_every >= 1, ">= 1"),
              "train.save_every": (t.save_every >= 1, ">= 1"), "train.keep_checkpoints": (t.keep_checkpoints >= 1, ">= 1"),
              "train.decode_check_every": (t.decode_check_every >= 0, ">= 0"),
              "drafter.lora.r": (dr.lora.r >= 0, ">= 0"), "drafter.medusa.num_heads": (dr.medusa.num_heads >= 1, ">= 1"),
              "drafter.medusa.num_layers": (dr.medusa.num_layers >= 0, ">= 0"),
              "drafter.medusa.stage": (dr.medusa.stage in (1, 2), "1 (Medusa-1) or 2 (Medusa-2)"),
              "drafter.medusa.heads_weight": (dr.medusa.heads_weight > 0, "> 0"),
              "drafter.medusa.backbone_lr_ratio": (dr.medusa.backbone_lr_ratio > 0, "> 0"),
              "drafter.eagle.ttt_steps": (dr.eagle.ttt_steps >= 1, ">= 1"),
              "drafter.eagle.draft_vocab_size": (dr.eagle.draft_vocab_size >= 0, ">= 0")}
    for key, (ok, rule) in checks.items():
        if not ok:
            raise RecipeError(f"recipe key {key!r} must be {rule}, got {OmegaConf.select(cfg, key)}")
    if dr.eagle.aux_layer_ids and len(dr.eagle.aux_layer_ids) != 3:
        raise RecipeError(f"recipe key 'drafter.eagle.aux_layer_ids' needs three layer ids (low, middle, high), got {list(dr.eagle.aux_layer_ids)}")
    if t.warm_start and not Path(t.warm_start).expanduser().is_dir():
        raise RecipeError(f"recipe key 'train.warm_start': checkpoint folder {t.warm_start!r} does not exist")
    _check_eval(cfg)


def _check_eval(cfg: DictConfig) -> None:
    e, kind, inf = cfg.eval, cfg.drafter.kind.value, cfg.inference
    checks = {"eval.num_prompts": (e.num_prompts >= 1, ">= 1"), "eval.max_new_tokens": (e.max_new_tokens >= 1, ">= 1"),
              "eval.sets": (len(e.sets) >= 1, "a non-empty list"), "eval.verifiers": (len(e.verifiers) >= 1, "a non-empty list"),
              "eval.temperatures": (len(e.temperatures) >= 1 and all(x >= 0 for x in e.temperatures), "a non-empty list of values >= 0"),
              "eval.k_sweep": (all(k >= 1 for k in e.k_sweep), "a list of values >= 1"),
              "eval.asd_sweep": (all(len(s) == 3 and s[0] >= 0 and s[1] >= 0 and s[2] >= 1 for s in e.asd_sweep),
                                 "a list of [budget >= 0, gate >= 0, max_mismatches >= 1]")}
    for key, (ok, rule) in checks.items():
        if not ok:
            raise RecipeError(f"recipe key {key!r} must be {rule}, got {OmegaConf.select(cfg, key)}")
    for name in e.sets:
        if name not in PROMPT_SETS and not Path(name).expanduser().exists():
            raise RecipeError(f"recipe key 'eval.sets': {name!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) "
                              "nor an existing JSONL file or datasets folder")
    verifiers = {v.value for v in e.verifiers}
    if "tree" in verifiers and not (inf.tree or inf.dynamic_tree.total_tokens):
        raise RecipeError("recipe key 'eval.verifiers': tree needs inference.tree (static) or inference.dynamic_tree.total_tokens")
    if "typical" in verifiers and (kind != "medusa" or not inf.tree):
        raise RecipeError("recipe key 'eval.verifiers': typical acceptance needs drafter.kind=medusa and a static inference.tree")


def _looks_local(name: str) -> bool:
    """A name that starts with / . or ~, or exists on disk, is a local folder; anything else is a hub id."""
    return name.startswith(("/", ".", "~")) or os.path.exists(name)


def save_recipe(cfg: DictConfig, folder: str | os.PathLike) -> Path:
    return atomic_write_text(Path(folder) / "recipe.yaml", OmegaConf.to_yaml(cfg))


def cli(main: Callable[[DictConfig], Any], argv: Optional[List[str]] = None) -> None:
    """Entry point shared by the launch scripts: `script.py RECIPE [key=value ...] [--print-config]`.

    Prints the resolved recipe, runs `main(cfg)`, and turns a SpecdrafterError or Ctrl-C into one line on
    stderr and a non-zero exit status (1 for bad input, 130 for an interrupt).
    """
    argv = sys.argv[1:] if argv is None else argv
    argv = [a for a in argv if not a.startswith("--local_rank")]  # added by the `deepspeed` launcher
    print_only = "--print-config" in argv
    args = [a for a in argv if a != "--print-config"]
    if not args or args[0].startswith("-") or "=" in args[0]:
        prog = Path(sys.argv[0]).name
        sys.exit(f"usage: {prog} RECIPE.yaml [key=value ...] [--print-config]")
    try:
        cfg = load_recipe(args[0], args[1:])
        if os.environ.get("RANK", "0") == "0":  # one copy of the recipe under a multi-rank launcher
            print(OmegaConf.to_yaml(cfg), end="", file=sys.stderr if not print_only else sys.stdout)
        if print_only:
            return
        main(cfg)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("interrupted: finished shards are kept; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
