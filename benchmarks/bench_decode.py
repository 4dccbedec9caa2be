"""Decode benchmark, side by side in one run: target-only HF `generate`, HF assisted generation with our draft
model, and our loops with every drafter given — draft model (chain), EAGLE-3 (chain, EAGLE-2 dynamic tree verified
whole and auto-sized, ASD at T = 0), Medusa (static tree: exact and typical acceptance) — interleaved prompt by
prompt on a fixed sample of MT-Bench, GSM8K and HumanEval first turns, repeated, at each temperature.

    python benchmarks/bench_decode.py recipes/smollm2-135m-generate.yaml [key=value ...] \\
        --draft-model runs/smollm2-135m/draft-tv/drafter --eagle3 runs/smollm2-135m/eagle3/drafter \\
        --medusa runs/smollm2-135m/medusa/drafter \\
        [--sets mtbench gsm8k humaneval] [--prompts 2] [--max-new-tokens 48] [--repeats 3] [--temperatures 0 1] [--out DIR]
        [--arms eagle3_chain eagle3_asd ...]

Without drafter flags the recipe's own drafter is benchmarked (chain, plus its tree when the recipe sets one).
Per arm: tokens/s (median over repeats), speedup over target-only (the median over repeats of the speedup within
each repeat, under results.json's side-by-side keys: speedup_median, speedup_range, speedup_rounds) with its spread
(their max − min; "⚠ noisy" where that exceeds |speedup − 1|), τ, α, c (draft time per drafted token ÷ target step,
measured inside the loop), the formula's predicted speedup from the measured α, c and v(n) (target pass over n tokens
÷ one, measured here with its spread and fitted monotone), measured/predicted, and the verifier's time per token ÷
target step; for ASD also its regret per prompt, the outputs that differ from strict greedy and its speed against
the strict arm. Writes bench_decode.json, bench_decode.md and bench_decode.png to --out.

With --llamacpp, after the loop's arms, each drafter given that llama.cpp serves (EAGLE-3, DFlash, DSpark, draft
model) is also served by llama-server from its GGUF export (exported beside it once; the target converted into the
cache once) and measured on the same prompts and temperatures, with and without the drafter alternating prompt by
prompt (engines/llamacpp_eval.py's arm): at the loop's k and at the k llama.cpp's measured costs pick, one thread per
server (--llamacpp-threads). Needs `specdrafter-llamacpp install`; nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from specdrafter.core.io import SpecdrafterError, atomic_write_json, atomic_write_text
from specdrafter.core.recipe import EvalVerifier
from specdrafter.core.recipe_checks import as_chain
from specdrafter.data.assets import load_prompt_set, load_target
from specdrafter.data.chat import eos_token_ids, user_prompt_ids
from specdrafter.engines.serve import gguf_pair, plan
from specdrafter.eval import llamacpp as llama_arm
from specdrafter.eval.acceptance import (
    NOISY,
    NOISY_LEGEND,
    SideBySideSpeedup,
    cycle_metrics,
    is_noisy,
    range_of,
    spread_label,
)
from specdrafter.eval.report import machine_line
from specdrafter.export.source import target_of
from specdrafter.inference.autotune import TreeSizeTuner, measure_pass_costs
from specdrafter.inference.decode import GenerationResult
from specdrafter.inference.decoder import build_decoder
from specdrafter.inference.sampling import SamplingParams
from specdrafter.jobs.decode import load_serving_target
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import KINDS, ArmSpec, Kind, drafter_path

Decode = Callable  # (prompt ids, temperature, generator) → list of new tokens, or a GenerationResult


@dataclass
class Arm:
    name: str
    decode: Decode
    shape: str = ""  # "k=4", "tree 17"
    k: object = 0  # chain block length: a number or "auto" (0: not a chain)
    tree_size: int = 0  # tokens per target pass of a tree arm
    greedy_only: bool = False
    runs: Dict[float, List[tuple]] = field(default_factory=dict)  # temperature → [(tokens, seconds)] per repeat
    cycles: Dict[float, list] = field(default_factory=dict)
    outputs: Dict[float, list] = field(default_factory=dict)  # temperature → new tokens per prompt (first repeat)
    per_prompt: Dict[float, List[list]] = field(default_factory=dict)  # temperature → per repeat: [(tokens, seconds)]
    regret: Dict[float, float] = field(default_factory=dict)  # temperature → ASD regret summed over the prompts


@dataclass(frozen=True)
class Setup:
    """What every arm decodes with."""

    target: torch.nn.Module
    eos: List[int]
    max_new_tokens: int
    inference: DictConfig  # the recipe's inference section (k, sampling, trees, ASD, typical)

    def sampling(self, t: float) -> SamplingParams:
        return SamplingParams(t, self.inference.top_k, self.inference.top_p)


def given_drafters(args) -> Dict[str, str]:
    """{kind: folder} of the drafter flags given (`--eagle3 PATH`, `--dspark PATH`, ...)."""
    return {name: getattr(args, name) for name in KINDS if getattr(args, name, None)}


def serving_target(cfg: DictConfig, args):
    """The target the arms verify with. A drafter flag names the recipe's own drafter when the recipe gives no
    drafter.path (`--dspark PATH` with the DSpark recipe); a recipe whose kind no flag names serves its plain target."""
    given = given_drafters(args)
    if given and not cfg.drafter.path:
        if cfg.drafter.kind not in given:
            return load_target(cfg.target.model, cfg.target.dtype.value, cfg.target.device,
                               cfg.target.untested_architecture)
        cfg.drafter.path = str(given[cfg.drafter.kind])
    return load_serving_target(cfg, drafter_path(cfg))


def build_arms(cfg: DictConfig, args, target, eos: List[int]) -> List[Arm]:
    """What is measured: target-only HF `generate`, then the arms of every drafter given (`--<kind> PATH`), or of the
    recipe's own drafter; each kind names its arms (kinds/: decoding.bench_arms)."""
    setup = Setup(target, eos, args.max_new_tokens, cfg.inference)
    given = given_drafters(args)
    if not given:  # the recipe's own drafter
        given[cfg.drafter.kind] = cfg.drafter.path
    arms = [Arm("target", hf_decoder(setup))]
    for name, path in given.items():
        arms += [build_arm(cfg, setup, KINDS[name], path, spec) for spec in KINDS[name].decoding.bench_arms(cfg, name)]
    return arms


def build_arm(cfg: DictConfig, setup: Setup, kind: Kind, path: Optional[str], spec: ArmSpec) -> Arm:
    c = variant(cfg, kind.name, path, spec.drafter, **spec.inference)
    if spec.hf_assisted:  # HF assisted generation with the draft model itself
        return Arm(spec.name, hf_decoder(setup, kind.decoding.assistant_model(c, setup.target, drafter_path(c))), spec.label)
    c.inference.verifier = spec.verifier.rule
    c.inference.max_new_tokens = setup.max_new_tokens
    decode = our_decoder(setup, c, kind.decoding.proposer(c, setup.target, drafter_path(c)))
    if spec.verifier.is_chain:
        return Arm(spec.name, decode, spec.label, spec.k, greedy_only=spec.verifier is EvalVerifier.asd)
    return Arm(spec.name, decode, spec.label, tree_size=spec.tree_size)


def variant(cfg: DictConfig, kind: str, path, drafter: Optional[dict] = None, **inference) -> DictConfig:
    """The recipe with drafter `kind` at `path`, no tree unless given, and the `drafter` and `inference` keys set."""
    c = as_chain(cfg)
    c.drafter.kind, c.drafter.path = kind, str(path) if path else None
    for section, keys in (("drafter", drafter or {}), ("inference", inference)):
        for key, value in keys.items():
            if isinstance(value, dict):  # a structured sub-config (dynamic_tree, block): set its fields one by one
                for field_name, x in value.items():
                    OmegaConf.update(c, f"{section}.{key}.{field_name}", x)  # converts to the field's type (an enum)
            else:
                OmegaConf.update(c, f"{section}.{key}", value)
    return c


# ------------------------------------------------------------------------------------------- decoders
def hf_decoder(setup: Setup, draft=None) -> Decode:
    """HF `generate`: target-only, or assisted by `draft` with k drafted tokens per step (at k = auto, HF's own
    adaptive schedule against ours)."""
    k = setup.inference.k
    if draft is None:
        assist = {}
    elif k == "auto":
        assist = dict(assistant_model=draft)
    else:
        assist = dict(assistant_model=draft, num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)

    def run(prompt, t, generator):
        torch.manual_seed(int(generator.initial_seed()))
        sample = dict(do_sample=t > 0, **({"temperature": t, "top_k": 0} if t else {}))
        out = setup.target.generate(torch.tensor([prompt], device=setup.target.device), max_new_tokens=setup.max_new_tokens,
                                    eos_token_id=setup.eos, pad_token_id=setup.eos[0], **sample, **assist)
        return out[0, len(prompt):].tolist()
    return run


def our_decoder(setup: Setup, cfg: DictConfig, proposer) -> Decode:
    """Our loops (inference/decoder.py:build_decoder), one decoder per arm, calibrated before any timing: a chain's
    tuners learn across the arm's prompts and temperatures; an auto-sized tree gets one size tuner per temperature,
    sharing that calibration (Decoder.at)."""
    decoder = build_decoder(cfg.inference, setup.target, proposer, setup.eos)
    decoder.calibrate([1] * 16)
    at: Dict[float, object] = {}
    return lambda prompt, t, g: at.setdefault(t, decoder.at(t))(prompt, g)


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


def set_speeds(arm: Arm, t: float, members: List[int]) -> List[float]:
    """tok/s of `arm` over the prompts `members` (one prompt set), one per repeat."""
    return [sum(run[i][0] for i in members) / sum(run[i][1] for i in members) for run in arm.per_prompt[t]]


def speeds(arm: Arm, t: float) -> List[float]:
    """tok/s of `arm` over all prompts, one per repeat."""
    return [n / s for n, s in arm.runs[t]]


def side_by_side(mine: List[float], base: List[float]) -> SideBySideSpeedup:
    """The speedup of tok/s `mine` over the baseline's `base`, one of each per repeat: both ran in the same repeat,
    interleaved, so each repeat's ratio cancels what the machine did between repeats. Its median (the lower middle
    one for an even count), their max − min (None with a single repeat), the ratios, the median repeat's baseline."""
    ratios = [x / y for x, y in zip(mine, base)]
    median = statistics.median_low(ratios)
    return SideBySideSpeedup(round(median, 3), _round(range_of(ratios)), [round(x, 3) for x in ratios],
                             round(base[ratios.index(median)], 2))


def _round(x: Optional[float], digits: int = 3) -> Optional[float]:
    return None if x is None else round(x, digits)


def table(arms: List[Arm], temperatures: List[float], one: float, v: Dict[int, float],
          sets: Optional[List[str]] = None) -> List[dict]:
    """One row per arm and temperature; `sets` (the prompt set of each prompt) adds the speedup on each set."""
    groups = {name: [i for i, x in enumerate(sets) if x == name] for name in dict.fromkeys(sets)} if sets else {}
    rows = []
    for t in temperatures:
        target = arms[0]
        for a in arms:
            if t not in a.runs:
                continue
            speedup = side_by_side(speeds(a, t), speeds(target, t))
            row = {"temperature": t, "arm": a.name, "shape": a.shape, "tokens_per_s": round(statistics.median(speeds(a, t)), 2),
                   **speedup.row(), "repeats": [round(x, 2) for x in speeds(a, t)]}
            if len(groups) > 1:
                by_set = {name: side_by_side(set_speeds(a, t, m), set_speeds(target, t, m)) for name, m in groups.items()}
                row["speedup_by_set"] = {name: s.median for name, s in by_set.items()}
                row["speedup_by_set_spread"] = {name: s.range for name, s in by_set.items()}
            if a.cycles.get(t):  # the first repeat's cycles and tokens
                metrics = cycle_metrics(a.cycles[t], a.runs[t][0][0], one, v, chain=bool(a.k))
                keep = ["k_used", "mean_drafted", "mean_tree_size", "tau", "alpha", "c", "predicted_speedup",
                        "verifier_per_token_vs_target_step"]
                row.update({key: value for key, value in metrics.rounded().items() if key in keep})
                if metrics.predicted_speedup:
                    row["measured_over_predicted"] = round(speedup.median / metrics.predicted_speedup, 3)
            strict = next((b for b in arms if b.name == a.name.replace("_asd", "_chain")), None)
            if a.name.endswith("_asd") and strict is not None and t in strict.outputs:  # ASD is lossy: what it cost
                pairs = list(zip(a.outputs[t], strict.outputs[t]))
                ratio = side_by_side(speeds(a, t), speeds(strict, t))
                row.update(asd_regret_per_prompt=round(a.regret[t] / len(pairs), 3),
                           outputs_differing=f"{sum(x != y for x, y in pairs)}/{len(pairs)}",
                           vs_strict=round(ratio.median - 1, 3), vs_strict_spread=ratio.range)
            rows.append(row)
    return rows


def markdown(rows: List[dict], header: str) -> str:
    lines = [header, "", "| T | arm | shape | tok/s | speedup | spread | τ | α | c | predicted | measured/predicted | "
                         "verifier/token ÷ target step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = r["shape"] + (f" ({r['k_used']})" if "auto" in r["shape"] and r.get("k_used") else "")
        shape += f" (mean {r['mean_tree_size']:g})" if "auto" in r["shape"] and r.get("mean_tree_size") else ""
        shape += f" (mean {r['mean_drafted']:g})" if "confidence" in r["shape"] and r.get("mean_drafted") else ""
        lines.append(f"| {r['temperature']:g} | {r['arm']} | {shape} | {r['tokens_per_s']} | {r['speedup_median']} | "
                     f"{spread_label(r['speedup_median'], r['speedup_range'])} | "
                     f"{r.get('tau', '')} | {r.get('alpha', '')} | {r.get('c', '')} | {r.get('predicted_speedup', '')} | "
                     f"{r.get('measured_over_predicted', '')} | {r.get('verifier_per_token_vs_target_step', '')} |")
    lines += ["", "spread: max − min over the repeats of the speedup measured within each repeat (none with one repeat). "
              + NOISY_LEGEND]
    by_set = [r for r in rows if "speedup_by_set" in r]
    if by_set:
        names = list(by_set[0]["speedup_by_set"])
        lines += ["", "Speedup over target-only on each prompt set (same run; in brackets its spread):", "",
                  "| T | arm | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        lines += [f"| {r['temperature']:g} | {r['arm']} | " + " | ".join(
            f"{r['speedup_by_set'][n]} ({spread_label(r['speedup_by_set'][n], r.get('speedup_by_set_spread', {}).get(n))})"
            for n in names) + " |" for r in by_set]
    asd = [r for r in rows if "asd_regret_per_prompt" in r]
    if asd:
        lines += ["", "ASD (lossy) against strict greedy with the same drafter and block length:", "",
                  "| arm | tok/s vs strict | spread | regret / prompt | outputs differing |", "|---|---|---|---|---|"]
        lines += [f"| {r['arm']} | {r['vs_strict']:+.1%} | {_percent_spread(1 + r['vs_strict'], r['vs_strict_spread'])} | "
                  f"{r['asd_regret_per_prompt']} | {r['outputs_differing']} |" for r in asd]
    return "\n".join(lines) + "\n"


def _percent_spread(ratio: float, spread: Optional[float]) -> str:
    if spread is None:
        return ""
    return f"{spread:.1%}" + (f" {NOISY}" if is_noisy(ratio, spread) else "")


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
        ax.bar(xs, [by[n]["speedup_median"] for n in names if n in by], width, label=f"measured, T={t:g}")
        ax.plot([x for x, n in zip(xs, [n for n in names if n in by]) if "predicted_speedup" in by[n]],
                [by[n]["predicted_speedup"] for n in names if n in by and "predicted_speedup" in by[n]], "k_", ms=14)
    ax.axhline(1, color="grey", lw=0.8, ls="--")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=25, ha="right")
    ax.set(ylabel="speedup over target-only", title="Decode speed (bars: measured; dashes: predicted)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def llamacpp_rows(cfg: DictConfig, args, prompts: List[List[int]]) -> List[dict]:
    """Each given drafter llama.cpp serves, in llama-server beside the target alone: at the loop's k and the plan's."""
    folder = target_of(cfg).folder
    given = given_drafters(args) or {cfg.drafter.kind: cfg.drafter.path}
    rows = []
    for name, path in given.items():
        if KINDS[name].export.llamacpp is None or path is None:
            print(f"llama.cpp: no {name} drafter there, skipped", file=sys.stderr)
            continue
        drafter, target = gguf_pair(Path(path), folder)
        cal = plan(drafter, target, args.llamacpp_threads)
        choice = cal.choose()
        ks = sorted({k for k in (cfg.inference.k, choice.k) if k != "auto" and k <= drafter.max_k})
        for t in args.temperatures:
            for k in ks:
                arm = llama_arm.side_by_side(target, drafter.gguf, drafter.spec_type, k, prompts, args.max_new_tokens, t,
                                   args.llamacpp_threads, "f32", cal, log=lambda line: print(line, file=sys.stderr))
                rows.append({"arm": f"{name}_llamacpp", "chosen": k == choice.k, "plan_pays": choice.pays, **asdict(arm),
                             "measured_over_predicted": round(arm.speedup_median / arm.predicted_speedup, 3)})
                print(f"llama.cpp {name} T={t:g} k={k}: {arm.speedup_median}× (predicted {arm.predicted_speedup}×)",
                      file=sys.stderr)
    return rows


def identical_label(row: dict) -> str:
    """T = 0: answers identical to target-only decoding, and the ties among the departures."""
    if row["identical"] is None:
        return ""
    ties = sum(d["tie"] for d in row["departures"])
    return f"{row['identical']}/{row['prompts']}" + (f" ({ties} tie(s))" if ties else "")


def llamacpp_markdown(rows: List[dict]) -> str:
    lines = ["", "llama.cpp (llama-server with the drafter's GGUF vs the same server without it, alternating prompt by "
             "prompt; speedup = median of the per-prompt ratios, spread = their max − min; α, τ from llama.cpp's "
             "counters; predicted = τ ÷ (v(k+1) + c(k)) at llama.cpp's measured costs; * = the k its plan picks):", "",
             "| T | arm | k | target tok/s | drafted tok/s | speedup | spread | τ | α | predicted | measured/predicted "
             "| T = 0 identical |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['temperature']:g} | {r['arm']} | {r['k']}{'*' if r['chosen'] else ''} | {r['alone_tokens_per_s']} "
              f"| {r['drafted_tokens_per_s']} | {r['speedup_median']} | "
              f"{spread_label(r['speedup_median'], r['speedup_range'])} | {r['tau']} | {r['alpha']} | "
              f"{r['predicted_speedup']} | {r['measured_over_predicted']} | "
              f"{identical_label(r)} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    for k in KINDS.values():
        if k.decoding.needs_folder:  # --draft-model, --eagle3, --medusa, ...: that kind's drafter folder
            parser.add_argument(f"--{k.name.replace('_', '-')}", dest=k.name, metavar="PATH")
    parser.add_argument("--sets", nargs="+", default=["mtbench", "gsm8k", "humaneval"])
    parser.add_argument("--prompts", type=int, default=2, help="per set")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--arms", nargs="+", help="only these arms (names as in the table; the target always runs)")
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--llamacpp", action="store_true", help="also serve each drafter in llama-server and measure it")
    parser.add_argument("--llamacpp-threads", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        target, tokenizer = serving_target(cfg, args)
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
    costs = measure_pass_costs(target, prompts[0], sizes)
    machine = {"target_step_s": costs.step_s, "target_step_spread": costs.step_spread, "v": costs.v, "v_raw": costs.v_raw,
               "v_spread": costs.spread, "v_repeats": costs.repeats}
    print(machine_line(machine), file=sys.stderr)
    measure(arms, prompts, args.temperatures, args.repeats, cfg.inference.seed)
    rows = table(arms, args.temperatures, costs.step_s, costs.v, origins)
    try:  # after the loop's arms, one engine at a time: llama.cpp's threads spin
        llama_rows = llamacpp_rows(cfg, args, prompts) if args.llamacpp else []
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    out = Path(args.out)
    header = (f"Decode benchmark: {len(prompts)} prompts ({', '.join(args.sets)}), {args.max_new_tokens} new tokens, "
              f"median of {args.repeats} repeats; " + machine_line(machine))
    atomic_write_json(out / "bench_decode.json", {"prompts": [r["id"] for r in records], "max_new_tokens": args.max_new_tokens,
                                                  "repeats": args.repeats, **machine, "rows": rows,
                                                  "llamacpp_rows": llama_rows})
    text = markdown(rows, header) + (llamacpp_markdown(llama_rows) if llama_rows else "")
    atomic_write_text(out / "bench_decode.md", text)
    plot(rows, args.temperatures, out / "bench_decode.png")
    print(text)


if __name__ == "__main__":
    main()
