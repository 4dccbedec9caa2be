"""The light evaluation training runs with its checkpoints (train.decode_check_every): a saved drafter through the
real decoding loop on a prompt or two, τ and α as users will see them rather than the held-out proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch
from omegaconf import DictConfig

from specdrafter.data.assets import load_prompt_set
from specdrafter.data.chat import eos_token_ids, user_prompt_ids
from specdrafter.inference.decode import alpha_per_token, speculative_generate
from specdrafter.inference.run import block_tuner, build_proposer
from specdrafter.inference.sampling import SamplingParams
from specdrafter.kinds import kind_of

MAX_PROMPTS = 2  # a check, not an evaluation: the eval job (eval/job.py) measures a checkpoint properly


@torch.no_grad()
def decode_check(cfg: DictConfig, folder: Path, target, tokenizer) -> Dict[str, float]:
    """The drafter saved in `folder` decodes the first eval.num_prompts ≤ MAX_PROMPTS prompts of eval.sets[0] (greedy,
    a chain of block length inference.k) with the training process's `target`: {"decode/tau", "decode/alpha"} over
    all their cycles (α as `inference/decode.py:acceptance_rate` defines it)."""
    c = cfg.copy()
    c.drafter.path, c.inference.tree, c.inference.dynamic_tree.total_tokens = str(folder), [], 0
    serving = kind_of(c).serving_target(folder, target)
    proposer = build_proposer(c, serving)  # the drafter in the target's dtype, beside it on its device
    eos = eos_token_ids(target, tokenizer)
    k = block_tuner(c.inference) or c.inference.k
    tokens, cycles = 0, []
    for record in load_prompt_set(cfg.eval.sets[0])[: min(cfg.eval.num_prompts, MAX_PROMPTS)]:
        prompt = user_prompt_ids(tokenizer, record["turns"][0])
        r = speculative_generate(serving, proposer, prompt, cfg.eval.max_new_tokens, SamplingParams(0.0), k, eos)
        tokens, cycles = tokens + len(r.tokens), cycles + r.cycles
    return {"decode/tau": tokens / max(len(cycles), 1), "decode/alpha": alpha_per_token(cycles)}
