"""Decode benchmark: target-only HF `generate`, HF assisted generation (`assistant_model=`, when the drafter
is a draft model), our chain loop and — when the recipe sets inference.tree or inference.dynamic_tree — our
tree loop with the same drafter, interleaved prompt by prompt on MT-Bench first turns, at each temperature.
Prints tokens/s, speedup over target-only, τ, α, the seed formula's predicted speedup from the measured α,
c (draft time per drafted token / target step, measured inside the loop) and v(n) (target pass over n tokens
/ one token), and the verifier's time per output token as a fraction of a target step.

    python -m eval.bench_decode recipes/smollm2-135m-generate.yaml [--prompts 4] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from data.assets import load_prompt_set
from data.io import SpecdrafterError
from data.recipe import load_recipe
from inference.generate import speculative_generate, tree_speculative_generate
from inference.run import build_drafter, build_proposer, load_serving_target
from inference.sampling import SamplingParams
from eval.acceptance import predicted_speedup, step_costs


def alpha_from_cycles(cycles, k: int) -> float:
    """Per-token acceptance: accepted / positions tried (a cycle tries min(accepted + 1, k) positions)."""
    tried = sum(min(c.accepted + 1, k) for c in cycles)
    return sum(c.accepted for c in cycles) / max(tried, 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    args = parser.parse_args(argv)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        target, tokenizer = load_serving_target(cfg)
        is_model = cfg.drafter.kind.value in ("self_draft", "draft_model")
        draft = build_drafter(cfg, target) if is_model else None
        chain = build_proposer(_without_trees(cfg), target)
        tree = build_proposer(cfg, target) if (cfg.inference.tree or cfg.inference.dynamic_tree.total_tokens) else None
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    k = cfg.inference.k
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for r in load_prompt_set("mtbench")[: args.prompts]]
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    tree_size = tree.max_tree_size if tree else 0
    target_costs = step_costs(target, prompts[0], sorted({*range(1, k + 2), *([tree_size] if tree else [])}))
    one = target_costs[1]
    v = {n: t / one for n, t in target_costs.items()}
    print(f"target step {one * 1e3:.1f} ms; v(n) = " + ", ".join(f"{n}: {x:.2f}" for n, x in v.items()), file=sys.stderr)

    table = []
    for temperature in args.temperatures:
        params = SamplingParams(temperature)
        sample = dict(do_sample=temperature > 0, **({"temperature": temperature, "top_k": 0} if temperature else {}))
        arms = {"target": [0, 0.0], **({"hf_assisted": [0, 0.0]} if draft is not None else {}), "ours_chain": [0, 0.0],
                **({"ours_tree": [0, 0.0]} if tree else {})}
        cycles = {"ours_chain": [], "ours_tree": []}
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                torch.manual_seed(i)
                start = time.perf_counter()
                out = target.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=eos[0], **sample)
                arms["target"][0] += out.shape[1] - len(prompt)
                arms["target"][1] += time.perf_counter() - start
                if draft is not None:
                    torch.manual_seed(i)
                    start = time.perf_counter()
                    out = target.generate(ids, assistant_model=draft, num_assistant_tokens=k,
                                          num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
                                          max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=eos[0], **sample)
                    arms["hf_assisted"][0] += out.shape[1] - len(prompt)
                    arms["hf_assisted"][1] += time.perf_counter() - start
            start = time.perf_counter()
            result = speculative_generate(target, chain, prompt, args.max_new_tokens, params, k, eos,
                                          generator=torch.Generator().manual_seed(i))
            arms["ours_chain"][0] += len(result.tokens)
            arms["ours_chain"][1] += time.perf_counter() - start
            cycles["ours_chain"] += result.cycles
            if tree:
                start = time.perf_counter()
                result = tree_speculative_generate(target, tree, prompt, args.max_new_tokens, params, eos,
                                                   generator=torch.Generator().manual_seed(i))
                arms["ours_tree"][0] += len(result.tokens)
                arms["ours_tree"][1] += time.perf_counter() - start
                cycles["ours_tree"] += result.cycles
        base = arms["target"][0] / arms["target"][1]
        for name, (tokens, seconds) in arms.items():
            row = {"temperature": temperature, "arm": name, "tokens": tokens, "tokens_per_s": round(tokens / seconds, 2),
                   "speedup": round(tokens / seconds / base, 3)}
            if name.startswith("ours"):
                cs = cycles[name]
                c = sum(x.draft_s for x in cs) / max(sum(x.drafted for x in cs), 1) / one
                row.update(tau=round(tokens / len(cs), 3), alpha=round(alpha_from_cycles(cs, k), 3), c=round(c, 3),
                           verifier_per_token_vs_target_step=round(sum(x.verifier_s for x in cs) / tokens / one, 4),
                           draft_share_of_time=round(sum(x.draft_s for x in cs) / seconds, 3))
                if name == "ours_chain":
                    predicted = predicted_speedup(row["alpha"], k, c, v[k + 1])
                else:  # a tree: τ measured, cost = the tree pass v(N+1) + the drafting
                    predicted = row["tau"] / (v[tree_size] + sum(x.draft_s for x in cs) / len(cs) / one)
                row.update(predicted_speedup=round(predicted, 3), measured_over_predicted=round(row["speedup"] / predicted, 3))
            table.append(row)
    print(json.dumps({"k": k, "drafter": cfg.drafter.kind.value, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                      "target_1_token_s": one, "v": v, "rows": table}, indent=2))
    print("| T | arm | tok/s | speedup | τ | α | c | predicted | measured/predicted | verifier/token ÷ target step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['temperature']} | {r['arm']} | {r['tokens_per_s']} | {r['speedup']} | {r.get('tau', '')} | "
              f"{r.get('alpha', '')} | {r.get('c', '')} | {r.get('predicted_speedup', '')} | "
              f"{r.get('measured_over_predicted', '')} | {r.get('verifier_per_token_vs_target_step', '')} |")


def _without_trees(cfg):
    chain = cfg.copy()
    chain.inference.tree = []
    chain.inference.dynamic_tree.total_tokens = 0
    return chain


if __name__ == "__main__":
    main()
