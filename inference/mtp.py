"""Chain drafting with a target's own MTP layer (train/mtp.py), as vLLM drafts with it when num_speculative_tokens
exceeds the number of MTP layers: the one layer again at each step, its own state fed back."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from transformers import DynamicCache

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.proposers import Proposal
from specdrafter.inference.sampling import SamplingParams, draw
from specdrafter.train.mtp import MtpLayer, attention_mask


class MtpProposer:
    """The layer's cache holds one entry per position t whose pair (the target's normed h_t, x_{t+1}) it has seen.
    The loop hands over the last layer's output of newly committed positions through `observe` (normed there, as the
    engines hand it over); `propose` feeds them, then k − 1 of its own (state, drafted token) pairs."""

    confidence_length = None  # drafts the k it is asked for

    def __init__(self, layer: MtpLayer, target):
        self.layer = layer.eval()
        self.embed, self.rope = target.get_input_embeddings(), target.model.rotary_emb
        self.norm, self.head = target.model.norm, target.lm_head
        self.feature_layers = [target.config.num_hidden_layers]  # the last layer's output, before the final norm
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.cached = 0  # positions whose pair is in the layer's cache
        self.pending: List[torch.Tensor] = []  # normed target states [n, d] of the positions after them

    @torch.no_grad()
    def observe(self, features: Dict[int, torch.Tensor]) -> None:
        self.pending.append(self.norm(features[self.feature_layers[0]]))  # [n, d]

    def step(self, hidden, ids, positions, mask):
        embeds = self.embed(ids)  # [1, n, d]
        return self.layer(hidden, embeds, self.rope(embeds, positions), positions, mask, self.cache)

    @torch.no_grad()
    def propose(self, committed: List[int], k: int, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> Proposal:
        if not self.pending:
            raise SpecdrafterError("MTP drafting needs the target's state at one position at least (a prompt of >= 2 "
                                   "tokens)")
        hidden = torch.cat(self.pending)[None]  # [1, m, d]
        start, m, device = self.cached, hidden.shape[1], hidden.device
        ids = torch.tensor([committed[start + 1:start + m + 1]], device=device)  # [1, m] x_{t+1} for each position t
        positions = torch.arange(start, start + m, device=device)[None]  # [1, m]
        allowed = torch.ones(m, start + m, dtype=torch.bool, device=device).tril(start)[None, None]  # past + causal
        state, normed = self.step(hidden, ids, positions, attention_mask(allowed, hidden.dtype))
        self.cached, self.pending = start + m, []
        state, normed = state[:, -1:], normed[:, -1:]  # [1, 1, d] predicts the token after the newest committed one
        tokens, rows = [], []
        for step in range(k):
            token, q = draw(self.head(normed)[0, -1].float().cpu(), params, generator)  # q [V] or None (greedy)
            tokens.append(token)
            rows.append(q)
            if step == k - 1:
                break
            position = torch.tensor([[self.cached + step]], device=device)  # the drafted pair's position
            state, normed = self.step(state, torch.tensor([[token]], device=device), position, None)
        return Proposal(torch.tensor(tokens), None if params.greedy else torch.stack(rows))

    def rollback(self, num_committed: int) -> None:
        drafted = self.cache.get_seq_length(self.layer.cache_index) - self.cached
        if drafted:
            self.cache.crop(-drafted)  # rollback: drop the drafted pairs; accepted ones return as target states
