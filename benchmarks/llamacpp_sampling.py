"""Is llama.cpp's speculative sampling exact at T = 1? A χ² test of the first two tokens' joint law through llama-server,
with and without a drafter, against the target's own law computed exactly (float64, from the HF model).

    python benchmarks/llamacpp_sampling.py [--samples 3000] [--kind eagle3|dspark] [--out runs/llamacpp-sampling]

Two arms: the target alone, and a random drafter of the kind (its drafts are all rejected, so this tests the residual
path only; a drafter that gets accepted is still to be added — the target as its own `--spec-type draft` model did not
start the server). A tiny random target (6 layers, width 64, SmolLM2's tokenizer,
its lm_head sharpened so that a few dozen token pairs carry most of the mass) is converted to GGUF; the random
drafter is exported with `--format gguf`. Each request samples five tokens, of which the first two are counted (the
server drafts only while more than one token remains), with every sampler but the temperature off (top-k 0, top-p 1,
min-p 0) and its own seed. Pairs expected fewer than 5 times are pooled into one bin. Prints and writes result.json:
per arm the χ² statistic, degrees of freedom, p-value, and the server's drafted / accepted counts.
Needs `specdrafter-llamacpp install`; runs one server at a time, one thread.
"""

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import torch
from omegaconf import OmegaConf
from scipy.stats import chisquare
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdrafter.core import llamacpp
from specdrafter.data.assets import ensure_smollm2
from specdrafter.export.formats import export
from specdrafter.export.gguf import DRAFT_FILE
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import KINDS, build_drafter

REPO = Path(__file__).resolve().parents[1]
SHARPEN = 36.0
PROMPT = list(range(200, 216))
# The server drafts only while more than one token remains to be generated: with 5 asked, the second token (and the
# rest) is verified against a draft; the first two are counted.
N_PREDICT = 5


def tiny_target(folder: Path):
    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                         bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model.eval(), tok


def exact_law(model, n: int) -> dict:
    """{(a, b): p(a | prompt) · p(b | prompt, a)} (float64) of every pair expected at least 5 times in n samples;
    the rest is the pooled bin."""
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1].double(), -1)
        law = {}
        for a in torch.nonzero(first * n >= 5).flatten().tolist():
            second = torch.softmax(model(torch.tensor([PROMPT + [a]])).logits[0, -1].double(), -1) * first[a]
            law.update({(a, b): float(second[b]) for b in torch.nonzero(second * n >= 5).flatten().tolist()})
    return law


def drafter_gguf(kind: str, target_dir: Path, tok, root: Path) -> Path:
    recipe = KINDS[kind].recipe
    cfg = load_recipe(REPO / "recipes" / recipe, [
        f"output_dir={root / 'run'}", f"target.model={target_dir}", "target.dtype=float32", "train.wandb.mode=disabled",
        "drafter.eagle.aux_layer_ids=[1,3,5]", "drafter.eagle.draft_vocab_size=0", "drafter.block.num_layers=1",
        "drafter.block.block_size=4", "drafter.block.aux_layer_ids=[1,3,5]", "drafter.block.markov_rank=8",
        "drafter.block.draft_vocab_size=0", "inference.k=3"])
    drafter = build_drafter(cfg, LlamaForCausalLM.from_pretrained(target_dir).eval(), None, tok)
    folder = root / "run" / "checkpoints" / "step-000001"
    drafter.save(drafter.module, folder / "drafter", tok)
    (folder / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
    (folder / "trainer_state.json").write_text(json.dumps({"step": 1, "drafter": kind, "metrics": {}}))
    return export(root / "run", "gguf", root / "gguf") / DRAFT_FILE


def sample_pairs(args: list, n: int) -> tuple:
    """(Counter of the first two tokens over n seeded requests, {"drafted", "accepted"} summed over them)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(llamacpp.binary("llama-server")), *args, "--port", str(port), "-t", "1", "-c", "256"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    counts, drafts = Counter(), {"drafted": 0, "accepted": 0}
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit("llama-server did not start")
                time.sleep(0.2)
        for i in range(n):
            body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                    "typical_p": 1.0, "repeat_penalty": 1.0, "seed": i, "samplers": ["temperature"],
                    "return_tokens": True, "cache_prompt": False}
            reply = urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}))
            answer = json.loads(reply.read())
            counts[tuple(answer["tokens"][:2])] += 1
            drafts["drafted"] += answer["timings"].get("draft_n", 0)
            drafts["accepted"] += answer["timings"].get("draft_n_accepted", 0)
            if (i + 1) % 500 == 0:
                print(f"  {i + 1}/{n}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return counts, drafts


def chi2(counts: Counter, law: dict, n: int) -> dict:
    """χ² of the observed pairs against the law, pairs expected < 5 times pooled (with every unlisted pair)."""
    kept = list(law)
    observed = [counts.get(pair, 0) for pair in kept]
    expected = [law[pair] * n for pair in kept]
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    stat, p = chisquare(observed, expected)
    return {"chi2": round(float(stat), 2), "dof": len(kept), "p_value": float(p), "bins": len(kept) + 1,
            "pooled_mass": round(expected[-1] / n, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--kind", default="eagle3", choices=("eagle3", "dspark"))
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "llamacpp-sampling")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llamacpp-sampling-"))
    model, tok = tiny_target(root / "target")
    law = exact_law(model, args.samples)
    print(f"{len(law)} pairs expected >= 5 times, {sum(law.values()):.3f} of the mass", flush=True)
    target_gguf = root / "target.gguf"
    llamacpp.convert(root / "target", target_gguf)
    draft = drafter_gguf(args.kind, root / "target", tok, root)
    spec = KINDS[args.kind].export.llamacpp.spec_type
    result = {"samples": args.samples, "kind": args.kind, "llama.cpp": llamacpp.SDIST.version}
    arms = {"target alone": [],
            f"with {args.kind} ({spec}, n_max 3)": ["-md", str(draft), "--spec-type", spec, "--spec-draft-n-max", "3"]}
    for arm, extra in arms.items():
        print(arm, flush=True)
        counts, drafts = sample_pairs(["-m", str(target_gguf), *extra], args.samples)
        result[arm] = {**chi2(counts, law, args.samples), **drafts, "pairs": {f"{a},{b}": c for (a, b), c in
                                                                             counts.most_common(5)}}
        print(f"  {result[arm]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'result.json'}")


if __name__ == "__main__":
    main()
