"""The τ-vs-target-tokens curve: does more target data make a drafter that accelerates decoding?

    python launch/scaling.py recipes/smollm2-135m-scaling.yaml [key=value ...]
    python -m specdrafter.eval.scaling recipes/smollm2-135m-scaling.yaml [key=value ...]   (the same)

For the recipe's data source (data.responses) one data job is grown, shard by shard, until it holds the largest of
`scaling.budgets` target tokens; then, for each budget, an EAGLE-3 head is trained on the dataset's first
conversations holding that many target tokens (train.data_tokens) and evaluated through the real decoding loop
(eval.sets × eval.temperatures × chain at inference.k and the auto-sized dynamic tree). At `scaling.compare_budget`
the other source is trained and evaluated too: regenerated (target) vs teacher-forced (dataset) at equal tokens.

Every step is one of the project's own commands, run as a subprocess (`python -m specdrafter.jobs.data`,
`.jobs.train`, `.eval.job`), each resuming where it stopped, so rerunning the same command after a kill continues
the curve. After every evaluated run `scaling.json`, `scaling.md` and `tau_vs_tokens.png` are rewritten in
output_dir: a budget still training appears as not reached.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from specdrafter.core.io import SpecdrafterError, atomic_write_json, atomic_write_text, complete_checkpoints  # noqa: E402
from specdrafter.core.recipe import save_recipe  # noqa: E402
from specdrafter.eval.acceptance import speedup_of  # noqa: E402
from specdrafter.jobs.cli import cli  # noqa: E402
from specdrafter.jobs.plan import check_against_target  # noqa: E402

log = logging.getLogger("specdrafter")


def command(module: str, recipe: str, overrides: List[str], *extra: str) -> None:
    """Run `python -m module` (a command of the package, so no checkout is needed) with the scaling recipe plus
    `extra` overrides; a failure stops the curve in one line."""
    cmd = [sys.executable, "-m", module, recipe, *overrides, *extra]
    log.info("$ python " + " ".join(cmd[1:]))
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise SpecdrafterError(f"{module} failed (exit {done.returncode}); rerun the same scaling command to resume")


def response_tokens(data_dir: Path) -> int:
    stats = data_dir / "stats.json"
    return json.loads(stats.read_text())["response_tokens"] if stats.is_file() else 0


def ensure_data(cfg: DictConfig, recipe: str, overrides: List[str], source: str, tokens: int, data_dir: Path) -> int:
    """Grow the data job of `source` until it holds `tokens` target tokens (whole shards are kept on each rerun)."""
    per_conversation = cfg.scaling.tokens_per_conversation
    conversations = 0
    while (have := response_tokens(data_dir)) < tokens:
        stats = json.loads((data_dir / "stats.json").read_text()) if have else None
        if stats:  # the measured tokens per conversation size the next step
            per_conversation = max(1.0, have / stats["conversations"])
            if stats["conversations"] < conversations:  # the prompt set is exhausted
                raise SpecdrafterError(f"{data_dir} holds {have} target tokens, fewer than the {tokens} asked, and the "
                                       "prompt set has no more conversations; lower scaling.budgets")
        shard = cfg.data.shard_size
        conversations = max(conversations + shard, math.ceil(tokens * 1.05 / per_conversation / shard) * shard)
        command("specdrafter.jobs.data", recipe, overrides, f"output_dir={data_dir}", f"data.responses={source}",
                f"data.num_conversations={conversations}")
    return response_tokens(data_dir)


def summarise(results: Path) -> Dict[str, dict]:
    """{ "<set>|T=<t>|<verifier>": {tau, alpha, the speedup's fields, ...} } from an eval job's results.json (newest
    checkpoint)."""
    data = json.loads(results.read_text())
    out = {}
    for c in data["cells"]:
        if c["sweep"] or c["verifier"] == "asd":
            continue
        speedup = speedup_of(c)
        out[f"{c['set']}|T={c['temperature']:g}|{c['verifier']}"] = {
            "tau": c.get("tau"), "alpha": c.get("alpha"), **(speedup.row() if speedup else {}),
            **{k: c.get(k) for k in ("predicted_speedup", "k_used", "mean_tree_size")}}
    return out


def run_scaling(cfg: DictConfig, recipe: str, overrides: List[str]) -> Path:
    out = Path(cfg.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    save_recipe(cfg, out)
    s = cfg.scaling
    main_source = cfg.data.responses.value
    if main_source == "mix":
        raise SpecdrafterError("recipe key 'data.responses': a scaling curve needs one source (target or dataset), not mix")
    other = "target" if main_source == "dataset" else "dataset"
    runs = [(main_source, b) for b in sorted(s.budgets)]
    if s.compare_budget:
        runs += [(other, s.compare_budget)]
        if s.compare_budget not in s.budgets:
            runs += [(main_source, s.compare_budget)]
    report_path = out / "scaling.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {"runs": {}}
    report["settings"] = {"budgets": sorted(s.budgets), "compare_budget": s.compare_budget, "source": main_source,
                          "sets": list(cfg.eval.sets), "temperatures": list(cfg.eval.temperatures),
                          "epochs": cfg.train.epochs, "k": cfg.inference.k}
    for source, budget in sorted(runs, key=lambda r: (r[1], r[0] != main_source)):
        name = f"{source}-{budget}"
        data_dir = out / f"data-{source}"
        ensure_data(cfg, recipe, overrides, source, budget, data_dir)
        run_dir = out / name
        command("specdrafter.jobs.train", recipe, overrides, f"output_dir={run_dir}", f"train.data_dir={data_dir}",
                f"train.data_tokens={budget}")
        newest = complete_checkpoints(run_dir / "checkpoints")[-1]
        state = json.loads((newest / "trainer_state.json").read_text())
        command("specdrafter.engines.evaluate", recipe, overrides, f"output_dir={run_dir}", f"eval.checkpoint={newest}",
                f"eval.output_dir={run_dir / 'eval'}", "eval.k_sweep=[]", "eval.verifiers=[chain,tree]")
        report["runs"][name] = {"source": source, "budget": budget, "step": state["step"],
                                "tokens_seen": state["tokens"], "heldout": state.get("metrics"),
                                "cells": summarise(run_dir / "eval" / "results.json")}
        atomic_write_json(report_path, report)
        write_scaling_report(report, out)
    log.info(f"scaling: {len(report['runs'])} runs trained and evaluated ({', '.join(report['runs'])}) → {out / 'scaling.md'}")
    return out


ALPHA_FOR_TAU_3 = 0.7413  # the per-token acceptance α with 1 + α + α² + α³ + α⁴ = 3: τ = 3 at k = 4 (i.i.d. model)


def alpha_trend(points: List[tuple]) -> Optional[Tuple[float, float]]:
    """Least-squares line α = a + b · log10(tokens) through (tokens, α) points: (a, b), or None for < 2 budgets."""
    if len({t for t, _ in points}) < 2:
        return None
    xs, ys = [math.log10(t) for t, _ in points], [a for _, a in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def trend_lines(runs: dict, st: dict, cases: List[str]) -> List[str]:
    """The chain α's slope per decade of target tokens for each set and T, and — an extrapolation, labelled so —
    the tokens at which that line would reach the α of τ = 3 at k = 4."""
    lines = ["", "## Trend (chain α against log10 target tokens, the curve's own source)", "",
             "| set | T | α per decade | budgets | tokens for α = 0.74 (τ = 3 at k = 4), extrapolated |", "|---|---|---|---|---|"]
    for case in cases:
        points = sorted((r["budget"], r["cells"][case + "|chain"]["alpha"]) for r in runs.values()
                        if r["source"] == st["source"] and (r["cells"].get(case + "|chain") or {}).get("alpha") is not None)
        fit = alpha_trend(points)
        if fit is None:
            continue
        a, b = fit
        reach = f"{10 ** ((ALPHA_FOR_TAU_3 - a) / b):.1e}" if b > 0 else "never (α does not grow)"
        dataset, temperature = case.split("|")
        lines.append(f"| {dataset} | {temperature[2:]} | {b:+.3f} | {len(points)} | {reach} |")
    return lines if len(lines) > 5 else []


def write_scaling_report(report: dict, out: Path) -> None:
    """scaling.md (a table per budget and source) and tau_vs_tokens.png (τ against target tokens, log x)."""
    runs = report["runs"]
    st = report["settings"]
    keys = sorted({k for r in runs.values() for k in r["cells"]})
    cases = sorted({k.rsplit("|", 1)[0] for k in keys})  # "<set>|T=<t>"
    ordered = sorted(runs.items(), key=lambda kv: (kv[1]["budget"], kv[1]["source"] != st["source"]))
    lines = ["# τ against target tokens (EAGLE-3)", "",
             f"Source of the curve: `{st['source']}`; budgets {', '.join(f'{b:,}' for b in st['budgets'])} target tokens; "
             f"{st['epochs']} epoch(s) each; chain at k = {st['k']} and the auto-sized dynamic tree. Speedups are over "
             "target-only HF `generate` on the same prompts, drift-corrected.", "",
             "| run | target tokens | steps | set | T | α chain | τ chain | τ tree | speedup chain | speedup tree |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def value(cell, field, fmt):
        return fmt.format(cell[field]) if cell and cell.get(field) is not None else "–"

    def speedup(cell):  # with its spread (the machine's drift, or the side-by-side rounds' range) where one was recorded
        measured = speedup_of(cell) if cell else None
        if measured is None:
            return "–"
        spread = measured.spread
        return f"{measured.value:.2f}×" + (f" ± {spread:.2f}" if spread is not None else "")

    for name, r in ordered:
        for case in cases:
            chain, tree = r["cells"].get(case + "|chain"), r["cells"].get(case + "|tree")
            dataset, temperature = case.split("|")
            lines.append(f"| {name} | {r['budget']:,} | {r['step']} | {dataset} | {temperature[2:]} | "
                         f"{value(chain, 'alpha', '{:.3f}')} | {value(chain, 'tau', '{:.2f}')} | {value(tree, 'tau', '{:.2f}')} "
                         "| "
                         f"{speedup(chain)} | {speedup(tree)} |")
    lines += trend_lines(runs, st, cases)
    missing = [b for b in st["budgets"] if f"{st['source']}-{b}" not in runs]
    if missing:
        lines += ["", f"Not reached yet: {', '.join(f'{b:,}' for b in missing)} target tokens (rerun the same command to "
                      "continue)."]
    atomic_write_text(out / "scaling.md", "\n".join(lines) + "\n")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, verifier in zip(axes, ("chain", "tree")):
        for key in [k for k in keys if k.endswith("|" + verifier)]:
            points = sorted((r["budget"], r["cells"][key]["tau"]) for r in runs.values()
                            if r["source"] == st["source"] and key in r["cells"])
            if points:
                ax.plot(*zip(*points), marker="o", label=key.rsplit("|", 1)[0])
            other = [(r["budget"], r["cells"][key]["tau"]) for r in runs.values()
                     if r["source"] != st["source"] and key in r["cells"]]
            if other:
                ax.scatter(*zip(*other), marker="x", color=ax.lines[-1].get_color() if ax.lines else None)
        ax.set_xscale("log")
        ax.set_xlabel("target tokens trained on")
        ax.set_title(f"{verifier} (× = the other source at equal tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("τ (tokens per target pass)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    tmp = out / ".tau_vs_tokens.png.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out / "tau_vs_tokens.png")


def main(argv: Optional[List[str]] = None) -> None:
    """`python -m specdrafter.eval.scaling RECIPE.yaml [key=value ...]` (launch/scaling.py)."""
    argv = sys.argv[1:] if argv is None else argv

    def curve(cfg: DictConfig) -> None:
        run_scaling(cfg, argv[0], [a for a in argv[1:] if "=" in a])

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli(curve, argv, check=check_against_target)  # before the first data job: what would stop its trainings


if __name__ == "__main__":
    main()
