"""Benchmark: memory under load — the decode CLI's prompt-file mode and the evaluation job over 500 prompts,
including prompts at the target's context limit. Memory should stay flat across prompts (no growth from KV caches,
tuners' statistics or results kept per prompt).

    python benchmarks/bench_load.py recipes/smollm2-135m-generate.yaml [key=value ...] [--tiny] [--prompts 500]
        [--max-new-tokens 8] [--out runs/bench]

The prompts are ShareGPT's first user turns (offline asset) plus a few filled to the context limit (the last one
that fits with max_new_tokens and a draft block, and one token past it, which must be skipped with its reason).
The drafter is the training-free self-draft, so no checkpoint is needed. Resident memory (VmRSS) is read after every
prompt of the decode CLI and sampled every 0.2 s during the evaluation job; the report gives RSS after the first 10 %
of the prompts, at the end, and the growth between them per 100 prompts. The target is the recipe's (its context
limit from its config.json), in float32 unless an override says otherwise; `--tiny` swaps in a 2-layer random Llama
with SmolLM2's tokenizer and a 512-token context: the same code paths in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError, atomic_write_json
from specdrafter.data.assets import ensure_smollm2, load_prompt_set, resolve_target
from specdrafter.data.chat import user_prompt_ids
from specdrafter.engines.evaluate import evaluate
from specdrafter.jobs.decode import decode_file
from specdrafter.jobs.recipe import load_recipe

K = 4


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def tiny_target(folder: Path) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def filled_to(tokenizer, n: int) -> str:
    """A user message whose chat-templated prompt has at most n tokens, as close to n as the filler allows."""
    words = ["word"] * n
    while len(user_prompt_ids(tokenizer, " ".join(words))) > n:
        words.pop()
    return " ".join(words)


def write_prompts(path: Path, tokenizer, context: int, count: int, max_new_tokens: int) -> dict:
    records = [r for r in load_prompt_set("sharegpt") if len(user_prompt_ids(tokenizer, r["turns"][0])) < context // 2]
    rows = [{"id": r["id"], "prompt": r["turns"][0]} for r in records[:count - 3]]
    fits = context - max_new_tokens - K  # the longest prompt that leaves room for max_new_tokens and a draft block
    limit = filled_to(tokenizer, fits)
    rows += [{"id": "at_limit", "prompt": limit}, {"id": "at_limit_2", "prompt": limit},
             {"id": "past_limit", "prompt": limit + " word word"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.with_name("prompts-fit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    return {"prompts": len(rows), "at_limit_tokens": len(user_prompt_ids(tokenizer, limit)), "context": context}


def growth(samples: list, count: int) -> dict:
    """RSS after the first 10 % of `samples` and at the end; growth per 100 prompts between them."""
    first = samples[max(len(samples) // 10 - 1, 0)]
    last = samples[-1]
    return {"rss_after_10pct_mib": round(first, 1), "rss_end_mib": round(last, 1), "peak_mib": round(max(samples), 1),
            "growth_per_100_prompts_mib": round((last - first) / (0.9 * count / 100), 2)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer random Llama (512-token context) as the target")
    parser.add_argument("--prompts", type=int, default=500)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--out", default="runs/bench")
    args = parser.parse_args(argv)
    name = "tiny" if args.tiny else Path(load_recipe(args.recipe, args.overrides).target.model).name
    out = Path(args.out) / f"load-{name}"
    out.mkdir(parents=True, exist_ok=True)
    defaults = ["target.dtype=float32", "drafter.num_layers=1" if args.tiny else "drafter.num_layers=6"]
    forced = [f"inference.max_new_tokens={args.max_new_tokens}", f"inference.k={K}"]
    if args.tiny:
        forced.append(f"target.model={tiny_target(out / 'tiny-target')}")
    common = [*defaults, *args.overrides, *forced]  # the command line's overrides between the bench's defaults and its own
    model = resolve_target(load_recipe(args.recipe, common).target.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    context = AutoConfig.from_pretrained(model).max_position_embeddings
    facts = write_prompts(out / "prompts.jsonl", tokenizer, context, args.prompts, args.max_new_tokens)
    report = {"target": name, **facts, "max_new_tokens": args.max_new_tokens}

    # the decode CLI over the prompt file (a fresh run: decode.jsonl removed first)
    (out / "decode" / "decode.jsonl").unlink(missing_ok=True)
    cfg = load_recipe(args.recipe, [*common, f"inference.prompts={out / 'prompts.jsonl'}", f"output_dir={out / 'decode'}"])
    samples, start = [], time.perf_counter()
    totals = decode_file(cfg, on_prompt=lambda i: samples.append(rss_mib()))
    report["decode"] = {**totals, "wall_s": round(time.perf_counter() - start, 1), **growth(samples, len(samples))}

    # the evaluation job: the prompt past the limit is refused before any pass, in one line
    def eval_recipe(prompts: Path):
        return load_recipe(args.recipe, [*common, f"output_dir={out / 'eval-run'}", f"eval.sets=[{prompts}]",
                                    f"eval.num_prompts={args.prompts}", "eval.temperatures=[0]", "eval.verifiers=[chain]",
                                    "eval.k_sweep=[]", "eval.asd_sweep=[]", f"eval.max_new_tokens={args.max_new_tokens}",
                                    f"eval.output_dir={out / 'eval'}"])
    for stale in (out / "eval").glob("results.json"):
        stale.unlink()
    start = time.perf_counter()
    try:
        evaluate(eval_recipe(out / "prompts.jsonl"))
        report["eval_refusal"] = "not refused"
    except SpecdrafterError as e:
        report["eval_refusal"] = {"error": str(e), "after_s": round(time.perf_counter() - start, 1)}
    # ... and the rest (baseline + one chain cell at T = 0) runs, RSS sampled in the background
    for stale in (out / "eval").glob("results.json"):
        stale.unlink()
    cfg = eval_recipe(out / "prompts-fit.jsonl")
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(rss_mib())
            time.sleep(0.2)
    sampler = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    sampler.start()
    try:
        evaluate(cfg)
        report["eval"] = {"wall_s": round(time.perf_counter() - start, 1)}
    except SpecdrafterError as e:  # e.g. a prompt at the context limit the job cannot take: report it
        report["eval"] = {"error": str(e), "wall_s": round(time.perf_counter() - start, 1)}
    done.set()
    sampler.join()
    report["eval"].update(growth(samples, args.prompts))
    atomic_write_json(out / "bench_load.json", report)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    try:
        main()
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
