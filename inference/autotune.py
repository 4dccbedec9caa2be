"""Choosing the block length k (`inference.k: auto`) and the size of a dynamic tree from measurements.

The cost model of docs/algorithms.md §Speedup model, with per-position acceptance instead of one α: drafting k
tokens and verifying them yields E[tokens | k] = 1 + Σ_{j=1..k} Π_{i≤j} a_i tokens per cycle, where a_i = P(draft i
accepted | drafts 1..i−1 accepted), at a cost of v(k+1) + k·c target steps (v(n): a target pass over n tokens ÷ one
token, c: one draft step ÷ one target step). The tuner keeps running estimates of every a_i and of c from the cycles
it has seen and picks, before each cycle, the k that maximises E[tokens | k] / (v(k+1) + k·c), among the k that the
acceptance alone does not rule out.

Timing that knows when it cannot be trusted: v(n) is the median of interleaved repeats (sizes in rotating order),
recorded with its spread over the repeats, and fitted monotone non-decreasing in n (isotonic regression) before any
tuner uses it. A tuner's `noise` is the larger of that spread ÷ √repeats, the raw medians' largest distance from the
monotone fit, and `MIN_NOISE`. Under a monotone v a longer block (a bigger tree) costs at least as much as the
shortest, so it can only pay through its extra expected tokens: one whose tokens exceed the shortest's by no more
than the noise is never chosen, however cheap noisy timings make it look (`robust_choice`).

Exactness is untouched: k is a function of past cycles only, never of the current draws.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

import torch

from specdrafter.models.targets import drop_last, new_cache, snapshot


@torch.no_grad()
def time_passes(model, context: Sequence[int], sizes: Sequence[int], repeats: int = 9) -> Dict[int, List[float]]:
    """Seconds of each of `repeats` cached forwards over n new tokens after `context`, for each n in `sizes`.

    The sizes are interleaved and their order rotates from repeat to repeat (repeat r starts at the r-th size), so a
    slow spell of the machine hits every size alike and no size always runs first or right after the same one."""
    sizes = list(dict.fromkeys(sizes))
    cache, device = new_cache(model), getattr(model, "device", torch.device("cpu"))  # an HF model knows its device
    model(input_ids=torch.tensor([list(context)], device=device), cache=cache, use_cache=True, logits_to_keep=1)
    times: Dict[int, List[float]] = {n: [] for n in sizes}
    for r in range(repeats):
        shift = r % len(sizes)
        for n in sizes[shift:] + sizes[:shift]:
            saved = snapshot(cache)  # a recurrent layer's state, restored after the pass
            start = time.perf_counter()
            model(input_ids=torch.tensor([(list(context) * n)[:n]], device=device), cache=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # a kernel launch returns before the pass is done
            times[n].append(time.perf_counter() - start)
            drop_last(cache, n, saved)
    return times


def measure_pass_costs(model, context: Sequence[int], sizes: Sequence[int], repeats: int = 9) -> "PassCosts":
    """v(n) for n in `sizes` (1 is always measured), with the spread of every measurement."""
    return PassCosts.from_timings(time_passes(model, context, sorted({1, *sizes}), repeats))


def relative_spread(values: Sequence[float]) -> float:
    """Interquartile range ÷ median of repeated measurements (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / median if median else 0.0


def monotone_fit(v: Dict[int, float]) -> Dict[int, float]:
    """v(n) fitted non-decreasing in n: isotonic least-squares regression (pool adjacent violators, every measured
    size weighted alike). v(1) — the unit, 1 by definition — stays as given, and no fitted value falls below it."""
    sizes = sorted(v)
    fixed = sizes[:1] if sizes and sizes[0] == 1 else []
    blocks: List[List[float]] = []  # [mean, count] of pooled neighbours
    for n in sizes[len(fixed):]:
        blocks.append([v[n], 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:  # a violation: pool the last two blocks
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    fitted = [m for m, count in blocks for _ in range(int(count))]
    floor = v[1] if fixed else float("-inf")
    return {**({1: v[1]} if fixed else {}), **{n: max(x, floor) for n, x in zip(sizes[len(fixed):], fitted)}}


@dataclass
class PassCosts:
    """What the tuners know about the target's passes on this machine: v(n) measured (`v_raw`: the median over
    repeats of each repeat's n-token pass ÷ the same repeat's 1-token pass, so a slow spell that hits a whole repeat
    cancels), fitted monotone (`v`, what every tuner and prediction uses), and how much the repeats scattered
    (`spread`: interquartile range ÷ median of those ratios; `step_spread`: the same for the 1-token pass's
    seconds)."""

    step_s: float  # seconds of one target decode step (median)
    v_raw: Dict[int, float]
    spread: Dict[int, float] = field(default_factory=dict)
    step_spread: float = 0.0
    repeats: int = 1  # timings behind each median
    v: Dict[int, float] = field(init=False)

    def __post_init__(self):
        self.v_raw = {int(n): float(x) for n, x in sorted(self.v_raw.items())}
        self.v = monotone_fit(self.v_raw)

    @classmethod
    def from_timings(cls, times: Dict[int, Sequence[float]]) -> "PassCosts":
        """From the seconds of every repeat at every size (`time_passes`; size 1 must be among them)."""
        ratios = {n: [a / b for a, b in zip(t, times[1])] for n, t in times.items()}  # paired within each repeat
        return cls(statistics.median(times[1]), {n: statistics.median(r) for n, r in ratios.items()},
                   {n: relative_spread(r) for n, r in ratios.items()}, relative_spread(times[1]),
                   min(len(t) for t in times.values()))

    @classmethod
    def from_seconds(cls, seconds: Dict[int, float]) -> "PassCosts":
        """From median seconds per size alone (no spread known)."""
        return cls(seconds[1], {n: t / seconds[1] for n, t in seconds.items()})

    @property
    def noise(self) -> float:
        """Relative uncertainty of the fitted v: the larger of the typical spread ÷ √repeats (the median's standard
        error is ≈ 0.93 × interquartile range ÷ √repeats; typical: the median over the sizes n ≥ 2) and the largest
        relative distance of a raw median from the monotone fit (a v that falls with n is noise in itself)."""
        spreads = [x for n, x in self.spread.items() if n >= 2]
        typical = statistics.median(spreads) / math.sqrt(max(self.repeats, 1)) if spreads else 0.0
        off = [abs(self.v_raw[n] - x) / x for n, x in self.v.items() if x > 0]
        return max([typical, *off])

    def cost(self, n: int) -> float:
        return pass_cost(self.v, n)


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


MIN_NOISE = 0.02  # timing on a shared machine is rarely better than 2 %: a tuner never trusts a smaller gain

CostInput = Union["PassCosts", Dict[int, float], None]  # a measurement, or median seconds per pass size


def robust_choice(expected: Sequence[float], speedups: Sequence[float], noise: float) -> int:
    """The index of the best predicted speedup among the choices that acceptance alone does not rule out.

    `expected[i]` is choice i's expected tokens per cycle (choices ordered from the smallest block or tree up),
    `speedups[i]` its predicted speedup under the monotone v. Under a monotone v a larger choice costs at least as
    much as the smallest one, so it can only pay through its extra expected tokens: a choice whose tokens exceed the
    smallest choice's by no more than `noise` (relative) is ruled out, however cheap the noisy timings make it look.
    Choice 0 is always allowed."""
    allowed = [i for i, e in enumerate(expected) if i == 0 or e > expected[0] * (1 + noise)]
    return max(allowed, key=lambda i: speedups[i])


class _PassCostModel:
    """v(n) as a tuner uses it: fitted monotone (`PassCosts`), with the relative noise of its measurement.

    `v` may be set to a bare table (tests, a hand-made model): it is fitted monotone all the same, and its departure
    from monotone counts as noise. `noise` is never below `min_noise`."""

    costs: Optional[PassCosts] = None
    step_s: float = 0.0  # seconds of one target decode step
    min_noise: float = MIN_NOISE

    def _use(self, costs: PassCosts) -> None:
        self.costs, self.step_s = costs, costs.step_s

    @property
    def v(self) -> Dict[int, float]:
        return self.costs.v if self.costs is not None else {}

    @v.setter
    def v(self, table: Dict[int, float]) -> None:
        self.costs = PassCosts(self.step_s, dict(table)) if table else None

    @property
    def calibrated(self) -> bool:
        return self.costs is not None

    @property
    def noise(self) -> float:
        return max(self.min_noise, self.costs.noise if self.costs is not None else 0.0)


def _as_pass_costs(costs: CostInput) -> Optional[PassCosts]:
    if costs is None or isinstance(costs, PassCosts):
        return costs
    return PassCosts.from_seconds(costs) if 1 in costs else None


class BlockLengthTuner(_PassCostModel):
    """Running per-position acceptance and draft cost → the block length of the next cycle.

    Counts start from a prior of `prior_accepted` / `prior_tried` at every position (0.5 by default, worth two
    cycles), so an unexplored position is neither ruled out nor trusted. `calibrate` measures v(n) once per target.
    `choose` never takes a k that the acceptance alone rules out (`robust_choice`).
    """

    def __init__(self, max_k: int = 8, start_k: int = 4, prior_accepted: float = 1.0, prior_tried: float = 2.0,
                 step_costs: CostInput = None, min_noise: float = MIN_NOISE):
        self.max_k, self.start_k = max_k, min(start_k, max_k)
        self.accepted = [prior_accepted] * max_k
        self.tried = [prior_tried] * max_k
        self.draft_s, self.drafted = 0.0, 0
        self.min_noise = min_noise
        costs = _as_pass_costs(step_costs)
        if costs is not None and all(n in costs.v for n in range(1, max_k + 2)):  # measured already: no calibration
            self._use(costs)

    def calibrate(self, target, context: Sequence[int], repeats: int = 5) -> None:
        self._use(measure_pass_costs(target, context, range(1, self.max_k + 2), repeats))

    def acceptance(self) -> List[float]:
        return [a / t for a, t in zip(self.accepted, self.tried)]

    def draft_cost(self) -> float:
        """c: seconds per draft step ÷ seconds per target step (None until a cycle was seen)."""
        return self.draft_s / self.drafted / self.step_s if self.drafted and self.step_s else None

    def predicted_speedup(self, k: int) -> float:
        return expected_tokens(self.acceptance(), k) / (self.v[k + 1] + k * self.draft_cost())

    def choose(self) -> int:
        """The k with the best predicted speedup (v fitted monotone) among those that acceptance alone does not
        rule out (`robust_choice`): E[tokens | k] must exceed E[tokens | 1] by more than `noise`. With one α,
        E[tokens | k] ÷ E[tokens | 1] < 1 / (1 − α²): at α = 0.11 that is +1.2 %, under `MIN_NOISE`, so k = 1
        whatever the measured v."""
        if not self.calibrated or self.draft_cost() is None:
            return self.start_k  # nothing measured yet
        ks = range(1, self.max_k + 1)
        expected = [expected_tokens(self.acceptance(), k) for k in ks]
        return 1 + robust_choice(expected, [self.predicted_speedup(k) for k in ks], self.noise)

    def update(self, drafted: int, accepted: int, draft_s: float) -> None:
        """One finished cycle: positions 1..min(accepted + 1, drafted) were tried, the first `accepted` passed."""
        for j in range(min(accepted + 1, drafted)):
            self.tried[j] += 1
            self.accepted[j] += j < accepted
        self.draft_s += draft_s
        self.drafted += drafted


class TreeSizeTuner(_PassCostModel):
    """How many of a dynamic tree's drafted candidates to verify (`inference.dynamic_tree.auto_size`).

    A node lies on the accepted path with probability Π a(q) along its path, where q is the draft's conditional
    probability of the node's token and a(q) = P(node accepted | its parent accepted), learnt online in bins of q
    (prior a(q) = q, a calibrated draft, worth two observations per bin). The accepted length counts the nodes of
    the accepted path, so verifying the n best candidates (draft-score order, closed under ancestors) yields
    E[tokens | n] = 1 + Σ_{i≤n} P̂_i per cycle at a cost of v(n+1) + c target steps (c: draft seconds per cycle ÷
    one target step, v fitted monotone and interpolated between measured sizes). `choose` returns the n that
    maximises the ratio among the n whose E[tokens | n] exceeds E[tokens | 1] by more than the timing noise
    (`robust_choice`, as `BlockLengthTuner.choose`).

    Drafting depth follows: `draft_depth` drafts one level below the deepest node verified in the last
    `RECENT` cycles (so the tree can grow back), and c is the mean draft time of those cycles.

    Exactness is untouched: n and the depth depend on past cycles and on the current draft only — the tree is
    still a deterministic function of the context, which is what the exact tree verifiers require.
    """

    RECENT = 8

    EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # bin upper edges of q; the last bin ends at 1

    def __init__(self, max_nodes: int, prior: float = 2.0, step_costs: CostInput = None, min_noise: float = MIN_NOISE):
        self.max_nodes = max_nodes
        self.edges = torch.tensor(self.EDGES, dtype=torch.float64)
        lower, upper = (0.0,) + self.EDGES, self.EDGES + (1.0,)
        self.accepted = torch.tensor([prior * (lo + hi) / 2 for lo, hi in zip(lower, upper)], dtype=torch.float64)
        self.tried = torch.full((len(upper),), prior, dtype=torch.float64)
        self.cycles = 0
        self.recent: Deque[Tuple[int, float]] = deque(maxlen=self.RECENT)  # (deepest verified node, draft seconds)
        self.min_noise = min_noise
        costs = _as_pass_costs(step_costs)
        if costs is not None and max(costs.v) >= max_nodes + 1:  # measured already: no calibration
            self._use(costs)

    def sizes(self) -> List[int]:
        """Tree-pass sizes (tokens) whose cost is measured; the others are interpolated."""
        grid = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
        return sorted({n for n in grid if n <= self.max_nodes} | {self.max_nodes + 1})

    def calibrate(self, target, context: Sequence[int], repeats: int = 5) -> None:
        self._use(measure_pass_costs(target, context, self.sizes(), repeats))

    def cost(self, n: int) -> float:
        return self.costs.cost(n)

    def acceptance(self, q: torch.Tensor) -> torch.Tensor:
        """a(q) for draft probabilities q [..]."""
        return (self.accepted / self.tried)[torch.bucketize(q.to(torch.float64), self.edges)]

    def choose(self, parents: Sequence[int], q: torch.Tensor) -> int:
        """n for candidates in draft-score order: `parents[i]` is candidate i's parent (an earlier candidate, or
        −1 for the root), q [m] their conditional draft probabilities."""
        if not self.calibrated or not self.cycles:
            return min(len(parents), self.max_nodes)  # nothing measured yet
        expected = self.expected_tokens(parents, q)
        return 1 + robust_choice(expected, self.predicted_speedups(parents, q), self.noise)

    def expected_tokens(self, parents: Sequence[int], q: torch.Tensor) -> List[float]:
        """E[tokens | n] = 1 + Σ_{i≤n} P̂_i for n = 1..m (the arguments of `choose`)."""
        a = self.acceptance(q).tolist()
        reach: List[float] = []
        for i, parent in enumerate(parents[: self.max_nodes]):
            reach.append((reach[parent] if parent >= 0 else 1.0) * a[i])  # P̂(candidate i on the accepted path)
        return (1.0 + torch.tensor(reach, dtype=torch.float64).cumsum(0)).tolist()

    def predicted_speedups(self, parents: Sequence[int], q: torch.Tensor) -> List[float]:
        """E[tokens | n] / (v(n+1) + c) for n = 1..m (the arguments of `choose`; v fitted monotone)."""
        c = sum(seconds for _, seconds in self.recent) / len(self.recent) / self.step_s
        return [e / (self.cost(n + 1) + c) for n, e in enumerate(self.expected_tokens(parents, q), start=1)]

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


class ConfidenceLength(_PassCostModel):
    """How many of a block drafter's drafts a cycle verifies (`drafter.block.length: confidence`), from its confidence
    head: c_j, an estimate of P(draft j accepted | drafts before it accepted), known before draft j is drawn (it reads
    the previous draft, not draft j).

    Draft j is kept when verifying it is worth it: with the survival s_i = Π_{i'≤i} c_{i'} of the kept drafts, the
    best E[tokens] / cost over every longer length m ≥ j — the drafts after j assumed as confident as j — beats
    stopping at j − 1, where E(n) = 1 + Σ_{i≤n} s_i and cost(n) = c + v(n + 1) (c: one block pass ÷ one target
    step, measured by `update`). The first draft whose keeping does not pay ends the cycle's drafts.

    Exactness: whether draft j is drawn at all depends on drafts 1..j−1 only, so the drafts are a stopped sequence and
    each one verified is distributed as the q row it is verified with. A rule that also read draft j (or the target's
    verdict) would bias the output. Until `calibrate` has measured v, every draft is kept."""

    def __init__(self, max_drafts: int, step_costs: CostInput = None, min_noise: float = MIN_NOISE,
                 draft_cost: Optional[float] = None):
        self.max_drafts, self.min_noise = max_drafts, min_noise
        self.draft_s: Deque[float] = deque(maxlen=64)  # seconds of recent block passes
        self.fixed_draft_cost = draft_cost  # c given instead of measured (a cost model fixed in advance)
        costs = _as_pass_costs(step_costs)
        if costs is not None and all(n in costs.v for n in range(1, max_drafts + 2)):
            self._use(costs)

    def calibrate(self, target, context: Sequence[int], repeats: int = 5) -> None:
        self._use(measure_pass_costs(target, context, range(1, self.max_drafts + 2), repeats))

    def draft_cost(self) -> float:
        """c: a block pass ÷ one target step (0 until a cycle has been timed)."""
        if self.fixed_draft_cost is not None:
            return self.fixed_draft_cost
        return statistics.median(self.draft_s) / self.step_s if self.draft_s and self.step_s else 0.0

    def cost(self, n: int) -> float:
        return pass_cost(self.v, n)

    def keep(self, confidences: Sequence[float]) -> bool:
        """Whether to draw and verify draft j = len(confidences), given c_1..c_j and that drafts 1..j−1 are kept."""
        if not self.calibrated:
            return True
        j, c = len(confidences), self.draft_cost()
        survive = math.prod(confidences[:-1])
        now = expected_tokens(confidences[:-1], j - 1)
        stop = now / (c + self.cost(j))  # the cycle ends after draft j − 1
        best, tokens = 0.0, now
        for m in range(j, self.max_drafts + 1):
            survive *= confidences[-1]
            tokens += survive
            best = max(best, tokens / (c + self.cost(m + 1)))
        return best > stop * (1 + self.noise)

    def update(self, draft_s: float) -> None:
        self.draft_s.append(draft_s)
