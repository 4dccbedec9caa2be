"""Distillation objectives: per position, over the vocabulary, with a loss mask (docs/algorithms.md §Objectives).

Convention: **p = target distribution, q = draft distribution**, both softmax(logits / T).
    tv       ½ Σ |p − q|                      = 1 − α with α = Σ min(p, q), the expected acceptance rate
                                                 at temperature T: minimising TV maximises acceptance.
    fkl      Σ p log(p / q)                   forward KL, mode-covering
    rkl      Σ q log(q / p)                   reverse KL, mode-seeking
    jsd      β·KL(p‖m) + (1−β)·KL(q‖m)        m = βp + (1−β)q, 0 < β < 1; ≤ log 2 at β = ½
    soft_ce  −Σ p log q                       = fkl + H(p): same gradient as fkl, offset by the entropy of p
Train at the temperature the drafter will serve at, so the TV being minimised is the served 1 − α.

-inf logits (top-k-masked targets, entries outside a draft vocabulary) are allowed: 0·log 0 = 0, never NaN.
Where q has no mass but p does, fkl and soft_ce are +inf (and rkl where p has none but q does); that is the
true value, so the caller must keep the draft's support covering the target's (e.g. mask the target too).
The target side is always detached: no gradient flows into the target model or its features.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import Tensor


def _kl(a: Tensor, log_a: Tensor, log_b: Tensor) -> Tensor:
    """KL(a‖b) = Σ a (log a − log b) over the last dim, with 0·log 0 = 0. The where() (not a * diff alone)
    keeps -inf − -inf = NaN out of both the value and the gradient where a = 0."""
    diff = torch.where(a > 0, log_a - log_b, 0.0)  # [..., V]
    return (a * diff).sum(-1)  # [...]


def total_variation(log_p: Tensor, log_q: Tensor) -> Tensor:
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)  # [...]


def acceptance(target_logits: Tensor, draft_logits: Tensor, temperature: float, target_lse: Tensor | None = None,
               draft_ids: Tensor | None = None) -> Tensor:
    """α = Σ_v min(p_v, q_v) = 1 − TV(p, q) per row at `temperature`: the chance that exact speculative sampling
    accepts the drafted token. draft_logits [N, Vd]; target_logits [N, V], or with target_lse [N] (the log of the
    target's normaliser over its whole vocabulary) its draft-vocabulary rows [N, Vd], so p is the target's true
    probability; draft_ids [Vd] (target id of each draft-vocabulary entry) slices a full-vocabulary p. Either way
    the target's mass outside the draft vocabulary can never be accepted."""
    t = target_logits.float() / temperature
    if target_lse is not None:
        p = (t - target_lse[:, None]).exp()  # [N, Vd]
    else:
        p = t.softmax(-1)  # [N, V]
        p = p[:, draft_ids] if draft_ids is not None else p  # q is zero outside the draft vocabulary
    q = (draft_logits.float() / temperature).softmax(-1)  # [N, Vd]
    return torch.minimum(p, q).sum(-1)  # [N]


def forward_kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    return _kl(log_p.exp(), log_p, log_q)


def reverse_kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    return _kl(log_q.exp(), log_q, log_p)


def jensen_shannon(log_p: Tensor, log_q: Tensor, beta: float = 0.5) -> Tensor:
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd_beta must be in (0, 1), got {beta}")
    p, q = log_p.exp(), log_q.exp()  # [..., V]
    m = beta * p + (1.0 - beta) * q  # [..., V]
    # log(1) = 0 stands in where m = 0; _kl never reads it there (p, q > 0 implies m > 0) and log(0) would
    # send 0/0 = NaN back through the gradient.
    log_m = torch.log(torch.where(m > 0, m, 1.0))  # [..., V]
    return beta * _kl(p, log_p, log_m) + (1.0 - beta) * _kl(q, log_q, log_m)


def soft_cross_entropy(log_p: Tensor, log_q: Tensor) -> Tensor:
    p = log_p.exp()  # [..., V]
    return -(p * torch.where(p > 0, log_q, 0.0)).sum(-1)  # [...]


def _log_probs(target_logits: Tensor, draft_logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    if target_logits.shape != draft_logits.shape:
        raise ValueError(f"target_logits {tuple(target_logits.shape)} and draft_logits "
                         f"{tuple(draft_logits.shape)} must have the same shape [..., V]")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # bf16/fp16 logits are upcast: a log-softmax over ~100k entries loses too much in half precision.
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    log_p = F.log_softmax(target_logits.detach().to(dtype) / temperature, dim=-1)  # [..., V]
    log_q = F.log_softmax(draft_logits.to(dtype) / temperature, dim=-1)  # [..., V]
    return log_p, log_q


Divergence = Callable[[Tensor, Tensor, float], Tensor]
"""(log p [..., V], log q [..., V], jsd β) → the objective at every position [...]."""

# The objectives train.objective may weight, by name. The recipe schema checks those keys against
# core/recipe_checks.py:OBJECTIVES before anything under train/ is imported (core/ cannot import train/);
# tests/test_objectives.py pins the two to the same names.
DIVERGENCES: Dict[str, Divergence] = {
    "tv": lambda log_p, log_q, beta: total_variation(log_p, log_q),
    "fkl": lambda log_p, log_q, beta: forward_kl(log_p, log_q),
    "rkl": lambda log_p, log_q, beta: reverse_kl(log_p, log_q),
    "jsd": jensen_shannon,
    "soft_ce": lambda log_p, log_q, beta: soft_cross_entropy(log_p, log_q),
}

DEFAULT_WEIGHTS = {"soft_ce": 1.0}  # what an empty train.objective trains


def objective_weights(objective: Mapping[str, float]) -> Dict[str, float]:
    """The weights a recipe's train.objective stands for: its own, or DEFAULT_WEIGHTS when it names none."""
    return dict(objective) or dict(DEFAULT_WEIGHTS)


def _check_name(name: str) -> None:
    if name not in DIVERGENCES:
        raise ValueError(f"unknown objective {name!r}; valid: {', '.join(DIVERGENCES)}")


def per_position(name: str, target_logits: Tensor, draft_logits: Tensor, temperature: float = 1.0,
                 jsd_beta: float = 0.5) -> Tensor:
    """Objective `name` at every position: logits [..., V] (same shape) → loss [...]."""
    _check_name(name)
    log_p, log_q = _log_probs(target_logits, draft_logits, temperature)
    return DIVERGENCES[name](log_p, log_q, jsd_beta)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """sum(values · mask) / max(sum(mask), 1) for a 0/1 mask. where() rather than a product, so a masked
    position's value (even inf) and its gradient are excluded exactly."""
    if mask.shape != values.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match the positions {tuple(values.shape)}")
    keep = mask.bool()  # [...]
    return torch.where(keep, values, 0.0).sum() / keep.sum().clamp_min(1)


@dataclass
class LossOutput:
    total: Tensor  # scalar, differentiable
    means: dict[str, Tensor]  # each weighted objective's masked mean (unweighted), detached

    @property
    def parts(self) -> dict[str, float]:
        """`means` as numbers, for logging: one device sync for all of them, and only when asked for."""
        return dict(zip(self.means, torch.stack(list(self.means.values())).tolist()))


def distill_loss(target_logits: Tensor, draft_logits: Tensor, mask: Tensor, weights: Mapping[str, float],
                 temperature: float = 1.0, jsd_beta: float = 0.5) -> LossOutput:
    """total = Σ weight · masked mean, over the objectives whose weight is nonzero (only those are computed).
    logits [..., V], mask [...] of 0/1."""
    for name in weights:
        _check_name(name)  # before any work, so a typo in a recipe fails at step 0
    active = {name: w for name, w in weights.items() if w != 0}
    if not active:
        raise ValueError(f"distill_loss needs a nonzero weight for at least one of {', '.join(DIVERGENCES)}")
    log_p, log_q = _log_probs(target_logits, draft_logits, temperature)  # once, shared by all objectives
    means = {name: masked_mean(DIVERGENCES[name](log_p, log_q, jsd_beta), mask) for name in active}
    total = sum(active[name] * mean for name, mean in means.items())
    return LossOutput(total=total, means={name: mean.detach() for name, mean in means.items()})


@dataclass(frozen=True)
class Objective:
    """What a training loss distils with: weights over DIVERGENCES, at a temperature (and JSD's β)."""
    weights: Dict[str, float]
    temperature: float = 1.0
    jsd_beta: float = 0.5

    @classmethod
    def of(cls, train_cfg) -> "Objective":
        """The recipe's train.objective (objective_weights: soft CE when empty), train.temperature, train.jsd_beta."""
        return cls(objective_weights(train_cfg.objective), train_cfg.temperature, train_cfg.jsd_beta)

    def __call__(self, target_logits: Tensor, draft_logits: Tensor, mask: Tensor) -> Tensor:
        """distill_loss(...).total: the objective, differentiable."""
        return distill_loss(target_logits, draft_logits, mask, self.weights, self.temperature, self.jsd_beta).total

    def per_row(self, target_logits: Tensor, draft_logits: Tensor) -> Tensor:
        """Σ weight · objective at every position [...], unmasked: what __call__ averages, for a caller that weights
        its rows (D-PACE)."""
        for name in self.weights:
            _check_name(name)
        log_p, log_q = _log_probs(target_logits, draft_logits, self.temperature)
        return sum(w * DIVERGENCES[name](log_p, log_q, self.jsd_beta) for name, w in self.weights.items() if w != 0)


def dpace_weights(confidence: Tensor, mask: Tensor, alpha: float = 0.5) -> Tensor:
    """D-PACE's weight of each position of a block (docs/algorithms.md §D-PACE), detached. confidence [..., L]: q_i,
    the draft's probability of the block's true token at position i; mask [..., L] 0/1 (the supervised positions):
        q̃_i = (1 − α) q_i + α        C_m = Π_{i≤m} q̃_i        w_j = Σ_{m≥j} C_m
    A masked position is a no-op in the product (q̃ = 1) and adds nothing to the sums; its own weight is 0.
    α = 1: w_j = the supervised positions from j on (γ − j for a whole block of γ drafts)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in [0, 1], got {alpha}")
    with torch.no_grad():
        keep = mask.bool()  # [..., L]
        smooth = torch.where(keep, (1.0 - alpha) * confidence.float() + alpha, 1.0)  # [..., L]
        cumulative = smooth.cumprod(-1) * keep  # [..., L] C_m
        return cumulative.flip(-1).cumsum(-1).flip(-1) * keep  # [..., L] w_j


def feature_loss(predicted: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """EAGLE-1's feature regression: SmoothL1 (β = 1) averaged over the hidden dim, then masked mean over
    positions. predicted/target [..., d], mask [...]; the target features are detached."""
    per_pos = F.smooth_l1_loss(predicted, target.detach(), reduction="none", beta=1.0).mean(-1)  # [...]
    return masked_mean(per_pos, mask)
