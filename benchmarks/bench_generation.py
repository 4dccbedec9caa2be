"""Benchmark: how fast the data job turns prompts into target tokens, against the teacher-forced ceiling.

    python benchmarks/bench_generation.py recipes/smollm2-135m-data.yaml [key=value ...] [--prompts 32] [--max-new-tokens 128]
        [--llama-threads N] [--llama-parallel N] [--gguf TARGET.gguf] [--no-llama-server]

Three arms on the same chat-templated ShareGPT prompts, in one process, interleaved (arm order rotates every
repeat), median of the repeats:
  ours         the data job's in-process engine (`specdrafter.data.hf_engine.sample_responses`: length-bucketed
               batches, finished rows leave the batch, top-p from a top-64 cut) at the recipe's temperature / top-p
  hf_generate  transformers' `model.generate` on the same batches (what the data job used before)
  forward      the teacher-forced forward of the backbone over prompt + response sequences of the same lengths
               (`data.responses: dataset` pays only this): the ceiling regeneration is measured against
and, once, after them (its threads spin while they wait, so it never runs beside torch):
  llama_server the data job's `data.engine: server` path through llama.cpp's llama-server: the target converted to
               GGUF by llama.cpp's converter in the recipe's dtype (or --gguf), served with --llama-threads threads
               (default: every core of this machine; run it alone) and --llama-parallel slots (default: the batch
               size), the same prompts as chat messages and the same sampling, sent by `ServerEngine` (probe
               excluded from the time) with as many requests in flight as slots. Skipped when llama.cpp is not
               built (`specdrafter-llamacpp install`) or with --no-llama-server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import torch
from transformers import GenerationConfig

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.data.assets import load_prompt_set, load_target, resolve_target
from specdrafter.data.chat import eos_token_ids, user_prompt_ids
from specdrafter.data.hf_engine import generate_responses
from specdrafter.data.server import ServerEngine
from specdrafter.inference.llama_server import LlamaServer
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


def llama_server_arm(model_dir: str, tokenizer, texts: List[str], max_prompt_tokens: int, max_new_tokens: int,
                     temperature: float, top_p: float, dtype: str, threads: int, parallel: int,
                     gguf: Optional[str] = None) -> dict:
    """One timed run of the data job's server engine against a llama-server of the target: tokens, seconds, tok/s
    and what it used. The GGUF is converted into a temporary folder unless `gguf` names one."""
    messages = [[{"role": "user", "content": t}] for t in texts]
    with tempfile.TemporaryDirectory(prefix="bench-generation-") as tmp:
        if gguf is None:
            if not Path(model_dir).is_dir():
                raise SpecdrafterError(f"the llama_server arm converts a local target folder; {model_dir!r} is "
                                       "not one: pass --gguf TARGET.gguf, or --no-llama-server")
            path = Path(tmp) / "target.gguf"
            start = time.perf_counter()
            llamacpp.convert(Path(model_dir), path, outtype=llamacpp.GGUF_TYPE_OF[dtype])
            print(f"llama_server: {model_dir} converted to {llamacpp.GGUF_TYPE_OF[dtype]} GGUF in "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
        else:
            path = Path(gguf)
        context = parallel * (max_prompt_tokens + max_new_tokens + 8)  # every slot holds its longest conversation
        with LlamaServer(path, threads=threads, parallel=parallel, context=context, extra=["--jinja"]) as server:
            engine = ServerEngine([server.url], parallel, tokenizer)
            facts = engine.probe(temperature, top_p)["servers"][0]
            engine.respond(messages[:2], 4, temperature, top_p, seed=0)  # warm-up
            start = time.perf_counter()
            responses = engine.respond(messages, max_new_tokens, temperature, top_p, seed=0)
            seconds = time.perf_counter() - start
    tokens = sum(map(len, responses))
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
            "threads": threads, "parallel": parallel, "context": context, "concurrency": parallel,
            "gguf": str(gguf) if gguf else f"converted from {model_dir} ({llamacpp.GGUF_TYPE_OF[dtype]})",
            "llama_cpp": f"{llamacpp.SDIST.name}=={llamacpp.SDIST.version}",
            "token_ids_from_server": facts["token_ids_from_server"], "request_fields": facts["extra_fields"],
            "skipped_conversations": engine.counters["skipped"]}


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
    parser.add_argument("--no-llama-server", action="store_true", help="skip the llama_server arm")
    parser.add_argument("--llama-threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="llama-server's -t (default: every core of this machine)")
    parser.add_argument("--llama-parallel", type=int, default=None,
                        help="llama-server's --parallel and the requests in flight (default: the batch size)")
    parser.add_argument("--gguf", default=None, help="serve this target GGUF instead of converting the target")
    args = parser.parse_args(argv)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        model, tokenizer = load_target(cfg.target.model, cfg.target.dtype.value,
                                       untested_architecture=cfg.target.untested_architecture)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    d = cfg.data
    batch_size = args.batch_size or d.batch_size
    texts = [r["turns"][0] for r in load_prompt_set(d.prompts)[: args.prompts * 4]]
    kept = [(t, p) for t, p in ((t, user_prompt_ids(tokenizer, t)) for t in texts) if len(p) <= d.max_prompt_tokens]
    texts, prompts = [t for t, _ in kept][: args.prompts], [p for _, p in kept][: args.prompts]
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
    if args.no_llama_server or not llamacpp.installed():
        result["llama_server"] = {"skipped": "--no-llama-server" if args.no_llama_server else
                                  f"llama.cpp is not built ({llamacpp.INSTALL_COMMAND})"}
    else:
        try:
            arm = llama_server_arm(resolve_target(cfg.target.model), tokenizer, texts, d.max_prompt_tokens,
                                   args.max_new_tokens, d.temperature, d.top_p, cfg.target.dtype.value,
                                   args.llama_threads, args.llama_parallel or min(batch_size, len(prompts)), args.gguf)
        except SpecdrafterError as e:
            sys.exit(f"error: {e}")
        result["llama_server"] = arm
        summary["llama_server"] = arm["tokens_per_s"]
        result["ours_vs_llama_server"] = round(summary["ours"] / arm["tokens_per_s"], 3)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    served = (f", llama-server {summary['llama_server']:.1f} tok/s ({args.llama_threads} threads, "
              f"{result['llama_server']['parallel']} slots)" if "llama_server" in summary else "")
    print(f"regeneration: ours {summary['ours']:.1f} tok/s ({result['threads']} threads), hf generate "
          f"{summary['hf_generate']:.1f} tok/s{served}; teacher-forced forward {summary['forward']:.1f} tok/s → ours "
          f"at {100 * result['ours_vs_forward']:.0f}% of the forward (hf generate "
          f"{100 * result['hf_generate_vs_forward']:.0f}%)")


if __name__ == "__main__":
    main()
