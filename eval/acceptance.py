"""Acceptance statistics of decoding runs (per-token α, the per-position curve), the speedup formula
(docs/algorithms.md §Speedup model) and `cycle_metrics`, the one place where a run's cycles become the numbers that
the evaluation job (eval/job.py) and the decode benchmark (benchmarks/bench_decode.py) report; also how a speedup's
spread is flagged. The cost measurements the formula needs (v(n)) live in inference/autotune.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

from specdrafter.inference.autotune import pass_cost
from specdrafter.inference.decode import CycleStats, alpha_per_token


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


@dataclass
class CycleMetrics:
    """What the cycles of one decoding run (a cell, a benchmark arm) say, unrounded."""

    tokens: int
    target_passes: int
    tau: float  # tokens per target pass, bonus included
    alpha: float  # accepted drafts / draft positions tried
    per_position: List[Optional[float]]
    per_position_n: List[int]
    c: float  # draft seconds ÷ one target step: per drafted token (chains), per cycle (trees)
    k_used: Optional[int]  # chains: the block length used most
    mean_drafted: Optional[float]  # chains: drafts verified per cycle on average (a block drafter's confidence sizes it)
    mean_tree_size: Optional[float]  # trees: tokens per target pass on average
    predicted_speedup: Optional[float]  # None where v(n) does not cover the passes
    best_k: Optional[int]  # chains: the k the formula prefers
    mean_tv: Optional[float]  # mean D_TV(p, q) at the tried positions (runs with record_tv)
    alpha_tv_gap: Optional[float]  # α − (1 − mean D_TV)
    verifier_per_token: float  # verifier seconds per token ÷ one target step

    def rounded(self) -> dict:
        """The fields as results.json and bench_decode.json store them (trees carry mean_tree_size, chains don't)."""
        r = lambda x, digits: None if x is None else round(x, digits)  # noqa: E731
        out = {"tokens": self.tokens, "target_passes": self.target_passes, "tau": r(self.tau, 3),
               "alpha": r(self.alpha, 4), "per_position": [r(a, 4) for a in self.per_position],
               "per_position_n": self.per_position_n, "mean_tv": r(self.mean_tv, 4),
               "alpha_tv_gap": r(self.alpha_tv_gap, 4), "c": r(self.c, 4), "k_used": self.k_used,
               "mean_drafted": r(self.mean_drafted, 2),
               "predicted_speedup": r(self.predicted_speedup, 3), "best_k": self.best_k,
               "verifier_per_token_vs_target_step": r(self.verifier_per_token, 4)}
        if self.mean_tree_size is not None:
            out["mean_tree_size"] = r(self.mean_tree_size, 2)
        return out


def cycle_metrics(cycles: List[CycleStats], tokens: int, step_s: float, v: Dict[int, float], chain: bool) -> CycleMetrics:
    """α, τ, the per-position curve, c, the predicted speedup (and best k) of one run from its `cycles`, the
    `tokens` it committed, one target step's seconds `step_s` and the machine's v(n) (fitted monotone). `chain`:
    a chain (c per drafted token, the closed form with the modal k) or a tree (c per cycle, τ ÷ mean cycle cost)."""
    passes = len(cycles)
    tau = tokens / max(passes, 1)
    alpha = alpha_per_token(cycles)
    calls = sum(x.drafted for x in cycles) if chain else passes  # chains draft token by token, trees once per cycle
    c = sum(x.draft_s for x in cycles) / max(calls, 1) / step_s
    tvs = [t for x in cycles for t in (x.tv or [])]
    mean_tv = sum(tvs) / len(tvs) if tvs else None
    k = modal_block_length(cycles)  # a fixed k, or where an auto-tuned run settled
    predicted = best_k = None
    if chain and k + 1 in v:
        predicted, best_k = predicted_speedup(alpha, k, c, v[k + 1]), best_block_length(alpha, c, v)
    elif not chain and cycles and v and max(v) >= max(x.size for x in cycles):
        predicted = tree_predicted_speedup(tau, cycles, c, v)
    return CycleMetrics(
        tokens=tokens, target_passes=passes, tau=tau, alpha=alpha, per_position=per_position_acceptance(cycles),
        per_position_n=position_counts(cycles), c=c, k_used=k if chain else None,
        mean_drafted=sum(x.drafted for x in cycles) / max(passes, 1) if chain else None,
        mean_tree_size=None if chain else sum(x.size for x in cycles) / max(passes, 1), predicted_speedup=predicted,
        best_k=best_k, mean_tv=mean_tv, alpha_tv_gap=None if mean_tv is None else alpha - (1 - mean_tv),
        verifier_per_token=sum(x.verifier_s for x in cycles) / max(tokens, 1) / step_s)


# ------------------------------------------------------------------------------- a speedup and its spread
NOISY = "⚠ noisy"
NOISY_LEGEND = "⚠ noisy: the speedup's spread is larger than its distance from 1×, so this measurement cannot tell it from 1×."


def is_noisy(speedup: Optional[float], spread: Optional[float]) -> bool:
    """A speedup whose effect |speedup − 1| is smaller than its spread (unknown spread: not flagged)."""
    return speedup is not None and spread is not None and abs(speedup - 1) < spread


def spread_label(speedup: Optional[float], spread: Optional[float]) -> str:
    """The spread as printed beside a speedup: "0.03", "0.21 ⚠ noisy", or "" when unknown."""
    if spread is None:
        return ""
    return f"{spread:g}" + (f" {NOISY}" if is_noisy(speedup, spread) else "")


def range_of(values: Sequence[float]) -> Optional[float]:
    """max − min: the spread of a speedup over repeats (None for fewer than two: unknown)."""
    return max(values) - min(values) if len(values) > 1 else None


@dataclass(frozen=True)
class DriftCorrectedSpeedup:
    """An eval cell's speedup with eval.repeats = 1: the cell decoded once, its baseline once, minutes apart, and the
    ratio corrected for the machine's drift between them (docs/algorithms.md §Measured speedup). Values as
    results.json stores them (rounded to 3 places)."""

    drift_corrected: float  # tok/s ÷ (baseline tok/s × baseline step ÷ cell step)
    drift_spread: Optional[float]  # drift_corrected × (the cell's + the baseline's target-step spread); None: unknown
    uncorrected: Optional[float]  # tok/s ÷ baseline tok/s as measured

    @property
    def value(self) -> float:
        return self.drift_corrected

    @property
    def spread(self) -> Optional[float]:
        return self.drift_spread

    def row(self) -> dict:
        return {"speedup_drift_corrected": self.drift_corrected, "speedup_drift_spread": self.drift_spread,
                "speedup_uncorrected": self.uncorrected}


@dataclass(frozen=True)
class SideBySideSpeedup:
    """An eval cell's speedup with eval.repeats = R > 1 (R rounds, each decoding target-only beside the cell prompt by
    prompt), or a bench_decode arm's (R repeats of every arm interleaved prompt by prompt): each round's ratio sees
    one machine speed. Values as results.json and bench_decode.json store them (rounded)."""

    median: float  # the median (lower middle) of the rounds' tok/s ÷ baseline tok/s
    range: Optional[float]  # their max − min
    rounds: List[float]
    baseline_tokens_per_s: Optional[float]  # the median round's target-only tok/s

    @property
    def value(self) -> float:
        return self.median

    @property
    def spread(self) -> Optional[float]:
        return self.range

    def row(self) -> dict:
        return {"speedup_median": self.median, "speedup_range": self.range, "speedup_rounds": self.rounds,
                "baseline_tokens_per_s": self.baseline_tokens_per_s}


Speedup = Union[DriftCorrectedSpeedup, SideBySideSpeedup]


def speedup_of(row: dict) -> Optional[Speedup]:
    """The measured speedup of a results.json cell, its summary in scaling.json or a bench_decode.json row (by the keys
    of its kind's `row()`), None if it has none."""
    if "speedup_median" in row:
        return SideBySideSpeedup(row["speedup_median"], row.get("speedup_range"), row.get("speedup_rounds", []),
                                 row.get("baseline_tokens_per_s"))
    if "speedup_drift_corrected" in row:
        return DriftCorrectedSpeedup(row["speedup_drift_corrected"], row.get("speedup_drift_spread"),
                                     row.get("speedup_uncorrected"))
    return None
