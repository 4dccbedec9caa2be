"""Decoding with a P-EAGLE head (train/peagle.py): one pass of the head drafts up to K tokens.

The head's cache holds the committed (target feature, next token) pairs, as EAGLE-3's (inference/eagle.py). A
proposal feeds the pairs waiting since the last cycle followed by n − 1 masked slots (fc(mask_hidden), the mask
token's embedding) in one causal pass: the last pair's output drafts the first token, slot j the (j + 1)-th. The slots
are rolled back after verification like EAGLE-3's drafted pairs; the accepted tokens come back as target features.

Exactness: draft j is drawn from its own row q_j with fresh randomness, and q_j depends on the committed context
only (no slot reads an earlier draft), so it is also q_j given the drafts before it, the distribution the verifier
divides by. At T = 0 each draft is its row's argmax.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.eagle import EagleProposer, draft_vocab_proposal
from specdrafter.inference.proposers import Proposal
from specdrafter.inference.sampling import SamplingParams, draw
from specdrafter.train.peagle import PEagleHead


class PEagleProposer(EagleProposer):
    """Chain drafting with a P-EAGLE head: min(k, K) drafts from one pass, K the depths it was trained for."""

    def __init__(self, head: PEagleHead, target):
        super().__init__(head, target)
        self.depths = head.num_depths

    @torch.no_grad()
    def propose(self, committed: List[int], k: int, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> Proposal:
        if not self.pending:
            raise SpecdrafterError("P-EAGLE drafting needs target features of at least one position (a prompt of >= 2 "
                                   "tokens)")
        n = min(k, self.depths)
        pairs = torch.cat(self.pending)[None]  # [1, m, d] fused target features of the waiting positions
        start, m, device = self.cached, pairs.shape[1], pairs.device
        ids = torch.tensor([committed[start + 1:start + m + 1]], device=device)  # [1, m] x_{t+1} for each position t
        slot_hidden, slot_embeds = self.head.mask_slots(self.embed, n - 1)  # [1, n − 1, d] each
        hidden = torch.cat([pairs, slot_hidden.to(pairs.dtype)], dim=1)  # [1, m + n − 1, d]
        embeds = torch.cat([self.embed(ids).to(pairs.dtype), slot_embeds.to(pairs.dtype)], dim=1)  # [1, m + n − 1, d]
        new = m + n - 1
        positions = torch.arange(start, start + new, device=device)[None]  # [1, m + n − 1] slot j at t + j
        mask = torch.ones(new, start + new, dtype=torch.bool, device=device).tril(start)[None, None]  # causal
        out, _ = self.head(hidden, embeds, positions, mask, self.cache)  # [1, m + n − 1, d]
        self.cached, self.pending = start + m, []  # the slots stay in the cache until rollback
        logits = self.head.logits(out[0, m - 1:]).float().cpu()  # [n, Vd] row j drafts token j + 1
        draft_ids = self.head.draft_ids.cpu()
        indices, rows = [], []
        for j in range(n):  # each draft from its own row, with fresh randomness
            index, q = draw(logits[j], params, generator)  # q [Vd] or None (greedy)
            indices.append(index)
            rows.append(q)
        return draft_vocab_proposal(indices, rows, draft_ids, self.vocab_size, params.greedy)
