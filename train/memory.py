"""The planner's memory model: bytes per rank of a training run, term by term, as jobs/train.py and DeepSpeed
allocate them (jobs/plan.py explains the terms and assembles the plan). The constants below were fitted to what
the loop allocates; tests/test_memory.py pins OBJECTIVE_BYTES and EAGLE-3's saved bytes per token and TTT step (on
the CPU) against the tensors autograd saves on tiny configs, benchmarks/bench_plan.py the whole plan against measured
peaks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig

from specdrafter.train.objectives import objective_weights

# vocabulary rows per matmul while the teacher's full-vocabulary normaliser is accumulated (train/drafters.py)
TEACHER_CHUNK = 16_384

GIB = 2**30
REDUCE_BUCKET = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size default (elements)
MAX_LIVE_PARAMETERS = 1_000_000_000  # ZeRO-3's stage3_max_live_parameters default
# Bytes per element of a [rows, vocabulary] pair of each distillation objective (train/objectives.py:DIVERGENCES,
# fp32): what its backward keeps (log q and each objective's own) and the peak while it is computed (with log p and
# temporaries).
OBJECTIVE_BYTES = {"soft_ce": (9, 21), "fkl": (9, 21), "tv": (12, 20), "rkl": (13, 21), "jsd": (23, 39)}
CPU_ADAM_TEMPS = 3  # torch AdamW on CPU goes tensor by tensor: ~3 temporaries of the largest tensor at the step

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
        c = c.get_text_config()  # a multimodal target (Gemma 3 from 4B up): its language model's config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                   getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim, c.vocab_size,
                   getattr(c, "max_position_embeddings", 0) or 0)


@dataclass
class Counts:
    target: int  # parameters of the target (frozen)
    trainable: int  # the drafter's trainable parameters
    frozen: int  # the drafter's frozen parameters (a LoRA base)
    largest: int  # the largest trainable tensor (CPU AdamW works tensor by tensor)
    draft: Optional[Shapes] = None  # a draft model's (or Medusa-2 backbone's) own shapes
    target_active: int = 0  # the target's parameters one token runs through (MoE: its routed experts only)


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
    """(bf16 module, bf16 autocast) as jobs/train.py resolves train.precision."""
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
    """Bytes of one micro-step, grouped by how long they live in jobs/train.py's inner loop."""
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


@dataclass
class MemoryInputs:
    """What a kind's activation terms read (kinds/: planner_activations)."""
    cfg: DictConfig
    T: Shapes  # the target's
    counts: Counts
    setup: Setup
    B: int  # micro_batch_size
    L: int  # max_length
    a: int  # bytes of the drafter's matmul outputs
    bf16: bool  # the drafter's weights in bf16
    amp: bool  # bf16 autocast
    bt: int  # bytes of the target's dtype
    objective: Tuple[int, int]  # objective_bytes(cfg)

    @property
    def N(self) -> int:
        return self.B * self.L  # every position of the worst batch counted


def activations(cfg: DictConfig, tconf, c: Counts, s: Setup, kind) -> Activations:
    """One micro-step's activation bytes of `kind` (kinds/: its training's feature_layers, its planning's activations)."""
    t = cfg.train
    T = Shapes.of(tconf)
    bf16, amp = precision(cfg, s.device)
    m = MemoryInputs(cfg, T, c, s, t.micro_batch_size, t.max_length, 2 if (bf16 or amp) else 4, bf16, amp,
                     dtype_bytes(cfg.target.dtype.value), objective_bytes(cfg))
    w = 2 if bf16 else 4  # bytes of the drafter's weights (and of the features handed to it)
    N, bt = m.N, m.bt
    act = Activations(batch=24 * N, features=8 * N)
    per_layer = len(kind.training.feature_layers(cfg, T.layers)) * N * T.hidden
    if t.features.value == "offline":
        hid = dtype_bytes(cfg.data.hidden_states.dtype.value)
        act.batch += per_layer * hid
        act.features += per_layer * w if not hid == bt == w else 0
    else:
        act.features += per_layer * w
        act.teacher_peak = (per_layer * bt if w != bt else 0) + target_forward_bytes(N, T, bt)
    if amp:  # autocast's bf16 copies of the drafter's weights, saved for the backward
        act.saved += 2 * c.trainable
    kind.planning.activations(act, m)
    return act


def dtype_bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def target_forward_bytes(N: int, T: Shapes, bt: int) -> int:
    """The frozen target's largest transient in one decoder layer (no grad): MLP activation, up and their product."""
    return N * (3 * T.intermediate + 4 * T.hidden) * bt


def objective_bytes(cfg: DictConfig) -> Tuple[int, int]:
    """(saved, peak) bytes per [rows, vocabulary] element of the recipe's objectives; they share log q (4 bytes)."""
    weights = [k for k, v in objective_weights(cfg.train.objective).items() if v]
    saved = 4 + sum(OBJECTIVE_BYTES[k][0] - 4 for k in weights)
    return saved, saved + max(OBJECTIVE_BYTES[k][1] - OBJECTIVE_BYTES[k][0] for k in weights)


# ------------------------------------------------------------------------------- the terms the kinds add
def full_vocab_teacher(act: Activations, m: MemoryInputs) -> None:
    """The target's rows over its full vocabulary, kept in fp32 for the loss."""
    N, V = m.N, m.T.vocab
    act.logits += 4 * N * V  # fp32 [rows, V]
    act.teacher_peak = max(act.teacher_peak, (2 if (m.bt == 2 or m.amp) else 0) * N * V)  # bf16 logits before .float()


def prediction(act: Activations, m: MemoryInputs, V: int, gather: int = 4) -> None:
    """One prediction over V entries at every position: its draft logits and gathered teacher rows (kept), the
    loss's saved tensors and transient, the backward's first gradients."""
    (saved, peak), rows, a = m.objective, m.N, m.a
    act.kept += rows * V * (a + gather)
    act.loss_saved += rows * V * saved
    act.loss_peak = max(act.loss_peak, rows * V * (peak - saved))
    act.backward_peak = max(act.backward_peak, rows * V * (8 + a))


def causal_lm(act: Activations, m: MemoryInputs, D: Shapes) -> None:
    """A trainable HF causal LM's saved activations (draft model, Medusa-2 backbone)."""
    d, attn, a = D.hidden, D.heads * D.head_dim, m.a
    per_layer = (24 if a == 4 else 16) * d + 3 * a * attn + 4 * a * D.kv_heads * D.head_dim + 4 * a * D.intermediate
    act.saved += m.N * (D.layers * per_layer + 12 * d)


def eagle3(act: Activations, m: MemoryInputs) -> None:
    """An EAGLE-3 head unrolled over drafter.eagle.ttt_steps (train/eagle.py:training_time_test)."""
    e, T, N, B, L, a = m.cfg.drafter.eagle, m.T, m.N, m.B, m.L, m.a
    Vd = e.draft_vocab_size or T.vocab
    if Vd < T.vocab:  # train.drafters.teacher_rows: chunked normaliser, only the draft rows kept
        act.logits += 4 * N * Vd + 8 * N
        act.teacher_peak = max(act.teacher_peak, 12 * N * min(TEACHER_CHUNK, T.vocab), 2 * N * Vd)
    else:
        full_vocab_teacher(act, m)
    d, I, h, kvh, hd = T.hidden, T.intermediate, T.heads, T.kv_heads, T.head_dim
    low = m.amp or m.bf16
    # saved per token and TTT step: the norms' inputs, the q/k/v and MLP inputs (autocast: a bf16 copy per linear)
    per_token = 30 * d if m.amp else (20 * d if m.bf16 else 32 * d)
    first = (6 if low else 12) * d  # fc's saved input [N, 3d]
    rows_d = (8 if low else 12) * d  # the logits' norm and lm_head input
    cuda = m.setup.device == "cuda"
    # q and the attention's output, and on CUDA o_proj's input, a copy of it ([B, h, T, hd] → [B, T, h·hd]); the
    # CPU kernel returns its output in that layout already
    attention = (3 if cuda else 2) * a * h * hd
    rotary = 2 * a * hd  # cos and sin [B, T, hd], saved by the rotation of q and k
    for j in range(e.ttt_steps):
        keys = (j + 1) * L
        act.saved += N * (per_token + attention + rotary + 2 * a * kvh * hd * (j + 1) + 4 * a * I + 4 * h + rows_d)
        # the TTT mask [T, (j+1)T]: CUDA keeps it and an fp32 bias; the CPU kernel keeps it as a bias in q's dtype
        act.saved += (5 if cuda else a) * keys * L
        if cuda:  # masked GQA attention runs on SDPA's math kernel: fp32 q, repeated k/v and probabilities
            act.saved += N * (4 * h * hd + 8 * h * hd * (j + 1)) + 4 * B * h * L * keys
        prediction(act, m, Vd, gather=4 if Vd < T.vocab else 8)
    act.saved += N * first
    if cuda:
        act.forward_peak = 4 * B * h * L * e.ttt_steps * L  # the last step's scores beside its probabilities
        act.backward_peak = max(act.backward_peak, 2 * act.forward_peak)
        act.notes.append("attention: masked GQA runs on SDPA's math kernel on CUDA: fp32 [B, heads, T, (j+1)·T] "
                         "probabilities per TTT step are included")


def eagle1(act: Activations, m: MemoryInputs) -> None:
    T = m.T
    full_vocab_teacher(act, m)
    act.saved += m.N * (32 * T.hidden + 4 * m.a * T.intermediate + 4 * m.a * T.heads * T.head_dim)
    prediction(act, m, T.vocab)


def medusa(act: Activations, m: MemoryInputs) -> None:
    md, T = m.cfg.drafter.medusa, m.T
    full_vocab_teacher(act, m)
    if md.stage == 2:
        causal_lm(act, m, m.counts.draft or T)
        prediction(act, m, T.vocab)
    for _ in range(md.num_heads):
        act.saved += m.N * T.hidden * (2 * m.a * md.num_layers + m.a + (2 if m.amp else 0))
        prediction(act, m, T.vocab)


def draft_model(act: Activations, m: MemoryInputs) -> None:
    full_vocab_teacher(act, m)
    causal_lm(act, m, m.counts.draft or m.T)
    prediction(act, m, m.T.vocab)


def block(act: Activations, m: MemoryInputs, drafts: int, heads: bool) -> None:
    """A block drafter (train/block.py): B · anchors blocks of block_size slots through its layers in one pass, each
    slot attending over [the context, its own block], and `drafts` predictions of B · anchors rows each (`heads`:
    DSpark's Markov and confidence heads). What autograd saves, term by term as models/block.py computes it;
    tests/test_memory.py pins it: exact in fp32, within 8 % with bf16 weights, where the float32 internals of the
    RMS norms add d bytes × (12 per slot and layer + 3 per slot + 3 per context position and layer + 11 per
    context position), a fit to the measured bytes rather than a derivation."""
    b, T, a = m.cfg.drafter.block, m.T, m.a
    Vd = b.draft_vocab_size or T.vocab
    if Vd < T.vocab:
        act.logits += 4 * m.N * Vd + 8 * m.N
        act.teacher_peak = max(act.teacher_peak, 12 * m.N * min(TEACHER_CHUNK, T.vocab), 2 * m.N * Vd)
    else:
        full_vocab_teacher(act, m)
    blocks = m.B * min(b.anchors, m.L - 1)
    Q, R, C = blocks * b.block_size, blocks * drafts, m.N  # slots, draft rows, context positions
    d, A, K, hd = T.hidden, T.heads * T.head_dim, T.kv_heads * T.head_dim, T.head_dim
    features = len(b.aux_layer_ids) or b.num_features
    softmax = 4 * T.heads * (m.L + b.block_size)  # a slot's attention weights over [context, own block], float32
    # per slot and layer: the residual and norm states (7d), q/k/v and the attention's inputs (5A + 2K), the MLP
    # (4I), the norms' rsqrt and the softmax
    per_slot = a * (7 * d + 5 * A + 2 * K + 4 * T.intermediate + T.heads + T.kv_heads + 3) + softmax
    per_context = a * (4 * K + T.kv_heads)  # each layer's context keys (projected, normed, rotated) and values
    once = a * (Q * (d + 2 * hd) + C * (features * d + 3 * d + 2 * hd + 1)  # embeddings, final norm, RoPE; fc in/out
                + (R * (d + b.markov_rank) if heads else 0)) + (a * Vd * d if Vd < T.vocab else 0)  # heads; lm_head rows
    norms32 = d * (12 * Q * b.num_layers + 3 * Q + 3 * C * b.num_layers + 11 * C) if a == 2 else 0
    act.saved += b.num_layers * (Q * per_slot + C * per_context) + once + norms32 + Q * m.L  # + the context mask
    act.forward_peak = max(act.forward_peak, Q * softmax)
    (saved, peak), rows = m.objective, blocks
    for _ in range(drafts):
        act.kept += rows * Vd * (a + 4)
        act.loss_saved += rows * Vd * saved
        act.loss_peak = max(act.loss_peak, rows * Vd * (peak - saved))
        act.backward_peak = max(act.backward_peak, rows * Vd * (8 + a))


# ----------------------------------------------------------------------------------------------- the plan
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
    # serving the target: its KV cache (models/targets.py:serving_cache_bytes) per sequence, bf16, {context: bytes}
    serving_cache: Dict[int, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.budget_gb * GIB

    def problems(self) -> List[str]:
        return [line for ok, line in self.checks if not ok]
