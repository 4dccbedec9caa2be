"""Turning logits into the distributions the verifiers compare. The *same* function must process the target's
logits (p) and the draft's logits (q): temperature, top-k and top-p applied to both, before any ratio."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data.io import SpecdrafterError


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
