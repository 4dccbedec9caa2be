"""How far apart are llama.cpp's log-probabilities for the same position when a one-token decode step computes them
and when a batched pass does? That gap decides when a T = 0 departure of speculative decoding from target-only
decoding is a numerical tie rather than a wrong verifier (eval/llamacpp.py: TIE_MARGIN).

    python benchmarks/llamacpp_tie_margin.py [--prompts 8] [--tokens 48] [--outtype f32] [--threads 1]
                                             [--out runs/llamacpp-tie-margin] [--target NAME_OR_DIR]
    python benchmarks/llamacpp_tie_margin.py --target qwen2.5-coder-1.5b-instruct --outtype source

The target (SmolLM2 unless --target, converted to GGUF with --outtype, or served as the GGUF it was converted from
with --outtype source) is served alone. Per MT-Bench prompt (the eval job's last
prompts first, in the target's chat template):
- single: one request generates --tokens tokens greedily with n_probs; each generated token's top log-probabilities
  come from a one-token decode step, the path target-only decoding takes;
- batched: for each generated position, the prompt and the tokens before it with the prompt cache off and one token
  asked: that position's log-probabilities come from the last row of a batched pass (matrix-matrix kernels, the
  kernel class of a verify pass over k + 1 tokens).
Per position: the change of the top-1 − top-2 margin between the two and the largest change of a log-probability both
list. The distribution (median, 99th percentile, max) is printed and written to result.json and result.md in --out,
beside what TIE_MARGIN says for the outtype and how many positions' greedy token the two disagree on.
Run it on a quiet machine (llama.cpp's threads spin); it takes a few minutes. Needs `specdrafter-llamacpp install`.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

from specdrafter.core import llamacpp
from specdrafter.core.io import atomic_write_text
from specdrafter.data.assets import load_prompt_set, resolve_target
from specdrafter.data.chat import user_prompt_ids
from specdrafter.data.gguf_assets import gguf_type, paired_gguf
from specdrafter.eval.llamacpp import TIE_MARGIN
from specdrafter.inference.llama_server import LlamaServer

N_PROBS = 5


def top_logprobs(entry: dict) -> dict:
    return {t["id"]: t["logprob"] for t in entry.get("top_logprobs") or []}


def margin(top: dict) -> float:
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="a built-in target or an HF folder")
    ap.add_argument("--outtype", default="f32", choices=["f32", "bf16", "f16", "q8_0", "source"],
                    help="the target's GGUF type; source: the GGUF it was converted from")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/llamacpp-tie-margin")
    args = ap.parse_args()
    folder = Path(resolve_target(args.target))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if args.outtype == "source":  # the GGUF a target was converted from (Qwen2.5-Coder's Q4_K_M file)
        target = paired_gguf(folder)
        args.outtype = target.name
    else:
        target = llamacpp.target_gguf(folder, args.outtype)
    prompts = [user_prompt_ids(tokenizer, r["turns"][0]) for r in load_prompt_set("mtbench")[-args.prompts:]]
    rows, started = [], time.time()
    with LlamaServer(target, threads=args.threads) as server:
        for p, prompt in enumerate(prompts):
            single = server.complete(prompt, args.tokens, n_probs=N_PROBS)
            tokens = [int(t) for t in single["tokens"]]
            for j, entry in enumerate(single["completion_probabilities"][:len(tokens)]):
                batched = server.complete(prompt + tokens[:j], 1, n_probs=N_PROBS)["completion_probabilities"][0]
                a, b = top_logprobs(entry), top_logprobs(batched)
                shared = set(a) & set(b)
                rows.append({"prompt": p, "position": j, "margin_single": margin(a), "margin_batched": margin(b),
                             "margin_change": abs(margin(a) - margin(b)),
                             "logprob_change": max(abs(a[t] - b[t]) for t in shared),
                             "argmax_differs": max(a, key=a.get) != max(b, key=b.get)})
            print(f"prompt {p + 1}/{len(prompts)}: {len(tokens)} positions, largest margin change so far "
                  f"{max(r['margin_change'] for r in rows):.2e}", flush=True)
    changes = sorted(r["margin_change"] for r in rows)
    logprob = sorted(r["logprob_change"] for r in rows)
    near = sorted(rows, key=lambda r: min(r["margin_single"], r["margin_batched"]))[:5]
    result = {
        "outtype": args.outtype, "threads": args.threads, "positions": len(rows), "prompts": len(prompts),
        "margin_change": {"median": statistics.median(changes), "p99": changes[int(0.99 * (len(changes) - 1))],
                          "max": changes[-1]},
        "logprob_change_max": logprob[-1], "argmax_differs": sum(r["argmax_differs"] for r in rows),
        "tie_margin": TIE_MARGIN.get(gguf_type(target)), "closest_calls": near, "seconds": round(time.time() - started, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "result.json", json.dumps(result, indent=2) + "\n")
    m = result["margin_change"]
    text = (f"# llama.cpp: one-token step against a batched pass, {args.outtype}, {args.threads} thread(s)\n\n"
            f"{len(rows)} positions over {len(prompts)} MT-Bench prompts, {result['seconds']} s.\n\n"
            f"| top-1 − top-2 margin change | |\n|---|---|\n| median | {m['median']:.2e} |\n| 99th percentile | "
            f"{m['p99']:.2e} |\n| max | {m['max']:.2e} |\n\nLargest change of a listed log-probability: "
            f"{result['logprob_change_max']:.2e}. Positions whose greedy token differs: {result['argmax_differs']}. "
            f"TIE_MARGIN for {args.outtype}: {result['tie_margin']}.\n")
    atomic_write_text(out / "result.md", text)
    print(text)


if __name__ == "__main__":
    main()
