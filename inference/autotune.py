"""Choosing the block length k from measurements (`inference.k: auto`).

The seed's cost model (ALGORITHMS.md §1) with per-position acceptance instead of one α: drafting k tokens and
verifying them yields E[tokens | k] = 1 + Σ_{j=1..k} Π_{i≤j} a_i tokens per cycle, where a_i = P(draft i accepted
| drafts 1..i−1 accepted), at a cost of v(k+1) + k·c target steps (v(n): a target pass over n tokens ÷ one token,
c: one draft step ÷ one target step). The tuner keeps running estimates of every a_i and of c from the cycles it
has seen and picks, before each cycle, the k that maximises E[tokens | k] / (v(k+1) + k·c).

Exactness is untouched: k is a function of past cycles only, never of the current draws.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch
from transformers import DynamicCache


@torch.no_grad()
def step_costs(model, context: Sequence[int], sizes: Sequence[int], repeats: int = 9) -> Dict[int, float]:
    """Median seconds of one cached forward over n new tokens after `context`, for each n in `sizes`.
    Sizes are interleaved within every repeat, so a noisy machine slows them alike."""
    cache = DynamicCache()
    model(input_ids=torch.tensor([list(context)]), cache=cache, use_cache=True, logits_to_keep=1)
    times: Dict[int, List[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            start = time.perf_counter()
            model(input_ids=torch.tensor([(list(context) * n)[:n]]), cache=cache, use_cache=True)
            times[n].append(time.perf_counter() - start)
            cache.crop(-n)
    return {n: statistics.median(t) for n, t in times.items()}


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E[tokens per cycle | k] = 1 + Σ_{j=1..k} Π_{i≤j} a_i (the bonus / correction token included)."""
    total, survive = 1.0, 1.0
    for a in acceptance[:k]:
        survive *= a
        total += survive
    return total


class BlockLengthTuner:
    """Running per-position acceptance and draft cost → the block length of the next cycle.

    Counts start from a prior of `prior_accepted` / `prior_tried` at every position (0.5 by default, worth two
    cycles), so an unexplored position is neither ruled out nor trusted. `calibrate` measures v(n) once per target.
    """

    def __init__(self, max_k: int = 8, start_k: int = 4, prior_accepted: float = 1.0, prior_tried: float = 2.0,
                 step_costs: Optional[Dict[int, float]] = None):
        self.max_k, self.start_k = max_k, min(start_k, max_k)
        self.accepted = [prior_accepted] * max_k
        self.tried = [prior_tried] * max_k
        self.draft_s, self.drafted = 0.0, 0
        self.v: Dict[int, float] = {}
        self.step_s = 0.0  # seconds of one target decode step
        if step_costs and all(n in step_costs for n in range(1, max_k + 2)):  # measured already: no calibration
            self.step_s, self.v = step_costs[1], {n: step_costs[n] / step_costs[1] for n in range(1, max_k + 2)}

    @property
    def calibrated(self) -> bool:
        return bool(self.v)

    def calibrate(self, target, context: Sequence[int], repeats: int = 5) -> None:
        costs = step_costs(target, context, range(1, self.max_k + 2), repeats)
        self.step_s, self.v = costs[1], {n: t / costs[1] for n, t in costs.items()}

    def acceptance(self) -> List[float]:
        return [a / t for a, t in zip(self.accepted, self.tried)]

    def draft_cost(self) -> float:
        """c: seconds per draft step ÷ seconds per target step (None until a cycle was seen)."""
        return self.draft_s / self.drafted / self.step_s if self.drafted and self.step_s else None

    def predicted_speedup(self, k: int) -> float:
        return expected_tokens(self.acceptance(), k) / (self.v[k + 1] + k * self.draft_cost())

    def choose(self) -> int:
        if not self.calibrated or self.draft_cost() is None:
            return self.start_k  # nothing measured yet
        return max(range(1, self.max_k + 1), key=self.predicted_speedup)

    def update(self, drafted: int, accepted: int, draft_s: float) -> None:
        """One finished cycle: positions 1..min(accepted + 1, drafted) were tried, the first `accepted` passed."""
        for j in range(min(accepted + 1, drafted)):
            self.tried[j] += 1
            self.accepted[j] += j < accepted
        self.draft_s += draft_s
        self.drafted += drafted
