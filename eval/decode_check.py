"""The light evaluation training runs with its checkpoints (train.decode_check_every): a saved drafter through the
real decoding loop on a prompt or two, τ and α as users will see them rather than the held-out proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch
from omegaconf import DictConfig

from specdrafter.data.assets import load_prompt_set
from specdrafter.data.chat import eos_token_ids, user_prompt_ids
from specdrafter.inference.decode import alpha_per_token
from specdrafter.inference.decoder import build_decoder
from specdrafter.kinds import kind_of

MAX_PROMPTS = 2  # a check, not an evaluation: the eval job (eval/job.py) measures a checkpoint properly


@torch.no_grad()
def decode_check(cfg: DictConfig, folder: Path, target, tokenizer) -> Dict[str, float]:
    """The drafter saved in `folder` decodes the first eval.num_prompts ≤ MAX_PROMPTS prompts of eval.sets[0] (greedy,
    a chain of block length inference.k) with the training process's `target`: {"decode/tau", "decode/alpha"} over
    all their cycles (α as `inference/decode.py:acceptance_rate` defines it)."""
    c = cfg.copy()
    c.drafter.path, c.inference.tree, c.inference.dynamic_tree.total_tokens = str(folder), [], 0
    c.inference.temperature, c.inference.verifier, c.inference.max_new_tokens = 0.0, "exact", cfg.eval.max_new_tokens
    serving = kind_of(c).serving_target(folder, target)
    proposer = kind_of(c).proposer(c, serving, str(folder))  # the drafter in the target's dtype, beside it on its device
    decoder = build_decoder(c.inference, serving, proposer, eos_token_ids(target, tokenizer))
    tokens, cycles = 0, []
    for record in load_prompt_set(cfg.eval.sets[0])[: min(cfg.eval.num_prompts, MAX_PROMPTS)]:
        r = decoder(user_prompt_ids(tokenizer, record["turns"][0]))
        tokens, cycles = tokens + len(r.tokens), cycles + r.cycles
    return {"decode/tau": tokens / max(len(cycles), 1), "decode/alpha": alpha_per_token(cycles)}
