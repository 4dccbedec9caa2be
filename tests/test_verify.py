"""Verifiers against the math: handcrafted greedy/ASD/typical cases, and χ² goodness-of-fit at level 1e-4 with
fixed seeds for every sampling verifier (chain and the three tree modes), on marginals and on joint
distributions of the first tokens emitted by toy autoregressive p and q."""

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.sampling import SamplingParams, draw, sample, sampling_probs
from specdrafter.inference.verify import (
    RegretLedger,
    TreeVerdict,
    Verdict,
    verify_asd,
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
    verify_typical,
)

LEVEL = 1e-4


def assert_distribution(counts: Counter, expected: dict, n: int):
    """χ² goodness of fit; cells with expected probability 0 must never occur."""
    for x, c in counts.items():
        assert expected.get(x, 0) > 0, f"emitted {x}, which has probability 0 under p"
    cells = [x for x, pr in expected.items() if pr > 0]
    if len(cells) == 1:
        return
    observed = np.array([counts.get(x, 0) for x in cells], dtype=float)
    exp = np.array([expected[x] for x in cells], dtype=float) * n
    assert abs(observed.sum() - exp.sum()) < 1e-6 * n
    assert chisquare(observed, exp).pvalue > LEVEL


def random_dist(gen, V, zeros=0, params=SamplingParams()):
    logits = torch.randn(V, generator=gen, dtype=torch.float64) * 2
    if zeros:
        logits[torch.randperm(V, generator=gen)[:zeros]] = float("-inf")
    return sampling_probs(logits, params)


# ------------------------------------------------------------------------------------------- sampling
def test_sampling_probs_top_k_top_p_and_greedy():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 2.0])
    assert sampling_probs(logits, SamplingParams(0.0)).tolist() == [1, 0, 0, 0, 0]  # first maximum
    top2 = sampling_probs(logits, SamplingParams(1.0, top_k=2))
    assert (top2 > 0).tolist() == [True, False, False, False, True]
    full = logits.double().softmax(-1)
    nucleus = sampling_probs(logits, SamplingParams(1.0, top_p=0.8))  # 0.39 + 0.39 < 0.8 → the 0.14 joins
    assert (nucleus > 0).tolist() == [True, True, False, False, True]
    torch.testing.assert_close(nucleus[nucleus > 0], full[nucleus > 0] / full[nucleus > 0].sum())
    torch.testing.assert_close(sampling_probs(logits, SamplingParams(2.0)), (logits.double() / 2).softmax(-1))


def test_sample_inverts_the_cdf_exactly_and_never_draws_a_zero():
    """The CDF-inversion sampler that replaced torch.multinomial in the verifiers and drafts: χ² against p,
    unnormalised input accepted, zero-probability entries (including the last ones) never drawn."""
    gen = torch.Generator().manual_seed(11)
    p = random_dist(gen, 12, zeros=4)
    p[-1] = 0.0
    n = 20000
    counts = Counter(sample(p * 3.7, gen) for _ in range(n))
    assert_distribution(counts, {i: float(v) / float(p.sum()) for i, v in enumerate(p)}, n)
    assert sample(torch.tensor([0.0, 0.0, 1.0, 0.0]), gen) == 2


def test_draw_is_argmax_when_greedy_and_samples_q_otherwise():
    gen = torch.Generator().manual_seed(3)
    logits = torch.tensor([0.5, 2.0, 2.0, -1.0])
    assert draw(logits, SamplingParams(0.0)) == (1, None)  # first maximum, no probabilities built
    token, q = draw(logits, SamplingParams(0.7, top_k=2), gen)
    torch.testing.assert_close(q, sampling_probs(logits, SamplingParams(0.7, top_k=2)))
    assert token in (1, 2)


@pytest.mark.parametrize("kwargs,word", [({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                         ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k")])
def test_bad_sampling_params_are_refused(kwargs, word):
    with pytest.raises(SpecdrafterError, match=word):
        SamplingParams(**kwargs)


# --------------------------------------------------------------------------------------------- greedy
def test_verify_greedy_row_alignment_ties_and_bonus():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0],  # row 0 scores d_1: tie of tokens 1 and 2 → the first maximum, 1
                           [9.0, 0.0, 0.0, 0.0],  # row 1 scores d_2: argmax 0
                           [0.0, 1.0, 2.0, 3.0],  # row 2 scores d_3: argmax 3
                           [4.0, 0.0, 4.0, 0.0]])  # row 3: the bonus row, tie of 0 and 2 → 0
    assert verify_greedy(torch.tensor([1, 0, 3]), logits) == Verdict(3, 0)  # all accepted: the bonus row's argmax
    # d_1..d_j match rows 0..j-1, d_{j+1} fails at row j: j accepted, then row j's argmax — never row j+1's, and the
    # later drafts (equal to their rows' argmax) are not accepted past the mismatch
    assert verify_greedy(torch.tensor([0, 0, 3]), logits) == Verdict(0, 1)
    assert verify_greedy(torch.tensor([3, 0, 3]), logits) == Verdict(0, 1)
    assert verify_greedy(torch.tensor([1, 2, 3]), logits) == Verdict(1, 0)
    assert verify_greedy(torch.tensor([1, 3, 3]), logits) == Verdict(1, 0)
    assert verify_greedy(torch.tensor([1, 0, 2]), logits) == Verdict(2, 3)
    assert verify_greedy(torch.tensor([1, 0, 0]), logits) == Verdict(2, 3)
    # ties: the second maximal index is not the argmax, even with an equal logit
    assert verify_greedy(torch.tensor([2, 0, 3]), logits) == Verdict(0, 1)
    assert verify_greedy(torch.tensor([1, 0, 3, 2]), torch.cat([logits, logits[3:]])) == Verdict(3, 0)
    # k = 1: row 0 scores the only draft, row 1 is the bonus
    assert verify_greedy(torch.tensor([1]), logits[:2]) == Verdict(1, 0)
    assert verify_greedy(torch.tensor([2]), logits[1:3]) == Verdict(0, 0)


# ----------------------------------------------------------------------------------- chain, exactness
def emitted_first_token(p, q, gen, n, extra_rows=1):
    """Draw d ~ q, verify k = 1, record the first emitted token."""
    counts = Counter()
    target = torch.stack([p, p])  # the bonus row is irrelevant to the first token
    for _ in range(n):
        d = torch.multinomial(q, 1, generator=gen)
        v = verify_sampling(d, q.unsqueeze(0), target, gen)
        counts[int(d[0]) if v.num_accepted else v.next_token] += 1
    return counts


@pytest.mark.parametrize("case", range(8))
def test_chain_first_token_is_distributed_as_p(case):
    gen = torch.Generator().manual_seed(100 + case)
    V = 6
    params = [SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_p=0.7), SamplingParams(0.5)][case % 4]
    p = random_dist(gen, V, zeros=case % 3, params=params)
    q = p.clone() if case == 5 else random_dist(gen, V, zeros=(case + 1) % 3, params=params)  # p == q included
    n = 100_000 if case == 0 else 20_000
    assert_distribution(emitted_first_token(p, q, gen, n), dict(enumerate(p.tolist())), n)


def test_chain_acceptance_rate_is_one_minus_total_variation():
    gen = torch.Generator().manual_seed(7)
    p, q = random_dist(gen, 5, 1), random_dist(gen, 5, 2)
    n, accepted = 50_000, 0
    for _ in range(n):
        d = torch.multinomial(q, 1, generator=gen)
        accepted += verify_sampling(d, q.unsqueeze(0), torch.stack([p, p]), gen).num_accepted
    alpha = float(torch.minimum(p, q).sum())
    assert abs(accepted / n - alpha) < 4.5 * (alpha * (1 - alpha) / n) ** 0.5  # ~1e-5 two-sided


def toy_models(seed, V, params=SamplingParams()):
    """First-order autoregressive p and q: row s = distribution of the next token after token s (s = V: start)."""
    gen = torch.Generator().manual_seed(seed)
    P = torch.stack([random_dist(gen, V, zeros=s % 2, params=params) for s in range(V + 1)])
    Q = torch.stack([random_dist(gen, V, zeros=(s + 1) % 2, params=params) for s in range(V + 1)])
    return P, Q, gen


def joint_of_p(P, V, length):
    out = {}
    for seq in itertools.product(range(V), repeat=length):
        prob, state = 1.0, V
        for t in seq:
            prob *= float(P[state, t])
            state = t
        out[seq] = prob
    return out


@pytest.mark.parametrize("k,params", [(2, SamplingParams()), (3, SamplingParams(top_k=3))])
def test_chain_joint_of_three_tokens_matches_p(k, params):
    V, length, n = 4, 3, 30_000
    P, Q, gen = toy_models(11 + k, V, params)
    counts = Counter()
    for _ in range(n):
        out, state = [], V
        while len(out) < length:
            draft, s = [], state
            for _ in range(k):
                s = int(torch.multinomial(Q[s], 1, generator=gen))
                draft.append(s)
            rows_p = P[[state] + draft]  # row i scores draft i (+ bonus row k)
            rows_q = Q[[state] + draft[:-1]]
            v = verify_sampling(torch.tensor(draft), rows_q, rows_p, gen)
            out += draft[:v.num_accepted] + [v.next_token]
            state = out[-1]
        counts[tuple(out[:length])] += 1
    assert_distribution(counts, joint_of_p(P, V, length), n)


# ------------------------------------------------------------------------------------ trees, exactness
TREE = [-1, 0, 0, 0, 1, 1, 2, 3]  # root with 3 children; they have 2, 1 and 1 children


def draft_children(q, n, mode, gen):
    if mode == "iid":
        return torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    if mode == "without_replacement":
        return torch.multinomial(q, n, replacement=False, generator=gen).tolist()
    return torch.topk(q, n).indices.tolist()  # deterministic top-k


def tree_cycle(P, Q, state, mode, gen):
    """Draft TREE from Q (children per node drawn per `mode`), verify against P, return the emitted tokens."""
    children = {}
    for j, parent in enumerate(TREE[1:], 1):
        children.setdefault(parent, []).append(j)
    tokens = [state] + [0] * (len(TREE) - 1)
    for node in range(len(TREE)):  # breadth-first order: a node's token is known before its children
        kids = children.get(node, [])
        if kids:
            support = int((Q[tokens[node]] > 0).sum())
            if mode != "iid" and len(kids) > support:
                raise AssertionError("test tree wider than the draft support")
            for c, t in zip(kids, draft_children(Q[tokens[node]], len(kids), mode, gen)):
                tokens[c] = t
    if mode == "topk":  # the rule decoding uses
        v = verify_tree_sampling(TREE, torch.tensor(tokens), P[tokens], gen)
    else:
        v = tree_sampling_with_drawn_children(TREE, torch.tensor(tokens), P[tokens], Q[tokens], mode, gen)
    return [tokens[j] for j in v.accepted_nodes] + [v.next_token]


def tree_sampling_with_drawn_children(parents, node_tokens, target_probs, draft_probs, mode, gen) -> TreeVerdict:
    """The two exact rules for trees whose children are drawn from q rather than chosen as its top-k (no drafter of
    ours drafts such trees; kept as references beside the rule decoding uses). At a node r := p, children in order:
      "iid"                  children drawn i.i.d. from q (SpecInfer): accept c if U·q(c) <= r(c), else
                             r := norm(max(0, r - q)); duplicates are not merged, each rejection updates r.
      "without_replacement"  (recursive rejection sampling): accept c if U·q_j(c) < r(c), else
                             r := norm(max(0, r - q_j)) and q_{j+1} := q_j with c zeroed, renormalised.
    `draft_probs` [N+1, V] holds, at row j, the q node j's children were drawn from."""
    children = {}
    for j, parent in enumerate(parents[1:], 1):
        children.setdefault(parent, []).append(j)
    node, path = 0, []
    while True:
        r, q, accepted = target_probs[node], draft_probs[node], None
        for c in children.get(node, []):
            t, u = int(node_tokens[c]), float(torch.rand((), generator=gen, dtype=torch.float64))
            if (u * q[t] <= r[t]) if mode == "iid" else (u * q[t] < r[t]):
                accepted = c
                break
            residual = (r - q).clamp_min(0)  # norm(max(0, r - q)); mass 0 only where r == q: keep r
            r = residual / residual.sum() if residual.sum() > 0 else r
            if mode == "without_replacement":
                q = q.clone()
                q[t] = 0
                q = q / q.sum() if q.sum() > 0 else q
        if accepted is None:
            return TreeVerdict(len(path), sample(r, gen), path)
        node = accepted
        path.append(node)


@pytest.mark.parametrize("mode", ["iid", "without_replacement", "topk"])
def test_tree_joint_of_two_tokens_matches_p(mode):
    V, length, n = 5, 2, 30_000
    P, Q, gen = toy_models({"iid": 1, "without_replacement": 2, "topk": 3}[mode], V)
    Q = (Q + 0.02) / (Q + 0.02).sum(-1, keepdim=True)  # full draft support, so 3 distinct children exist
    counts = Counter()
    for _ in range(n):
        out, state = [], V
        while len(out) < length:
            out += tree_cycle(P, Q, state, mode, gen)
            state = out[-1]
        counts[tuple(out[:length])] += 1
    assert_distribution(counts, joint_of_p(P, V, length), n)


@pytest.mark.parametrize("mode", ["iid", "without_replacement", "topk"])
def test_tree_first_token_with_masks_and_p_equal_q(mode):
    V, n = 6, 20_000
    for seed, params in [(21, SamplingParams(top_k=4)), (22, SamplingParams(top_p=0.8))]:
        P, Q, gen = toy_models(seed, V, params)
        Q = P.clone() if seed == 21 else Q  # p == q: rejection must never reach an empty residual
        if mode != "iid":  # these modes need 3 distinct children: give q full support (p keeps its masks)
            Q = (Q + 0.05) / (Q + 0.05).sum(-1, keepdim=True)
        counts = Counter(tree_cycle(P, Q, V, mode, gen)[0] for _ in range(n))
        assert_distribution(counts, dict(enumerate(P[V].tolist())), n)


def test_tree_greedy_follows_the_argmax_path():
    parents = [-1, 0, 0, 1, 2]
    tokens = torch.tensor([9, 3, 4, 1, 2])
    logits = torch.zeros(5, 6)
    logits[0, 4] = 1  # root prefers 4 → node 2
    logits[2, 2] = 1  # node 2 prefers 2 → node 4
    logits[4, 5] = 1  # node 4 (leaf) bonus 5
    v = verify_tree_greedy(parents, tokens, logits)
    assert (v.num_accepted, v.next_token, v.accepted_nodes) == (2, 5, [2, 4])
    logits[2] = 0
    logits[2, 0] = 1  # no child of node 2 matches
    v = verify_tree_greedy(parents, tokens, logits)
    assert (v.num_accepted, v.next_token, v.accepted_nodes) == (1, 0, [2])


# ------------------------------------------------------------------------------------------------ ASD
def asd_logits(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_asd_with_zero_budget_is_strict_greedy_even_on_ties():
    logits = asd_logits([[1, 1, 0], [0, 2, 0], [0, 0, 3]])  # row 0: tie between 0 and 1 (argmax = 0)
    for budget, gate, cap in [(0.0, 0.25, 2), (8.0, 0.0, 2), (8.0, 0.25, 0)]:
        v = verify_asd(torch.tensor([1, 1]), logits, RegretLedger(budget), gate, cap)  # token 1: zero regret
        assert (v.num_accepted, v.next_token) == (verify_greedy(torch.tensor([1, 1]), logits).num_accepted, 0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randint(0, 3, (4, 5), generator=gen).double()  # many ties
        draft = torch.randint(0, 5, (3,), generator=gen)
        assert verify_asd(draft, logits, RegretLedger(0.0), 0.25, 2) == verify_greedy(draft, logits)


def test_asd_accepts_a_cheap_mismatch_and_reuses_the_suffix():
    # K = 4. Row 0: draft 1 has regret 0.5 (v_0 = 4 → 0.125 <= 0.25); rows 1-3 match; bonus = argmax row 4.
    logits = asd_logits([[2.0, 1.5, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 7]])
    ledger = RegretLedger(8.0)
    v = verify_asd(torch.tensor([1, 2, 1, 0]), logits, ledger, 0.25, 2)
    assert (v.num_accepted, v.next_token) == (4, 2) and ledger.spent == pytest.approx(0.5)


def test_asd_local_gate_uses_the_suffix_value():
    logits = asd_logits([[0, 0, 0], [2.0, 1.0, 0], [0, 0, 1]])  # draft 1 at i = 1: regret 1, v_1 = K - 1 = 1
    v = verify_asd(torch.tensor([0, 1]), logits, RegretLedger(8.0), 0.25, 2)
    assert (v.num_accepted, v.next_token) == (1, 0)  # 1 / 1 > 0.25: stop at i = 1
    v = verify_asd(torch.tensor([0, 1]), logits, RegretLedger(8.0), 1.0, 2)
    assert (v.num_accepted, v.next_token) == (2, 2)


def test_asd_budget_exhausts_exactly_and_the_ledger_persists_across_blocks():
    logits = asd_logits([[1.0, 0, 0], [1.0, 0, 0], [1.0, 0, 0], [0, 0, 1]])  # every mismatch costs 1
    ledger = RegretLedger(2.0)
    v = verify_asd(torch.tensor([1, 1, 1]), logits, ledger, 1.0, 3)
    assert (v.num_accepted, v.next_token, ledger.spent) == (2, 0, 2.0)  # the third would exceed B
    v = verify_asd(torch.tensor([1, 0, 0]), logits, ledger, 1.0, 3)  # next block, same request
    assert (v.num_accepted, ledger.spent) == (0, 2.0)  # budget used up: even the first mismatch is refused
    tie = asd_logits([[1.0, 1.0], [0, 1]])
    v = verify_asd(torch.tensor([1]), tie, ledger, 1.0, 3)
    assert v.num_accepted == 0  # a zero-regret tie is refused once the budget is exactly used up


def test_asd_cap_and_no_skipping_past_an_infeasible_token():
    logits = asd_logits([[0.2, 0, 0], [0.2, 0, 0], [0.2, 0, 0], [0, 0, 1]])
    v = verify_asd(torch.tensor([1, 1, 1]), logits, RegretLedger(8.0), 1.0, 2)
    assert v.num_accepted == 2  # cap M = 2
    expensive = asd_logits([[0, 0, 0], [9.0, 0, 0], [0, 0, 0], [0, 0, 1]])
    v = verify_asd(torch.tensor([0, 1, 0]), expensive, RegretLedger(8.0), 0.25, 2)
    assert (v.num_accepted, v.next_token) == (1, 0)  # token 2 matches, but the infeasible token 1 stops the prefix


# --------------------------------------------------------------------------------------------- typical
def test_typical_acceptance_threshold_longest_path_and_score():
    V = 4
    confident = torch.tensor([8.0, 0, 0, 0])  # low entropy: threshold = min(eps, delta e^-H) = eps; only token 0 passes
    mixed = torch.tensor([0.0, 0, 1, -9])  # p ≈ (0.212, 0.212, 0.576, 2.6e-5), H ≈ 0.976: min(0.09, 0.113) = 0.09
    named = lambda t: torch.eye(V)[t] * 50  # noqa: E731  a bonus row that names its path: p(t) = 1 - 3e-22
    paths = {(0, 1): [confident, mixed, named(0)],  # length 2, Σ log p = log p(0) + log 0.212
             (0, 2): [confident, mixed, named(3)],  # length 2, Σ log p = log p(0) + log 0.576: the winner
             (0, 3): [confident, mixed, named(1)],  # length 1 (p(3) < 0.09): the highest Σ log p, but shorter
             (3, 0): [confident, confident, named(2)]}  # length 0
    for order in ([(0, 1), (0, 2), (0, 3), (3, 0)], [(0, 2), (3, 0), (0, 3), (0, 1)]):  # the winner 2nd, then 1st
        candidates = torch.tensor(order)
        logits = torch.stack([torch.stack(paths[c]) for c in order])  # [P, D+1, V]
        v = verify_typical(candidates, logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
        assert (v.num_accepted, v.accepted_nodes, v.next_token) == (2, [order.index((0, 2))], 3)
        greedy = verify_typical(candidates, logits, temperature=0.0)  # typical iff argmax: only (0, 2) is whole
        assert (greedy.num_accepted, greedy.accepted_nodes, greedy.next_token) == (2, [order.index((0, 2))], 3)
    # the threshold is min(eps, delta · e^-H): a flat row (p = 0.25, e^-H = 1/4) against the three ways it can fall
    flat = torch.zeros(V)
    candidates, logits = torch.tensor([[0, 1]]), torch.stack([confident, flat, named(0)])[None]
    for eps, delta, accepted in [(0.09, 0.3, 2), (0.5, 1.2, 1), (0.2, 1.2, 2), (0.5, 0.9, 2), (0.26, 2.0, 1)]:
        v = verify_typical(candidates, logits, 1.0, eps, delta, torch.Generator().manual_seed(0))
        assert v.num_accepted == accepted, (eps, delta)
