"""llama.cpp's costs, and a drafter measured in llama-server: what the launcher plans with and the eval job reports.

The cost model is the loop's (docs/algorithms.md §Speedup model), with llama.cpp's own numbers in it:

    speedup(k) = E[tokens per step | k] / (v(k+1) + c(k))        both terms in target steps

- v(n): llama.cpp's target pass over n tokens ÷ its pass over one, measured with `llama-bench` (`-p n -n 0` at a
  depth of `DEPTH` tokens), rounds of every size in rotating order, so a slow spell hits every size alike
  (`measure_v`, the loop's `PassCosts`).
- c(k): what one step of drafting k tokens costs in llama-server beyond the verify pass, ÷ one target step. Measured
  in the server itself, as `calibrate` runs the drafter at n_max = k for k in `CALIBRATED_K` and at n_max = K on
  calibration prompts: per verify step, c(k) = step time ÷ target-only token time − v(k+1); linear in k between the
  measured points (the k a plan picks are small, so they are measured, not interpolated: a line from k = 1 to K
  under-counted EAGLE-3's second draft by about a sixth on an AVX512 Xeon).
- E[tokens | k] = 1 + Σ_{j≤k} P(A ≥ j), A the drafts accepted in a step, from llama-server's own per-position
  counters at n_max = K (its log at `-lv 4`, "acc per pos"); at T = 0 the first k drafts do not depend on n_max, so
  the curve at K serves every k ≤ K.

- A confidence cut: llama.cpp stops a step's drafting where the drafter's top probability (DSpark: its confidence
  head) falls below `--spec-draft-p-min`. `calibrate` also runs the drafter at n_max = K with each p_min of
  `CONFIDENCE_CUTS`, and such a setting is priced by what it measured there: tokens per step ÷ the step's cost in
  target steps (a step drafts a varying number of tokens, so the cost is measured, not composed from v and c).

- Thread pools that sleep: with a drafter, llama-server runs two thread pools (the target's and the drafter's), and
  the idle one spins for `--poll` (50 by default) before it sleeps, taking a core from the one that works on a 2-core
  machine. `calibrate` measures the best plain k again with `POOLS_SLEEP` (`--poll 0 --poll-draft 0`), and the plan
  serves with it where the step is cheaper by more than the timing noise (its step cost measured, as a cut's).

llama.cpp's replies carry `draft_n` and `draft_n_accepted`; each verify step commits its accepted drafts and one
token of the target's, so a reply's verify steps are `predicted_n − 1 − draft_n_accepted` (its first token comes
from the prompt pass). α = accepted ÷ drafted and τ = tokens per verify step, as the loop defines them.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.eval.acceptance import range_of
from specdrafter.inference.autotune import MIN_NOISE, PassCosts, expected_tokens, pass_cost, robust_choice
from specdrafter.inference.llama_server import LlamaServer, dies_with_parent

DEPTH = 128  # tokens already in the cache when llama-bench times a pass (a decode step sits after its prompt)
# A first differing token at T = 0 is a numerical tie when the target's top-2 log-probability margin there (from a
# target-only pass) is at most this, per GGUF weight type. A verify pass over k + 1 tokens and a 1-token step run
# different kernels (matrix-matrix against matrix-vector products, other summation orders) and round differently.
# Measured on SmolLM2 (benchmarks/llamacpp_tie_margin.py, 384 positions of 8 MT-Bench answers, one-token steps against
# a batched pass): the margin moves by up to 1.1e-2 in f32 (median 1.6e-3) and 0.16 in bf16 (median 1.6e-2, 5 greedy
# tokens flipped); on Qwen2.5-Coder-1.5B's Q4_K_M file (128 positions of 4 MT-Bench answers) by up to 0.66 (median
# 0.072, 2 greedy tokens flipped): its K-quant matmuls quantize the activations to 8 bits per block, differently in the
# batched kernels. Twice the largest measured move is still a tie; a larger margin is a wrong verifier. f16 is taken
# as bf16 and q8_0 is a guess: neither was measured.
TIE_MARGIN = {"f32": 0.03, "f16": 0.3, "bf16": 0.3, "q8_0": 0.3, "q4_k_m": 1.3}
CALIBRATED_K = (1, 2, 3, 4)  # block lengths whose drafting cost is measured, beside the drafter's longest, K
CONFIDENCE_CUTS = (0.3, 0.5, 0.7)  # --spec-draft-p-min values measured at n_max = K
POOLS_SLEEP = ("--poll", "0", "--poll-draft", "0")  # idle thread pools sleep instead of spinning
_POS_LINE = re.compile(r"acc per pos = \(([0-9., ]*)\)")


# ------------------------------------------------------------------------------------------------------- v(n)
def measure_v(target: Path, sizes: Sequence[int], threads: int = 1, rounds: int = 5, depth: int = DEPTH) -> PassCosts:
    """llama.cpp's v(n) for the target GGUF, n in `sizes` (1 always): `rounds` llama-bench runs, each timing every
    size once (after a warm-up) in an order that rotates from round to round."""
    sizes = sorted({1, *sizes})
    times: Dict[int, List[float]] = {n: [] for n in sizes}
    for r in range(rounds):
        order = sizes[r % len(sizes):] + sizes[:r % len(sizes)]
        for n in order:
            times[n].extend(bench_passes(target, n, threads, depth))
    return PassCosts.from_timings(times)


def bench_passes(target: Path, n: int, threads: int, depth: int) -> List[float]:
    """Seconds of each llama-bench pass over n tokens with `depth` tokens cached (one run, after its warm-up)."""
    cmd = [str(llamacpp.binary("llama-bench")), "-m", str(target), "-p", str(n), "-n", "0", "-d", str(depth),
           "-r", "1", "-t", str(threads), "-o", "json", *(["--repack", "0"] if llamacpp.amx_repack_crashes() else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=dies_with_parent())  # no orphan if killed
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecdrafterError(f"llama-bench failed on {str(target)!r} (exit {done.returncode}): {last}")
    return [ns / 1e9 for row in json.loads(done.stdout) for ns in row["samples_ns"]]


def pass_ms(gguf: Path, n: int, threads: int, depth: int = DEPTH, rounds: int = 3) -> float:
    """Median milliseconds of a pass over n tokens over `rounds` llama-bench runs (the benchmarks' price of a pass)."""
    return 1e3 * statistics.median(t for _ in range(rounds) for t in bench_passes(gguf, n, threads, depth))


# ---------------------------------------------------------------------------------------------- answers
@dataclass
class Answer:
    """One llama-server reply: its tokens and what the engine timed and counted."""

    tokens: List[int]
    ms: float  # llama.cpp's generation time (prompt processing excluded)
    drafted: int = 0
    accepted: int = 0

    @property
    def steps(self) -> int:
        """Verify steps (or target steps without a drafter): the first token comes from the prompt pass."""
        return max(len(self.tokens) - 1 - self.accepted, 1)

    @classmethod
    def of(cls, reply: dict) -> "Answer":
        t = reply["timings"]
        return cls(list(reply["tokens"]), float(t["predicted_ms"]), int(t.get("draft_n", 0)),
                   int(t.get("draft_n_accepted", 0)))


def answer(server: LlamaServer, prompt: Sequence[int], n: int, temperature: float = 0.0, seed: int = 0,
           **fields) -> Answer:
    return Answer.of(server.complete(prompt, n, temperature=temperature, seed=seed, **fields))


def token_ms(answers: Sequence[Answer]) -> float:
    """Target-only milliseconds per token (per step), over answers without a drafter."""
    return sum(a.ms for a in answers) / max(sum(a.steps for a in answers), 1)


def reach_curve(log_text: str) -> List[float]:
    """P(A ≥ j), j = 1..K, from llama-server's "acc per pos" lines (one per finished request, `-lv 4`), unweighted:
    every request of a calibration run decodes the same number of tokens (EOS ignored), so the plain mean pools them."""
    rows = [[float(x) for x in m.group(1).split(",") if x.strip()] for m in _POS_LINE.finditer(log_text)]
    rows = [r for r in rows if r]
    if not rows:
        return []
    width = max(len(r) for r in rows)
    return [statistics.fmean(r[j] if j < len(r) else 0.0 for r in rows) for j in range(width)]


def settled_log(server: LlamaServer, requests: int, wait_s: float = 3.0) -> str:
    """The server's log once it holds a per-position line for each of `requests` (llama.cpp writes its log from
    a thread of its own, a moment after the reply), or after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while len(_POS_LINE.findall(text := server.log_text())) < requests and time.monotonic() < deadline:
        time.sleep(0.05)
    return text


def conditional(reach: Sequence[float]) -> List[float]:
    """a_j = P(A ≥ j | A ≥ j − 1), what `expected_tokens` takes."""
    out, before = [], 1.0
    for r in reach:
        out.append(r / before if before > 0 else 0.0)
        before = r
    return out


# ------------------------------------------------------------------------------------------- calibration
@dataclass
class Cut:
    """The drafter at n_max = K with llama.cpp's confidence cut p_min, as measured in the server (T = 0)."""

    p_min: float
    tokens_per_step: float
    drafts_per_step: float
    step_cost: float  # one verify step (drafting included) ÷ one target-only token

    @property
    def predicted(self) -> float:
        return self.tokens_per_step / self.step_cost


@dataclass
class Calibration:
    """A drafter in llama-server on this machine: c at the measured block lengths, its acceptance curve, the v(n) it
    goes with."""

    spec_type: str
    max_k: int
    c: Dict[int, float]  # c(k) at the measured k (CALIBRATED_K up to K, and K)
    reach: List[float]  # P(A ≥ j), j = 1..K, at T = 0
    v: Dict[int, float]  # llama.cpp's v(n), fitted monotone
    v_noise: float
    target_ms: float  # target-only ms per token in the server
    threads: int
    prompts: int
    tokens: int  # per prompt
    cuts: List[Cut] = field(default_factory=list)  # at n_max = max_k, one per p_min of CONFIDENCE_CUTS
    sleeping: Dict[int, float] = field(default_factory=dict)  # k → step cost with POOLS_SLEEP, in target steps

    def c_at(self, k: int) -> float:
        """c(k), measured or on the line between the nearest measured block lengths (the end ones beyond them)."""
        if k in self.c:
            return self.c[k]
        ks = sorted(self.c)
        lo = max([x for x in ks if x < k] or ks[:1])
        hi = min([x for x in ks if x > k] or ks[-1:])
        if hi == lo:
            return self.c[lo]
        return self.c[lo] + (self.c[hi] - self.c[lo]) * (k - lo) / (hi - lo)

    def tokens_per_step(self, k: int) -> float:
        return expected_tokens(conditional(self.reach), k)

    def step_cost(self, k: int, p_min: float = 0.0) -> float:
        """One verify step at block length k, in target steps: v(k+1) + c(k); with a confidence cut, the step cost
        measured at that cut."""
        if p_min > 0:
            return self.cut(p_min).step_cost
        return pass_cost(self.v, k + 1) + self.c_at(k)

    def cut(self, p_min: float) -> Cut:
        found = [c for c in self.cuts if abs(c.p_min - p_min) < 1e-9]
        if not found:
            raise SpecdrafterError(f"the calibration has no confidence cut at p_min {p_min:g} (measured: "
                                   f"{', '.join(f'{c.p_min:g}' for c in self.cuts) or 'none'})")
        return found[0]

    def predicted(self, k: int) -> float:
        """The predicted speedup over the same server without the drafter at block length k."""
        return self.tokens_per_step(k) / self.step_cost(k)

    def alpha_needed(self, speedup: float) -> Optional[float]:
        """The per-draft acceptance α (the same at every position) at which the best k would reach `speedup` at
        these costs; None if no α < 1 does."""
        def best(alpha: float) -> float:
            return max(sum(alpha ** j for j in range(k + 1)) / self.step_cost(k) for k in range(1, self.max_k + 1))
        if best(0.999) < speedup:
            return None
        lo, hi = 0.0, 0.999
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if best(mid) < speedup else (lo, mid)
        return hi

    def table(self) -> List[dict]:
        return [{"k": k, "tokens_per_step": round(self.tokens_per_step(k), 3), "c": round(self.c_at(k), 4),
                 "v": round(pass_cost(self.v, k + 1), 4), "predicted_speedup": round(self.predicted(k), 3)}
                for k in range(1, self.max_k + 1)]

    def choose(self) -> "Choice":
        """The k with the best predicted speedup among those acceptance does not rule out (the loop's
        `robust_choice`), or a confidence cut where one beats that k by more than the timing noise; and whether it
        pays: predicted ≥ 1 + the timing noise."""
        ks = list(range(1, self.max_k + 1))
        noise = max(MIN_NOISE, self.v_noise)
        best = ks[robust_choice([self.tokens_per_step(k) for k in ks], [self.predicted(k) for k in ks], noise)]
        choice = Choice(best, self.predicted(best), self.predicted(best) >= 1 + noise, noise)
        if best in self.sleeping and self.sleeping[best] < self.step_cost(best) * (1 - noise):
            asleep = self.tokens_per_step(best) / self.sleeping[best]
            choice = Choice(best, asleep, asleep >= 1 + noise, noise, pools_sleep=True)
        cut = max(self.cuts, key=lambda c: c.predicted, default=None)
        if cut is not None and cut.predicted > choice.predicted * (1 + noise):
            choice = Choice(self.max_k, cut.predicted, cut.predicted >= 1 + noise, noise, cut.p_min)
        return choice

    def to_json(self) -> dict:
        return {**asdict(self), "c": {str(k): x for k, x in self.c.items()}, "v": {str(n): x for n, x in self.v.items()},
                "sleeping": {str(k): x for k, x in self.sleeping.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        return cls(**{**data, "c": {int(k): x for k, x in data["c"].items()},
                      "v": {int(n): x for n, x in data["v"].items()},
                      "cuts": [Cut(**c) for c in data.get("cuts", [])],
                      "sleeping": {int(k): x for k, x in data.get("sleeping", {}).items()}})


@dataclass(frozen=True)
class Choice:
    k: int  # --spec-draft-n-max
    predicted: float
    pays: bool  # predicted speedup clear of 1 by the timing noise
    noise: float
    p_min: float = 0.0  # --spec-draft-p-min: 0 drafts k tokens every step
    pools_sleep: bool = False  # served with POOLS_SLEEP

    def extra(self) -> List[str]:
        """llama-server's arguments for this choice beyond n_max and p_min."""
        return list(POOLS_SLEEP) if self.pools_sleep else []

    def flags(self) -> str:
        return " ".join([f"--spec-draft-n-max {self.k}"] + ([f"--spec-draft-p-min {self.p_min:g}"] if self.p_min else [])
                        + self.extra())


def calibrate(target: Path, draft: Path, spec_type: str, max_k: int, prompts: Sequence[Sequence[int]],
              tokens: int = 64, threads: int = 1, costs: Optional[PassCosts] = None, log=print,
              cuts: Sequence[float] = CONFIDENCE_CUTS) -> Calibration:
    """Measure the drafter in llama-server: target-only token time, then the drafter at each n_max of
    `CALIBRATED_K` up to max_k and at max_k, and at max_k with each confidence cut of `cuts`, on `prompts` at T = 0
    (one server at a time: llama.cpp's threads spin)."""
    costs = costs or measure_v(target, range(2, max_k + 2), threads)
    log(f"llama.cpp v(n) for n = 1..{max_k + 1}: " + ", ".join(f"{costs.v[n]:.2f}" for n in sorted(costs.v)))
    with LlamaServer(target, threads=threads) as alone:
        base = [answer(alone, p, tokens, ignore_eos=True) for p in prompts]
    target_ms = token_ms(base)
    c, reach = {}, []
    for k in sorted({k for k in CALIBRATED_K if k <= max_k} | {max_k}):
        with LlamaServer(target, draft, spec_type, n_max=k, p_min=0.0, threads=threads, extra=["-lv", "4"]) as s:
            runs = [answer(s, p, tokens, ignore_eos=True) for p in prompts]  # equal lengths: rows pool evenly
            log_text = settled_log(s, len(prompts))
        step_ms = sum(a.ms for a in runs) / sum(a.steps for a in runs)
        c[k] = max(step_ms / target_ms - costs.cost(k + 1), 0.0)
        if k == max_k:
            reach = reach_curve(log_text) or [sum(a.accepted for a in runs) / sum(a.steps for a in runs)]
        log(f"  n_max {k}: {step_ms:.1f} ms per step against {target_ms:.1f} ms per target token, c({k}) = {c[k]:.3f}")
    partial = Calibration(spec_type, max_k, c, reach, dict(costs.v), costs.noise, target_ms, threads, len(prompts),
                          tokens)
    best = partial.choose().k
    with LlamaServer(target, draft, spec_type, n_max=best, p_min=0.0, threads=threads, extra=list(POOLS_SLEEP)) as s:
        runs = [answer(s, p, tokens, ignore_eos=True) for p in prompts]
    sleeping = {best: sum(a.ms for a in runs) / sum(a.steps for a in runs) / target_ms}
    log(f"  n_max {best} with the idle thread pool asleep ({' '.join(POOLS_SLEEP)}): {sleeping[best]:.2f} target "
        f"steps a step, against {partial.step_cost(best):.2f}")
    measured_cuts = []
    for p_min in cuts:
        with LlamaServer(target, draft, spec_type, n_max=max_k, p_min=p_min, threads=threads) as s:
            runs = [answer(s, p, tokens, ignore_eos=True) for p in prompts]
        steps = sum(a.steps for a in runs)
        cut = Cut(p_min, 1 + sum(a.accepted for a in runs) / steps, sum(a.drafted for a in runs) / steps,
                  sum(a.ms for a in runs) / steps / target_ms)
        measured_cuts.append(cut)
        log(f"  n_max {max_k}, p_min {p_min:g}: {cut.drafts_per_step:.2f} drafts and {cut.tokens_per_step:.2f} tokens "
            f"per step at {cut.step_cost:.2f} target steps each")
    return Calibration(spec_type, max_k, c, reach, dict(costs.v), costs.noise, target_ms, threads, len(prompts), tokens,
                       measured_cuts, sleeping)


# --------------------------------------------------------------------------------------- T = 0 identity
@dataclass
class Departure:
    """Where a drafted answer first left target-only decoding, and the target's top-2 margin there."""

    prompt: int
    position: int
    margin: Optional[float]  # top-1 − top-2 log-probability of the target there (a logit difference)
    tie: bool

    def line(self) -> str:
        kind = "a numerical tie" if self.tie else "NOT a tie: the verifier is inexact"
        return f"prompt {self.prompt}, token {self.position}: margin {self.margin:.3g} ({kind})"


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first index where two answers differ (a shorter one differing at its end), None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(server: LlamaServer, context: Sequence[int]) -> Optional[float]:
    """The target's top-1 − top-2 log-probability at the token after `context`, from a target-only server."""
    reply = server.complete(context, 1, n_probs=2)
    top = reply["completion_probabilities"][0].get("top_logprobs") or []
    return top[0]["logprob"] - top[1]["logprob"] if len(top) >= 2 else None


def departure(i: int, prompt: Sequence[int], alone: Sequence[int], drafted: Sequence[int], target: LlamaServer,
              outtype: str) -> Optional[Departure]:
    at = first_difference(alone, drafted)
    if at is None:
        return None
    margin = top2_margin(target, list(prompt) + list(alone[:at]))
    return Departure(i, at, margin, margin is not None and margin <= TIE_MARGIN.get(outtype, TIE_MARGIN["f32"]))


@dataclass
class ArmResult:
    """One cell of the llama.cpp arm: the same prompts without and with the drafter, alternating."""

    k: Optional[int]  # None: an n-gram mode at llama.cpp's own sizes
    temperature: float
    prompts: int
    tokens: int
    alone_tokens_per_s: float
    drafted_tokens_per_s: float
    speedup_median: float
    speedup_range: Optional[float]
    alpha: float
    tau: float
    drafted: int
    accepted: int
    predicted_speedup: Optional[float] = None
    identical: Optional[int] = None  # T = 0: answers identical to target-only decoding
    departures: List[dict] = field(default_factory=list)
    p_min: float = 0.0  # llama.cpp's confidence cut (0: every step drafts k)
    pools_sleep: bool = False  # the drafted server ran with POOLS_SLEEP


def side_by_side(target: Path, draft: Optional[Path], spec_type: str, k: Optional[int],
                 prompts: Sequence[Sequence[int]], tokens: int,
                 temperature: float = 0.0, threads: int = 1, outtype: str = "f32",
                 calibration: Optional[Calibration] = None, log=print, raise_inexact: bool = True,
                 p_min: float = 0.0, pools_sleep: bool = False) -> ArmResult:
    """Both servers up (idle, a server does not spin), prompts sent to each in turn: target-only, then drafted, so a
    slow spell hits both arms of a prompt. At T = 0 every answer must equal target-only decoding, or depart at a tie
    (else InexactVerifier, or with raise_inexact=False the departures are only recorded: `check_exact`).

    The predicted speedup is the cost model's at the acceptance measured here: τ ÷ (v(k+1) + c(k)) with the
    calibration's costs, as the loop's cells predict theirs from their own α (with a confidence cut p_min, the
    step cost the calibration measured at that cut). Without a drafter (`draft` None: one of llama.cpp's n-gram
    modes, core/llamacpp.py:DRAFTLESS) and with k None, llama.cpp drafts at its own sizes and nothing is predicted."""
    alone, drafted, ratios, departures = [], [], [], []
    with LlamaServer(target, threads=threads) as base, \
            LlamaServer(target, draft, spec_type, n_max=k, p_min=p_min if draft is not None else None,
                        threads=threads, extra=list(POOLS_SLEEP) if pools_sleep else []) as spec:
        for i, p in enumerate(prompts):
            a, d = answer(base, p, tokens, temperature, seed=i), answer(spec, p, tokens, temperature, seed=i)
            alone.append(a)
            drafted.append(d)
            ratios.append((len(d.tokens) / d.ms) / (len(a.tokens) / a.ms))
            if temperature == 0:
                found = departure(i, p, a.tokens, d.tokens, base, outtype)
                if found is not None:
                    departures.append(found)
                    log(f"  departs at {found.line()}")
    drafts, accepted = sum(d.drafted for d in drafted), sum(d.accepted for d in drafted)
    rate = lambda answers: 1000 * sum(len(x.tokens) for x in answers) / sum(x.ms for x in answers)  # noqa: E731
    result = ArmResult(
        k, temperature, len(prompts), tokens, round(rate(alone), 2), round(rate(drafted), 2),
        round(statistics.median_low(ratios), 3), _rounded(range_of(ratios)), round(accepted / max(drafts, 1), 4),
        round(1 + accepted / sum(d.steps for d in drafted), 4), drafts, accepted,  # τ: the prompt pass's token aside
        None,
        None if temperature else len(prompts) - len(departures), [asdict(x) for x in departures])
    result.p_min = p_min
    result.pools_sleep = pools_sleep
    if calibration is not None and k is not None:
        cost = calibration.sleeping[k] if pools_sleep else calibration.step_cost(k, p_min)
        result.predicted_speedup = round(result.tau / cost, 3)
    if raise_inexact:
        check_exact(result)
    return result


def check_exact(result: ArmResult) -> None:
    """InexactVerifier if an answer departed from target-only decoding where the target's choice was clear."""
    wrong = [Departure(**x) for x in result.departures if not x["tie"]]
    if wrong:
        raise InexactVerifier(f"llama.cpp at k = {result.k}: {len(wrong)} answer(s) departed from target-only decoding "
                              f"at a clear margin, first at {wrong[0].line()}")


class InexactVerifier(SpecdrafterError):
    """A T = 0 answer departed from target-only decoding where the target's choice was clear."""


def _rounded(value: Optional[float]) -> Optional[float]:
    """A spread to 3 places; None stays None (one prompt has no spread)."""
    return None if value is None else round(value, 3)
