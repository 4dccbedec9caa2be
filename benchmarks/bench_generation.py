"""Benchmark: how fast the data job turns prompts into target tokens, against the teacher-forced ceiling.

    python benchmarks/bench_generation.py recipes/smollm2-135m-data.yaml [key=value ...] [--prompts 32] [--max-new-tokens 128]

Three arms on the same chat-templated ShareGPT prompts, in one process, interleaved (arm order rotates every
repeat), median of the repeats:
  ours        the data job's in-process engine (`specdrafter.data.regenerate.sample_responses`: length-bucketed batches,
              finished rows leave the batch, top-p from a top-64 cut) at the recipe's temperature / top-p
  hf_generate transformers' `model.generate` on the same batches (what the data job used before)
  forward     the teacher-forced forward of the backbone over prompt + response sequences of the same lengths
              (`data.responses: dataset` pays only this): the ceiling regeneration is measured against
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import GenerationConfig

from specdrafter.core.io import SpecdrafterError
from specdrafter.data.assets import load_prompt_set, load_target
from specdrafter.data.chat import eos_token_ids, user_prompt_ids
from specdrafter.data.regenerate import generate_responses
from specdrafter.jobs.recipe import load_recipe


def hf_generate(model, tokenizer, prompts, max_new_tokens, temperature, top_p, batch_size):
    """The old path: `model.generate` per left-padded batch (finished rows keep decoding padding)."""
    eos = eos_token_ids(model, tokenizer)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else dict(do_sample=False)
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0], **sampling)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        batch = [prompts[i] for i in rows]
        width = max(map(len, batch))
        ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in batch])  # [B, T] left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])  # [B, T]
        new = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
        for i, row in zip(rows, new.tolist()):
            stop = next((j for j, t in enumerate(row) if t in eos), None)
            out[i] = row if stop is None else row[:stop + 1]
    return out  # in input order


def forward(model, sequences, batch_size):
    """Teacher-forced backbone forward (what caching hidden states costs), right-padded, length-sorted batches."""
    order = sorted(sequences, key=len)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in batch])  # [B, T]
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])  # [B, T]
        model.model(input_ids=ids, attention_mask=mask)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the recipe's data.batch_size")
    parser.add_argument("--forward-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        model, tokenizer = load_target(cfg.target.model, cfg.target.dtype.value)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    d = cfg.data
    batch_size = args.batch_size or d.batch_size
    texts = [r["turns"][0] for r in load_prompt_set(d.prompts)[: args.prompts * 4]]
    prompts = [user_prompt_ids(tokenizer, t) for t in texts]
    prompts = [p for p in prompts if len(p) <= d.max_prompt_tokens][: args.prompts]
    generator = torch.Generator().manual_seed(0)
    arms = {
        "ours": lambda: generate_responses(model, tokenizer, prompts, args.max_new_tokens, d.temperature, d.top_p,
                                           batch_size, generator=generator),
        "hf_generate": lambda: hf_generate(model, tokenizer, prompts, args.max_new_tokens, d.temperature, d.top_p,
                                           batch_size),
    }
    runs = {name: [] for name in [*arms, "forward"]}
    with torch.inference_mode():
        generate_responses(model, tokenizer, prompts[:2], 4, d.temperature, d.top_p, 2)  # warm-up
        for r in range(args.repeats):
            names = list(arms)[r % 2:] + list(arms)[:r % 2]
            for name in names:
                start = time.perf_counter()
                responses = arms[name]()
                seconds = time.perf_counter() - start
                tokens = sum(map(len, responses))
                runs[name].append({"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)})
            # the forward arm runs over the sequences the last arm produced (the lengths of real data)
            sequences = [p + resp for p, resp in zip(prompts, responses)]
            start = time.perf_counter()
            forward(model, sequences, args.forward_batch_size)
            seconds = time.perf_counter() - start
            tokens = sum(map(len, sequences))
            runs["forward"].append({"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)})
    summary = {name: statistics.median(x["tokens_per_s"] for x in rs) for name, rs in runs.items()}
    result = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "batch_size": batch_size,
              "temperature": d.temperature, "top_p": d.top_p, "threads": torch.get_num_threads(), "runs": runs,
              "median_tokens_per_s": summary,
              "ours_vs_forward": round(summary["ours"] / summary["forward"], 3),
              "hf_generate_vs_forward": round(summary["hf_generate"] / summary["forward"], 3),
              "ours_vs_hf_generate": round(summary["ours"] / summary["hf_generate"], 3)}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(f"regeneration: ours {summary['ours']:.1f} tok/s, hf generate {summary['hf_generate']:.1f} tok/s; "
          f"teacher-forced forward {summary['forward']:.1f} tok/s → ours at {100 * result['ours_vs_forward']:.0f}% "
          f"of the forward (hf generate {100 * result['hf_generate_vs_forward']:.0f}%)")


if __name__ == "__main__":
    main()
