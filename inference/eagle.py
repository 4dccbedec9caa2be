"""The proposers that decode with an EAGLE head (models/eagle.py): chain drafting and EAGLE-2 dynamic trees."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn
from transformers import DynamicCache

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.autotune import TreeSizeTuner
from specdrafter.inference.proposers import Proposal
from specdrafter.inference.sampling import SamplingParams, draw
from specdrafter.inference.tree import TreeShape, grow_dynamic_tree, select_dynamic_tree
from specdrafter.models.eagle import Eagle1Head, Eagle3Head, check_head_fits


class EagleProposer:
    """Chain drafting with an EAGLE-3 (or EAGLE-1) head.

    The head's cache holds one entry per position t whose pair (target feature f_t, next token x_{t+1}) it has
    seen. The loop hands over features of newly committed positions through `observe`; they wait in `pending`
    until the next `propose`, which feeds them, then k − 1 of its own (hidden state, drafted token) pairs.
    """

    confidence_length = None  # drafts the k it is asked for

    def __init__(self, head: nn.Module, target):
        check_head_fits(head, target)
        if isinstance(head, Eagle1Head):
            head.attach(target)
        self.head = head.eval()
        self.embed = target.get_input_embeddings()
        self.vocab_size = target.config.vocab_size
        self.feature_layers = head.aux_layer_ids
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.cached = 0  # positions whose target-feature pair is in the head's cache
        self.pending: List[torch.Tensor] = []  # fused features [n, d] of the positions after them

    @torch.no_grad()
    def observe(self, features: Dict[int, torch.Tensor]) -> None:
        """Features {layer id: [n, d_t]} of the next n committed positions."""
        self.pending.append(self.head.fuse(features))  # [n, d]

    @torch.no_grad()
    def feed_pending(self, committed: List[int]) -> torch.Tensor:
        """Feed the waiting target features with their next tokens; return the last output hidden state [1, 1, d]."""
        if not self.pending:
            raise SpecdrafterError("EAGLE drafting needs target features of at least one position (a prompt of >= 2 tokens)")
        hidden = torch.cat(self.pending)[None]  # [1, m, d]
        start, m = self.cached, hidden.shape[1]
        device = hidden.device
        ids = torch.tensor([committed[start + 1:start + m + 1]], device=device)  # [1, m] x_{t+1} for each position t
        positions = torch.arange(start, start + m, device=device)[None]  # [1, m]
        mask = torch.ones(m, start + m, dtype=torch.bool, device=device).tril(start)[None, None]  # causal over past + new
        out, _ = self.head(hidden, self.embed(ids), positions, mask, self.cache)  # [1, m, d]
        self.cached, self.pending = start + m, []
        return out[:, -1:]

    @torch.no_grad()
    def propose(self, committed: List[int], k: int, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> Proposal:
        hidden = self.feed_pending(committed)  # [1, 1, d] predicts the token after the newest committed one
        position = self.cached  # the first drafted pair sits right after the fed positions
        draft_ids = self.head.draft_ids  # [Vd] target id of each draft-vocabulary entry
        indices, rows = [], []
        for step in range(k):
            # sampled in the draft vocabulary: the other target tokens have q = 0 (logit −inf) anyway
            index, q = draw(self.head.logits(hidden)[0, -1].cpu(), params, generator)  # q [Vd] or None (greedy)
            indices.append(index)
            rows.append(q)
            if step == k - 1:
                break
            token = draft_ids[index:index + 1][None]  # [1, 1]
            hidden, _ = self.head(hidden, self.embed(token), torch.tensor([[position + step]], device=hidden.device),
                                  None, self.cache)
        return draft_vocab_proposal(indices, rows, draft_ids.cpu(), self.vocab_size, params.greedy)

    def rollback(self, num_committed: int) -> None:
        drafted = self.cache.get_seq_length() - self.cached
        if drafted:
            self.cache.crop(-drafted)  # rollback: drop the drafted pairs; accepted ones return as target features


def draft_vocab_proposal(indices: List[int], rows: List[Optional[torch.Tensor]], draft_ids: torch.Tensor,
                         vocab_size: int, greedy: bool) -> Proposal:
    """A proposal drawn in a pruned draft vocabulary, in the target's: the tokens of the draft-vocabulary `indices`,
    and (sampling) each q row [Vd] placed at its tokens' ids of a [k, V] row, the other target tokens at q = 0."""
    tokens = draft_ids[indices]  # [k]
    if greedy:  # no q rows
        return Proposal(tokens, None)
    probs = torch.zeros(len(indices), vocab_size, dtype=torch.float64)
    probs[:, draft_ids] = torch.stack(rows)  # [k, V]
    return Proposal(tokens, probs)


class EagleTreeProposer(EagleProposer):
    """EAGLE-2 dynamic tree drafted by the EAGLE-3 head (docs/algorithms.md §Dynamic trees), with
    `DynamicTreeProposer`'s selection rules: score = cumulative draft log-prob (log-softmax over the draft
    vocabulary) along the path; each depth, every frontier node proposes its top_k children, the top_k of those k²
    become the next frontier; the tree is the `total_tokens` best nodes overall (closed under ancestors; ties
    towards shallower nodes).

    A frontier node at depth d is fed as the pair (output hidden state of its parent — for d = 1 the last output
    of `feed_pending` —, embedding of its token) at position cached + d − 1, seeing the committed pairs and its
    fed ancestors: exactly what the chain proposer feeds for the same path. The tree entries are cropped before
    returning, so the cache again holds only the `cached` committed pairs.
    """

    def __init__(self, head: Eagle3Head, target, depth: int = 5, top_k: int = 8, total_tokens: int = 60):
        if min(depth, top_k, total_tokens) < 1:
            raise SpecdrafterError(f"dynamic tree needs depth, top_k, total_tokens >= 1, got {depth}, {top_k}, {total_tokens}")
        if top_k > len(head.d2t):
            raise SpecdrafterError(f"dynamic tree top_k ({top_k}) exceeds the EAGLE head's draft vocabulary "
                                   f"({len(head.d2t)} tokens)")
        super().__init__(head, target)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.max_tree_size = total_tokens + 1

    @torch.no_grad()
    def propose_tree(self, committed: list[int], sizer: Optional[TreeSizeTuner] = None) -> tuple[TreeShape, torch.Tensor]:
        """The tree's shape and node tokens [N+1] (target ids; node 0 = the newest committed token)."""
        hidden = self.feed_pending(committed)[0]  # [1, d] predicts the depth-1 children
        past = self.cached  # committed pairs in the cache; depth-d nodes sit at position past + d − 1
        draft_ids = self.head.draft_ids  # [Vd] candidates hold draft-vocabulary indices
        outputs = {-1: hidden[0]}  # output hidden state [d] of each fed node: its children's input

        def feed_frontier(frontier, candidates, mask):
            parent_out = torch.stack([outputs[candidates[c].parent] for c in frontier])[None]  # [1, F, d]
            ids = draft_ids[[candidates[c].token for c in frontier]][None]  # [1, F] target ids
            positions = torch.full_like(ids, past + candidates[frontier[0]].depth - 1)  # [1, F]
            seen = torch.cat([mask.new_ones(len(frontier), past), mask], dim=1).to(ids.device)  # [F, S] committed pairs too
            out, _ = self.head(parent_out, self.embed(ids), positions, seen[None, None], self.cache)  # [1, F, d]
            outputs.update(zip(frontier, out[0]))
            return self.head.logits(out[0]).log_softmax(-1)  # [F, Vd]

        levels = sizer.draft_depth(self.depth) if sizer is not None else self.depth
        root_logp = self.head.logits(hidden).log_softmax(-1)  # [1, Vd]
        candidates, fed = grow_dynamic_tree(root_logp, levels, self.top_k, feed_frontier)
        self.cache.crop(-fed)  # rollback: drop the tree nodes, keep the `cached` committed pairs
        shape, keep, self.node_probs = select_dynamic_tree(candidates, self.total_tokens, sizer)
        return shape, torch.tensor([committed[-1]] + draft_ids[[candidates[c].token for c in keep]].tolist())
