"""Verifiers: pure functions of tokens and probabilities/logits. No model, no cache, no I/O.

Convention everywhere: **p = target distribution, q = draft distribution** (gpt-fast uses the opposite).
Row alignment of a chain: the target is fed [last_committed, d_1, ..., d_k]; row i-1 scores d_i and row k
gives the bonus distribution. A verdict's emitted tokens are `draft[:num_accepted] + [next_token]`.
Probabilities must come from `inference.sampling.sampling_probs`, applied identically to p and q.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from specdrafter.inference.sampling import sample


@dataclass
class Verdict:
    num_accepted: int
    next_token: int


@dataclass
class TreeVerdict(Verdict):
    accepted_nodes: List[int] = field(default_factory=list)  # tree node indices (root excluded), root to leaf


def _uniform(generator: Optional[torch.Generator]) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)). Its mass is 0 only when p <= q everywhere, i.e. p == q, where rejection has
    probability 0; if rounding still gets us here, p itself is the right distribution to fall back on."""
    r = (p - q).clamp_min(0)
    mass = r.sum()
    return r / mass if mass > 0 else p


# ----------------------------------------------------------------------------------------------- chain
def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy (T = 0): accept d_i while d_i == argmax(row i-1); emit the argmax of the first mismatching row
    (or of row k, the bonus). `draft_tokens` [k], `target_logits` [k+1, V]. argmax takes the first maximum."""
    best = target_logits.argmax(-1)  # [k+1]
    k = draft_tokens.shape[0]
    mismatch = (draft_tokens != best[:k]).nonzero()
    n = int(mismatch[0]) if len(mismatch) else k
    return Verdict(n, int(best[n]))


def verify_sampling(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    generator: Optional[torch.Generator] = None) -> Verdict:
    """Exact speculative sampling (Leviathan et al. 2023): the emitted tokens are distributed exactly as p.

    For i = 1..k accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) (fresh uniform each); at the first
    rejection emit x ~ norm(max(0, p_i - q_i)); if all k are accepted emit the bonus x ~ p_{k+1}.
    `draft_probs` q [k, V], `target_probs` p [k+1, V], float64.
    """
    k = draft_tokens.shape[0]
    u = torch.rand(k, generator=generator, dtype=torch.float64)  # one fresh uniform per position
    p_d = target_probs[:k].gather(1, draft_tokens[:, None]).squeeze(1)  # [k] p_i(d_i)
    q_d = draft_probs.gather(1, draft_tokens[:, None]).squeeze(1)  # [k] q_i(d_i)
    rejected = (u * q_d >= p_d).nonzero()  # u < p/q without dividing; q(d) = 0 accepts iff p(d) > 0
    if len(rejected) == 0:
        return Verdict(k, sample(target_probs[k], generator))
    i = int(rejected[0])
    return Verdict(i, sample(_residual(target_probs[i], draft_probs[i]), generator))


# ------------------------------------------------------------------------------------------------- ASD
@dataclass
class RegretLedger:
    """Regret budget of one request (ASD). Create it after prefill; never reset it between blocks."""
    budget: float
    spent: float = 0.0


def verify_asd(draft_tokens: torch.Tensor, target_logits: torch.Tensor, ledger: RegretLedger, gate: float,
               max_mismatches: int) -> Verdict:
    """Approximate speculative decoding (greedy only; lossy by design, docs/algorithms.md §ASD).

    Regret of draft token x_i: r_i = max_v z_i(v) - z_i(x_i) on raw logits z. Exact matches are free. A
    mismatch is accepted only if it passes all three gates:
      budget  S + r_i <= B and S < B, S = ledger.spent + this block's accepted regret so far
              (strict, so a zero-regret tie is refused at B = 0 and once the budget is used up);
      local   r_i / v_i <= g with suffix value v_i = K - i (g = 0 accepts nothing);
      cap     at most M accepted mismatches in this block.
    The longest contiguous feasible prefix is taken (never skipping an infeasible token); later tokens equal
    to the argmax of their rows (already conditioned on the accepted mismatch) ride along for free. The bonus
    is the argmax of row `num_accepted`. The ledger is charged after the prefix is chosen.
    `draft_tokens` [K], `target_logits` [K+1, V].
    """
    K = draft_tokens.shape[0]
    z = target_logits.to(torch.float64)
    best = z.argmax(-1)  # [K+1], first maximum
    spent_in_block, mismatches, n = 0.0, 0, 0
    for i in range(K):
        x = int(draft_tokens[i])
        if x != int(best[i]):
            regret = float(z[i, best[i]] - z[i, x])
            spent = ledger.spent + spent_in_block
            within_budget = spent < ledger.budget and spent + regret <= ledger.budget
            within_gate = gate > 0 and regret / (K - i) <= gate
            if not (within_budget and within_gate and mismatches < max_mismatches):
                break
            spent_in_block += regret
            mismatches += 1
        n = i + 1
    ledger.spent += spent_in_block
    return Verdict(n, int(best[n]))


# ----------------------------------------------------------------------------------------------- trees
def verify_tree_greedy(parents: Sequence[int], node_tokens: torch.Tensor, target_logits: torch.Tensor) -> TreeVerdict:
    """Greedy tree verification: from the root, descend into the child whose token is the argmax of the current
    node's row; stop where no child matches and emit that argmax. Node 0 is the root (last committed token);
    `parents[j]` is node j's parent (parents[0] = -1); `node_tokens` [N+1]; `target_logits` [N+1, V]."""
    children = _children(parents)
    best = target_logits.argmax(-1)  # [N+1]
    node, path = 0, []
    while True:
        nxt = next((c for c in children[node] if int(node_tokens[c]) == int(best[node])), None)
        if nxt is None:
            return TreeVerdict(len(path), int(best[node]), path)
        node = nxt
        path.append(node)


def verify_tree_sampling(parents: Sequence[int], node_tokens: torch.Tensor, target_probs: torch.Tensor,
                         generator: Optional[torch.Generator] = None) -> TreeVerdict:
    """Exact tree verification at T > 0 for a tree of deterministic top-k children (EAGLE-2/3, Medusa, a draft
    model's static or dynamic tree; docs/algorithms.md §Tree verification): the emitted tokens are distributed
    exactly as p.

    The draft's q is a point mass on each child, so the rule needs only p. At a node, r := p (the node's target row);
    its children are tried in order: accept child c with probability r(c), else r(c) := 0 and renormalise. Accepting
    descends into the child; if all children are rejected, emit x ~ r. At a leaf the bonus is drawn from the leaf's
    row. `target_probs` p [N+1, V], row j for node j.
    """
    children = _children(parents)
    node, path = 0, []
    while True:
        r = target_probs[node]
        accepted = None
        for c in children[node]:
            t = int(node_tokens[c])
            if _uniform(generator) < r[t]:
                accepted = c
                break
            r = r.clone()
            r[t] = 0
            r = r / r.sum() if r.sum() > 0 else target_probs[node]
        if accepted is None:
            return TreeVerdict(len(path), sample(r, generator), path)
        node = accepted
        path.append(node)


def _children(parents: Sequence[int]) -> List[List[int]]:
    children: List[List[int]] = [[] for _ in parents]
    for j, parent in enumerate(parents):
        if j > 0:
            children[parent].append(j)
    return children


# ---------------------------------------------------------------------------------------------- Medusa
def verify_typical(candidates: torch.Tensor, target_logits: torch.Tensor, temperature: float,
                   epsilon: float = 0.09, delta: float = 0.3,
                   generator: Optional[torch.Generator] = None) -> TreeVerdict:
    """Medusa typical acceptance (lossy, not distribution-exact). `candidates` [P, D] are the root-to-leaf
    paths of a static tree (tokens); `target_logits` [P, D+1, V], row i of path j scoring candidates[j, i].

    A token x is accepted iff p(x) > min(epsilon, delta · exp(-H(p))), p = softmax(logits / T),
    H(p) = -Σ p log(p + 1e-5). At T = 0, x is accepted iff it is the argmax. A path's accepted length is the
    cumulative product of its mask; among the longest paths the one with the highest Σ log p wins. The next
    token is sampled from (argmax at T = 0) the row after the last accepted token.
    `accepted_nodes` holds the chosen path's index, and `num_accepted` its accepted length.
    """
    logits = target_logits.to(torch.float64)
    P, D = candidates.shape
    rows = logits[:, :D]  # [P, D, V]
    if temperature == 0:
        mask = candidates == rows.argmax(-1)  # [P, D]
        logp = torch.zeros(P, D, dtype=torch.float64)
    else:
        probs = (rows / temperature).softmax(-1)  # [P, D, V]
        entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)  # [P, D]
        threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
        chosen = probs.gather(-1, candidates.unsqueeze(-1)).squeeze(-1)  # [P, D]
        mask = chosen > threshold
        logp = torch.log(chosen.clamp_min(1e-30))
    accepted = mask.long().cumprod(-1)  # [P, D]
    lengths = accepted.sum(-1)  # [P]
    score = (logp * accepted).sum(-1)  # [P]
    longest = lengths == lengths.max()
    best = int(torch.where(longest, score, torch.full_like(score, float("-inf"))).argmax())
    n = int(lengths[best])
    bonus = logits[best, n]
    next_token = int(bonus.argmax()) if temperature == 0 else sample((bonus / temperature).softmax(-1), generator)
    return TreeVerdict(n, next_token, [best])
