"""Benchmark: batched, left-padded target generation (the data job's path) vs batch-size-1 `generate`.

    python -m eval.bench_generation recipes/smollm2-135m-data.yaml [--prompts 8] [--max-new-tokens 48]

Both arms decode the same chat-templated ShareGPT prompts greedily in one process, interleaved
(batch-1, batched, batch-1, batched, ...), so they see the same machine state; prints tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from data.assets import load_prompt_set, load_target
from data.generate import generate_responses
from data.io import SpecdrafterError
from data.recipe import load_recipe


def timed(model, tokenizer, prompts, max_new_tokens, batch_size):
    start = time.perf_counter()
    responses = generate_responses(model, tokenizer, prompts, max_new_tokens, 0.0, 1.0, batch_size)
    seconds = time.perf_counter() - start
    tokens = sum(len(r) for r in responses)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the recipe's data.batch_size")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        model, tokenizer = load_target(cfg.target.model, cfg.target.dtype.value)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    batch_size = args.batch_size or cfg.data.batch_size
    texts = [r["turns"][0] for r in load_prompt_set(cfg.data.prompts)[: args.prompts * 4]]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for t in texts]
    prompts = [p for p in prompts if len(p) <= cfg.data.max_prompt_tokens][: args.prompts]
    runs = {"batch_size_1": [], f"batch_size_{batch_size}": []}
    with torch.inference_mode():
        timed(model, tokenizer, prompts[:1], 4, 1)  # warm-up
        for _ in range(args.repeats):
            runs["batch_size_1"].append(timed(model, tokenizer, prompts, args.max_new_tokens, 1))
            runs[f"batch_size_{batch_size}"].append(timed(model, tokenizer, prompts, args.max_new_tokens, batch_size))
    summary = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    ratio = summary[f"batch_size_{batch_size}"] / summary["batch_size_1"]
    print(json.dumps({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                      "runs": runs, "median_tokens_per_s": summary, "speedup": round(ratio, 2)}, indent=2))
    print(f"batch-1: {summary['batch_size_1']:.1f} tok/s   batched ({batch_size}): "
          f"{summary[f'batch_size_{batch_size}']:.1f} tok/s   speedup {ratio:.2f}x")


if __name__ == "__main__":
    main()
