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
