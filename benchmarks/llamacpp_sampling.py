"""Is llama.cpp's speculative sampling exact at T = 1? A χ² test of the first two tokens' joint law through llama-server,
with and without a drafter, against the target's own law computed exactly (float64, from the HF model).

    python benchmarks/llamacpp_sampling.py [--samples 3000] [--kind eagle3|dspark] [--noise 0.1]
                                           [--arch llama|qwen3|qwen3_moe|mistral|gemma3|gpt_oss|deepseek_v3|qwen3_next]
                                           [--arms SUBSTRING] [--out runs/llamacpp-sampling]
    python benchmarks/llamacpp_sampling.py --summarise DIR [DIR ...]     # one table over several runs

A tiny random target (SmolLM2's tokenizer, its lm_head sharpened so that a few dozen token pairs carry most of the
mass) is converted to GGUF: by default a 6-layer Llama of width 64; with --arch, the architecture matrix's tiny model
of that row (models/targets.py:tiny_config: 4 layers, width 64, its features on — a sliding window of 8 over the
16-token prompt, MoE routing, gpt-oss's sinks, MLA, Qwen3-Next's linear attention; Gemma 3 in 6 layers, the layout
llama.cpp assumes, one full-attention layer after five sliding ones, attention scaled by the head size, and Mistral
without a window, which llama.cpp does not apply), so that llama.cpp's own cache
rollback for that architecture runs under the test. A drafter family the export refuses beside that target (llama.cpp
cannot serve it there) drops its arms, and the report says why.

Arms, each a fresh llama-server (one at a time, one thread), and each drafter under both of llama.cpp's
`--spec-draft-sampling` modes: `greedy` (the default: the draft is its argmax, the target samples each position and
keeps the draft while they agree, "sample and match") and `probabilistic` (the draft samples its own top-10 at the
request's temperature and the target accepts with probability min(1, p/q), else draws from norm(max(0, p − q)):
rejection sampling):

- the target alone;
- a random drafter of `--kind` (exported with `--format gguf`): its drafts are all rejected, the residual path only;
- the target as its own draft model (`--spec-type draft-simple`, `-md` the same GGUF): drafts accepted often;
- the target with Gaussian noise added to every weight (σ = `--noise` × that tensor's std, seed 1) as the draft
  model: acceptance mid-range, so acceptance and the residual draw are both exercised.

Each request samples five tokens, of which the first two are counted (the server drafts only while more than one token
remains: after the prompt pass's first token, 4 remain, so the second token is verified against a 3-token draft),
with every sampler but the temperature off (`LlamaServer.complete`: top-k 0, top-p 1, min-p 0, samplers
["temperature"]) and its own seed (request i has seed i, in every arm). Before counting, each drafting arm is probed
with n_predict 3: the server can draft only after the first token (2 remain, so a 1-token draft), so a reply with
draft_n 1 shows that the second token itself was verified against a draft (and draft_n_accepted, how often
that draft was accepted). Only `draft-simple` (and MTP) give the verifier the draft's q: with EAGLE-3, DFlash or
DSpark, `probabilistic` silently falls back to sample and match. Pairs expected fewer than 5 times are pooled into
one bin. Writes result.json and result.md to --out: per arm the χ² statistic, degrees of
freedom, p-value, the server's drafted / accepted counts (`timings.draft_n`, `draft_n_accepted`, summed over the
requests, all drafted positions) and the fraction of seeds whose pair equals the target alone's.
Needs `specdrafter-llamacpp install`.
"""

import argparse
import copy
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from omegaconf import OmegaConf
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.data.assets import ensure_smollm2
from specdrafter.export.formats import export
from specdrafter.export.gguf import DRAFT_FILE
from specdrafter.inference.llama_server import LlamaServer
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import KINDS, build_drafter
from specdrafter.models.targets import LLAMACPP_LAYOUT, tiny_config

REPO = Path(__file__).resolve().parents[1]
SHARPEN = 36.0
PROMPT = list(range(200, 216))
# The server drafts only while more than one token remains to be generated: with 5 asked, the second token (and the
# rest) is verified against a draft; the first two are counted.
N_PREDICT = 5
N_MAX = 3
PROBES = 100
ALPHA = 0.001
MODES = ("greedy", "probabilistic")


def tiny_target(folder: Path, arch: str):
    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    torch.manual_seed(0)
    if arch == "llama":  # the first run's target, kept so that its numbers stay reproducible
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
    else:
        config = tiny_config(arch, len(tok))
        config.update(LLAMACPP_LAYOUT.get(arch, {}))  # what llama.cpp assumes of Gemma 3 and Mistral
        config.tie_word_embeddings = False
        config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 2
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model.eval(), tok


def perturbed(model, tok, folder: Path, noise: float, seed: int = 1) -> None:
    """The target with N(0, (noise · std(W))²) added to every weight W (seeded), saved to `folder`."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * noise * weight.std())
    draft.save_pretrained(folder)
    tok.save_pretrained(folder)


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
    """A random drafter of `kind` for the target, exported --format gguf (a SpecdrafterError where the export refuses
    it beside this target)."""
    recipe = KINDS[kind].training.recipe
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    layers = target.config.num_hidden_layers
    aux = [1, layers // 2, layers - 1]
    cfg = load_recipe(REPO / "recipes" / recipe, [
        f"output_dir={root / 'run'}", f"target.model={target_dir}", "target.dtype=float32", "train.wandb.mode=disabled",
        f"drafter.eagle.aux_layer_ids={aux}", "drafter.eagle.draft_vocab_size=0", "drafter.eagle.attention_bias=false",
        "drafter.block.num_layers=1", "drafter.block.block_size=4", f"drafter.block.aux_layer_ids={aux}",
        "drafter.block.markov_rank=8", "drafter.block.draft_vocab_size=0", "drafter.block.init_from_target=false",
        "inference.k=3"])
    drafter = build_drafter(cfg, target, None, tok)
    folder = root / "run" / "checkpoints" / "step-000001"
    drafter.save(drafter.module, folder / "drafter", tok)
    (folder / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
    (folder / "trainer_state.json").write_text(json.dumps({"step": 1, "drafter": kind, "metrics": {}}))
    return export(root / "run", "gguf", root / "gguf") / DRAFT_FILE


def sample_pairs(server: LlamaServer, n: int) -> tuple:
    """([the first two tokens of request i, seed i] for i < n, {"drafted", "accepted"} summed over them)."""
    pairs, drafts = [], {"drafted": 0, "accepted": 0}
    for i in range(n):
        timings = (answer := server.complete(PROMPT, N_PREDICT, temperature=1.0, seed=i))["timings"]
        pairs.append(tuple(answer["tokens"][:2]))
        drafts["drafted"] += timings.get("draft_n", 0)
        drafts["accepted"] += timings.get("draft_n_accepted", 0)
        if (i + 1) % 1000 == 0:
            print(f"  {i + 1}/{n}", flush=True)
    return pairs, drafts


def second_token_drafted(server: LlamaServer) -> tuple:
    """(The fraction of n_predict-3 requests, seeds unlike the counted ones', whose second token was drafted, the
    fraction whose draft of it was accepted): after the first token 2 remain, so the server drafts 1; after the
    second, 1 remains and it drafts none."""
    replies = [server.complete(PROMPT, 3, temperature=1.0, seed=10**6 + i)["timings"] for i in range(PROBES)]
    return (sum(timings.get("draft_n", 0) == 1 for timings in replies) / PROBES,
            sum(timings.get("draft_n_accepted", 0) for timings in replies) / PROBES)


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


def markdown(result: dict) -> str:
    lines = ["# llama-server's first two tokens at T = 1 against the target's exact law",
             "",
             f"Target: a tiny random {result.get('target', 'llama')}. "
             f"{result['samples']:,} seeded requests per arm, llama.cpp {result['llama.cpp']}, one thread; "
             f"{result['bins'] - 1} pairs expected ≥ 5 times ({1 - result['pooled_mass']:.1%} of the mass), the rest "
             f"pooled; α = {ALPHA}. Command: `{result['command']}`",
             "",
             "| arm | χ² | dof | p | drafted / accepted | acceptance | 2nd token drafted / accepted (probe) | seeds with "
             "the target alone's pair |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, r in result["arms"].items():
        drafted = f"{r['drafted']:,} / {r['accepted']:,}" if r["drafted"] else "—"
        rate = f"{r['acceptance']:.3f}" if r["drafted"] else "—"
        probe = ("—" if r["second_token_drafted"] is None else
                 f"{r['second_token_drafted']:.0%} / {r['second_token_accepted']:.0%}")
        lines.append(f"| {arm} | {r['chi2']:.2f} | {r['dof']} | {r['p_value']:.3g} | {drafted} | {rate} | {probe} | "
                     f"{round(r['same_as_target'] * result['samples']):,} / {result['samples']:,} |")
    worst = min(r["p_value"] for r in result["arms"].values())
    lines += ["", f"Smallest p: {worst:.3g} ({'not ' if worst >= ALPHA else ''}below α = {ALPHA}).", ""]
    if result.get("refused"):
        lines += [f"No {result['kind']} arms: the export refuses it beside this target ({result['refused']}).", ""]
    return "\n".join(lines)


def summary(folders: list) -> str:
    """One Markdown table over several runs' result.json (one row per architecture): the smallest p of its arms,
    with the arm, and the acceptance of its rejection-sampling arms."""
    lines = ["| target | pairs (mass) | arms | smallest p (arm) | rejection sampling: acceptance, p | kind's arms |",
             "|---|---|---|---|---|---|"]
    for folder in folders:
        r = json.loads((Path(folder) / "result.json").read_text())
        arm, worst = min(r["arms"].items(), key=lambda a: a[1]["p_value"])
        rejection = ", ".join(f"{a['acceptance']:.2f} (p {a['p_value']:.2g})" for name, a in r["arms"].items()
                              if name.endswith("probabilistic") and "as draft model" in name)
        kind = "refused by the export" if r.get("refused") else f"{r['kind']} ✓"
        lines.append(f"| {r.get('target', 'llama')} | {r['bins'] - 1} ({1 - r['pooled_mass']:.0%}) | {len(r['arms'])} | "
                     f"{worst['p_value']:.3g} ({arm}) | {rejection} | {kind} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--kind", default="eagle3", choices=("eagle3", "dspark"))
    parser.add_argument("--noise", type=float, default=0.1, help="the perturbed draft model's σ ÷ each weight's std")
    parser.add_argument("--arch", default="llama", choices=("llama", "qwen3", "qwen3_moe", "mistral", "gemma3",
                                                             "gpt_oss", "deepseek_v3", "qwen3_next"),
                        help="the target's architecture: a row of the matrix (docs/targets.md)")
    parser.add_argument("--out", type=Path, default=None, help="default runs/llamacpp-sampling[-ARCH]")
    parser.add_argument("--arms", help="only the arms whose name contains this (e.g. probabilistic), and the target "
                                           "alone")
    parser.add_argument("--summarise", nargs="+", metavar="DIR", help="print one table over these runs' results, "
                                                                      "and nothing else")
    args = parser.parse_args()
    if args.summarise:
        try:
            print(summary(args.summarise))
        except (OSError, ValueError, KeyError) as e:  # a folder without a finished run's result.json
            sys.exit(f"error: --summarise: {type(e).__name__}: {e} (each DIR holds a run's result.json)")
        return
    args.out = args.out or REPO / "runs" / ("llamacpp-sampling" + ("" if args.arch == "llama" else f"-{args.arch}"))
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llamacpp-sampling-") as tmp:
        root = Path(tmp)
        model, tok = tiny_target(root / "target", args.arch)
        law = exact_law(model, args.samples)
        print(f"{len(law)} pairs expected >= 5 times, {sum(law.values()):.3f} of the mass", flush=True)
        target_gguf = root / "target.gguf"
        llamacpp.convert(root / "target", target_gguf)
        perturbed(model, tok, root / "perturbed", args.noise)
        noisy_gguf = root / "perturbed.gguf"
        llamacpp.convert(root / "perturbed", noisy_gguf)
        spec, refused = KINDS[args.kind].export.llamacpp.spec_type, None
        simple = KINDS["draft_model"].export.llamacpp.spec_type
        drafters = {f"target as draft model ({simple})": (target_gguf, simple),
                    f"target + noise σ={args.noise} as draft model ({simple})": (noisy_gguf, simple)}
        try:
            drafters = {f"random {args.kind} ({spec})": (drafter_gguf(args.kind, root / "target", tok, root), spec),
                        **drafters}
        except SpecdrafterError as e:  # llama.cpp cannot serve this family beside this target: its arms are left out
            refused = str(e)
            print(f"no {args.kind} arms: {refused}", flush=True)
        arms = {"target alone": {}}
        arms.update({f"{name}, {mode}": {"draft": gguf, "spec_type": spec_type, "n_max": N_MAX, "p_min": 0.0,
                                         "extra": ["--spec-draft-sampling", mode]}
                     for name, (gguf, spec_type) in drafters.items() for mode in MODES})
        if args.arms:  # the target alone stays: the other arms' "seeds with the target alone's pair" read it
            arms = {arm: a for arm, a in arms.items() if arm == "target alone" or args.arms in arm}
        result = {"samples": args.samples, "kind": args.kind, "noise": args.noise, "arch": args.arch,
                  "target": model.config.model_type, "n_predict": N_PREDICT, "n_max": N_MAX, "alpha": ALPHA,
                  "llama.cpp": llamacpp.SDIST.version, "refused": refused,
                  "command": f"python benchmarks/llamacpp_sampling.py --samples {args.samples} --kind {args.kind} "
                             f"--noise {args.noise}" + ("" if args.arch == "llama" else f" --arch {args.arch}")
                             + (f" --arms {args.arms!r}" if args.arms else ""),
                  "arms": {}}
        alone = None
        for arm, server_args in arms.items():
            print(arm, flush=True)
            with LlamaServer(target_gguf, threads=1, context=256, **server_args) as server:
                probe, probe_accepted = second_token_drafted(server) if server_args else (None, None)
                pairs, drafts = sample_pairs(server, args.samples)
            alone = alone or pairs
            counts = Counter(pairs)
            test = chi2(counts, law, args.samples)
            result.update(bins=test.pop("bins"), pooled_mass=test.pop("pooled_mass"))
            result["arms"][arm] = {
                **test, **drafts, "acceptance": round(drafts["accepted"] / drafts["drafted"], 4) if drafts["drafted"]
                else None, "second_token_drafted": probe, "second_token_accepted": probe_accepted,
                "same_as_target": sum(a == b for a, b in zip(pairs, alone)) / args.samples,
                "pairs": {f"{a},{b}": c for (a, b), c in counts.most_common(5)}}
            print(f"  {result['arms'][arm]}", flush=True)
    result["seconds"] = round(time.monotonic() - start)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    (args.out / "result.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {args.out / 'result.json'}, {args.out / 'result.md'}")


if __name__ == "__main__":
    main()
