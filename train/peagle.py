"""P-EAGLE (docs/algorithms.md §P-EAGLE; Hui et al., arXiv 2602.01469): an EAGLE-3 head that drafts K tokens in one
forward pass. The head, its folder, and its training with COD subsampling.

The head is models/eagle.py's EAGLE-3 head plus one learnt vector, `mask_hidden` [1, 3·d_t], which stands in for the
target features the head does not have at the later draft positions. Drafting after the pair (f_t, x_{t+1}) at
position t (depth 0, exactly as EAGLE-3's first step) appends K − 1 slots at positions t + 1 … t + K − 1, each fed
fc(mask_hidden) as its hidden state and the target's embedding of `mask_token_id` as its token; slot j predicts
x_{t+j+2}. The slots attend causally: to every real pair up to t and to the slots before them. None of them reads the
draft's own earlier outputs, so one pass yields all K rows, and each row is a distribution of the context alone.

Training (COD, "conditional drop-token" sampling, speculators' and NeMo Automodel's scheme) lays all depths of all
positions out as one flat sequence per row. Depth 0 keeps every position (it is the context too). Depth j keeps
about n · max(r^j, r_min) chains, n the row's supervised positions, drawn among the chains kept at depth j − 1 whose
token x_{a+j+2} is target-generated, so every kept element has all its shallower slots and sees at training exactly
what it sees at decoding: the depth-0 elements up to its anchor a and its own chain's slots 1 … j. Depth j of chain
a is compared with the target's row a + j + 1, the same lead as EAGLE-3's TTT step j (train/drafters.py).

Config keys (config.json, top level; vLLM reads `mask_token_id` and the `mask_hidden` tensor when served with
`parallel_drafting: true`): parallel_drafting (true: this is a P-EAGLE head), mask_token_id, num_depths (the K it was
trained for: decoding refuses more).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import torch
from omegaconf import DictConfig
from torch import nn

from specdrafter.core.io import SpecdrafterError
from specdrafter.models.eagle import (
    EAGLE31_FLAGS,
    Eagle3Head,
    _build_config,
    _fill,
    _read_head_folder,
    default_aux_layers,
    eagle3_config,
    eagle3_head_config,
    eagle3_layout,
    full_vocab_maps,
    remap_eagle3_weights,
    save_eagle3,
)
from specdrafter.train.batches import Batch
from specdrafter.train.block import check_mask_token
from specdrafter.train.drafters import MASTER_DTYPE, Prediction, TargetOutput, counted_rows, start_draft_vocab
from specdrafter.train.eagle import shift_left


class PEagleHead(Eagle3Head):
    """An EAGLE-3 head with the learnt hidden state of its masked draft slots."""

    def __init__(self, config):
        super().__init__(config)
        target_d = getattr(config, "target_hidden_size", None) or config.hidden_size
        # vLLM's buffer is [1, 3·d] and reads the tensor as view(1, -1); fed through fc (and EAGLE-3.1's norms) like
        # the three target features it replaces
        self.mask_hidden = nn.Parameter(torch.randn(1, 3 * target_d))

    @property
    def num_depths(self) -> int:
        return int(self.config.num_depths)

    @property
    def mask_token_id(self) -> int:
        return int(self.config.mask_token_id)

    def mask_slots(self, embed: nn.Module, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The inputs of n masked slots: (hidden [1, n, d], the mask token's embedding [1, n, d])."""
        hidden = self.fuse_concatenated(self.mask_hidden)  # [1, d]
        token = torch.full((1, n), self.mask_token_id, device=hidden.device)
        return hidden[None].expand(1, n, -1), embed(token).to(hidden.dtype)


def peagle_config(target_config, aux_layer_ids, draft_vocab_size: int, num_depths: int, mask_token_id: int,
                  attention_bias=None, flags=None):
    """EAGLE-3's config (models/eagle.py:eagle3_config) with P-EAGLE's three keys."""
    config = eagle3_config(target_config, aux_layer_ids, draft_vocab_size, attention_bias, flags)
    config.parallel_drafting, config.num_depths, config.mask_token_id = True, num_depths, mask_token_id
    return config


def is_peagle(config: dict) -> bool:
    """Whether a config.json holds a P-EAGLE head: an EAGLE-3 folder that says parallel_drafting."""
    return config.get("parallel_drafting") is True and eagle3_layout(config) is not None


def load_peagle(folder: str | Path, dtype: torch.dtype = torch.float32) -> PEagleHead:
    """A P-EAGLE head from our training folder or its vllm export; anything else is one line."""
    folder, what = Path(folder), "P-EAGLE head"
    raw, weights = _read_head_folder(folder, what)
    if not is_peagle(raw):
        raise SpecdrafterError(f"{str(folder)!r} is not a P-EAGLE head (its config.json has no parallel_drafting: true "
                               "on an EAGLE-3 head)")
    for key in ("mask_token_id", "num_depths"):
        if not isinstance(raw.get(key), int) or isinstance(raw.get(key), bool) or raw[key] < 0:
            raise SpecdrafterError(f"{str(folder / 'config.json')!r}: {key} = {raw.get(key)!r}; a P-EAGLE head needs "
                                   "it as a non-negative integer")
    if "mask_hidden" not in weights:
        raise SpecdrafterError(f"the weights in {str(folder)!r} have no mask_hidden: without it the head cannot draft "
                               "past its first token in one pass")
    config = _build_config(lambda: eagle3_head_config(raw, eagle3_layout(raw), str(folder)), folder, what)
    head = PEagleHead(config)
    weights = {**remap_eagle3_weights(weights, eagle3_layout(raw)),
               "mask_hidden": weights["mask_hidden"].reshape(1, -1)}  # vLLM reads any shape as view(1, -1)
    return _fill(head, full_vocab_maps(head, weights), folder, what, dtype)


def cod_chains(loss_mask: torch.Tensor, depths: int, ratio: float, ratio_min: float
               ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """COD's chains for depths 1 … depths − 1: per depth j, (anchors [B, N_j], valid [B, N_j] bool), anchors sorted,
    invalid entries at anchor 0. A row keeps floor(n · max(ratio^j, ratio_min)) chains at depth j (n: its positions
    whose x_{t+2} is target-generated), drawn uniformly (torch's global RNG: a resumed run draws the same) among its
    depth-(j − 1) chains whose x_{a+j+2} is target-generated too; depth 0 is every position."""
    mask = loss_mask.bool()
    B, T = mask.shape
    lead = torch.zeros_like(mask)  # [B, T] x_{t+2} target-generated: the depth-0 rows the loss counts
    lead[:, :-2] = mask[:, 2:]
    n = lead.sum(1)  # [B]
    alive, out = lead, []
    for j in range(1, depths):
        ok = torch.zeros_like(mask)  # [B, T] chain a may go on to depth j: x_{a+j+2} is target-generated
        if j + 2 < T:
            ok[:, :T - j - 2] = mask[:, j + 2:]
        pool = alive & ok  # [B, T]
        keep = torch.minimum((n * max(ratio ** j, ratio_min)).floor().long(), pool.sum(1))  # [B]
        N = int(keep.max()) if B else 0
        score = torch.rand(B, T, device=mask.device).masked_fill(~pool, -1.0)  # [B, T]
        top, at = score.topk(N, dim=1)  # [B, N] a uniform draw of the pool
        valid = (torch.arange(N, device=mask.device)[None] < keep[:, None]) & (top >= 0)  # [B, N]
        alive = torch.zeros_like(mask).scatter(1, at, valid)  # the kept chains go on
        at = torch.where(valid, at, at.new_full((), T)).sort(dim=1).values  # invalid ones sort last
        valid = at < T
        out.append((at.masked_fill(~valid, 0), valid))
    return out


def cod_mask(anchor: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The flat sequence's attention: [B, 1, N, N], True = may attend. Element (a, j) sees the depth-0 elements at
    positions <= a and the valid elements of its own chain at depths 1 … j; anchor [B, N], depth [N], valid [B, N].
    An invalid element still sees depth 0 up to its anchor (no empty row)."""
    context = (depth[None, None, :] == 0) & (anchor[:, None, :] <= anchor[:, :, None])  # [B, N, N]
    chain = ((anchor[:, None, :] == anchor[:, :, None]) & (depth[None, None, :] <= depth[None, :, None])
             & (depth[None, None, :] > 0) & valid[:, None, :] & valid[:, :, None])  # [B, N, N]
    return (context | chain)[:, None]


def flat_outputs(head: PEagleHead, embed: nn.Module, fused: torch.Tensor, input_ids: torch.Tensor,
                 chains: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One pass of the head over the flat COD sequence: the T positions (depth 0: fused [B, T, d] with x_{t+1}),
    then depth 1's chains, depth 2's, ... (`cod_chains`), each slot fed the masked inputs at position a + j.
    Returns the output hidden states [B, N, d] in that order."""
    B, T = input_ids.shape
    device = input_ids.device
    positions = torch.arange(T, device=device)[None].expand(B, T)  # [B, T]
    anchor = torch.cat([positions] + [a for a, _ in chains], dim=1)  # [B, N]
    depth = torch.cat([torch.zeros(T, dtype=torch.long, device=device)]
                      + [torch.full((a.shape[1],), j, device=device) for j, (a, _) in enumerate(chains, start=1)])  # [N]
    valid = torch.cat([torch.ones_like(positions, dtype=torch.bool)] + [v for _, v in chains], dim=1)  # [B, N]
    slot_hidden, slot_embeds = head.mask_slots(embed, anchor.shape[1] - T)  # [1, S, d] each
    hidden = torch.cat([fused, slot_hidden.expand(B, -1, -1).to(fused.dtype)], dim=1)  # [B, N, d]
    embeds = torch.cat([embed(shift_left(input_ids, 1)).to(fused.dtype),  # x_{t+1} at depth 0
                        slot_embeds.expand(B, -1, -1).to(fused.dtype)], dim=1)  # [B, N, d]
    out, _ = head(hidden, embeds, anchor + depth[None], cod_mask(anchor, depth, valid))  # [B, N, d]
    return out


class PEagleDrafter:
    """A P-EAGLE head for training: EAGLE-3's head and draft vocabulary (drafter.eagle), and drafter.peagle's depths,
    COD ratios and mask token; one Prediction per depth ("depth0", "depth1", ...)."""

    def __init__(self, cfg: DictConfig, target: nn.Module, data=None, tokenizer=None):
        e, p = cfg.drafter.eagle, cfg.drafter.peagle
        L, V = target.config.num_hidden_layers, target.config.vocab_size
        aux = list(e.aux_layer_ids) or default_aux_layers(L)
        vocab = e.draft_vocab_size or V
        flags = {key: e[key] for key in EAGLE31_FLAGS}
        config = peagle_config(target.config, aux, vocab, p.depths, p.mask_token_id, e.attention_bias, flags)
        head = PEagleHead(config).to(MASTER_DTYPE)
        if data is not None:
            check_mask_token(p.mask_token_id, data, tokenizer)
        start_draft_vocab(head, target, vocab, data)
        self.module, self.embed = head, target.get_input_embeddings()
        self.teacher_ids = head.draft_ids if vocab < V else None  # the teacher's rows the loss needs (run_target)
        self.depths, self.ratio, self.ratio_min, self.decay = p.depths, p.cod_ratio, p.cod_ratio_min, p.depth_decay
        self.prediction_names = [f"depth{j}" for j in range(self.depths)]

    def predictions(self, module, batch: Batch, target: TargetOutput) -> List[Prediction]:
        chains = cod_chains(batch.loss_mask, self.depths, self.ratio, self.ratio_min)
        out = flat_outputs(module, self.embed, module.fuse(target.features), batch.input_ids, chains)  # [B, N, d]
        preds, start = [self._prediction(0, module, out, counted_rows(batch.loss_mask, 2), target)], batch.input_ids.shape[1]
        for j, (a, v) in enumerate(chains, start=1):  # depth j of chain a predicts x_{a+j+2}: the target's row a+j+1
            b, n = v.nonzero(as_tuple=True)
            preds.append(self._prediction(j, module, out, (b, start + n), target, target.row_index[b, a[b, n] + j + 1]))
            start += a.shape[1]
        return preds

    def _prediction(self, j: int, module, out, rows, target: TargetOutput, index=None) -> Prediction:
        """Depth j's Prediction at the flat elements `rows`, against the target's rows `index` (depth 0: lead 2)."""
        index = target.rows(rows, 2) if index is None else index  # [R]
        if target.lse is None:  # full-vocabulary teacher rows
            p = target.logits[index]  # [R, V]
            in_vocab, lse = module.t2d[p.argmax(-1)], None  # as EAGLE-3: rows the draft vocabulary can follow
        else:
            p, in_vocab, lse = target.logits[index], target.top_in_vocab[index], target.lse[index]
        return Prediction(f"depth{j}", self.decay ** j, module.logits(out[rows]), p, module.draft_ids,
                          loss_rows=in_vocab, target_lse=lse)

    def save(self, module, folder: Path, tokenizer) -> None:
        save_eagle3(module, folder)
