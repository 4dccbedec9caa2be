"""Turning logits into the distributions the verifiers compare. The *same* function must process the target's
logits (p) and the draft's logits (q): temperature, top-k and top-p applied to both, before any ratio."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from specdrafter.core.io import SpecdrafterError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise SpecdrafterError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecdrafterError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecdrafterError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] in float64 after temperature, top-k and top-p (in that order).

    Temperature 0 gives a one-hot at the first maximal index, so exact sampling reduces to greedy.
    Masked tokens get probability exactly 0, so they can never be drafted or emitted.
    """
    logits = logits.to(torch.float64)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float64)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token if the tokens ranked above it already cover top_p (the crossing token is kept)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def draw(logits: torch.Tensor, params: SamplingParams,
         generator: Optional[torch.Generator] = None) -> Tuple[int, Optional[torch.Tensor]]:
    """One draft token from logits [V]: (token, its q row [V] float64), or (argmax, None) when greedy — no
    probabilities are built then (argmax of the logits = argmax of the one-hot `sampling_probs` gives)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = sampling_probs(logits, params)  # [V]
    return sample(q, generator), q


def sample(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """One index drawn from probs [V] (need not sum to 1) by inverting its CDF: the first i with
    cdf[i] > u·cdf[-1], u ~ U[0, 1) in float64. A zero-probability index can never be drawn (its cdf equals its
    predecessor's). Over a 49k vocabulary this is ~13× faster than `torch.multinomial` on this CPU."""
    cdf = probs.to(torch.float64).cumsum(-1)  # [V]
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u[None], right=True))
    return i if i < len(cdf) else int(probs.nonzero()[-1])  # u·cdf[-1] rounded up to cdf[-1]: the last possible index
