"""Decoding with a block drafter (DFlash, DSpark, DFlash2, Domino; models/block.py): one backbone pass drafts the whole
block.

The drafter's cache holds the fused target features of every committed position but the newest, whose features the
target has not produced yet: that token is the block's anchor. The loop hands over the features of the newly
committed positions after each verification (`observe`), so nothing is ever rolled back: the block itself is never
cached.

Exactness (docs/algorithms.md): each draft is drawn from the q row it is verified with, with fresh randomness.
DFlash's rows are the backbone's marginals, drawn independently; DSpark's are the Markov-corrected rows given the
draft drawn before (the anchor for the first), drawn left to right; Domino's are the corrected rows given every draft
drawn before, its GRU state carried from draft to draft. At T = 0 each draft is its row's argmax. How many
drafts are verified is fixed (inference.k), or decided draft by draft from the confidence head before each draft
is drawn (inference/autotune.py:ConfidenceLength) — never from what the target says.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch
from torch import nn

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.autotune import ConfidenceLength
from specdrafter.inference.proposers import Proposal
from specdrafter.inference.sampling import SamplingParams, draw
from specdrafter.models.block import BlockDrafter, check_config


def check_drafter_fits(drafter: BlockDrafter, target: nn.Module) -> None:
    """A drafter trained for another target reads the wrong features: one line naming what differs."""
    c, t = drafter.config, target.config
    if not c.num_target_layers:  # a folder that does not say (speculators'): the ids must fit this target
        c.num_target_layers = t.num_hidden_layers
        check_config(c, f"the {c.variant} drafter on this target")
    for name, ours, theirs in (("num_target_layers", c.num_target_layers, t.num_hidden_layers),
                               ("target_hidden_size", c.target_hidden_size or c.hidden_size, t.hidden_size),
                               ("vocab_size", c.vocab_size, t.vocab_size)):
        if ours != theirs:
            raise SpecdrafterError(f"the {c.variant} drafter was built for a target with {name} = {ours}; this target "
                                   f"has {theirs}")


class BlockProposer:
    """Chain drafting with a DFlash or DSpark drafter: up to min(k, γ) drafts per cycle from one backbone pass."""

    def __init__(self, drafter: BlockDrafter, target: nn.Module, length: Optional[ConfidenceLength] = None):
        check_drafter_fits(drafter, target)
        if length is not None and drafter.confidence_head is None:
            raise SpecdrafterError(f"drafter.block.length=confidence needs a confidence head; this {drafter.variant.name} "
                                   "drafter has none (use drafter.block.length=fixed)")
        self.drafter, self.target = drafter.eval(), target
        self.feature_layers = drafter.feature_layers
        self.confidence_length = length  # Decoder.calibrate measures its v(n) before any request is timed
        self.vocab_size = target.config.vocab_size
        self.head = drafter.draft_head(target)  # the lm_head rows of the draft vocabulary, gathered once
        self.reset()

    def reset(self) -> None:
        self.cache = self.drafter.new_cache()

    @torch.no_grad()
    def observe(self, features: Dict[int, torch.Tensor]) -> None:
        """Features {layer id: [n, d_t]} of the next n committed positions."""
        self.drafter.extend_context(self.cache, torch.cat([features[k] for k in self.feature_layers], -1)[None])

    @torch.no_grad()
    def propose(self, committed: List[int], k: int, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> Proposal:
        if self.cache.length != len(committed) - 1:
            raise SpecdrafterError(f"block drafting needs the target features of every committed position but the "
                                   f"newest ({len(committed) - 1}); it has {self.cache.length}")
        start = time.perf_counter()
        d = self.drafter
        anchor = torch.tensor([committed[-1]], device=d.d2t.device)
        block = d.draft_block(self.cache, anchor, self.target, self.head)  # logits [1, γ, Vd], hidden [1, γ, d]
        draft_ids = d.draft_ids
        prev, indices, rows, confidences = anchor, [], [], []
        state = None  # Domino's GRU state over the anchor and the drafts so far (None for the other variants)
        for j in range(min(k, d.num_drafts)):
            state = d.read(state, prev, self.target)  # [1, 1, g] or None
            logits, confidence = d.heads(block.logits[:, j], block.hidden[:, j], prev, state=state,
                                         draft=j)  # [1, Vd], [1] or None
            if self.confidence_length is not None:
                confidences.append(float(torch.sigmoid(confidence.float())))
                if j and not self.confidence_length.keep(confidences):  # decided before draft j is drawn (always one draft)
                    break
            index, q = draw(logits[0].float().cpu(), params, generator)  # q [Vd] or None (greedy)
            indices.append(index)
            rows.append(q)
            prev = draft_ids[index:index + 1]  # the heads' previous token, a target id
        if self.confidence_length is not None:
            self.confidence_length.update(time.perf_counter() - start)
        tokens = draft_ids.cpu()[indices]  # [n]
        if params.greedy:
            return Proposal(tokens, None)
        probs = torch.zeros(len(indices), self.vocab_size, dtype=torch.float64)
        probs[:, draft_ids.cpu()] = torch.stack(rows)  # [n, V] the q rows in the target's vocabulary
        return Proposal(tokens, probs)

    def rollback(self, num_committed: int) -> None:
        """Nothing to drop: the cache only ever holds committed positions (the loop observes the accepted ones)."""
