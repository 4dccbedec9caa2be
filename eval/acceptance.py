"""Acceptance through the real decoding loop: τ (tokens per target pass, bonus included), per-token α and the
per-position acceptance curve of a drafter on MT-Bench first turns (or another prompt set), per temperature.

    python -m eval.acceptance recipes/smollm2-135m-generate.yaml drafter.kind=eagle3 drafter.path=DIR \\
        [--prompts 8] [--max-new-tokens 64] [--temperatures 0 1] [--set mtbench]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

import torch

from data.assets import load_prompt_set
from data.io import SpecdrafterError
from data.recipe import load_recipe
from inference.generate import CycleStats, speculative_generate, tree_speculative_generate
from inference.run import build_proposer, load_serving_target
from inference.sampling import SamplingParams


def per_position_acceptance(cycles: List[CycleStats]) -> List[Optional[float]]:
    """P(draft j accepted | drafts 1..j−1 accepted), j = 1..k: the acceptance curve along the block."""
    k = max(c.drafted for c in cycles)
    reached = [sum(1 for c in cycles if c.accepted >= j and c.drafted > j) for j in range(k)]
    accepted = [sum(1 for c in cycles if c.accepted > j) for j in range(k)]
    return [a / r if r else None for a, r in zip(accepted, reached)]  # None: no cycle got that far


def alpha_per_token(cycles: List[CycleStats]) -> float:
    """Accepted drafts / draft positions tried (a cycle tries its accepted ones plus the first rejected)."""
    tried = sum(min(c.accepted + 1, c.drafted) for c in cycles)
    return sum(c.accepted for c in cycles) / max(tried, 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--set", default="mtbench")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    args = parser.parse_args(argv)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        target, tokenizer = load_serving_target(cfg)
        proposer = build_proposer(cfg, target)
        records = load_prompt_set(args.set)[: args.prompts]
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    if not records:
        sys.exit(f"error: prompt set {args.set!r} is empty")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for r in records]
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    rows = []
    for temperature in args.temperatures:
        params = SamplingParams(temperature, cfg.inference.top_k, cfg.inference.top_p)
        cycles, tokens = [], 0
        for i, prompt in enumerate(prompts):
            generator = torch.Generator().manual_seed(cfg.inference.seed + i)
            if hasattr(proposer, "propose_tree"):
                result = tree_speculative_generate(target, proposer, prompt, args.max_new_tokens, params, eos, generator)
            else:
                result = speculative_generate(target, proposer, prompt, args.max_new_tokens, params, cfg.inference.k, eos,
                                              generator=generator)
            cycles += result.cycles
            tokens += len(result.tokens)
        rows.append({"temperature": temperature, "tokens": tokens, "target_passes": len(cycles),
                     "tau": round(tokens / len(cycles), 3), "alpha": round(alpha_per_token(cycles), 3),
                     "per_position": [None if a is None else round(a, 3) for a in per_position_acceptance(cycles)]})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"drafter": cfg.drafter.kind.value, "path": cfg.drafter.path, "k": cfg.inference.k,
                      "set": args.set, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": rows},
                     indent=2))


if __name__ == "__main__":
    main()
