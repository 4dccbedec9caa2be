"""Proposers: what drafts tokens for the speculative loop. A proposer owns its own state (e.g. a KV cache);
the loop tells it which tokens were committed so it can roll back.

Interface (chain proposers):
    proposer.reset()                                   start a new request
    proposer.propose(committed, k, params, generator)  → Proposal of k tokens (+ their q rows)
    proposer.rollback(num_committed)                   drop state beyond the committed prefix
Medusa and EAGLE proposers (training issue) implement the same three calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from data.io import SpecdrafterError
from inference.sampling import SamplingParams, sampling_probs
from inference.tree import TreeShape, tree_attention, tree_positions


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] drafted token ids
    probs: Optional[torch.Tensor]  # [k, V] q rows the tokens were drawn from (None for greedy)


class DraftModelProposer:
    """A small causal LM sharing the target's tokenizer drafts k tokens autoregressively from its own KV cache.

    Cache invariant: it holds the first `cached` committed tokens (all but the newest ones); propose() first
    feeds the committed tokens it has not seen, then k - 1 of its own drafts (the k-th is never fed).
    """

    def __init__(self, model: nn.Module):
        self.model = model.eval()
        self.cache = DynamicCache()
        self.cached = 0

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.cached = 0

    @torch.no_grad()
    def propose(self, committed: List[int], k: int, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> Proposal:
        feed = committed[self.cached:]  # tokens the draft has not seen yet (at least the newest one)
        tokens, rows = [], []
        for step in range(k):
            ids = torch.tensor([feed])  # [1, n]
            logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits[0, -1]  # [V]
            self.cached += len(feed)
            q = sampling_probs(logits, params)  # [V]
            token = int(q.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=generator))
            tokens.append(token)
            rows.append(q)
            feed = [token]
        return Proposal(torch.tensor(tokens), None if params.greedy else torch.stack(rows))

    def rollback(self, num_committed: int) -> None:
        # keep at most the committed prefix minus the newest token (it is fed at the next propose)
        keep = min(self.cached, num_committed - 1)
        self.cache.crop(-(self.cached - keep))  # rollback: drop rejected drafts
        self.cached = keep


def self_draft(target: nn.Module, num_layers: int) -> nn.Module:
    """Training-free baseline drafter: the target's first `num_layers` decoder layers + its final norm and
    lm_head, sharing the target's weights (no copy). A plain HF causal LM, so it also works as
    `assistant_model=` in transformers' assisted generation."""
    layers = target.model.layers
    if not 1 <= num_layers <= len(layers):
        raise SpecdrafterError(f"self-draft num_layers must be in 1..{len(layers)}, got {num_layers}")
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
    parent (deterministic top-k children, verified exactly with `verify_tree_sampling(mode="topk")`).

    Levels are fed to the draft one at a time with tree attention; afterwards the draft cache is cropped back to
    the committed prefix, so the accepted path is re-fed at the next cycle like any committed token.
    """

    @torch.no_grad()
    def propose_tree(self, committed: List[int], shape: TreeShape) -> torch.Tensor:
        """Node tokens [N+1] of `shape` (node 0 = the newest committed token)."""
        tokens = [committed[-1]] + [0] * (shape.size - 1)
        width = 1 + max(c[-1] for c in shape.choices[1:])
        feed = committed[self.cached:]
        root_logits = self.model(input_ids=torch.tensor([feed]), cache=self.cache, use_cache=True,
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
            logits = self.model(input_ids=torch.tensor([tokens[fed:end]]), cache=self.cache, use_cache=True,
                                attention_mask=tree_attention(mask[fed:end, 1:end], past),
                                position_ids=tree_positions(depths[fed:end], past - 1)).logits[0]  # [n, V]
            for row, j in enumerate(range(fed, end)):
                ranked[j] = logits[row].topk(width).indices
            fed = end
        self.cache.crop(-(fed - 1))  # rollback: drop the tree nodes, keep the committed prefix
        return torch.tensor(tokens)
