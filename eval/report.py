"""report.md and the plots of an evaluation (eval/job.py), rebuilt from results.json alone.

Plots: acceptance_by_position.png (newest checkpoint, chain cells of the first set, one line per temperature),
by_step.png (α and τ by checkpoint step), speedup_vs_k.png (the formula's curve from the measured α, c and v(n),
and the measured speedups of the k sweep)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from specdrafter.core.io import atomic_write_text  # noqa: E402
from specdrafter.eval.acceptance import (  # noqa: E402
    NOISY,
    NOISY_LEGEND,
    is_noisy,
    predicted_speedup,
    speedup_of,
    spread_label,
)

MIN_SAMPLES = 5  # fewest cycles behind a point of the acceptance-by-position plot


def write_report(data: dict, out: Path) -> Path:
    cells = data["cells"]
    newest = _newest(cells)
    lines = [f"# Acceptance report: {data['drafter']} drafter for {data['target']}", ""]
    s = data["settings"]
    if not cells:  # eval.engines=[llama.cpp]: our loop decoded nothing, so the report is the llama.cpp arm alone
        lines += [f"{s['num_prompts']} prompts per set, up to {s['max_new_tokens']} new tokens each.", ""]
        return atomic_write_text(out / "report.md", "\n".join(lines + llamacpp_section(data)) + "\n")
    lines += [f"{s['num_prompts']} prompts per set, up to {s['max_new_tokens']} new tokens each; "
              + machine_line(data.get("machine", {})), ""]
    main = [c for c in cells if c["checkpoint"] == newest and not c["sweep"] and c["verifier"] != "asd"]
    repeats = s.get("repeats", 1)
    if repeats > 1:
        how = (f"Speedups are over target-only HF `generate` on the same prompts: each cell was decoded {repeats} times, "
               "each time with target-only decoding of every prompt right beside the cell's (alternately before and "
               "after). `speedup (median)` = the median of those side-by-side ratios of tok/s (results.json: "
               "`speedup_median`), `range` = their max − min (`speedup_range`). The cell's other columns are from the "
               "median round.")
        speedup_columns = [("speedup (median)", _speedup), ("range", _spread)]
    else:
        how = ("Speedups are over target-only HF `generate` on the same prompts. `speedup (drift-corrected)` "
               "(results.json: `speedup_drift_corrected`) corrects for the machine's drift between the baseline and "
               "each cell (a target step is timed around both: tok/s ÷ (baseline tok/s × baseline step ÷ cell step)); "
               "`uncorrected` is the plain ratio. `drift spread` (`speedup_drift_spread`) = speedup × (interquartile "
               "range ÷ median of the target-step timings around the cell + around its baseline): how far the "
               "machine's speed moved while they ran.")
        speedup_columns = [("speedup (drift-corrected)", _speedup), ("drift spread", _spread)]
    uncorrected = [("uncorrected", "speedup_uncorrected")] if repeats == 1 else []
    lines += [how, "", NOISY_LEGEND, ""]
    lines += [f"## Checkpoint {newest}", "", cell_table(main, [
        ("set", "set"), ("T", "temperature"), ("verifier", "verifier"), ("k / tree", shape_label), ("α", "alpha"),
        ("τ", "tau"), ("tok/s", "tokens_per_s"), *speedup_columns, *uncorrected,
        ("predicted", "predicted_speedup"), ("measured/predicted", "measured_over_predicted"), ("mean D_TV", "mean_tv"),
        ("α − (1 − D_TV)", "alpha_tv_gap"),
        ("c", "c"), ("best k", "best_k"), ("GSM8K acc.", "answer_accuracy")]), ""]
    lines += ["Per-position acceptance (P(draft j accepted | 1..j−1 accepted); in brackets the cycles that tried j):", "",
              cell_table(main, [("set", "set"), ("T", "temperature"), ("verifier", "verifier"),
                            ("per position", positions_label)]), ""]
    steps = [c for c in cells if not c["sweep"] and c["verifier"] != "asd"]
    if len({c["checkpoint"] for c in steps}) > 1:
        lines += ["## By checkpoint", "", cell_table(sorted(steps, key=lambda c: (c["step"] or 0)), [
            ("checkpoint", "checkpoint"), ("step", "step"), ("set", "set"), ("T", "temperature"), ("verifier", "verifier"),
            ("α", "alpha"), ("τ", "tau"), *speedup_columns]), ""]
    sweep = [c for c in cells if c["sweep"]]
    if sweep:  # the auto cell is planned once: as a main cell when inference.k is auto, so fetch it from there
        ref = sweep[0]
        sweep += [c for c in cells if not c["sweep"] and c["k"] == "auto" and c["verifier"] == "chain" and
                  (c["checkpoint"], c["set"], c["temperature"]) == (ref["checkpoint"], ref["set"], ref["temperature"])]
    sweep = sorted(sweep, key=lambda c: (c["k"] == "auto", c["k"] if c["k"] != "auto" else 0))
    if sweep:
        lines += [f"## Speedup vs k ({sweep[0]['set']}, T = 0, checkpoint {sweep[0]['checkpoint']})", "", cell_table(sweep, [
            ("k", shape_label), ("α", "alpha"), ("τ", "tau"), ("tok/s", "tokens_per_s"), *speedup_columns,
            ("predicted", "predicted_speedup"), ("measured/predicted", "measured_over_predicted")]), ""]
    audit = asd_audit(data, out)
    if audit:
        lines += ["## ASD audit (T = 0, strict greedy vs approximate speculative decoding)", "", cell_table(audit, [
            ("set", "set"), ("setting", "setting"), ("tok/s", "tokens_per_s"), ("vs strict", "vs_strict"),
            ("spread", "vs_strict_spread"), ("τ", "tau"),
            ("regret / prompt", "asd_regret"), ("outputs differing", "differs"), ("GSM8K acc.", "answer_accuracy")]), ""]
    lines += llamacpp_section(data)
    lines += ["## Target-only baselines (HF generate)", "", cell_table(
        [{"cell": k.replace("|", ", "), **b} for k, b in data["baselines"].items()], [
            ("set, T", "cell"), ("tokens", "tokens"), ("tok/s", "tokens_per_s"),
            ("target-step spread", "target_step_spread")]), ""]
    plots = [_plot_positions(main, out), _plot_steps(steps, out), _plot_sweep(sweep, data, out)]
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots if p]
    return atomic_write_text(out / "report.md", "\n".join(lines) + "\n")


def llamacpp_section(data: dict) -> List[str]:
    """The llama.cpp arm (engines/llamacpp_eval.py): its cells beside the loop's speedup for the same checkpoint, set,
    temperature and k, the plan's costs, and every T = 0 departure with its margin."""
    arm = data.get("llamacpp") or {}
    if not arm.get("cells"):
        return []
    cal, choice = arm["calibration"], arm["choice"]
    loop = {(c["checkpoint"], c["set"], c["temperature"], c["k"]): c for c in data["cells"]
            if c["verifier"] == "chain" and not c.get("asd")}

    def loop_speedup(c: dict) -> Optional[float]:
        found = None if c.get("p_min") else loop.get((c["checkpoint"], c["set"], c["temperature"], c["k"]))
        return _speedup(found) if found else None

    def identical(c: dict) -> str:
        if c["identical"] is None:
            return ""
        ties = sum(d["tie"] for d in c["departures"])
        wrong = len(c["departures"]) - ties
        return f"{c['identical']}/{c['prompts']}" + (f", {ties} tie(s)" if ties else "") + (
            f", **{wrong} at a clear margin ✗**" if wrong else "")

    pays = "pays" if choice["pays"] else "does not pay: specdrafter-serve would serve the target alone"
    lines = [f"## llama.cpp beside our loop ({arm['spec_type']}, {arm['threads']} thread(s) per server, target GGUF "
             f"{arm['outtype']})", "",
             f"Each cell: the same prompts through llama-server without and with the drafter, alternating prompt by "
             f"prompt; `speedup` = the median of the per-prompt ratios of tok/s, `range` their max − min; α and τ from "
             f"llama.cpp's own counters (draft_n, draft_n_accepted); `predicted` = τ ÷ (v(k+1) + c(k)) at llama.cpp's "
             f"measured costs (with a confidence cut p_min: τ ÷ the step cost measured at that cut); `loop` = our "
             f"loop's speedup for the same set, T and k (— if the loop did not run "
             f"it). llama.cpp's target runs {1000 / cal['target_ms']:.1f} tok/s here; v(n) = "
             + ", ".join(f"{n}: {x:.2f}" for n, x in cal["v"].items())
             + "; c(k) = " + ", ".join(f"{k}: {x:.3f}" for k, x in cal["c"].items())
             + " (per target step, linear in between)"
             + "".join(f"; confidence cut p_min {c['p_min']:g} at k = {cal['max_k']}: {c['tokens_per_step']:.2f} "
                       f"tokens per step at {c['step_cost']:.2f} target steps" for c in cal.get("cuts", []))
             + f". The plan picks k = {choice['k']}"
             + (f" with p_min {choice['p_min']:g}" if choice.get("p_min") else "")
             + (" with the idle thread pool asleep (--poll 0 --poll-draft 0: measured "
                + ", ".join(f"{x:.2f} target steps a step at k = {k}" for k, x in cal.get("sleeping", {}).items())
                + ")" if choice.get("pools_sleep") else "")
             + f", predicted {choice['predicted']:.2f}×, which {pays} (timing noise ±{100 * choice['noise']:.0f} %)."
             + "".join(baseline_note(name, b) for name, b in arm.get("baselines", {}).items()),
             "",
             cell_table(sorted(arm["cells"], key=lambda c: (c.get("baseline") or "", c["sweep"], c["set"],
                                                            c["temperature"], c["k"] or 0, c.get("p_min", 0.0))), [
                 ("arm", lambda c: c.get("baseline") or "the drafter"), ("set", "set"), ("T", "temperature"),
                 ("k", lambda c: ("own" if c["k"] is None else str(c["k"])) + (" asleep" if c.get("pools_sleep") else "")),
                 ("p_min", lambda c: c.get("p_min") or "–"),
                 ("α", "alpha"), ("τ", "tau"),
                 ("target tok/s", "alone_tokens_per_s"), ("drafted tok/s", "drafted_tokens_per_s"),
                 ("speedup", "speedup_median"), ("range", "speedup_range"), ("predicted", "predicted_speedup"),
                 ("measured/predicted", "measured_over_predicted"), ("loop", loop_speedup),
                 ("T = 0 identical", identical)]), ""]
    departures = [(c, d) for c in arm["cells"] for d in c["departures"]]
    if departures:
        lines += ["First departures from target-only decoding at T = 0 (the target's top-1 − top-2 log-probability "
                  "there; a tie is within the weight type's rounding):", ""]
        lines += [f"- {c['id']}: prompt {d['prompt']}, token {d['position']}, margin "
                  f"{'?' if d['margin'] is None else format(d['margin'], '.3g')} "
                  f"({'tie' if d['tie'] else 'clear: the verifier is inexact'})" for c, d in departures]
        lines.append("")
    return lines


def baseline_note(name: str, b: dict) -> str:
    """What a baseline arm of the llama.cpp table is, and the setting it ran at."""
    if b.get("draft") is None:
        return f" Arm {name}: llama.cpp's --spec-type {b['spec_type']} without a drafter, at its own sizes." \
            if name != "spec-default" else " Arm spec-default: llama-server's --spec-default (ngram-mod, its sizes)."
    c = b["choice"]
    return (f" Arm {name}: the draft model {Path(b['draft']).name} at k = {b['k']}, the best its own plan found "
            f"(predicted {c['predicted']:.2f}×, {'pays' if c['pays'] else 'does not pay'}).")


def asd_audit(data: dict, out: Path) -> List[dict]:
    """Each ASD cell beside its strict-greedy reference (same checkpoint, set and k): speed, regret, and the share
    of prompts whose output differs from strict greedy's."""
    rows = []
    for c in [c for c in data["cells"] if c["verifier"] == "asd"]:
        strict = next((s for s in data["cells"] if s["verifier"] == "chain" and s["temperature"] == 0 and not s["asd"]
                       and s["checkpoint"] == c["checkpoint"] and s["set"] == c["set"] and s["k"] == c["k"]), None)
        if strict is None:
            continue
        if not rows or rows[-1]["set"] != c["set"]:
            rows.append({**strict, "setting": "strict", "vs_strict": "", "vs_strict_spread": "", "differs": ""})
        mine, theirs = _outputs(out / c["outputs"]), _outputs(out / strict["outputs"])
        differs = sum(a != b for a, b in zip(mine, theirs)) / max(len(mine), 1)
        budget, gate, mismatches = c["asd"]
        ratio = c["tokens_per_s"] / strict["tokens_per_s"]
        spreads = [c.get("target_step_spread"), strict.get("target_step_spread")]  # the machine around each cell
        spread = None if None in spreads else ratio * sum(spreads)
        label = "" if spread is None else f"{100 * spread:.1f} %" + (f" {NOISY}" if is_noisy(ratio, spread) else "")
        rows.append({**c, "setting": f"ASD B={budget:g} g={gate:g} M={mismatches:g}", "differs": round(differs, 3),
                     "vs_strict": f"{100 * (ratio - 1):+.1f} %", "vs_strict_spread": label})
    return rows


def _outputs(path: Path) -> List[List[int]]:
    return [json.loads(line)["tokens"] for line in path.read_text().splitlines() if line.strip()]


def _newest(cells: List[dict]) -> str:
    return max(cells, key=lambda c: (c["step"] is not None, c["step"] or 0))["checkpoint"] if cells else "–"


def positions_label(c: dict) -> str:
    counts = c.get("per_position_n") or [None] * len(c["per_position"])
    return " ".join(("–" if a is None else f"{a:.2f}") + ("" if n is None else f" [{n}]")
                    for a, n in zip(c["per_position"], counts))


def machine_line(m: dict) -> str:
    """The target step and v(n) of results.json's "machine": the monotone fit every number uses, and — when they
    were recorded — the raw medians and the spread over repeats in brackets."""
    raw, spread = m.get("v_raw", {}), m.get("v_spread", {})
    step = f"target step {m.get('target_step_s', 0) * 1e3:.1f} ms"
    if "target_step_spread" in m:
        step += f" (spread {100 * m['target_step_spread']:.0f} %)"

    def one(n: str, x: float) -> str:
        extra = [f"raw {raw[n]:.2f}"] if n in raw and abs(raw[n] - x) >= 0.005 else []
        extra += [f"spread {100 * spread[n]:.0f} %"] if spread.get(n) else []
        return f"{n}: {x:.2f}" + (f" [{', '.join(extra)}]" if extra else "")
    fit = " (fitted monotone; [raw median, spread over repeats])" if raw else ""
    return f"{step} on this machine; v(n){fit} = " + ", ".join(one(n, x) for n, x in m.get("v", {}).items())


def _speedup(c: dict) -> Optional[float]:
    speedup = speedup_of(c)
    return speedup.value if speedup else None


def _spread(c: dict) -> str:
    """A cell's speedup spread, flagged when it exceeds the effect (|speedup − 1|)."""
    speedup = speedup_of(c)
    return spread_label(speedup.value, speedup.spread) if speedup else ""


def shape_label(c: dict) -> str:
    if c.get("tree_size"):
        mean = c.get("mean_tree_size")
        return f"tree {c['tree_size']}" + (f" (auto, mean {mean:g})" if mean and mean < c["tree_size"] else "")
    if c["k"] == "auto":
        return f"auto ({c.get('k_used')})"
    mean = c.get("mean_drafted")  # below k: a block drafter's confidence head verified fewer
    return str(c["k"]) + (f" (mean {mean:g})" if mean is not None and mean < c["k"] - 0.005 else "")


def cell_table(rows: List[dict], columns) -> str:
    if not rows:
        return "(none)"
    head = "| " + " | ".join(name for name, _ in columns) + " |"
    rule = "|" + "---|" * len(columns)
    body = []
    for r in rows:
        values = [key(r) if callable(key) else r.get(key) for _, key in columns]
        values = [v + 0.0 if isinstance(v, float) else v for v in values]  # no "-0" from a rounded negative zero
        body.append("| " + " | ".join("" if v is None else f"{v:g}" if isinstance(v, float) else str(v) for v in values) + " |")
    return "\n".join([head, rule, *body])


def _plot_positions(cells: List[dict], out: Path):
    chain = [c for c in cells if c["verifier"] == "chain" and c["set"] == cells[0]["set"]] if cells else []
    if not chain:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for c in chain:  # points tried by fewer than MIN_SAMPLES cycles are left out: one cycle makes a 0 or a 1
        counts = c.get("per_position_n") or [MIN_SAMPLES] * len(c["per_position"])
        ys = [float("nan") if y is None or n < MIN_SAMPLES else y for y, n in zip(c["per_position"], counts)]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"T = {c['temperature']:g}")
    ax.set_xticks(range(1, max(len(c["per_position"]) for c in chain) + 1))
    ax.set(xlabel="draft position j", ylabel="P(accepted | 1..j−1 accepted)", ylim=(0, 1),
           title=f"Acceptance by position ({chain[0]['set']}, {chain[0]['checkpoint']})")
    ax.legend()
    return _save(fig, out / "acceptance_by_position.png")


def _plot_steps(cells: List[dict], out: Path):
    stepped = [c for c in cells if c["step"] is not None and c["verifier"] == "chain"]
    if not stepped:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    series: Dict[tuple, List[dict]] = {}
    for c in sorted(stepped, key=lambda c: c["step"]):
        series.setdefault((c["set"], c["temperature"]), []).append(c)
    for (name, t), cs in series.items():
        a1.plot([c["step"] for c in cs], [c["alpha"] for c in cs], marker="o", label=f"{name} T={t:g}")
        a2.plot([c["step"] for c in cs], [c["tau"] for c in cs], marker="o", label=f"{name} T={t:g}")
    a1.set(xlabel="training step", ylabel="α (per token)", title="α by checkpoint")
    a2.set(xlabel="training step", ylabel="τ (tokens per target pass)", title="τ by checkpoint")
    a2.legend(fontsize=7)
    return _save(fig, out / "by_step.png")


def _plot_sweep(sweep: List[dict], data: dict, out: Path):
    v = {int(n): x for n, x in data.get("machine", {}).get("v", {}).items()}
    if not sweep or not v:
        return None
    fixed = [c for c in sweep if c["k"] != "auto"]
    ref = sweep[0]  # the formula's inputs from the sweep's cells: mean α and c
    alpha = sum(c["alpha"] for c in sweep) / len(sweep)
    c_cost = sum(c["c"] for c in sweep) / len(sweep)
    longest = max([c["k"] for c in fixed] + [c.get("k_used") or 1 for c in sweep]) + 2  # v(n) may go on for trees
    ks = [k for k in range(1, min(max(v), longest + 1)) if k + 1 in v]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(ks, [predicted_speedup(alpha, k, c_cost, v[k + 1]) for k in ks], label=f"predicted (α={alpha:.2f}, c={c_cost:.2f})")
    ax.plot([c["k"] for c in fixed], [_speedup(c) for c in fixed], "o", label="measured, fixed k")
    for c in sweep:
        if c["k"] == "auto":
            ax.plot([c["k_used"]], [_speedup(c)], "r*", ms=12, label=f"measured, k = auto (settled at {c['k_used']})")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="block length k", ylabel="speedup over target-only", title=f"Speedup vs k ({ref['set']}, T = 0)")
    ax.legend()
    return _save(fig, out / "speedup_vs_k.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
