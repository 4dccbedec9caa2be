"""Decode benchmark, side by side in one run: target-only HF `generate`, HF assisted generation with our draft
model, and our loops with every drafter given — draft model (chain), EAGLE-3 (chain, EAGLE-2 dynamic tree verified
whole and auto-sized, ASD at T = 0), Medusa (static tree: exact and typical acceptance) — interleaved prompt by
prompt on a fixed sample of MT-Bench, GSM8K and HumanEval first turns, repeated, at each temperature.

    python -m specdrafter.eval.bench_decode recipes/smollm2-135m-generate.yaml --draft-model runs/smollm2-135m/draft-tv/drafter \\
        --eagle3 runs/smollm2-135m/eagle3/drafter --medusa runs/smollm2-135m/medusa/drafter \\
        [--sets mtbench gsm8k humaneval] [--prompts 2] [--max-new-tokens 48] [--repeats 3] [--temperatures 0 1] [--out DIR]
        [--arms eagle3_chain eagle3_asd ...]

Without drafter flags the recipe's own drafter is benchmarked (chain, plus its tree when the recipe sets one).
Per arm: tokens/s (median over repeats), speedup over target-only, τ, α, c (draft time per drafted token ÷ target
step, measured inside the loop), the formula's predicted speedup from the measured α, c and v(n) (target pass over
n tokens ÷ one, measured here), measured/predicted, and the verifier's time per token ÷ target step; for ASD also
its regret per prompt, the outputs that differ from strict greedy and its speed against the strict arm. Writes
bench_decode.json, bench_decode.md and bench_decode.png to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from specdrafter.core.io import SpecdrafterError, atomic_write_json, atomic_write_text
from specdrafter.core.recipe import load_recipe
from specdrafter.data.assets import load_prompt_set
from specdrafter.data.chat import eos_token_ids, user_prompt_ids
from specdrafter.eval.acceptance import alpha_per_token, modal_block_length, predicted_speedup, tree_predicted_speedup
from specdrafter.inference.autotune import TreeSizeTuner, step_costs
from specdrafter.inference.decode import ASDSettings, GenerationResult, speculative_generate, tree_speculative_generate
from specdrafter.inference.medusa import typical_generate
from specdrafter.inference.run import block_length, build_proposer, load_draft_model, load_serving_target
from specdrafter.inference.sampling import SamplingParams

DEFAULT_MEDUSA_TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]
DEFAULT_DYNAMIC_TREE = {"total_tokens": 16, "depth": 4, "top_k": 4}  # verified whole (eagle3_tree)
AUTO_DYNAMIC_TREE = {"total_tokens": 32, "depth": 5, "top_k": 6}  # candidates the tuner sizes from (eagle3_tree_auto)


@dataclass
class Arm:
    name: str
    decode: Callable  # (prompt ids, temperature, generator) → list of new tokens, or a GenerationResult
    shape: str = ""  # "k=4", "tree 17"
    k: object = 0  # chain block length: a number or "auto" (0: not a chain)
    tree_size: int = 0  # tokens per target pass of a tree arm
    greedy_only: bool = False
    runs: Dict[float, List[tuple]] = field(default_factory=dict)  # temperature → [(tokens, seconds)] per repeat
    cycles: Dict[float, list] = field(default_factory=dict)
    outputs: Dict[float, list] = field(default_factory=dict)  # temperature → new tokens per prompt (first repeat)
    per_prompt: Dict[float, List[list]] = field(default_factory=dict)  # temperature → per repeat: [(tokens, seconds)]
    regret: Dict[float, float] = field(default_factory=dict)  # temperature → ASD regret summed over the prompts


def build_arms(cfg, args, target, eos) -> List[Arm]:
    inf, k = cfg.inference, cfg.inference.k
    params = lambda t: SamplingParams(t, inf.top_k, inf.top_p)  # noqa: E731

    def hf(draft=None):
        def run(prompt, t, generator):
            torch.manual_seed(int(generator.initial_seed()))
            sample = dict(do_sample=t > 0, **({"temperature": t, "top_k": 0} if t else {}))
            if draft is None:
                extra = {}
            elif k == "auto":  # HF's own adaptive schedule against ours
                extra = dict(assistant_model=draft)
            else:
                extra = dict(assistant_model=draft, num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                             assistant_confidence_threshold=0.0)
            out = target.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                                  pad_token_id=eos[0], **sample, **extra)
            return out[0, len(prompt):].tolist()
        return run

    def chain(proposer, asd=None):
        block = block_length(inf)  # a tuner (k = auto) per arm, learning across its prompts
        if not isinstance(block, int):
            block.calibrate(target, [1] * 16)  # before any timing
        return lambda prompt, t, g: speculative_generate(target, proposer, prompt, args.max_new_tokens, params(t), block,
                                                         eos, asd, g)

    def tree(proposer):
        sized = getattr(proposer, "tuner", None)  # an auto-sized dynamic tree: one tuner per temperature
        if sized is not None:
            sized.calibrate(target, [1] * 16)  # before any timing
            costs, tuners = {n: x * sized.step_s for n, x in sized.v.items()}, {}

        def run(prompt, t, generator):
            if sized is not None:
                proposer.tuner = tuners.setdefault(t, TreeSizeTuner(sized.max_nodes, step_costs=costs))
            return tree_speculative_generate(target, proposer, prompt, args.max_new_tokens, params(t), eos, generator)
        return run

    def variant(kind, path, **inference):
        c = cfg.copy()
        c.drafter.kind, c.drafter.path = kind, str(path) if path else None
        c.inference.tree, c.inference.dynamic_tree.total_tokens = [], 0
        for key, value in inference.items():
            if isinstance(value, dict):  # a structured sub-config (dynamic_tree): set its fields one by one
                for field_name, x in value.items():
                    c.inference[key][field_name] = x
            else:
                c.inference[key] = value
        return c

    arms = [Arm("target", hf())]
    given = {"draft_model": args.draft_model, "eagle3": args.eagle3, "medusa": args.medusa}
    if not any(given.values()):  # the recipe's own drafter
        given[cfg.drafter.kind.value] = cfg.drafter.path or "recipe"
    if given.get("draft_model") or given.get("self_draft"):
        kind = "draft_model" if given.get("draft_model") else "self_draft"
        c = variant(kind, given.get("draft_model"))
        draft = load_draft_model(c, target)
        arms += [Arm("hf_assisted", hf(draft), f"k={k}"), Arm(f"{kind}_chain", chain(build_proposer(c, target)), f"k={k}", k)]
        if inf.tree:  # the recipe's static tree for the draft model too
            arms.append(Arm(f"{kind}_tree", tree(build_proposer(variant(kind, given.get("draft_model"), tree=inf.tree), target)),
                            f"tree {len(inf.tree) + 1}", tree_size=len(inf.tree) + 1))
    if given.get("eagle3"):
        c = variant("eagle3", given["eagle3"])
        eagle = build_proposer(c, target)
        dyn = {**DEFAULT_DYNAMIC_TREE, **({k_: inf.dynamic_tree[k_] for k_ in DEFAULT_DYNAMIC_TREE}
                                           if inf.dynamic_tree.total_tokens else {})}

        def eagle_tree(name, auto_size, **shape):  # the recipe's (or the default) dynamic tree, all of it or auto-sized
            t = {**dyn, **shape, "auto_size": auto_size}
            label = f"dynamic {t['total_tokens']}/{t['depth']}/{t['top_k']}" + (" auto" if auto_size else "")
            proposer = build_proposer(variant("eagle3", given["eagle3"], dynamic_tree=t), target)
            return Arm(name, tree(proposer), label, tree_size=t["total_tokens"] + 1)

        arms += [Arm("eagle3_chain", chain(eagle), f"k={k}", k), eagle_tree("eagle3_tree", False),
                 eagle_tree("eagle3_tree_auto", True, **AUTO_DYNAMIC_TREE),
                 Arm("eagle3_asd", chain(eagle, ASDSettings(inf.asd.budget, inf.asd.gate, inf.asd.max_mismatches)),
                     f"k={k} B={inf.asd.budget:g}", k, greedy_only=True)]
    if given.get("medusa"):
        choices = [list(x) for x in inf.tree] or DEFAULT_MEDUSA_TREE
        medusa = build_proposer(variant("medusa", given["medusa"], tree=choices), target)
        size = len(choices) + 1
        typical = lambda prompt, t, g: typical_generate(target, medusa, prompt, args.max_new_tokens, t,  # noqa: E731
                                                        inf.typical.eps, inf.typical.delta, eos, g)
        arms += [Arm("medusa_tree", tree(medusa), f"tree {size}", tree_size=size),
                 Arm("medusa_typical", typical, f"tree {size}", tree_size=size)]
    return arms


def measure(arms: List[Arm], prompts: List[List[int]], temperatures: List[float], repeats: int, seed: int) -> None:
    """Every arm on every prompt, interleaved (arm order rotates per prompt, so no arm always runs first)."""
    for t in temperatures:
        active = [a for a in arms if not (a.greedy_only and t > 0)]
        for r in range(repeats):
            totals = {a.name: [0, 0.0] for a in active}
            for a in active:
                a.per_prompt.setdefault(t, []).append([None] * len(prompts))
            for i, prompt in enumerate(prompts):
                for a in active[i % len(active):] + active[:i % len(active)]:
                    generator = torch.Generator().manual_seed(seed + i)
                    start = time.perf_counter()
                    out = a.decode(prompt, t, generator)
                    seconds = time.perf_counter() - start
                    tokens = out.tokens if isinstance(out, GenerationResult) else out
                    totals[a.name][0] += len(tokens)
                    totals[a.name][1] += seconds
                    a.per_prompt[t][r][i] = (len(tokens), seconds)
                    if r == 0:
                        a.outputs.setdefault(t, []).append(tokens)
                    if isinstance(out, GenerationResult) and r == 0:
                        a.cycles.setdefault(t, []).extend(out.cycles)
                        a.regret[t] = a.regret.get(t, 0.0) + out.asd_regret
            for a in active:
                a.runs.setdefault(t, []).append(tuple(totals[a.name]))
            print(f"T={t:g} repeat {r + 1}/{repeats}: " + ", ".join(
                f"{a.name} {totals[a.name][0] / totals[a.name][1]:.1f}" for a in active) + " tok/s", file=sys.stderr)


def set_speed(arm: Arm, t: float, members: List[int]) -> float:
    """tok/s of `arm` over the prompts `members` (one prompt set), median over repeats."""
    return statistics.median(sum(run[i][0] for i in members) / sum(run[i][1] for i in members)
                             for run in arm.per_prompt[t])


def table(arms: List[Arm], temperatures: List[float], one: float, v: Dict[int, float],
          sets: Optional[List[str]] = None) -> List[dict]:
    """One row per arm and temperature; `sets` (the prompt set of each prompt) adds the speedup on each set."""
    groups = {name: [i for i, x in enumerate(sets) if x == name] for name in dict.fromkeys(sets)} if sets else {}
    rows = []
    for t in temperatures:
        base = statistics.median(n / s for n, s in arms[0].runs[t])
        for a in arms:
            if t not in a.runs:
                continue
            speed = statistics.median(n / s for n, s in a.runs[t])
            row = {"temperature": t, "arm": a.name, "shape": a.shape, "tokens_per_s": round(speed, 2),
                   "speedup": round(speed / base, 3), "repeats": [round(n / s, 2) for n, s in a.runs[t]]}
            if len(groups) > 1:
                row["speedup_by_set"] = {name: round(set_speed(a, t, m) / set_speed(arms[0], t, m), 3)
                                         for name, m in groups.items()}
            cs = a.cycles.get(t)
            if cs:
                tokens = a.runs[t][0][0]
                drafted = sum(c.drafted for c in cs) if a.k else len(cs)
                c = sum(x.draft_s for x in cs) / max(drafted, 1) / one
                alpha = alpha_per_token(cs)
                k = modal_block_length(cs)  # the fixed k, or where the tuner settled
                predicted = (predicted_speedup(alpha, k, c, v[k + 1]) if a.k
                             else tree_predicted_speedup(tokens / len(cs), cs, c, v))
                row["k_used"] = k if a.k else None
                if a.tree_size:
                    row["mean_tree_size"] = round(sum(x.size for x in cs) / len(cs), 2)
                row.update(tau=round(tokens / len(cs), 3), alpha=round(alpha, 3), c=round(c, 3),
                           predicted_speedup=round(predicted, 3), measured_over_predicted=round(speed / base / predicted, 3),
                           verifier_per_token_vs_target_step=round(sum(x.verifier_s for x in cs) / tokens / one, 4))
            strict = next((b for b in arms if b.name == a.name.replace("_asd", "_chain")), None)
            if a.name.endswith("_asd") and strict is not None and t in strict.outputs:  # ASD is lossy: what it cost
                pairs = list(zip(a.outputs[t], strict.outputs[t]))
                row.update(asd_regret_per_prompt=round(a.regret[t] / len(pairs), 3),
                           outputs_differing=f"{sum(x != y for x, y in pairs)}/{len(pairs)}",
                           vs_strict=round(speed / statistics.median(n / s for n, s in strict.runs[t]) - 1, 3))
            rows.append(row)
    return rows


def markdown(rows: List[dict], header: str) -> str:
    lines = [header, "", "| T | arm | shape | tok/s | speedup | τ | α | c | predicted | measured/predicted | verifier/token ÷ "
                         "target step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = r["shape"] + (f" ({r['k_used']})" if "auto" in r["shape"] and r.get("k_used") else "")
        shape += f" (mean {r['mean_tree_size']:g})" if "auto" in r["shape"] and r.get("mean_tree_size") else ""
        lines.append(f"| {r['temperature']:g} | {r['arm']} | {shape} | {r['tokens_per_s']} | {r['speedup']} | "
                     f"{r.get('tau', '')} | {r.get('alpha', '')} | {r.get('c', '')} | {r.get('predicted_speedup', '')} | "
                     f"{r.get('measured_over_predicted', '')} | {r.get('verifier_per_token_vs_target_step', '')} |")
    by_set = [r for r in rows if "speedup_by_set" in r]
    if by_set:
        names = list(by_set[0]["speedup_by_set"])
        lines += ["", "Speedup over target-only on each prompt set (same run):", "",
                  "| T | arm | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        lines += [f"| {r['temperature']:g} | {r['arm']} | " + " | ".join(str(r["speedup_by_set"][n]) for n in names) + " |"
                  for r in by_set]
    asd = [r for r in rows if "asd_regret_per_prompt" in r]
    if asd:
        lines += ["", "ASD (lossy) against strict greedy with the same drafter and block length:", "",
                  "| arm | tok/s vs strict | regret / prompt | outputs differing |", "|---|---|---|---|"]
        lines += [f"| {r['arm']} | {r['vs_strict']:+.1%} | {r['asd_regret_per_prompt']} | {r['outputs_differing']} |"
                  for r in asd]
    return "\n".join(lines) + "\n"


def plot(rows: List[dict], temperatures: List[float], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["arm"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 1.1), 3.8))
    width = 0.8 / len(temperatures)
    for j, t in enumerate(temperatures):
        by = {r["arm"]: r for r in rows if r["temperature"] == t}
        xs = [i + j * width for i, n in enumerate(names) if n in by]
        ax.bar(xs, [by[n]["speedup"] for n in names if n in by], width, label=f"measured, T={t:g}")
        ax.plot([x for x, n in zip(xs, [n for n in names if n in by]) if "predicted_speedup" in by[n]],
                [by[n]["predicted_speedup"] for n in names if n in by and "predicted_speedup" in by[n]], "k_", ms=14)
    ax.axhline(1, color="grey", lw=0.8, ls="--")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=25, ha="right")
    ax.set(ylabel="speedup over target-only", title="Decode speed (bars: measured; dashes: predicted)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--draft-model")
    parser.add_argument("--eagle3")
    parser.add_argument("--medusa")
    parser.add_argument("--sets", nargs="+", default=["mtbench", "gsm8k", "humaneval"])
    parser.add_argument("--prompts", type=int, default=2, help="per set")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--arms", nargs="+", help="only these arms (names as in the table; the target always runs)")
    parser.add_argument("--out", default="runs/bench")
    args = parser.parse_args(argv)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        target, tokenizer = load_serving_target(cfg)
        eos = eos_token_ids(target, tokenizer)
        arms = build_arms(cfg, args, target, eos)
        unknown = sorted(set(args.arms or []) - {a.name for a in arms})
        if unknown:
            raise SpecdrafterError(f"--arms: no arm {unknown[0]!r} with these drafters (arms: {', '.join(a.name for a in arms)})")
        arms = [a for a in arms if a.name == "target" or not args.arms or a.name in args.arms]
        records, origins = [], []  # the prompts, and the set each came from
        for name in args.sets:
            chosen = load_prompt_set(name)[: args.prompts]
            records, origins = records + chosen, origins + [name] * len(chosen)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    prompts = [user_prompt_ids(tokenizer, r["turns"][0]) for r in records]
    longest = cfg.inference.k_max if cfg.inference.k == "auto" else cfg.inference.k
    grids = [TreeSizeTuner(a.tree_size - 1).sizes() for a in arms if a.tree_size]  # auto-sized trees: v(n) between
    sizes = sorted({*range(1, longest + 2), *(a.tree_size for a in arms if a.tree_size), *(n for g in grids for n in g)})
    costs = step_costs(target, prompts[0], sizes)
    one, v = costs[1], {n: x / costs[1] for n, x in costs.items()}
    print(f"target step {one * 1e3:.1f} ms; v(n) = " + ", ".join(f"{n}: {x:.2f}" for n, x in v.items()), file=sys.stderr)
    measure(arms, prompts, args.temperatures, args.repeats, cfg.inference.seed)
    rows = table(arms, args.temperatures, one, v, origins)
    out = Path(args.out)
    header = (f"Decode benchmark: {len(prompts)} prompts ({', '.join(args.sets)}), {args.max_new_tokens} new tokens, "
              f"median of {args.repeats} repeats; target step {one * 1e3:.1f} ms; v(n) = "
              + ", ".join(f"{n}: {x:.2f}" for n, x in v.items()))
    atomic_write_json(out / "bench_decode.json", {"prompts": [r["id"] for r in records], "max_new_tokens": args.max_new_tokens,
                                                  "repeats": args.repeats, "target_step_s": one, "v": v, "rows": rows})
    atomic_write_text(out / "bench_decode.md", markdown(rows, header))
    plot(rows, args.temperatures, out / "bench_decode.png")
    print(markdown(rows, header))


if __name__ == "__main__":
    main()
