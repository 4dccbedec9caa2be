"""Choosing the block length k from measurements (`inference.k: auto`).

The cost model of docs/algorithms.md §Speedup model, with per-position acceptance instead of one α: drafting k
tokens and verifying them yields E[tokens | k] = 1 + Σ_{j=1..k} Π_{i≤j} a_i tokens per cycle, where a_i = P(draft i
accepted | drafts 1..i−1 accepted), at a cost of v(k+1) + k·c target steps (v(n): a target pass over n tokens ÷ one
token, c: one draft step ÷ one target step). The tuner keeps running estimates of every a_i and of c from the cycles
it has seen and picks, before each cycle, the k that maximises E[tokens | k] / (v(k+1) + k·c).

Exactness is untouched: k is a function of past cycles only, never of the current draws.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

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


def pass_cost(v: Dict[int, float], n: int) -> float:
    """v(n), a target pass over n tokens ÷ one token, from costs measured at some sizes: linear between them
    (the largest measured cost beyond them)."""
    if n in v:
        return v[n]
    below, above = [m for m in v if m < n], [m for m in v if m > n]
    if not above:
        return v[max(below)]
    lo, hi = max(below), min(above)
    return v[lo] + (v[hi] - v[lo]) * (n - lo) / (hi - lo)


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


class TreeSizeTuner:
    """How many of a dynamic tree's drafted candidates to verify (`inference.dynamic_tree.auto_size`).

    A node lies on the accepted path with probability Π a(q) along its path, where q is the draft's conditional
    probability of the node's token and a(q) = P(node accepted | its parent accepted), learnt online in bins of q
    (prior a(q) = q, a calibrated draft, worth two observations per bin). The accepted length counts the nodes of
    the accepted path, so verifying the n best candidates (draft-score order, closed under ancestors) yields
    E[tokens | n] = 1 + Σ_{i≤n} P̂_i per cycle at a cost of v(n+1) + c target steps (c: draft seconds per cycle ÷
    one target step, v interpolated between measured sizes). `choose` returns the n that maximises the ratio.

    Drafting depth follows: `draft_depth` drafts one level below the deepest node verified in the last
    `RECENT` cycles (so the tree can grow back), and c is the mean draft time of those cycles.

    Exactness is untouched: n and the depth depend on past cycles and on the current draft only — the tree is
    still a deterministic function of the context, which is what the exact tree verifiers require.
    """

    RECENT = 8

    EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # bin upper edges of q; the last bin ends at 1

    def __init__(self, max_nodes: int, prior: float = 2.0, step_costs: Optional[Dict[int, float]] = None):
        self.max_nodes = max_nodes
        self.edges = torch.tensor(self.EDGES, dtype=torch.float64)
        lower, upper = (0.0,) + self.EDGES, self.EDGES + (1.0,)
        self.accepted = torch.tensor([prior * (lo + hi) / 2 for lo, hi in zip(lower, upper)], dtype=torch.float64)
        self.tried = torch.full((len(upper),), prior, dtype=torch.float64)
        self.cycles = 0
        self.recent: Deque[Tuple[int, float]] = deque(maxlen=self.RECENT)  # (deepest verified node, draft seconds)
        self.v: Dict[int, float] = {}
        self.step_s = 0.0
        if step_costs and 1 in step_costs and max(step_costs) >= max_nodes + 1:
            self.step_s, self.v = step_costs[1], {n: t / step_costs[1] for n, t in step_costs.items()}

    @property
    def calibrated(self) -> bool:
        return bool(self.v)

    def sizes(self) -> List[int]:
        """Tree-pass sizes (tokens) whose cost is measured; the others are interpolated."""
        grid = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
        return sorted({n for n in grid if n <= self.max_nodes} | {self.max_nodes + 1})

    def calibrate(self, target, context: Sequence[int], repeats: int = 5) -> None:
        costs = step_costs(target, context, self.sizes(), repeats)
        self.step_s, self.v = costs[1], {n: t / costs[1] for n, t in costs.items()}

    def cost(self, n: int) -> float:
        return pass_cost(self.v, n)

    def acceptance(self, q: torch.Tensor) -> torch.Tensor:
        """a(q) for draft probabilities q [..]."""
        return (self.accepted / self.tried)[torch.bucketize(q.to(torch.float64), self.edges)]

    def choose(self, parents: Sequence[int], q: torch.Tensor) -> int:
        """n for candidates in draft-score order: `parents[i]` is candidate i's parent (an earlier candidate, or
        −1 for the root), q [m] their conditional draft probabilities."""
        if not self.calibrated or not self.cycles:
            return min(len(parents), self.max_nodes)  # nothing measured yet
        value = self.predicted_speedups(parents, q)
        return 1 + max(range(len(value)), key=value.__getitem__)

    def predicted_speedups(self, parents: Sequence[int], q: torch.Tensor) -> List[float]:
        """E[tokens | n] / (v(n+1) + c) for n = 1..m (the arguments of `choose`)."""
        a = self.acceptance(q).tolist()
        reach: List[float] = []
        for i, parent in enumerate(parents[: self.max_nodes]):
            reach.append((reach[parent] if parent >= 0 else 1.0) * a[i])  # P̂(candidate i on the accepted path)
        c = sum(seconds for _, seconds in self.recent) / len(self.recent) / self.step_s
        gain = 1.0 + torch.tensor(reach, dtype=torch.float64).cumsum(0)  # [m] E[tokens | n = 1..m]
        return [float(gain[n - 1]) / (self.cost(n + 1) + c) for n in range(1, len(reach) + 1)]

    def update(self, parents: Sequence[int], q: torch.Tensor, accepted_nodes: Sequence[int], draft_s: float) -> None:
        """One verified tree (node 0 = root; `parents`, q [N+1] in tree order): every node whose parent was on the
        accepted path was tried; those on it were accepted."""
        on_path = {0, *accepted_nodes}
        tried = [i for i in range(1, len(parents)) if parents[i] in on_path]
        if tried:
            bins = torch.bucketize(q[tried].to(torch.float64), self.edges)
            self.tried.index_add_(0, bins, torch.ones(len(tried), dtype=torch.float64))
            self.accepted.index_add_(0, bins, torch.tensor([float(i in on_path) for i in tried], dtype=torch.float64))
        depth = [0] * len(parents)
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
        self.recent.append((max(depth), draft_s))
        self.cycles += 1

    def draft_depth(self, limit: int) -> int:
        """How many levels to draft next: one below the deepest node verified lately, at most `limit`."""
        return min(limit, 1 + max(d for d, _ in self.recent)) if self.recent else limit
