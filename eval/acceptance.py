"""Acceptance statistics of decoding runs (per-token α, the per-position curve) and the speedup formula
(docs/algorithms.md §Speedup model), shared by the evaluation job (eval/job.py) and the decode benchmark
(eval/bench_decode.py). The cost measurements the formula needs (v(n)) live in inference/autotune.py."""

from __future__ import annotations

from typing import Dict, List, Optional

from specdrafter.inference.autotune import pass_cost
from specdrafter.inference.decode import CycleStats


def per_position_acceptance(cycles: List[CycleStats]) -> List[Optional[float]]:
    """P(draft j accepted | drafts 1..j−1 accepted), j = 1..k: the acceptance curve along the block."""
    k = max(c.drafted for c in cycles)
    reached = [sum(1 for c in cycles if c.accepted >= j and c.drafted > j) for j in range(k)]
    accepted = [sum(1 for c in cycles if c.accepted > j) for j in range(k)]
    return [a / r if r else None for a, r in zip(accepted, reached)]  # None: no cycle got that far


def position_counts(cycles: List[CycleStats]) -> List[int]:
    """How many cycles tried draft position j (j = 1..k): the sample size behind each point of the curve."""
    k = max((c.drafted for c in cycles), default=0)
    return [sum(1 for c in cycles if c.accepted >= j and c.drafted > j) for j in range(k)]


def alpha_per_token(cycles: List[CycleStats]) -> float:
    """Accepted drafts / draft positions tried (a cycle tries its accepted ones plus the first rejected)."""
    tried = sum(min(c.accepted + 1, c.drafted) for c in cycles)
    return sum(c.accepted for c in cycles) / max(tried, 1)


def predicted_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """The closed form (docs/algorithms.md §Speedup model): E[tokens per cycle] = (1 − α^(k+1)) / (1 − α) over
    the cycle's cost v(k+1) + k·c, both in target steps."""
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    return tokens / (v + k * c)


def modal_block_length(cycles: List[CycleStats]) -> int:
    """The block length used most often (a fixed k, or where an auto-tuned run settled)."""
    drafted = [c.drafted for c in cycles]
    return max(set(drafted), key=drafted.count) if drafted else 0


def best_block_length(alpha: float, c: float, v: Dict[int, float]) -> int:
    """The k that the formula says is fastest, over the k whose verification cost v(k+1) was measured."""
    return max((n - 1 for n in v if n >= 2), key=lambda k: predicted_speedup(alpha, k, c, v[k + 1]), default=1)


def tree_predicted_speedup(tau: float, cycles: List[CycleStats], c: float, v: Dict[int, float]) -> float:
    """A tree's measured τ over the cost of its average cycle, v(tree size) + c (c: draft time per cycle ÷ one
    target step) — the size may change every cycle (inference.dynamic_tree.auto_size)."""
    return tau / (sum(pass_cost(v, x.size) for x in cycles) / len(cycles) + c)
