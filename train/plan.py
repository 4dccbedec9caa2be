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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from specdrafter.core.cli import cli
from specdrafter.core.io import SpecdrafterError
from specdrafter.recipes import RECIPES_DIR

TARGETS_DIR = RECIPES_DIR / "targets"
GIB = 2**30
DEFAULT_GPU_GB = 80.0
REDUCE_BUCKET = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size default (elements)
MAX_LIVE_PARAMETERS = 1_000_000_000  # ZeRO-3's stage3_max_live_parameters default
TEMPLATE_TOKENS = 32  # chat-template tokens per turn, for token estimates without a tokenizer
# Bytes per element of a [rows, vocabulary] pair of the distillation loss (train/objectives.py, fp32): what its
# backward keeps (log q and each objective's own) and the peak while it is computed (with log p and temporaries).
OBJECTIVE_BYTES = {"soft_ce": (9, 21), "fkl": (9, 22), "tv": (12, 20), "rkl": (13, 21), "jsd": (23, 35)}
CPU_ADAM_TEMPS = 3  # torch AdamW on CPU goes tensor by tensor: ~3 temporaries of the largest tensor at the step


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


@dataclass
class Shapes:
    """What the memory model reads from a (target or draft) config."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    positions: int

    @classmethod
    def of(cls, c) -> "Shapes":
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                   getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim, c.vocab_size,
                   getattr(c, "max_position_embeddings", 0) or 0)


# ------------------------------------------------------------------------------------------- meta models
@dataclass
class Counts:
    target: int  # parameters of the target (frozen)
    trainable: int  # the drafter's trainable parameters
    frozen: int  # the drafter's frozen parameters (a LoRA base)
    largest: int  # the largest trainable tensor (CPU AdamW works tensor by tensor)
    draft: Optional[Shapes] = None  # a draft model's (or Medusa-2 backbone's) own shapes


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
    """(module, draft shapes or None). A draft model named by drafter.path is built from its config, not loaded."""
    import warnings

    from specdrafter.train.drafters import build_drafter

    dr = cfg.drafter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft's calls of deprecated transformers 5 names
        if dr.kind.value == "draft_model" and dr.path:
            from peft import LoraConfig, get_peft_model
            from transformers import AutoModelForCausalLM

            dconf = target_config(dr.path)
            module = AutoModelForCausalLM.from_config(dconf).to(torch.float32)
            if dr.lora.r > 0:
                module = get_peft_model(module, LoraConfig(r=dr.lora.r, lora_alpha=dr.lora.alpha, task_type="CAUSAL_LM",
                                                           target_modules=list(dr.lora.target_modules)))
            return module, Shapes.of(dconf)
        drafter = build_drafter(cfg, target)
    t = Shapes.of(target.config)
    if dr.kind.value == "draft_model":
        layers = len(dr.layers) or dr.num_layers
        return drafter.module, Shapes(**{**t.__dict__, "layers": layers})
    if dr.kind.value == "medusa" and dr.medusa.stage == 2:
        return drafter.module, t
    return drafter.module, None


# ------------------------------------------------------------------------------------------------ memory
@dataclass
class Setup:
    """The run's shape: where it runs and how the recipe's precision resolves there."""
    world: int = 1
    gpus_per_node: int = 1
    device: str = "cuda"  # "cuda": plan a GPU; "cpu": this machine (CPU kernels, tensor-by-tensor AdamW)
    resident: bool = False  # count only pages a CPU process touches (its RSS), not what it allocates

    @property
    def nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)


def precision(cfg: DictConfig, device: str) -> Tuple[bool, bool]:
    """(bf16 module, bf16 autocast) as train/loop.py resolves train.precision."""
    p = cfg.train.precision.value
    bf16 = p == "bf16" or (p == "auto" and device == "cuda")
    return bf16, p == "amp_bf16"


@dataclass
class States:
    """The drafter's bytes per rank under DeepSpeed: persistent, plus the gradients and step transients."""
    weights: int  # flat weights (+ fp32 master / partition copies), frozen weights
    optimizer: int  # AdamW moments
    bucket: int = 0  # ZeRO 1-2 gradient bucket: allocated at a backward's first gradient, freed after the backward
    grads_kept: int = 0  # gradients that outlive the step (ZeRO 1-3's)
    grads_backward: int = 0  # gradients that exist only from the backward to the step (ZeRO 0: set to None after it)
    step: int = 0  # at the step, above grads_kept: remaining gradients, fp32 gradient copies, AdamW temporaries

    def terms(self) -> Dict[str, int]:
        out = {"drafter weights": self.weights, "gradients": self.grads_kept + self.grads_backward,
               "optimizer state": self.optimizer}
        if self.bucket:
            out["reduce bucket"] = self.bucket
        return out


def model_states(cfg: DictConfig, c: Counts, s: Setup) -> States:
    t = cfg.train
    bf16, _ = precision(cfg, s.device)
    w = 2 if bf16 else 4
    n, P, F = s.world, c.trainable, c.frozen
    cuda = s.device == "cuda"
    adam = 4 * (P if t.zero_stage == 0 else P // n)  # foreach temporaries on CUDA and for ZeRO's flat partition
    if t.zero_stage == 0 and not cuda:
        adam = CPU_ADAM_TEMPS * 4 * c.largest
    if t.zero_stage == 0:
        if bf16:  # DeepSpeed's fp16-style wrapper: fp32 master weights; their fp32 gradients at the step
            return States(w * (P + F) + 4 * P, 8 * P, grads_backward=w * P, step=w * P + 4 * P + adam)
        allreduce = 4 * min(P, REDUCE_BUCKET) if n > 1 else 0  # the flattened all-reduce bucket
        return States(4 * (P + F), 8 * P, grads_backward=4 * P, step=4 * P + max(adam, allreduce))
    if t.zero_stage == 3:
        live = w * min(P + F, MAX_LIVE_PARAMETERS)  # gathered parameters in flight
        return States(w * (P + F) // n + 4 * P // n + live, 8 * P // n, grads_kept=w * P // n, step=4 * P // n + adam)
    bucket = w * (min(REDUCE_BUCKET, P) if s.resident else REDUCE_BUCKET)  # untouched pages are not resident
    kept = w * P // n if t.zero_stage == 2 else w * P
    return States(w * (P + F) + 4 * P // n, 8 * P // n, bucket, grads_kept=kept, grads_backward=w * c.largest,
                  step=4 * P // n + adam)


@dataclass
class Activations:
    """Bytes of one micro-step, grouped by how long they live in train/loop.py's inner loop."""
    batch: int = 0  # the batch on the device (ids, masks, cached features)
    features: int = 0  # TargetOutput's features in the drafter's dtype (+ its row index)
    logits: int = 0  # TargetOutput's teacher rows (fp32)
    teacher_peak: int = 0  # transient above `features` while the target runs and the teacher rows are computed
    kept: int = 0  # what Prediction objects hold: draft logits, gathered teacher rows
    saved: int = 0  # autograd's saved tensors of the drafter's forward
    loss_saved: int = 0  # ... and of the losses
    loss_peak: int = 0  # the largest transient while one prediction's loss is computed
    forward_peak: int = 0  # the largest transient of the drafter's forward
    backward_peak: int = 0  # the largest transient of the backward (besides the gradients)
    notes: List[str] = field(default_factory=list)

    @property
    def teacher(self) -> int:
        return self.features + self.logits

    def phases(self, st: States) -> Dict[str, Dict[str, int]]:
        """Bytes above the persistent states at each moment of a micro-step, by term. The loop holds the previous
        micro-step's TargetOutput and predictions until it rebinds them: during the next teacher, and (predictions)
        until the next forward has returned. ZeRO 1-2's bucket comes with the first gradient hook, once the loss's
        tensors are freed (EAGLE-3's shared lm_head waits for every TTT step's branch)."""
        base = self.batch + self.features + self.kept
        out = {"teacher": {"teacher logits": self.logits + max(self.teacher_peak, self.logits),
                           "activations": self.teacher + self.kept + self.batch + self.features - self.logits},
               "forward": {"activations": self.kept + base + self.saved + self.forward_peak},
               "loss": {"activations": base + self.saved + self.loss_saved + self.loss_peak},
               "backward": {"gradients": st.grads_backward, "activations": base + self.saved + self.loss_saved
                            + max(0, self.backward_peak - st.grads_backward)},
               "step": {"gradients": st.grads_backward, "activations": base + max(0, st.step - st.grads_backward)}}
        if st.bucket:
            out["bucket"] = {"reduce bucket": st.bucket, "gradients": st.grads_backward, "activations": base + self.saved}
        for name, terms in out.items():
            terms.setdefault("teacher logits", self.logits)
        return out

    def peak(self, st: States) -> Tuple[str, Dict[str, int]]:
        return max(self.phases(st).items(), key=lambda kv: sum(kv[1].values()))


def activations(cfg: DictConfig, tconf, c: Counts, s: Setup) -> Activations:
    t, dr = cfg.train, cfg.drafter
    T = Shapes.of(tconf)
    B, L = t.micro_batch_size, t.max_length
    N = B * L
    bf16, amp = precision(cfg, s.device)
    a = 2 if (bf16 or amp) else 4  # bytes of the drafter's matmul outputs
    w = 2 if bf16 else 4  # bytes of the drafter's weights (and of the features handed to it)
    bt = _bytes(cfg.target.dtype.value)
    kind = dr.kind.value
    act = Activations(batch=24 * N, features=8 * N)
    per_layer = len(_needed_layers(cfg, T)) * N * T.hidden
    if t.features.value == "offline":
        hid = _bytes(cfg.data.hidden_states.dtype.value)
        act.batch += per_layer * hid
        act.features += per_layer * w if not hid == bt == w else 0
    else:
        act.features += per_layer * w
        act.teacher_peak = (per_layer * bt if w != bt else 0) + _target_forward(N, T, bt)
    objective = _objective_bytes(cfg)
    if amp:  # autocast's bf16 copies of the drafter's weights, saved for the backward
        act.saved += 2 * c.trainable
    if kind == "eagle3":
        _eagle3(act, cfg, T, N, B, L, a, amp, bf16, bt, objective, s)
    elif kind == "eagle1":
        _full_vocab_teacher(act, N, T.vocab, bt, amp)
        _eagle1(act, T, N, a, objective)
    elif kind == "medusa":
        _full_vocab_teacher(act, N, T.vocab, bt, amp)
        _medusa(act, cfg, T, c, N, a, amp, objective)
    else:
        _full_vocab_teacher(act, N, T.vocab, bt, amp)
        _causal_lm(act, c.draft or T, N, a)
        _prediction(act, N, T.vocab, a, objective)
    return act


def _bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _needed_layers(cfg: DictConfig, T: Shapes) -> List[int]:
    from specdrafter.train.drafters import default_aux_layers

    if cfg.drafter.kind.value == "eagle3":
        return sorted(set(cfg.drafter.eagle.aux_layer_ids or default_aux_layers(T.layers)) | {T.layers})
    return [T.layers]


def _target_forward(N: int, T: Shapes, bt: int) -> int:
    """The frozen target's largest transient in one decoder layer (no grad): MLP activation, up and their product."""
    return N * (3 * T.intermediate + 4 * T.hidden) * bt


def _objective_bytes(cfg: DictConfig) -> Tuple[int, int]:
    """(saved, peak) bytes per [rows, vocabulary] element of the recipe's objectives; they share log q (4 bytes)."""
    weights = [k for k, v in (dict(cfg.train.objective) or {"soft_ce": 1.0}).items() if v]
    saved = 4 + sum(OBJECTIVE_BYTES[k][0] - 4 for k in weights)
    return saved, saved + max(OBJECTIVE_BYTES[k][1] - OBJECTIVE_BYTES[k][0] for k in weights)


def _full_vocab_teacher(act: Activations, N: int, V: int, bt: int, amp: bool) -> None:
    act.logits += 4 * N * V  # fp32 [rows, V]
    act.teacher_peak = max(act.teacher_peak, (2 if (bt == 2 or amp) else 0) * N * V)  # bf16 logits before .float()


def _prediction(act: Activations, rows: int, V: int, a: int, objective: Tuple[int, int], gather: int = 4) -> None:
    """One prediction over V entries at `rows` positions: its draft logits and gathered teacher rows (kept), the
    loss's saved tensors and transient, the backward's first gradients."""
    saved, peak = objective
    act.kept += rows * V * (a + gather)
    act.loss_saved += rows * V * saved
    act.loss_peak = max(act.loss_peak, rows * V * (peak - saved))
    act.backward_peak = max(act.backward_peak, rows * V * (8 + a))


def _eagle3(act, cfg, T: Shapes, N, B, L, a, amp, bf16, bt, objective, s: Setup) -> None:
    from specdrafter.train.drafters import TEACHER_CHUNK

    e = cfg.drafter.eagle
    Vd = e.draft_vocab_size or T.vocab
    if Vd < T.vocab:  # train.drafters.teacher_rows: chunked normaliser, only the draft rows kept
        act.logits += 4 * N * Vd + 8 * N
        act.teacher_peak = max(act.teacher_peak, 12 * N * min(TEACHER_CHUNK, T.vocab), 2 * N * Vd)
    else:
        _full_vocab_teacher(act, N, T.vocab, bt, amp)
    d, I, h, kvh, hd = T.hidden, T.intermediate, T.heads, T.kv_heads, T.head_dim
    # saved per token and TTT step: the norms' inputs, the q/k/v and MLP inputs (autocast: a bf16 copy per linear)
    per_token = 30 * d if amp else (20 * d if bf16 else 32 * d)
    first = (6 if (amp or bf16) else 12) * d  # fc's saved input [N, 3d]
    rows_d = (8 if (amp or bf16) else 12) * d  # the logits' norm and lm_head input
    cuda = s.device == "cuda"
    for j in range(e.ttt_steps):
        keys = (j + 1) * L
        act.saved += N * (per_token + 3 * a * h * hd + 2 * a * kvh * hd * (j + 1) + 4 * a * I + 4 * h + rows_d)
        act.saved += (5 if cuda else 1) * keys * L  # the TTT mask [T, (j+1)T] (CUDA: also as an fp32 bias)
        if cuda:  # masked GQA attention runs on SDPA's math kernel: fp32 q, repeated k/v and probabilities
            act.saved += N * (4 * h * hd + 8 * h * hd * (j + 1)) + 4 * B * h * L * keys
        _prediction(act, N, Vd, a, objective, gather=4 if Vd < T.vocab else 8)
    act.saved += N * first
    if cuda:
        act.forward_peak = 4 * B * h * L * e.ttt_steps * L  # the last step's scores beside its probabilities
        act.backward_peak = max(act.backward_peak, 2 * act.forward_peak)
        act.notes.append("attention: masked GQA runs on SDPA's math kernel on CUDA: fp32 [B, heads, T, (j+1)·T] "
                         "probabilities per TTT step are included")


def _eagle1(act, T: Shapes, N, a, objective) -> None:
    d, I = T.hidden, T.intermediate
    act.saved += N * (32 * d + 4 * a * I + 4 * a * T.heads * T.head_dim)
    _prediction(act, N, T.vocab, a, objective)


def _medusa(act, cfg, T: Shapes, c: Counts, N, a, amp, objective) -> None:
    m = cfg.drafter.medusa
    if m.stage == 2:
        _causal_lm(act, c.draft or T, N, a)
        _prediction(act, N, T.vocab, a, objective)
    for _ in range(m.num_heads):
        act.saved += N * T.hidden * (2 * a * m.num_layers + a + (2 if amp else 0))
        _prediction(act, N, T.vocab, a, objective)


def _causal_lm(act, D: Shapes, N, a) -> None:
    """A trainable HF causal LM's saved activations (draft model, Medusa-2 backbone)."""
    d, attn = D.hidden, D.heads * D.head_dim
    per_layer = (24 if a == 4 else 16) * d + 3 * a * attn + 4 * a * D.kv_heads * D.head_dim + 4 * a * D.intermediate
    act.saved += N * (D.layers * per_layer + 12 * d)


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


TRAINABLE = ("draft_model", "medusa", "eagle3", "eagle1")


def make_plan(cfg: DictConfig, recipe: str = "", setup: Optional[Setup] = None,
              budget_gb: Optional[float] = None) -> Plan:
    """The whole plan of a recipe; `budget_gb` overrides train.gpu_memory_gb (the launchers pass the device's)."""
    s = setup or Setup()
    tconf = target_config(cfg.target.model)
    T = Shapes.of(tconf)
    checks = recipe_checks(cfg, T, s)
    kind = cfg.drafter.kind.value
    counts, terms, notes = None, {}, []
    if kind in TRAINABLE and not [line for ok, line in checks if not ok]:
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
    act = activations(cfg, tconf, c, s)
    phase, at_peak = act.peak(st)
    terms = {"target weights": _bytes(cfg.target.dtype.value) * c.target, "drafter weights": st.weights,
             "gradients": st.grads_kept + at_peak.get("gradients", 0), "optimizer state": st.optimizer}
    if at_peak.get("reduce bucket"):
        terms["reduce bucket"] = at_peak["reduce bucket"]
    terms["activations"] = at_peak["activations"]
    terms["teacher logits"] = at_peak["teacher logits"]
    from specdrafter.train.drafters import TEACHER_CHUNK

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
    out = []
    dr, kind = cfg.drafter, cfg.drafter.kind.value
    if kind == "eagle3":
        from specdrafter.train.drafters import default_aux_layers

        aux = list(dr.eagle.aux_layer_ids) or default_aux_layers(T.layers)
        bad = [k for k in aux if not 0 <= k <= T.layers]
        out.append((not bad, f"recipe key 'drafter.eagle.aux_layer_ids': layer id {bad[0]} is out of range for a target "
                             f"with {T.layers} layers (valid: 0..{T.layers})" if bad else
                    f"aux layers {aux} within the target's 0..{T.layers}"))
        Vd = dr.eagle.draft_vocab_size or T.vocab
        out.append((Vd <= T.vocab, f"recipe key 'drafter.eagle.draft_vocab_size' ({Vd}) exceeds the target's vocabulary "
                                   f"of {T.vocab} tokens" if Vd > T.vocab else f"draft vocabulary {Vd} <= {T.vocab}"))
        last = cfg.train.max_length + dr.eagle.ttt_steps - 1  # TTT step j sits at rotary position t + j
        out.append((not T.positions or last <= T.positions,
                    f"recipe keys 'train.max_length' ({cfg.train.max_length}) and 'drafter.eagle.ttt_steps' "
                    f"({dr.eagle.ttt_steps}) reach position {last}, beyond the head's max_position_embeddings "
                    f"({T.positions})" if T.positions and last > T.positions else
                    f"TTT positions up to {last} within the head's {T.positions or 'unbounded'}"))
    if kind == "draft_model" and dr.path:
        D = Shapes.of(target_config(dr.path))
        ok = D.vocab == T.vocab and (not D.positions or cfg.train.max_length <= D.positions)
        out.append((ok, f"draft vocabulary {D.vocab} = {T.vocab}, max_length within its {D.positions} positions" if ok else
                    f"recipe key 'drafter.path': {dr.path!r} has {D.vocab} tokens and {D.positions} positions; "
                    f"the target has {T.vocab} tokens and train.max_length is {cfg.train.max_length}"))
    if kind in ("eagle3", "eagle1", "medusa") or (kind == "draft_model" and not dr.path):
        out += _offline_cache_check(cfg, T)
    out.append((s.world >= 1 and s.gpus_per_node >= 1, f"world size {s.world} ({s.nodes} node(s) × {s.gpus_per_node})"))
    return out


def _offline_cache_check(cfg: DictConfig, T: Shapes) -> List[Tuple[bool, str]]:
    if cfg.train.features.value != "offline" or not cfg.train.data_dir:
        return []
    stats = _read_json(Path(cfg.train.data_dir).expanduser() / "stats.json")
    if stats is None:
        return []
    cached, need = stats.get("hidden_state_layers") or [], _needed_layers(cfg, T)
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
    if plan.kind == "eagle3" and name in ("activations", "teacher logits"):
        fix += ", drafter.eagle.ttt_steps" if name == "activations" else ", drafter.eagle.draft_vocab_size"
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
        layers = _needed_layers(cfg, T) if cfg.drafter.kind.value in TRAINABLE else [T.layers]
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
    except Exception:  # a damaged or older recipe: no estimate from it
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
             f"{s.nodes} node(s) × {s.gpus_per_node} GPU(s) = world {s.world}" if p.kind in TRAINABLE else
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
        steps = f", {cfg.drafter.eagle.ttt_steps} TTT steps" if cfg.drafter.kind.value == "eagle3" else ""
        return f"activations ({t.micro_batch_size} × {t.max_length} tokens{steps})"
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
        bt = _bytes(cfg.target.dtype.value)
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
    # the plan is the output: no resolved recipe before it
    cli(print_plan, argv, flags={"--nodes": 1, "--gpus-per-node": None}, show_recipe=False)


if __name__ == "__main__":
    main()
