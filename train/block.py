"""Training a block drafter (DFlash, DSpark, DFlash2, Domino; models/block.py, docs/block-drafters.md).

Each sequence of a batch gets up to `drafter.block.anchors` blocks, at anchor positions a sampled uniformly among
those whose next token is target-generated too (loss_mask[a] and loss_mask[a + 1]). All blocks of the batch go
through the drafter in one pass (models/block.py:BlockAttention: block b sees the context before its anchor
and its own slots). Draft j of a block predicts x_{a+1+j}, so it is compared with the target's row a + j — the same
Prediction every other kind makes (train/drafters.py), one per draft position ("draft1", "draft2", ...), weighted
exp(−j / loss_decay). A draft is counted only while the tokens x_{a+1..a+1+j} are all target-generated (a
contiguous supervised prefix): past a prompt token, what the block should have drafted is not the target's.
With drafter.block.loss_weighting=dpace each counted draft's rows are weighted by D-PACE instead
(train/objectives.py:dpace_weights, from the draft's probability of x_{a+1+j}; docs/algorithms.md#d-pace).

DSpark's Markov head is teacher-forced on the true previous token; its confidence head learns the acceptance of its
draft, BCE(σ(c_j), 1 − TV(p_j, q_j)) with TV at the training temperature and detached, added to the loss with
weight `drafter.block.confidence_weight`.

DFlash2's logits train as DFlash's; its candidate selector adds a K-way CE of the true token among the draft's top-K
candidates, scored after the true previous token (`selector_loss`), weighted drafter.block.selector_weight × the
draft's exp(−j / loss_decay).

Domino's drafts are its corrected logits, the GRU teacher-forced on the true tokens before each draft. While
λ = drafter.block.base_weight · max(0, 1 − step / (base_decay · steps)) is above 0, each corrected draft's objective is
weighted (1 − λ) and its uncorrected backbone logits get the same objective as a prediction of their own, "base{j+1}",
weighted λ — SpecForge's (1 − λ)·CE(final) + λ·CE(base), which first trains the backbone alone (`at_step`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import List, Tuple

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from specdrafter.core.io import SpecdrafterError
from specdrafter.models.block import (
    BlockDrafter,
    Variant,
    block_config,
    copy_target_layers,
    token_windows,
)
from specdrafter.models.block_folders import save_block_drafter
from specdrafter.train.batches import Batch
from specdrafter.train.drafters import MASTER_DTYPE, Prediction, TargetOutput
from specdrafter.train.eagle import build_draft_vocab
from specdrafter.train.objectives import acceptance, dpace_weights


def drafter_config(cfg: DictConfig, target_config, variant: Variant):
    """The recipe's drafter.block as a models/block.py config for `target_config` (checked there, one line)."""
    b = cfg.drafter.block
    return block_config(target_config, variant, num_layers=b.num_layers, block_size=b.block_size,
                        aux_layer_ids=list(b.aux_layer_ids) or None, mask_token_id=b.mask_token_id,
                        markov_rank=b.markov_rank if variant.heads else 0,
                        draft_vocab_size=b.draft_vocab_size, num_features=b.num_features,
                        selector=dict(conv_kernel_size=b.conv_kernel_size, conv_group_size=b.conv_group_size,
                                      selector_rank=b.selector_rank, selector_top_k=b.selector_top_k),
                        correction=dict(gru_hidden_dim=b.gru_hidden_dim, emb_dim=b.correction_dim,
                                        pure_draft_prefix_len=b.uncorrected_drafts))


def sample_anchors(loss_mask: torch.Tensor, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` anchors per sequence, uniformly without replacement among the positions t with loss_mask[t] and
    loss_mask[t + 1], sorted (torch's global RNG: a resumed run draws the same ones). Returns (anchors [B, N], valid
    [B, N] bool) with N = min(count, T − 1); a sequence with fewer candidates has invalid entries at anchor 0."""
    mask = loss_mask.bool()
    candidate = mask[:, :-1] & mask[:, 1:]  # [B, T−1]
    N = min(count, candidate.shape[1])
    score = torch.rand(candidate.shape, device=mask.device).masked_fill(~candidate, -1.0)  # [B, T−1]
    top, at = score.topk(N, dim=1)  # [B, N]
    valid = top >= 0
    at = torch.where(valid, at, at.new_full((), candidate.shape[1]))  # invalid ones sort last
    at, order = at.sort(dim=1)
    valid = valid.gather(1, order)
    return at.masked_fill(~valid, 0), valid


class BlockTrainingDrafter:
    """A DFlash or DSpark drafter for training: built from the target (its last layers copied in where the tensors
    fit, and a pruned vocabulary counted from the data), its predictions per draft position, and its folder."""

    def __init__(self, cfg: DictConfig, target: nn.Module, variant: Variant, data=None, tokenizer=None):
        b = cfg.drafter.block
        config = drafter_config(cfg, target.config, variant)
        module = BlockDrafter(config).to(MASTER_DTYPE)
        if b.init_from_target:
            copy_target_layers(module, target)
        V, Vd = config.vocab_size, config.draft_vocab_size or config.vocab_size
        if data is not None:
            check_mask_token(config.mask_token_id, data, tokenizer)
            if Vd < V:
                d2t, _ = build_draft_vocab(data.target_tokens(), V, Vd)
                module.set_draft_vocab(d2t + torch.arange(Vd))
        self.module, self.target = module, target
        self.teacher_ids = module.draft_ids if Vd < V else None  # the teacher's rows the loss needs (run_target)
        self.anchors, self.decay, self.confidence_weight = b.anchors, b.loss_decay, b.confidence_weight
        self.confidence_decay, self.confidence_detach = b.confidence_decay, b.confidence_detach
        self.temperature = cfg.train.temperature
        self.dpace_alpha = b.dpace_alpha if b.loss_weighting.value == "dpace" else None
        self.selector_weight = b.selector_weight if module.candidate_selector is not None else 0.0
        self.prediction_names = [f"draft{j + 1}" for j in range(module.num_drafts)]
        # Domino: the uncorrected logits' decaying share λ (`at_step`), a prediction "base{j+1}" of each corrected
        # draft (logged beside the drafts' losses; the held-out α̂ are the drafts', as decoding draws them)
        self.base_start, self.base_decay = (b.base_weight, b.base_decay) if module.prefix_gru is not None else (0, 0)
        self.base = self.base_start  # λ at this step
        self.corrected = range(config.pure_draft_prefix_len, module.num_drafts) if self.base_start else range(0)
        # jobs/train.py:param_groups: the Markov head's sparse embedding learns at markov_lr_scale × train.lr
        self.lr_scales = {"markov_head.": b.markov_lr_scale} if module.markov_head is not None else {}
        self.lr_holds = {"markov_head.": b.markov_hold} if module.markov_head is not None else {}

    def at_step(self, step: int, total: int) -> None:
        """Domino's λ at optimizer step `step` of `total` (jobs/train.py calls it before each step, a resumed run
        too): base_weight, falling linearly to 0 at base_decay · total, then 0 (SpecForge's linear_lambda_base)."""
        progress = min(step / max(1, int(total * self.base_decay)), 1.0)
        self.base = self.base_start * (1.0 - progress)

    def weight(self, j: int) -> float:
        """Draft j's share of the loss (0-based): exp(−j / loss_decay), or 1 with loss_decay 0."""
        return math.exp(-j / self.decay) if self.decay else 1.0

    def confidences(self, module, logits, ids, anchors, supervised) -> torch.Tensor:
        """q [B, N, γ]: each supervised draft's probability (at T = 1, as the peers') of the block's true token
        x_{a+1+j}, detached; 0 where a pruned vocabulary lacks that token, and at unsupervised slots."""
        γ = logits.shape[2]
        at = (anchors[..., None] + 1 + torch.arange(γ, device=ids.device)).clamp(max=ids.shape[1] - 1)  # [B, N, γ]
        tokens = ids.gather(1, at.flatten(1)).view_as(at)  # [B, N, γ]
        if self.teacher_ids is not None:  # target id → draft row, −1 outside the draft vocabulary
            lookup = torch.full((module.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
            lookup[module.draft_ids] = torch.arange(len(module.draft_ids), device=ids.device)
            tokens = lookup[tokens]
        token = tokens[supervised]  # [R]
        log_q = logits[supervised].detach().float().log_softmax(-1)  # [R, Vd]
        q = log_q.gather(-1, token.clamp_min(0)[:, None])[:, 0].exp()  # [R]
        out = torch.zeros(supervised.shape, device=ids.device)  # [B, N, γ]
        out[supervised] = torch.where(token >= 0, q, 0.0)
        return out

    def predictions(self, module, batch: Batch, target: TargetOutput) -> List[Prediction]:
        ids = batch.input_ids
        anchors, valid = sample_anchors(batch.loss_mask, self.anchors)  # [B, N]
        context = module.context_features(target.features)  # [B, T, m·d_t]
        prev = module.teacher_prev(ids, anchors)  # [B, N, γ] the true previous tokens (DSpark's heads)
        drafts = module(context, module.block_inputs(ids, anchors), anchors, self.target, prev,
                        detach_confidence=self.confidence_detach)
        γ = module.num_drafts
        # draft j counts while x_{a+1..a+1+j} are all target-generated: a contiguous supervised prefix
        supervised = token_windows(batch.loss_mask, anchors, 1, γ, 0).cumprod(-1).bool() & valid[..., None]  # [B, N, γ]
        rows = anchors[..., None] + torch.arange(γ, device=ids.device)  # [B, N, γ] the target's row a + j
        row_weights = None  # [B, N, γ] D-PACE's
        if self.dpace_alpha is not None:
            q = self.confidences(module, drafts.logits, ids, anchors, supervised)
            row_weights = dpace_weights(q, supervised, self.dpace_alpha)
        out = []
        for j in range(γ):
            b, n = supervised[..., j].nonzero(as_tuple=True)
            index = target.row_index[b, rows[b, n, j]]  # [R_j] into the target's logits
            draft = drafts.logits[b, n, j]  # [R_j, Vd]
            teacher = target.logits[index]  # [R_j, V] (or [R_j, Vd] with a pruned vocabulary's teacher rows)
            lse = target.lse[index] if target.lse is not None else None  # [R_j] with a pruned vocabulary
            confidence = None
            if drafts.confidence is not None and self.confidence_weight:
                accept = acceptance(teacher, draft.detach(), self.temperature, lse)  # [R_j] α of each draft
                scale = self.confidence_weight * (self.weight(j) if self.confidence_decay else 1.0)
                confidence = scale * F.binary_cross_entropy_with_logits(
                    drafts.confidence[b, n, j].float(), accept) if len(b) else draft.sum() * 0.0
            selector = None
            if self.selector_weight:
                selector = self.selector_weight * self.weight(j) * selector_loss(
                    module, draft, drafts.hidden[b, n, j], prev[b, n, j], ids[b, rows[b, n, j] + 1])
            pruned = self.teacher_ids is not None
            weight = self.weight(j) if row_weights is None else 1.0  # D-PACE's row weights replace the decay
            base = self.base if j in self.corrected else 0.0  # Domino's share of the uncorrected logits
            out.append(Prediction(f"draft{j + 1}", (1 - base) * weight, draft, teacher,
                                  module.draft_ids if pruned else None,
                                  # as EAGLE-3: rows whose top token the draft vocabulary lacks teach it nothing useful
                                  loss_rows=target.top_in_vocab[index] if pruned else None,
                                  target_lse=lse, confidence_loss=confidence, selector_loss=selector,
                                  row_weights=None if row_weights is None else row_weights[b, n, j]))
        for j in self.corrected:  # Domino (full vocabulary): the backbone's own logits of the corrected drafts
            b, n = supervised[..., j].nonzero(as_tuple=True)
            out.append(Prediction(f"base{j + 1}", self.base * (self.weight(j) if row_weights is None else 1.0),
                                  drafts.base[b, n, j], target.logits[target.row_index[b, rows[b, n, j]]],
                                  row_weights=None if row_weights is None else row_weights[b, n, j]))
        return out

    def save(self, module, folder: Path, tokenizer) -> None:
        save_block_drafter(module, folder)


def selector_loss(module: BlockDrafter, logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor,
                  gold: torch.Tensor) -> torch.Tensor:
    """DFlash2's selector objective at R rows of one draft position: the K-way CE of the true token x_{a+1+j} (gold
    [R]) among the draft's top-K candidates of its logits [R, V], scored after the true previous token (prev [R],
    teacher-forced: the anchor for the first draft) from the slot's hidden [R, d]. A true token outside the top K
    replaces the K-th candidate in this loss only (decoding never sees it). The gradient also reaches the backbone
    through the candidates' logits, as in SpecForge's and speculators' default."""
    if not len(gold):
        return logits.sum() * 0.0
    K = module.config.selector_top_k
    candidates = logits.detach().topk(K, dim=-1).indices  # [R, K]
    hit = candidates == gold[:, None]  # [R, K]
    found = hit.any(-1)  # [R]
    candidates[:, -1] = torch.where(found, candidates[:, -1], gold)
    label = torch.where(found, hit.int().argmax(-1), K - 1)  # [R] the true token's place among the candidates
    scores = module.candidate_selector.scores(logits.gather(-1, candidates), candidates, hidden, prev)  # [R, K]
    return F.cross_entropy(scores, label)


def check_mask_token(mask_token_id: int, data, tokenizer) -> None:
    """The mask token must be a row no training text uses: the drafter would not tell a mask from a real token."""
    if any(bool((s == mask_token_id).any()) for s in data.sequences):
        name = tokenizer.convert_ids_to_tokens(mask_token_id) if tokenizer is not None else None
        raise SpecdrafterError(f"recipe key 'drafter.block.mask_token_id': token {mask_token_id}"
                               + (f" ({name!r})" if name else "") + " occurs in the training data; pick a token "
                               "the chat text never uses (a reserved special token)")
