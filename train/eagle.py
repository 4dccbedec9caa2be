"""EAGLE-3 training: the draft vocabulary (d2t / t2d) and the training-time test (docs/algorithms.md §EAGLE).

Shifting convention. Position t of draft step j reads the token x_{t+j+1} and — at step 0 — the fused target
feature f_t, later the head's own step-(j−1) output at t; it is trained towards the target's distribution at
position t+j+1 (the one that predicts x_{t+j+2}), counted only where x_{t+j+2} is a target-generated token.
Step j sits at rotary position t + j, exactly where decoding places the j-th drafted pair.

Attention at step j: the step-0 keys causally (positions ≤ t) plus, for each later step i ≤ j, only the key at
the same position t — what the head sees when it drafts j tokens ahead at decode time.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from specdrafter.models.eagle import Eagle3Head


def build_draft_vocab(token_ids: Sequence[torch.Tensor], vocab_size: int, draft_vocab_size: int):
    """The `draft_vocab_size` most frequent tokens among `token_ids` (loss-masked training tokens; ties towards
    lower ids), sorted by id. Returns (d2t [Vd] int64 with target_id = i + d2t[i], t2d [V] bool)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in token_ids:
        counts += torch.bincount(ids.long(), minlength=vocab_size)
    # stable sort by descending count keeps lower ids first among equal counts
    chosen = torch.sort(torch.argsort(-counts, stable=True)[:draft_vocab_size]).values  # [Vd]
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def ttt_mask(length: int, step: int, device=None) -> torch.Tensor:
    """Keys of steps 0..step laid out one block of `length` after another: [1, 1, T, (step+1)·T], True = attend."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()  # step 0: positions <= t
    same = torch.eye(length, dtype=torch.bool, device=device)  # later steps: position t only
    return torch.cat([causal] + [same] * step, dim=1)[None, None]


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at position t along dim 1, `fill` past the end."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, :x.shape[1] - n] = x[:, n:]
    return out


def training_time_test(head: Eagle3Head, embed: nn.Module, fused: torch.Tensor, input_ids: torch.Tensor,
                       steps: int) -> List[torch.Tensor]:
    """Run `steps` draft steps over whole sequences at once; return each step's output hidden states [B, T, d]
    (their logits, head.logits(h), predict x_{t+j+2}). fused [B, T, d] (head.fuse of the target features),
    input_ids [B, T]."""
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device)[None].expand(B, T)  # [B, T]
    hidden, prev_kv, out = fused, [], []
    for j in range(steps):
        embeds = embed(shift_left(input_ids, j + 1)).to(fused.dtype)  # [B, T, d] x_{t+j+1}, in the head's dtype
        hidden, kv = head(hidden, embeds, positions + j, ttt_mask(T, j, input_ids.device), prev_kv=prev_kv)
        prev_kv.append(kv)
        out.append(hidden)  # [B, T, d] also the input of step j+1
    return out
