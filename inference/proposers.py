"""Proposers: what drafts tokens for the speculative loops. A proposer owns its own state (e.g. a KV cache);
the loop tells it which tokens were committed so it can roll back. `Proposer` and `TreeProposer` below are the
contract; the drafters are this module's draft-model proposers, inference/eagle.py's and inference/medusa.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.autotune import ConfidenceLength, TreeSizeTuner
from specdrafter.inference.sampling import SamplingParams, draw
from specdrafter.inference.tree import TreeShape, grow_dynamic_tree, select_dynamic_tree, tree_attention, tree_positions
from specdrafter.models.targets import Snapshot, check_tree_draft, drop_last, new_cache, snapshot


def device_of(model: nn.Module) -> torch.device:
    """Where a model's weights are: the loops build its inputs there (docs/architecture.md §Devices)."""
    return next(model.parameters()).device


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] drafted token ids
    probs: Optional[torch.Tensor]  # [k, V] q rows the tokens were drawn from (None for greedy)


class Proposer(Protocol):
    """What the chain loop (inference/decode.py:speculative_generate) asks of a drafter."""

    feature_layers: Sequence[int]  # target layer ids whose features `observe` wants (empty: it reads none)
    confidence_length: Optional[ConfidenceLength]  # cuts each block by its confidence (block drafters); None: k drafts

    def reset(self) -> None:
        """Start a new request."""

    def observe(self, features: Dict[int, torch.Tensor]) -> None:
        """Target features {layer id: [n, d]} of the positions just committed (after prefill: the prompt's)."""

    def propose(self, committed: List[int], k: int, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> Proposal:
        """Up to k draft tokens after `committed` (+ the q rows they were drawn from at T > 0). Drafting fewer is
        allowed when the choice depends only on the drafts drawn before (a block drafter's confidence)."""

    def rollback(self, num_committed: int) -> None:
        """Drop every state beyond the committed prefix of `num_committed` tokens."""


class TreeProposer(Proposer, Protocol):
    """What the tree loop (inference/decode.py:tree_speculative_generate) asks of a drafter, besides a Proposer's."""

    max_tree_size: int  # nodes of the largest tree it drafts, root included (the cache room the loop reserves)
    node_probs: torch.Tensor  # [N+1] each node's draft probability in the last tree (read by the tree-size tuner)

    def propose_tree(self, committed: List[int], sizer: Optional[TreeSizeTuner] = None) -> Tuple[TreeShape, torch.Tensor]:
        """The tree's shape and its node tokens [N+1] (node 0 = the newest committed token). A dynamic tree is cut to
        what `sizer` (the decoder's TreeSizeTuner) finds worth verifying; None, or a static tree: all of it."""


class DraftModelProposer:
    """A small causal LM sharing the target's tokenizer drafts k tokens autoregressively from its own KV cache.

    Cache invariant: it holds the first `cached` committed tokens (all but the newest ones); propose() first
    feeds the committed tokens it has not seen, then k - 1 of its own drafts (the k-th is never fed).
    """

    feature_layers: Sequence[int] = ()  # a draft model reads tokens only
    confidence_length = None

    def __init__(self, model: nn.Module):
        self.model = model.eval()
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.cached = 0
        self.saved: Dict[int, Snapshot] = {}  # a recurrent draft: its layers' states after each position fed

    def observe(self, features: Dict[int, torch.Tensor]) -> None:
        pass

    @torch.no_grad()
    def propose(self, committed: List[int], k: int, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> Proposal:
        feed = committed[self.cached:]  # tokens the draft has not seen yet (at least the newest one)
        tokens, rows = [], []
        self.saved.clear()
        for step in range(k):
            ids = torch.tensor([feed], device=device_of(self.model))  # [1, n]
            logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits[0, -1].cpu()  # [V]
            self.cached += len(feed)
            state = snapshot(self.cache)  # None unless the draft has recurrent layers
            if state is not None:
                self.saved[self.cached] = state
            token, q = draw(logits, params, generator)
            tokens.append(token)
            rows.append(q)
            feed = [token]
        return Proposal(torch.tensor(tokens), None if params.greedy else torch.stack(rows))

    def rollback(self, num_committed: int) -> None:
        # keep at most the committed prefix minus the newest token (it is fed at the next propose)
        keep = min(self.cached, num_committed - 1)
        drop_last(self.cache, self.cached - keep, self.saved.get(keep))  # rollback: drop rejected drafts
        self.cached = keep


def self_draft(target: nn.Module, num_layers: int) -> nn.Module:
    """Training-free baseline drafter: the target's first `num_layers` decoder layers + its final norm and
    lm_head, sharing the target's weights (no copy). A plain HF causal LM, so it also works as
    `assistant_model=` in transformers' assisted generation."""
    layers = target.model.layers
    if not 1 <= num_layers <= len(layers):
        raise SpecdrafterError(f"recipe key 'drafter.num_layers': a self-draft is the target's first 1..{len(layers)} "
                               f"layers, got {num_layers}")
    config = AutoConfig.for_model(**{**target.config.to_dict(), "num_hidden_layers": num_layers})
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = nn.ModuleList(layers[:num_layers])
    draft.model.norm = target.model.norm
    draft.model.rotary_emb = target.model.rotary_emb
    draft.lm_head = target.lm_head
    draft.generation_config = target.generation_config
    return draft.eval()


def check_vocabularies(target: nn.Module, draft: nn.Module) -> None:
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise SpecdrafterError(f"draft vocabulary ({vd} tokens) differs from the target's ({vt} tokens); "
                               "a draft model must share the target's tokenizer")


class DraftModelTreeProposer(DraftModelProposer):
    """Drafts a static tree with a draft model: the child of rank r is the draft's r-th most likely token at its
    parent (deterministic top-k children, verified exactly with `verify_tree_sampling`).

    Levels are fed to the draft one at a time with tree attention; afterwards the draft cache is cropped back to
    the committed prefix, so the accepted path is re-fed at the next cycle like any committed token.
    """


    def __init__(self, model: nn.Module, shape: TreeShape):
        check_tree_draft(model.config)
        super().__init__(model)
        self.shape = shape
        self.max_tree_size = shape.size

    @torch.no_grad()
    def propose_tree(self, committed: List[int], sizer: Optional[TreeSizeTuner] = None) -> Tuple[TreeShape, torch.Tensor]:
        """The tree's shape and node tokens [N+1] (node 0 = the newest committed token)."""
        shape = self.shape
        tokens = [committed[-1]] + [0] * (shape.size - 1)
        width = 1 + max(c[-1] for c in shape.choices[1:])
        feed = committed[self.cached:]
        device = device_of(self.model)
        root_logits = self.model(input_ids=torch.tensor([feed], device=device), cache=self.cache, use_cache=True,
                                 logits_to_keep=1).logits[0, -1]  # [V]
        self.cached += len(feed)
        past = self.cached  # the root is now part of the cached past; tree nodes 1.. follow it
        ranked = {0: root_logits.topk(width).indices}  # children by rank: the draft's most likely tokens first
        depths, mask = shape.depths, shape.ancestors_mask()
        fed = 1  # tree nodes [1, fed) are in the draft cache
        for depth in range(1, max(depths) + 1):
            level = [j for j in range(1, shape.size) if depths[j] == depth]
            for j in level:
                tokens[j] = int(ranked[shape.parents[j]][shape.choices[j][-1]])
            end = level[-1] + 1
            if depth == max(depths):  # the deepest level has no children: no need to feed it
                break
            logits = self.model(input_ids=torch.tensor([tokens[fed:end]], device=device), cache=self.cache, use_cache=True,
                                attention_mask=tree_attention(mask[fed:end, 1:end], past).to(device),
                                position_ids=tree_positions(depths[fed:end], past - 1).to(device)).logits[0]  # [n, V]
            for row, j in enumerate(range(fed, end)):
                ranked[j] = logits[row].topk(width).indices
            fed = end
        self.cache.crop(-(fed - 1))  # rollback: drop the tree nodes, keep the committed prefix
        return shape, torch.tensor(tokens)


class DynamicTreeProposer(DraftModelProposer):
    """EAGLE-2 dynamic tree drafted by a draft model (docs/algorithms.md §Dynamic trees): score = cumulative draft
    log-prob along the path. Each depth, every frontier node proposes its top_k children; the top_k of those k²
    become the next frontier; every proposed node is remembered. The tree is the `total_tokens` best nodes overall —
    closed under ancestors since scores only fall along a path (ties broken towards shallower nodes)."""

    def __init__(self, model: nn.Module, depth: int = 5, top_k: int = 8, total_tokens: int = 60):
        if min(depth, top_k, total_tokens) < 1:
            raise SpecdrafterError(f"dynamic tree needs depth, top_k, total_tokens >= 1, got {depth}, {top_k}, {total_tokens}")
        check_tree_draft(model.config)
        super().__init__(model)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.max_tree_size = total_tokens + 1

    @torch.no_grad()
    def propose_tree(self, committed: List[int], sizer: Optional[TreeSizeTuner] = None) -> Tuple[TreeShape, torch.Tensor]:
        feed = committed[self.cached:]
        device = device_of(self.model)
        root = self.model(input_ids=torch.tensor([feed], device=device), cache=self.cache, use_cache=True,
                          logits_to_keep=1).logits[0, -1:]  # [1, V]
        self.cached += len(feed)
        past = self.cached  # a depth-d node sits at position past − 1 + d and sees the committed past

        def feed_frontier(frontier, candidates, mask):
            ids = torch.tensor([[candidates[c].token for c in frontier]], device=device)  # [1, F]
            depth = candidates[frontier[0]].depth
            return self.model(input_ids=ids, cache=self.cache, use_cache=True,
                              attention_mask=tree_attention(mask, past).to(device),
                              position_ids=torch.full_like(ids, past - 1 + depth)).logits[0].log_softmax(-1)  # [F, V]

        levels = sizer.draft_depth(self.depth) if sizer is not None else self.depth
        candidates, fed = grow_dynamic_tree(root.log_softmax(-1), levels, self.top_k, feed_frontier)
        self.cache.crop(-fed)  # rollback: drop the tree nodes, keep the committed prefix
        shape, keep, self.node_probs = select_dynamic_tree(candidates, self.total_tokens, sizer)
        return shape, torch.tensor([committed[-1]] + [candidates[c].token for c in keep])
