"""Regeneration in this process (data.engine=hf), beside data/server.py's client of serving engines and with the
same `respond`: the target's answers sampled at data.temperature and data.top_p, prompts of similar length batched
together, one cached forward per step, a row leaving the batch as soon as it ends; `sample_tokens` is the law
it draws from (tests/test_data_llamacpp.py compares llama.cpp's with it).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from specdrafter.data.chat import chat_ids, eos_token_ids
from specdrafter.models.targets import new_cache


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of logits [B, V]: argmax at temperature 0, else a draw from softmax(logits / T) cut to
    its top-p nucleus (a token is dropped when the tokens ranked above it already cover top_p), by CDF inversion.

    The nucleus is looked for among the 64 most likely tokens first and the full vocabulary is sorted only for the
    rows whose 64 best tokens cover less than top_p, so most rows cost a top-k instead of a 49k-entry sort."""
    if temperature == 0:
        return logits.argmax(-1)  # [B]
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    if top_p >= 1:
        cdf = probs.cumsum(-1)  # [B, V]
        u = torch.rand(len(probs), 1, generator=generator).to(cdf) * cdf[:, -1:]  # [B, 1]
        return torch.searchsorted(cdf, u, right=True).clamp_max(probs.shape[-1] - 1)[:, 0]
    top, ids = torch.topk(probs, min(64, probs.shape[-1]), dim=-1)  # [B, K] descending
    short = top.sum(-1) < top_p  # [B] rows whose nucleus may reach beyond the 64 best tokens
    token = torch.empty(len(probs), dtype=torch.long, device=logits.device)
    token[~short] = draw_from_nucleus(top[~short], ids[~short], top_p, generator)
    if short.any():
        token[short] = draw_from_nucleus(*torch.sort(probs[short], dim=-1, descending=True), top_p, generator)
    return token


def draw_from_nucleus(top: torch.Tensor, ids: torch.Tensor, top_p: float,
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A draw per row from probabilities top [B, K] (descending; token ids ids [B, K]) cut to the top-p nucleus."""
    kept = torch.where(top.cumsum(-1) - top < top_p, top, 0.0)  # [B, K] the nucleus, unnormalised
    cdf = kept.cumsum(-1)  # [B, K]
    u = torch.rand(len(top), 1, generator=generator).to(cdf) * cdf[:, -1:]  # [B, 1] (the generator may live on the CPU)
    pick = torch.searchsorted(cdf, u, right=True).clamp_max(kept.shape[-1] - 1)  # [B, 1]
    return ids.gather(-1, pick)[:, 0]  # [B]


@torch.no_grad()
def sample_responses(model, prompts: List[List[int]], max_new_tokens: int, temperature: float, top_p: float,
                     batch_size: int, eos: Sequence[int], pad: int, generator: Optional[torch.Generator] = None,
                     on_batch: Optional[Callable[[int, int], None]] = None) -> List[List[int]]:
    """One response per prompt from the target: prompts of similar length batched together (left-padded), one
    cached forward per step, and a row leaves the batch (its cache rows dropped) as soon as it emits an EOS or
    reaches max_new_tokens, so finished rows cost nothing while the others go on.

    Returns each response's token ids up to and including the first EOS (no EOS if max_new_tokens was hit), in
    input order. `on_batch(num_prompts, num_new_tokens)` is called after every batch (progress reporting)."""
    device = model.device
    eos_t = torch.tensor(list(eos), device=device)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    responses: List[List[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        for row, i in enumerate(batch):  # left padding: the last prompt token of every row is at T-1
            input_ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            attention_mask[row, width - len(prompts[i]):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # [B, T]
        cache = new_cache(model)  # a recurrent target's states too (models/targets.py)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
        rows = torch.tensor(batch, device=device)  # [B] which prompt each batch row answers
        positions = position_ids[:, -1:]  # [B, 1]
        for step in range(max_new_tokens):
            token = sample_tokens(logits, temperature, top_p, generator)  # [B]
            for i, t in zip(rows.tolist(), token.tolist()):
                responses[i].append(t)
            done = torch.isin(token, eos_t) | (step + 1 == max_new_tokens)  # [B]
            if done.all():
                break
            if done.any():  # finished rows leave the batch and the cache
                keep = (~done).nonzero()[:, 0]  # [B']
                cache.batch_select_indices(keep)
                rows, token, positions, attention_mask = rows[keep], token[keep], positions[keep], attention_mask[keep]
            positions = positions + 1
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)  # [B', S+1]
            logits = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=positions,
                           cache=cache, use_cache=True).logits[:, -1]  # [B', V]
        if on_batch is not None:
            on_batch(len(batch), sum(len(responses[i]) for i in batch))
    return responses


def generate_responses(model, tokenizer, prompts: List[List[int]], max_new_tokens: int, temperature: float,
                       top_p: float, batch_size: int, on_batch: Optional[Callable[[int, int], None]] = None,
                       generator: Optional[torch.Generator] = None) -> List[List[int]]:
    """`sample_responses` with the target's EOS ids and pad token."""
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return sample_responses(model, prompts, max_new_tokens, temperature, top_p, batch_size, eos, pad, generator,
                            on_batch)


class HFEngine:
    """Regeneration in this process (`data.engine: hf`), with the same `respond` as the serving-engine client."""

    def __init__(self, model, tokenizer, batch_size: int, on_batch: Optional[Callable[[int, int], None]] = None):
        self.model, self.tokenizer, self.batch_size, self.on_batch = model, tokenizer, batch_size, on_batch
        self.counters: Dict[str, int] = {}

    def probe(self, temperature: float, top_p: float) -> dict:
        return {"engine": "hf"}

    def respond(self, messages: List[List[dict]], max_new_tokens: int, temperature: float, top_p: float,
                seed: int) -> List[List[int]]:
        prompts = [chat_ids(self.tokenizer, m, True) for m in messages]
        return generate_responses(self.model, self.tokenizer, prompts, max_new_tokens, temperature, top_p,
                                  self.batch_size, self.on_batch, torch.Generator().manual_seed(seed))

