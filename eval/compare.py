"""The block-drafter comparison in one report: drafters trained on the same data (launch/block_comparison.sh), each
evaluated by the eval job and benchmarked side by side by bench_decode, and the block drafters' goals checked against
those numbers.

    python -m specdrafter.eval.compare --runs runs/smollm2-135m --drafters eagle3-regen dflash dspark dspark-tf \
        --baseline eagle3-regen --candidate dspark --out docs/results/block-comparison

The goals are the candidate's (a block drafter) against the baseline's (EAGLE-3 on the same data). Reads, for each
run folder of --drafters that is there, <runs>/<name>/eval/results.json (the eval job's) and the newest
<runs>/<name>/checkpoints/*/trainer_state.json (the tokens trained on, prompts and answers, and the seconds of the
optimizer steps), and every <runs>/bench-*/bench_decode.json. Writes <out>/README.md and copies beside it each
evaluation's report.md, results.json and plots (<out>/<name>/) and each benchmark's bench_decode.{md,json,png}
(<out>/<bench>/). Nothing is estimated here: a goal whose numbers are missing says "not measured".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import List, Optional

from specdrafter.core.io import (
    SpecdrafterError,
    atomic_write_bytes,
    atomic_write_text,
    complete_checkpoints,
    first_line,
    read_checkpoint_state,
)
from specdrafter.eval.acceptance import speedup_of
from specdrafter.eval.report import cell_table, positions_label, shape_label
from specdrafter.kinds import KINDS

TAU_RATIO, TAU_MTBENCH = 1.5, 3.0  # DSpark τ ≥ 1.5 × EAGLE-3's on every set and temperature; ≥ 3.0 on MT-Bench, T = 0
SPEEDUP = {0.0: 2.0, 1.0: 1.6}  # bench_decode with the bf16 target, over target-only: T → the goal
ASD_GAIN = 0.07  # ASD over strict on the same DSpark drafter, T = 0: tokens/s
# the benchmarks launch/block_comparison.sh runs: each drafter at its auto k (fp32 and bf16 targets), and
# bench-<candidate>: the candidate fixed, confidence-sized and under ASD
AUTO_K, AUTO_K_BF16 = "bench-block-auto", "bench-block-auto-bf16"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_bytes().decode())
    except (OSError, ValueError) as e:
        raise SpecdrafterError(f"cannot read {path}: {first_line(e)}") from None


def main_cells(results: dict) -> List[dict]:
    """The chain cells at the recipe's own k (not the k sweep) of the newest checkpoint of an evaluation."""
    cells = [c for c in results["cells"] if c["verifier"] == "chain" and not c["sweep"]]
    newest = max((c["step"] or 0 for c in cells), default=0)
    return [c for c in cells if (c["step"] or 0) == newest]


def training_cost(run: Path) -> Optional[dict]:
    """Tokens (prompts and answers) per second of a training run's optimizer steps (its newest checkpoint), or None."""
    done = complete_checkpoints(run / "checkpoints") if (run / "checkpoints").is_dir() else []
    if not done:
        return None
    state = read_checkpoint_state(done[-1], only=())  # the state's own checksum; the weights are not read
    if not state.get("seconds"):
        return None  # a checkpoint from before the loop recorded its time
    return {"drafter": state.get("drafter"), "step": state["step"], "tokens": state["tokens"], "seconds": state["seconds"],
            "tokens_per_s": state["tokens"] / state["seconds"]}


def collect(runs: Path, names: List[str], baseline: str, candidate: str) -> dict:
    """{"evals": {run: results.json}, "training": {run: training_cost}, "benches": {bench: bench_decode.json},
    "kinds": {run: kind}, "baseline", "candidate"} of the run folders `names` that are there, in that order."""
    found = {"evals": {}, "training": {}, "benches": {}, "kinds": {}, "baseline": baseline, "candidate": candidate}
    for name in names:
        if (runs / name / "eval" / "results.json").is_file():
            found["evals"][name] = read_json(runs / name / "eval" / "results.json")
        cost = training_cost(runs / name)
        if cost:
            found["training"][name] = cost
        kind = (found["evals"].get(name) or cost or {}).get("drafter")
        if kind is not None:
            found["kinds"][name] = kind
    for path in sorted(runs.glob("bench-*/bench_decode.json")):
        found["benches"][path.parent.name] = read_json(path)
    return found


def label(found: dict, name: str) -> str:
    """A run as the report names it: its kind's title, and the run folder's name where that is not the kind's."""
    kind = found["kinds"].get(name)
    if kind is None:
        return name
    title = KINDS[kind].title if kind in KINDS else kind
    return title if name == kind else f"{title} ({name})"


def _cell(cells: List[dict], set_name: str, t: float) -> Optional[dict]:
    return next((c for c in cells if c["set"] == set_name and c["temperature"] == t), None)


def _bench_row(bench: Optional[dict], arm: str, t: float) -> Optional[dict]:
    return next((r for r in (bench or {}).get("rows", []) if r["arm"] == arm and r["temperature"] == t), None)


def _spread(spread: Optional[float]) -> str:
    return f" (spread {spread:.2f})" if spread is not None else ""


def _bench_speedup(row: dict) -> str:
    return f"{row['speedup_median']:.2f}×{_spread(row['speedup_range'])} at k {row.get('k_used')}"


def _verdict(value: Optional[float], goal: float, unit: str = "") -> str:
    if value is None:
        return "not measured"
    return "**met**" if value >= goal else f"missed by {goal - value:.2f}{unit}"


def goals(found: dict) -> List[dict]:
    """One row per goal: its id, what it asks, what was measured, and whether it was met."""
    rows, baseline, candidate = [], found["baseline"], found["candidate"]
    them, us = label(found, baseline), label(found, candidate)
    arm = found["kinds"].get(candidate, candidate)  # bench_decode names its arms <kind>_chain, <kind>_asd, ...
    base, cand = (main_cells(found["evals"][n]) if n in found["evals"] else [] for n in (baseline, candidate))
    ratios = [(c["set"], c["temperature"], c["tau"] / b["tau"]) for c in cand
              if (b := _cell(base, c["set"], c["temperature"])) and b["tau"]]
    worst = min(ratios, key=lambda r: r[2]) if ratios else None
    rows.append({"id": "tau_ratio", "goal": f"{us} τ ≥ {TAU_RATIO}× {them}'s (chain, same data), every "
                 "set, T 0 and 1",
                 "measured": (f"{statistics.mean(r[2] for r in ratios):.2f}× on average over {len(ratios)} cells; "
                              f"lowest {worst[2]:.2f}× ({worst[0]}, T = {worst[1]:g})") if ratios else "",
                 "verdict": _verdict(worst[2] if worst else None, TAU_RATIO, "×")})
    mt = _cell(cand, "mtbench", 0.0)
    rows.append({"id": "tau_mtbench", "goal": f"{us} τ ≥ {TAU_MTBENCH} on MT-Bench, T = 0",
                 "measured": f"τ {mt['tau']:.2f}" if mt else "", "verdict": _verdict(mt["tau"] if mt else None, TAU_MTBENCH)})
    bf16, fp32 = (found["benches"].get(name) for name in (AUTO_K_BF16, AUTO_K))
    for t, goal in SPEEDUP.items():
        r, r32 = _bench_row(bf16, f"{arm}_chain", t), _bench_row(fp32, f"{arm}_chain", t)
        measured = [f"{_bench_speedup(r)} with the bf16 target"] if r else []
        measured += [f"{_bench_speedup(r32)} with the fp32 target (the faster dtype on a CPU without native bf16)"] if r32 else []
        rows.append({"id": f"bench_t{t:g}", "goal": f"bench_decode, bf16 target, T = {t:g}: {us} ≥ {goal}× over "
                     "target-only", "measured": "; ".join(measured),
                     "verdict": _verdict(r["speedup_median"] if r else None, goal, "×")})
    asd = _bench_row(found["benches"].get(f"bench-{candidate}"), f"{arm}_asd", 0.0)
    rows.append({"id": "asd", "goal": f"ASD over strict on the same {us}, T = 0: ≥ +{ASD_GAIN:.0%} tokens/s",
                 "measured": (f"{asd['vs_strict']:+.1%}{_spread(asd.get('vs_strict_spread'))}; regret/prompt "
                              f"{asd['asd_regret_per_prompt']}, outputs differing from strict {asd['outputs_differing']}")
                 if asd and "vs_strict" in asd else "",
                 "verdict": _verdict(asd["vs_strict"] if asd and "vs_strict" in asd else None, ASD_GAIN)})
    cost = found["training"]
    if baseline in cost and candidate in cost:
        a, b = cost[candidate]["tokens_per_s"], cost[baseline]["tokens_per_s"]
        measured = (f"{us} {a:.0f}, {them} {b:.0f} tokens/s of training (prompts and answers of the same conversations, so "
                    f"the ratio is the one per target token): {a / b:.2f}× as fast")
    else:
        measured = ""
    rows.append({"id": "training_cost", "goal": f"training cost per target token, {us} vs {them}, same run",
                 "measured": measured, "verdict": "reported" if measured else "not measured"})
    return rows


def tau_table(found: dict) -> str:
    names = list(found["evals"])
    cells = {n: main_cells(found["evals"][n]) for n in names}
    keys = list(dict.fromkeys((c["set"], c["temperature"]) for n in names for c in cells[n]))
    columns = [("set", lambda r: r["set"]), ("T", lambda r: r["t"])]
    for n in names:
        columns.append((f"{label(found, n)} τ (α, k)", lambda r, n=n: _tau_alpha(r[n])))
    b, c = found["baseline"], found["candidate"]
    if b in names and c in names:
        columns.append((f"{label(found, c)} ÷ {label(found, b)} τ",
                        lambda r: f"{r[c]['tau'] / r[b]['tau']:.2f}×" if r[c] and r[b] else ""))
    rows = [{"set": s, "t": t, **{n: _cell(cells[n], s, t) for n in names}} for s, t in keys]
    return cell_table(rows, columns)


def _tau_alpha(c: Optional[dict]) -> str:
    return f"{c['tau']:.2f} ({c['alpha']:.2f}, {shape_label(c)})" if c else ""


def speedup_table(found: dict) -> str:
    """Each evaluation's own speedups (the eval job's, one thread beside a training on the other core)."""
    rows = [{"drafter": label(found, n), **c} for n in found["evals"] for c in main_cells(found["evals"][n])]
    return cell_table(rows, [("drafter", "drafter"), ("set", "set"), ("T", "temperature"), ("τ", "tau"),
                         ("tok/s", "tokens_per_s"), ("speedup", lambda c: _speedup(c)), ("c", "c"),
                         ("predicted", "predicted_speedup")])


def _speedup(c: dict) -> str:
    s = speedup_of(c)
    return f"{s.value:.2f} ± {s.spread:.2f}" if s else ""


def positions_table(found: dict) -> str:
    rows = [{"drafter": label(found, n), **c} for n in found["evals"] for c in main_cells(found["evals"][n])
            if c["set"] == "mtbench"]
    return cell_table(rows, [("drafter", "drafter"), ("T", "temperature"),
                             ("acceptance at draft j, given 1..j−1 accepted [cycles]", positions_label)])


def bench_table(bench: dict) -> str:
    return cell_table(bench["rows"], [("T", "temperature"), ("arm", "arm"), ("shape", "shape"), ("tok/s", "tokens_per_s"),
                                  ("speedup", "speedup_median"), ("spread", "speedup_range"), ("τ", "tau"), ("α", "alpha"),
                                  ("c", "c"), ("k used", "k_used"), ("predicted", "predicted_speedup")])


def write(found: dict, runs: Path, out: Path) -> Path:
    lines = [f"# {label(found, found['candidate'])} against {label(found, found['baseline'])}, trained on the same data",
             "", "Made by `launch/block_comparison.sh` (`python -m specdrafter.eval.compare`) from the reports of the "
             f"runs in `{runs}`, copied beside this file.", "",
             "## Goals", "", cell_table(goals(found), [("goal", "goal"), ("measured", "measured"), ("", "verdict")]), ""]
    if found["evals"]:
        lines += ["## Acceptance (eval job)", "", "τ = tokens per target pass (bonus included), α = accepted drafts ÷ "
                  "draft positions tried (a chain tries a position only while every draft before it was accepted), at "
                  "each recipe's k; chain verification.", "", tau_table(found), "",
                  "Per position on MT-Bench:", "", positions_table(found), "",
                  "The eval job's own speedups (each evaluation on one thread, possibly beside a training on the other "
                  "core; the quiet benchmarks below are the speed numbers):", "", speedup_table(found), ""]
    if found["training"]:
        lines += ["## Training", "", cell_table([{**c, "drafter": label(found, n)} for n, c in found["training"].items()], [
            ("drafter", "drafter"), ("steps", "step"), ("tokens (prompts and answers)", "tokens"),
            ("seconds of steps", "seconds"),
            ("tokens/s", lambda c: round(c["tokens_per_s"], 1))]), ""]
    for name, bench in found["benches"].items():
        lines += [f"## Decode benchmark `{name}`", "", f"{len(bench['prompts'])} prompts × {bench['max_new_tokens']} "
                  f"tokens, {bench['repeats']} repeats; full table in [{name}/bench_decode.md]({name}/bench_decode.md).",
                  "", bench_table(bench), ""]
    atomic_write_text(out / "README.md", "\n".join(lines))
    for name in found["evals"]:
        for f in (runs / name / "eval").iterdir():
            if f.name in ("report.md", "results.json") or f.suffix == ".png":
                atomic_write_bytes(out / name / f.name, f.read_bytes())
    for name in found["benches"]:
        for f in (runs / name).glob("bench_decode.*"):
            atomic_write_bytes(out / name / f.name, f.read_bytes())
    return out / "README.md"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="runs/smollm2-135m", help="the folder of the comparison's runs")
    parser.add_argument("--drafters", nargs="+", required=True, help="run folders under --runs, in the report's order")
    parser.add_argument("--baseline", required=True, help="the run the goals measure the candidate against")
    parser.add_argument("--candidate", required=True, help="the run whose goals the report checks")
    parser.add_argument("--out", default="docs/results/block-comparison")
    args = parser.parse_args(argv)
    try:
        runs = Path(args.runs)
        if not runs.is_dir():
            raise SpecdrafterError(f"--runs {runs}: no such folder")
        for flag in ("baseline", "candidate"):
            if getattr(args, flag) not in args.drafters:
                raise SpecdrafterError(f"--{flag} {getattr(args, flag)} is not one of --drafters {' '.join(args.drafters)}")
        found = collect(runs, args.drafters, args.baseline, args.candidate)
        if not (found["evals"] or found["benches"]):
            raise SpecdrafterError(f"--runs {runs}: no evaluation (<name>/eval/results.json) or benchmark "
                                   "(bench-*/bench_decode.json) of the comparison's drafters there yet")
        print(f"wrote {write(found, runs, Path(args.out))}")
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
