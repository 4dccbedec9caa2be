"""The evaluation's llama.cpp arm: the newest checkpoint served by llama-server, measured beside our loop's cells.

    python launch/eval_acceptance.py RECIPE.yaml checkpoint=RUN eval.engines=[loop,llama.cpp]

The eval job's one entry point (engines/evaluate.py, run by `launch/eval_acceptance.py`) runs the loop's cells
(eval/job.py:run_eval), then, when eval.engines names llama.cpp, this arm, into the same results.json and report. It
sits on the top floor, above export/, because llama.cpp serves a checkpoint from its GGUF export.

Before any cell is decoded the arm is prepared, so that bad input costs seconds, not the loop's minutes: the
checkpoint is exported to GGUF (beside it, once), the target converted (into the cache, once) at
eval.llamacpp.outtype, the pair checked (vocabulary, feature width), and the drafter calibrated in llama.cpp on this
machine (engines/serve.py's plan: v(n), c(k), cached). Then per cell, the same prompts through llama-server without and
with the drafter, alternating prompt by prompt (eval/llamacpp.py:side_by_side):
- the newest checkpoint × each set × each temperature, at the block length the plan picks (what `specdrafter-serve`
  would serve, whether or not it pays), and on the first set at T = 0 each k of eval.k_sweep the drafter can take;
- tok/s of both servers, the speedup (median of the per-prompt ratios, and their range), llama.cpp's counters turned
  into α and τ, the predicted speedup τ ÷ (v(k+1) + c(k)) at llama.cpp's measured costs, measured ÷ predicted;
- at T = 0 every answer must equal target-only decoding; a departure is classified by the target's top-2 margin
  there: a tie within the weight type's rounding is counted and reported, a clear margin fails the cell (its row is
  kept, marked, and the job exits with an error once the other cells are done).

results.json gains "llamacpp": {"threads", "outtype", "target_gguf", "drafter_gguf", "spec_type", "max_k",
"calibration": (eval/llamacpp.py:Calibration.to_json), "choice": {"k", "predicted", "pays", "noise"},
"cells": [{"id", "checkpoint", "set", "sweep", "exact", ...ArmResult's fields, "measured_over_predicted"}]}.
Cells are saved as they finish; a rerun skips them. A server that dies mid-run is one line naming the cell.
Servers run one thread each by default (eval.llamacpp.threads): llama.cpp's threads spin, so nothing else should run
on the machine meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from omegaconf import DictConfig
from transformers import AutoTokenizer

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.llamacpp import DRAFTLESS
from specdrafter.core.recipe import EvalEngine
from specdrafter.data.chat import user_prompt_ids, with_template_kwargs
from specdrafter.data.gguf_assets import GGUF_TARGETS, ensure_gguf_target, gguf_type, paired_gguf
from specdrafter.engines.serve import Drafter, check_pair, gguf_pair, has_confidence, plan, resolve_drafter
from specdrafter.eval.acceptance import speedup_of
from specdrafter.eval.job import EvalJob, Results
from specdrafter.eval.llamacpp import Calibration, Departure, InexactVerifier, side_by_side
from specdrafter.eval.report import write_report
from specdrafter.export.source import target_of
from specdrafter.kinds import kind_of

log = logging.getLogger("specdrafter")
ENGINE = EvalEngine.llamacpp.value


def check_served(cfg: DictConfig) -> None:
    """One line if llama.cpp serves no drafter of the recipe's kind: before anything else is read."""
    kind = kind_of(cfg)
    if kind.export.llamacpp is None:
        raise SpecdrafterError(f"recipe key 'eval.engines': llama.cpp serves no {kind.description} (it has EAGLE-3, "
                               "DFlash, DSpark and draft models); remove llama.cpp from eval.engines")


def prepare(cfg: DictConfig, job: EvalJob):
    """(the newest checkpoint of `job` (eval/job.py:eval_job), its drafter as GGUF, the target as GGUF), checked as a
    pair (check_served first)."""
    newest, outtype = job.checkpoints[-1], asked_type(cfg)  # the recipe read before the target is looked up
    folder = target_of(cfg).folder
    if folder is None:
        raise SpecdrafterError(f"the llama.cpp arm converts the target's HF folder, and {cfg.target.model!r} is not on "
                               "this machine")
    drafter, target = gguf_pair(newest.drafter, folder, outtype, cfg.eval.llamacpp.drafter_type.value)
    if cfg.eval.llamacpp.p_min_sweep and not has_confidence(drafter):
        raise SpecdrafterError("recipe key 'eval.llamacpp.p_min_sweep': this DSpark drafter has no confidence head to "
                               "cut by (llama-server takes only --spec-draft-p-min 0 for it); leave it empty")
    return newest, drafter, target


def asked_type(cfg: DictConfig) -> Optional[str]:
    """eval.llamacpp.outtype, None where unset (a GGUF target is served as its own file)."""
    return cfg.eval.llamacpp.outtype.value if cfg.eval.llamacpp.outtype is not None else None


def run_arm(cfg: DictConfig, job: EvalJob, newest, drafter: Drafter, target: Path) -> Path:
    """Every llama.cpp cell not yet in results.json; the report rebuilt after each. Returns the evaluation folder."""
    e, threads, out = cfg.eval, cfg.eval.llamacpp.threads, job.out
    served = asked_type(cfg) or gguf_type(target)  # the target's weight type: a tie's margin depends on it
    results = Results(out, job.header)
    cal = plan(drafter, target, threads)
    choice = cal.choose()
    arm = results.data.setdefault("llamacpp", {"cells": []})
    arm.update(threads=threads, outtype=served, target_gguf=target.name,
               drafter_gguf=str(drafter.gguf), spec_type=drafter.spec_type, max_k=drafter.max_k,
               calibration=cal.to_json(), choice=asdict(choice))
    tokenizer = with_template_kwargs(AutoTokenizer.from_pretrained(drafter.target_folder),
                                     job.target["chat_template_kwargs"])
    sets = job.sets
    prompts = {name: [user_prompt_ids(tokenizer, r["turns"][0]) for r in records] for name, records in sets.items()}
    cells = plan_cells(newest.name, list(sets), list(e.temperatures), choice.k, list(e.k_sweep), drafter.max_k,
                       choice.p_min, list(e.llamacpp.p_min_sweep), choice.pools_sleep)
    others = {b.name: b for b in baselines(cfg, target, drafter.target_folder, threads)}
    cells += baseline_cells(list(others.values()), list(sets), list(e.temperatures))
    arm["baselines"] = {b.name: b.to_json() for b in others.values()}
    done = {c["id"] for c in arm["cells"]}
    todo = [c for c in cells if c["id"] not in done]
    log.info(f"llama.cpp arm: {len(cells)} cells ({len(cells) - len(todo)} already in {results.path}), {threads} "
             f"thread(s) per server, {drafter.spec_type}, the plan's k = {choice.k} (predicted {choice.predicted:.2f}×)"
             + (f"; beside it {', '.join(others)}" if others else ""))
    for cell in todo:
        other = others.get(cell.get("baseline"))
        gguf, spec_type, measured = ((drafter.gguf, drafter.spec_type, cal) if other is None else
                                     (other.draft, other.spec_type, other.calibration))
        try:
            found = side_by_side(target, gguf, spec_type, cell["k"], prompts[cell["set"]],
                                 e.max_new_tokens, cell["temperature"], threads, served, measured,
                                 log=log.info, raise_inexact=False, p_min=cell["p_min"],
                                 pools_sleep=cell.get("pools_sleep", False))
        except SpecdrafterError as error:
            raise SpecdrafterError(f"llama.cpp cell {cell['id']}: {error} (the finished cells are kept in "
                                   f"{results.path})") from None
        row = {**cell, **asdict(found), "exact": all(d["tie"] for d in found.departures)}
        row["measured_over_predicted"] = (round(found.speedup_median / found.predicted_speedup, 3)
                                          if found.predicted_speedup else None)
        arm["cells"] = [c for c in arm["cells"] if c["id"] != cell["id"]] + [row]
        results.save()
        log.info(f"  {cell['id']}: {found.speedup_median:.2f}× (predicted {found.predicted_speedup}×), "
                 f"α {found.alpha:.3f}, τ {found.tau:.2f}" + ("" if cell["temperature"] else
                                                             f", identical {found.identical}/{found.prompts}"))
    write_report(results.data, out)
    failed = [c for c in arm["cells"] if not c["exact"]]
    if failed:  # their rows are kept; the job fails loudly
        first = next(Departure(**d) for d in failed[0]["departures"] if not d["tie"])
        raise InexactVerifier(f"llama.cpp departed from target-only decoding at a clear margin in {len(failed)} "
                              f"cell(s), first in {failed[0]['id']} at {first.line()} (see {out / 'report.md'})")
    for line in both_speedups(results.data):
        log.info(line)
    return out


@dataclass(frozen=True)
class Baseline:
    """An arm beside the drafter (eval.llamacpp.baselines): one of llama.cpp's modes without a drafter, at its own
    sizes, or a draft model as users serve it, at the n_max its own plan picks (whether or not that pays)."""

    name: str
    spec_type: str
    draft: Optional[Path] = None
    k: Optional[int] = None
    calibration: Optional[Calibration] = None

    def to_json(self) -> dict:
        out = {"spec_type": self.spec_type, "draft": None if self.draft is None else str(self.draft), "k": self.k}
        if self.calibration is not None:
            out["choice"] = asdict(self.calibration.choose())
            out["calibration"] = self.calibration.to_json()
        return out


def baselines(cfg: DictConfig, target: Path, folder: Path, threads: int) -> List[Baseline]:
    """eval.llamacpp.baselines, resolved: a draft model is fetched (a built-in name), checked against the target
    (vocabulary) and planned on this machine (cached), one line for a name that is neither."""
    found = []
    for name in cfg.eval.llamacpp.baselines:
        if name in DRAFTLESS:
            found.append(Baseline(name, name))
            continue
        path = paired_gguf(ensure_gguf_target(name)) if name in GGUF_TARGETS else Path(name).expanduser()
        if not path.is_file():
            raise SpecdrafterError(f"recipe key 'eval.llamacpp.baselines': {name!r} is neither one of llama.cpp's modes "
                                   f"without a drafter ({', '.join(DRAFTLESS)}), a built-in model "
                                   f"({', '.join(GGUF_TARGETS)}) nor a GGUF file")
        other = resolve_drafter(path, folder)
        other.target_folder = folder
        check_pair(other, target)
        cal = plan(other, target, threads)
        choice = cal.choose()
        log.info(f"baseline {name}: its plan picks k = {choice.k}, predicted {choice.predicted:.2f}×")
        found.append(Baseline(name, other.spec_type, other.gguf, choice.k, cal))
    return found


def baseline_cells(others: List[Baseline], sets: List[str], temperatures: List[float]) -> List[dict]:
    """Each baseline on each set at each temperature, at its k (None: llama.cpp's own sizes)."""
    return [{"id": f"{b.name}|{name}|T={float(t)}|{ENGINE}|k={b.k if b.k is not None else 'own'}", "checkpoint": None,
             "baseline": b.name, "set": name, "temperature": float(t), "k": b.k, "p_min": 0.0, "sweep": False}
            for b in others for name in sets for t in temperatures]


def plan_cells(checkpoint: str, sets: List[str], temperatures: List[float], k: int, k_sweep: List[int],
               max_k: int, p_min: float = 0.0, p_min_sweep: Sequence[float] = (), pools_sleep: bool = False) -> List[dict]:
    """The arm's cells: each set × temperature at the plan's k (and confidence cut, and idle pools asleep where the
    plan says so), then the first set at T = 0 at each swept k, and at the longest block with each swept cut."""
    cells: List[dict] = []

    def add(name: str, temperature: float, kk: int, sweep: bool, cut: float = 0.0, asleep: bool = False) -> None:
        cell_id = f"{checkpoint}|{name}|T={float(temperature)}|{ENGINE}|k={kk}" + (f"|p_min={cut:g}" if cut else "") \
            + ("|pools_sleep" if asleep else "")
        if all(c["id"] != cell_id for c in cells):
            cells.append({"id": cell_id, "checkpoint": checkpoint, "set": name, "temperature": float(temperature),
                          "k": kk, "p_min": float(cut), "sweep": sweep, **({"pools_sleep": True} if asleep else {})})

    for name in sets:
        for temperature in temperatures:
            add(name, temperature, k, False, p_min, pools_sleep)
    for kk in k_sweep:
        if kk <= max_k:
            add(sets[0], 0.0, kk, True)
    for cut in p_min_sweep:
        add(sets[0], 0.0, max_k, True, cut)
    return cells


def both_speedups(data: dict) -> List[str]:
    """The headline of each engine, newest checkpoint, first set, T = 0: our loop's first cell and llama.cpp's cell
    at the plan's k, with what the plan advises."""
    lines = []
    loop = [c for c in data["cells"] if not c["sweep"] and c["verifier"] == "chain" and c["temperature"] == 0]
    if loop:
        newest = max(loop, key=lambda c: c["step"] or 0)["checkpoint"]
        c = next(c for c in loop if c["checkpoint"] == newest)
        s = speedup_of(c)
        k = c["k"] if c["k"] != "auto" else f"auto ({c.get('k_used')})"
        lines.append(f"our loop:  {c['set']} T=0 k={k}: {s.value:.2f}×" + (f" (spread {s.spread:.2f})" if s.spread
                     is not None else "") + f", α {c['alpha']:.3f}, τ {c['tau']:.2f}, predicted "
                     f"{c['predicted_speedup']}× ({c['checkpoint']})")
    arm = data.get("llamacpp") or {}
    cells = [c for c in arm.get("cells", []) if not c["sweep"] and c["temperature"] == 0 and not c.get("baseline")]
    if cells:
        c, choice = cells[0], arm["choice"]
        spread = "" if c["speedup_range"] is None else f" (range {c['speedup_range']})"  # one prompt: no spread
        lines.append(f"llama.cpp: {c['set']} T=0 k={c['k']}" + (f" p_min={c['p_min']:g}" if c.get("p_min") else "")
                     + f": {c['speedup_median']:.2f}×{spread}, "
                     f"α {c['alpha']:.3f}, τ {c['tau']:.2f}, predicted {c['predicted_speedup']}×, identical to the "
                     f"target alone {c['identical']}/{c['prompts']}" + (f" ({len(c['departures'])} tie(s))"
                                                                          if c["departures"] else ""))
        cut = f" with p_min {choice['p_min']:g}" if choice.get("p_min") else ""
        lines.append(f"llama.cpp's plan: k = {choice['k']}{cut}, predicted {choice['predicted']:.2f}×: " +
                     ("serve it with the drafter" if choice["pays"] else
                      "it does not pay here, specdrafter-serve serves the target alone"))
        for name in arm.get("baselines", {}):  # beside it, on the same set at T = 0
            c = next((c for c in arm["cells"] if c.get("baseline") == name and c["set"] == cells[0]["set"]
                      and c["temperature"] == 0), None)
            if c is not None:
                lines.append(f"  beside it, {name}: k={'own' if c['k'] is None else c['k']}: "
                             f"{c['speedup_median']:.2f}×, α {c['alpha']:.3f}, identical {c['identical']}/{c['prompts']}")
    return lines
