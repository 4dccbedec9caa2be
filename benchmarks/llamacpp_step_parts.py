"""Where a speculative step's time goes in llama-server with a draft model (`--spec-type draft-simple`).

    python benchmarks/llamacpp_step_parts.py TARGET.gguf DRAFT.gguf --target-dir HF_DIR [--threads 2] [--k 1 2 4]
        [--prompts 4] [--tokens 64] [--poll 50] [--patched PATCHED_LLAMA_SERVER]

For each n_max k the server decodes HumanEval prompts at T = 0 with every step drafting k tokens (p_min 0), and one
measured step is split into what llama.cpp's source says it does (docs/llamacpp.md, "What a draft model's step costs
in llama-server"):

    verify     the target's pass over k + 1 tokens (llama-bench -p k+1 at a depth of 128)
    drafting   the server's own timer around drafting (its `dur(b,g,a)` statistics, g, at -lv 4), beside k single
               draft passes priced by llama-bench (k·c₁): the difference is sampling and hand-over
    re-eval    the draft's pass over the same k + 1 tokens (llama-bench), which the server runs after every verify
    rest       the measured step minus the three

and the target alone is timed in the same server build (ms per token), so each step is also given in target steps.
With --patched (a llama-server built with benchmarks/llamacpp_patches/keep-draft-kv.patch by
benchmarks/llamacpp_patches/build.sh), each k is also run on that build with LLAMA_SPEC_KEEP_DRAFT_KV=1: the draft
keeps what it drafted and decodes only the verify batch's last token again; its tokens must equal the pinned build's.
Run it on a quiet machine, one process at a time: llama.cpp's threads spin.
"""

import argparse
import re
import sys
from pathlib import Path

from specdrafter.core.io import SpecdrafterError
from specdrafter.data.assets import load_prompt_set
from specdrafter.data.chat import user_prompt_ids
from specdrafter.eval.llamacpp import answer, pass_ms, settled_log, token_ms
from specdrafter.inference.llama_server import LlamaServer

DRAFT_TIMER = re.compile(r"dur\(b,g,a\) = ([0-9.]+), ([0-9.]+), ([0-9.]+) ms")


def prompts_of(tokenizer_dir: Path, count: int):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [user_prompt_ids(tokenizer, r["turns"][0]) for r in load_prompt_set("humaneval")[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("draft", type=Path)
    parser.add_argument("--target-dir", type=Path, required=True, help="the target's HF folder (its tokenizer)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--poll", type=int, default=None, help="llama-server --poll and --poll-draft (default: its own)")
    parser.add_argument("--patched", type=Path, help="a llama-server built with keep-draft-kv.patch")
    args = parser.parse_args()
    poll = [] if args.poll is None else ["--poll", str(args.poll), "--poll-draft", str(min(args.poll, 1))]
    prompts = prompts_of(args.target_dir, args.prompts)
    with LlamaServer(args.target, threads=args.threads, extra=poll) as alone:
        target_ms = token_ms([answer(alone, p, args.tokens, ignore_eos=True) for p in prompts])
    c1 = pass_ms(args.draft, 1, args.threads)
    print(f"target alone in llama-server: {target_ms:.1f} ms per token; draft pass over 1 token (llama-bench): "
          f"{c1:.1f} ms; threads {args.threads}, poll {'default' if args.poll is None else args.poll}")
    print(f"{'k':>2} {'step ms':>8} {'= target steps':>14} {'verify':>7} {'drafting':>9} {'(k·c1)':>7} {'re-eval':>8} "
          f"{'rest':>6} {'accepted/step':>14}")
    builds = [("pinned", None, None)] + ([("patched", args.patched, {"LLAMA_SPEC_KEEP_DRAFT_KV": "1"})]
                                         if args.patched else [])
    for k in args.k:
        verify, reeval = pass_ms(args.target, k + 1, args.threads), pass_ms(args.draft, k + 1, args.threads)
        tokens = {}
        for build, binary, env in builds:
            with LlamaServer(args.target, args.draft, "draft-simple", n_max=k, p_min=0.0, threads=args.threads,
                             extra=["-lv", "4", *poll], binary=binary, env=env) as server:
                runs = [answer(server, p, args.tokens, ignore_eos=True) for p in prompts]
                timers = DRAFT_TIMER.findall(settled_log(server, len(prompts)))
            tokens[build] = [a.tokens for a in runs]
            steps = sum(a.steps for a in runs)
            step = sum(a.ms for a in runs) / steps
            drafting = float(timers[-1][1]) / steps if timers else float("nan")  # cumulative over the server's life
            redo = reeval if build == "pinned" else float("nan")  # the patched draft decodes one token there
            rest = step - verify - drafting - (reeval if build == "pinned" else 0.0)
            print(f"{k:>2} {step:8.1f} {step / target_ms:14.2f} {verify:7.1f} {drafting:9.1f} {k * c1:7.1f} "
                  f"{redo:8.1f} {rest:6.1f} {sum(a.accepted for a in runs) / steps:14.2f}  {build}")
        if args.patched:
            same = sum(a == b for a, b in zip(tokens["pinned"], tokens["patched"]))
            print(f"   T = 0 tokens of the patched build equal the pinned build's on {same}/{len(prompts)} prompts")


if __name__ == "__main__":
    try:
        main()
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
