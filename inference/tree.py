"""Token trees for tree verification (docs/algorithms.md §Token trees).

Node 0 is the root (the newest committed token); nodes 1..N follow breadth-first, each after its parent.
A tree's shape is `parents` (parents[0] = -1). Static trees come from Medusa-style choice lists; the draft
fills in node tokens each cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Sequence, Tuple

import torch

from specdrafter.core.io import SpecdrafterError


@dataclass(frozen=True)
class TreeShape:
    parents: Tuple[int, ...]  # parents[0] = -1
    choices: Tuple[Tuple[int, ...], ...]  # node j's path of child ranks from the root (() for the root)

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> List[int]:
        return [len(c) for c in self.choices]

    def ancestors_mask(self) -> torch.Tensor:
        """M [N+1, N+1] bool: M[i, j] iff j is i or an ancestor of i (M = I; M[:, 0] = 1; OR in the parent's row)."""
        n = self.size
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask

    def leaf_paths(self) -> List[List[int]]:
        """Root-to-leaf node paths (root excluded): the retrieval indices."""
        has_child = {p for p in self.parents[1:]}
        paths = []
        for j in range(1, self.size):
            if j not in has_child:
                path, node = [], j
                while node > 0:
                    path.append(node)
                    node = self.parents[node]
                paths.append(path[::-1])
        return paths


def tree_from_choices(choices: Sequence[Sequence[int]], num_heads: int | None = None) -> TreeShape:
    """A static tree from choice paths, e.g. [[0], [1], [0, 0], [0, 1]]: path [a, b] is the b-th ranked
    candidate at depth 2 below the a-th ranked candidate at depth 1. Every prefix of a path must be listed.
    `num_heads` (Medusa) bounds the depth: a path longer than the number of heads refers to a missing head."""
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    if not paths or any(len(c) == 0 or min(c) < 0 for c in paths):
        raise SpecdrafterError("tree choices must be non-empty lists of non-negative ranks")
    if num_heads is not None and max(len(c) for c in paths) > num_heads:
        deepest = max(paths, key=len)
        raise SpecdrafterError(f"tree choice {list(deepest)} needs {len(deepest)} draft heads but only {num_heads} exist")
    index = {(): 0}
    parents = [-1]
    for c in paths:
        if c[:-1] not in index:
            raise SpecdrafterError(f"tree choice {list(c)} is listed without its parent {list(c[:-1])}")
        index[c] = len(parents)
        parents.append(index[c[:-1]])
    return TreeShape(tuple(parents), ((),) + tuple(paths))


def tree_from_parents(parents: Sequence[int]) -> TreeShape:
    """A tree given breadth-first parents (each parent listed before its children); a node's choice path
    records its rank among its siblings, so `choices` stays meaningful for dynamic trees too."""
    choices: List[Tuple[int, ...]] = [()]
    siblings: dict = {}
    for j in range(1, len(parents)):
        p = parents[j]
        if not 0 <= p < j:
            raise SpecdrafterError(f"tree node {j} has parent {p}; parents must come first")
        siblings[p] = siblings.get(p, -1) + 1
        choices.append(choices[p] + (siblings[p],))
    return TreeShape(tuple(parents), tuple(choices))


class Candidate(NamedTuple):
    """One node a dynamic-tree proposer drafted (EAGLE-2 expansion)."""
    score: float  # cumulative draft log-prob along the path from the root
    depth: int  # 1 for the root's children
    parent: int  # index of the parent candidate, or −1 for the root
    token: int  # the drafter's vocabulary index


def grow_dynamic_tree(root_logp: torch.Tensor, levels: int, top_k: int,
                      feed: Callable[[List[int], List[Candidate], torch.Tensor], torch.Tensor]) -> Tuple[List[Candidate], int]:
    """EAGLE-2's expansion (docs/algorithms.md §Dynamic trees), shared by every dynamic-tree proposer.

    `root_logp` [1, V]: the draft's log-probs after the newest committed token. Each depth, every frontier node proposes
    its top_k children (score = its own score + the child's log q); the top_k of those k² become the next frontier,
    and `feed(frontier, candidates, mask)` runs them through the drafter in one call and returns their children's
    log-probs [F, V]. `mask` [F, fed + F] says which tree slots each frontier node sees besides the committed past:
    its fed ancestors and itself (slots in feeding order). Every proposed node is a candidate; returns the candidates
    (for `select_dynamic_tree`) and how many nodes were fed (for the drafter's rollback)."""
    candidates: List[Candidate] = []
    frontier, ancestry, fed = [-1], {-1: []}, []
    logp = root_logp
    for depth in range(1, levels + 1):
        top = logp.topk(top_k, dim=-1)
        children = []
        for row, parent in enumerate(frontier):
            base = candidates[parent].score if parent >= 0 else 0.0
            for lp, token in zip(top.values[row].tolist(), top.indices[row].tolist()):
                candidates.append(Candidate(base + lp, depth, parent, token))
                children.append(len(candidates) - 1)
        if depth == levels:
            break
        frontier = sorted(children, key=lambda c: -candidates[c].score)[:top_k]
        slot = {c: i for i, c in enumerate(fed + frontier)}  # tree slot of every fed node, in feeding order
        mask = torch.zeros(len(frontier), len(slot), dtype=torch.bool)  # [F, fed + F]
        for row, c in enumerate(frontier):
            ancestry[c] = ancestry[candidates[c].parent] + [c]
            mask[row, [slot[a] for a in ancestry[c]]] = True
        logp = feed(frontier, candidates, mask)  # [F, V]
        fed += frontier
    return candidates, len(fed)


def select_dynamic_tree(nodes: Sequence[Candidate], total_tokens: int,
                        tuner=None) -> Tuple[TreeShape, List[int], torch.Tensor]:
    """The tree to verify from EAGLE-2 candidates `nodes`: the `total_tokens` best by score (cumulative draft log-prob)
    — closed under ancestors since scores only fall along a path (ties go to shallower nodes) — or the first n of
    them that a `TreeSizeTuner` chooses.
    Returns (shape, the kept candidates in tree order = breadth-first, q [N+1]: each node's conditional draft
    probability, 1 for the root)."""
    ranked = sorted(range(len(nodes)), key=lambda c: (-nodes[c].score, nodes[c].depth))[:total_tokens]
    rank = {-1: -1, **{c: i for i, c in enumerate(ranked)}}
    parent_score = lambda c: nodes[nodes[c].parent].score if nodes[c].parent >= 0 else 0.0  # noqa: E731
    q = torch.tensor([nodes[c].score - parent_score(c) for c in ranked], dtype=torch.float64).exp()  # [m]
    n = tuner.choose([rank[nodes[c].parent] for c in ranked], q) if tuner is not None else len(ranked)
    keep = sorted(ranked[:n], key=lambda c: (nodes[c].depth, c))  # breadth-first: parents before children
    index = {-1: 0, **{c: i + 1 for i, c in enumerate(keep)}}
    shape = tree_from_parents([-1] + [index[nodes[c].parent] for c in keep])
    return shape, keep, torch.cat([torch.ones(1, dtype=torch.float64), q[[rank[c] for c in keep]]])


def cartesian_choices(top_k: Sequence[int]) -> List[List[int]]:
    """Full Cartesian tree: top_k[d] children for every node at depth d (e.g. [3, 2] → 3 + 6 nodes)."""
    out, frontier = [], [[]]
    for k in top_k:
        frontier = [path + [r] for path in frontier for r in range(k)]
        out += frontier
    return out


def tree_allowed(shape_mask: torch.Tensor, past_len: int) -> torch.Tensor:
    """[N+1, past + N+1] bool: every node sees the whole committed past plus itself and its ancestors in the tree."""
    return torch.cat([torch.ones(shape_mask.shape[0], past_len, dtype=torch.bool), shape_mask], dim=1)


def tree_attention(shape_mask: torch.Tensor, past_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """4D additive mask [1, 1, N+1, past + N+1] (0 = attend, -inf = not) of `tree_allowed`. HF Llama accepts it with
    explicit position_ids (a target with sliding-window layers needs models/targets.py:tree_masks)."""
    allowed = tree_allowed(shape_mask, past_len)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def tree_positions(depths: Sequence[int], past_len: int) -> torch.Tensor:
    """position_ids [1, N+1]: a node's position is its depth (number of ancestors) + the committed length."""
    return torch.tensor([depths], dtype=torch.long) + past_len
