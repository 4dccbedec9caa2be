"""The acceptance evaluation job: how much will each checkpoint accelerate the target, measured through the
real decoding loop on this machine.

    python launch/eval_acceptance.py recipes/<x>.yaml checkpoint=<checkpoint, drafter folder or run dir> [eval.*=...]

A *cell* is one (checkpoint, prompt set, temperature, verifier[, k / ASD setting]): the first eval.num_prompts
prompts of the set decoded with eval.max_new_tokens each. Cells are appended to results.json as they finish, so a
rerun after a crash skips them. The report (report.md + plots) is rebuilt from results.json at the end.

results.json (schema 1; "sha256": of the rest of the file, checked on a rerun — a damaged file is moved aside):
    {"schema": 1, "target": str, "drafter": kind, "settings": {...the eval knobs the numbers depend on...},
     "machine": {"target_step_s": seconds of one target decode step (median of "v_repeats" interleaved repeats),
                 "target_step_spread": its interquartile range ÷ median over the repeats, "v_repeats",
                 "v": {"n": target pass over n tokens ÷ one, fitted monotone non-decreasing in n (isotonic regression)},
                 "v_raw": {"n": the median over repeats of each repeat's n-token pass ÷ its 1-token pass},
                 "v_spread": {"n": interquartile range ÷ median of those ratios}},   measured before the first
                                  cell is decoded ({} until then)
     "baselines": {"<set>|T=<t>": {"tokens", "seconds", "tokens_per_s", "outputs", "target_step_s",
                                   "target_step_spread"}},   target-only HF generate, and the target step measured
                                  around it (median and interquartile range ÷ median of 5 timings before + 5 after)
     "cells": [{"id", "checkpoint", "step", "set", "temperature", "verifier", "k", "tree_size", "asd",
                "prompts", "tokens", "target_passes", "seconds", "tokens_per_s",
                "target_step_s",  one target step measured around the cell (the machine's speed at the time)
                "target_step_spread",   interquartile range ÷ median of those step timings (how far the speed moved)
                the speedup over the baseline (eval/acceptance.py), one of two kinds; the report flags a cell whose
                |speedup − 1| is smaller than its spread ("⚠ noisy"):
                  eval.repeats = 1, the cell and its baseline decoded once each, minutes apart:
                "speedup_drift_corrected",   tok/s ÷ (baseline tok/s × baseline step ÷ cell step)
                "speedup_drift_spread",      speedup_drift_corrected × (the cell's + the baseline's target_step_spread)
                "speedup_uncorrected",       tok/s ÷ baseline tok/s as measured
                  eval.repeats = R > 1, the cell decoded R times, each time with target-only decoding of every
                  prompt right beside the cell's (alternately before and after); the rest of the row is the
                  median round's:
                "speedup_rounds",   the R ratios tok/s ÷ baseline tok/s
                "speedup_median",   their median (the lower middle one for an even R)
                "speedup_range",    their max − min
                "baseline_tokens_per_s",   the median round's target-only tok/s
                "tau",            tokens per target pass, bonus included
                "alpha",          accepted drafts / draft positions tried
                "per_position",   P(draft j accepted | drafts 1..j−1 accepted), j = 1..k (trees: by depth)
                "per_position_n", how many cycles tried position j (the sample size of each point)
                "mean_tv", "alpha_tv_gap",   mean D_TV(p, q) at the tried positions and α − (1 − mean D_TV): ≈ 0 for
                                             exact chain sampling (chain cells only; null elsewhere)
                "c",              draft time per drafted token (per tree, for trees) ÷ target step
                "predicted_speedup", "measured_over_predicted", "best_k" (chain: the k the formula prefers),
                "k_used",         the block length used most (k, or where `auto` settled)
                "mean_drafted",   drafts verified per cycle on average (below k: the confidence head's length)
                "mean_tree_size", tree cells: tokens per target pass on average (≤ tree_size when auto-sized)
                "asd_regret",     mean realised regret per prompt (ASD cells)
                "sweep",          true for the speedup-vs-k cells
                "outputs"}]}      a JSONL beside results.json: {id, tokens, text} per prompt
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from specdrafter.core.checkpoints import Checkpoint, find_checkpoints
from specdrafter.core.io import (
    SpecdrafterError,
    atomic_write_json,
    atomic_write_text,
    first_line,
    json_digest,
    move_aside,
)
from specdrafter.core.recipe import ASDConfig, EvalVerifier
from specdrafter.core.recipe_checks import as_chain
from specdrafter.data.assets import load_prompt_set, load_target
from specdrafter.data.chat import eos_token_ids, user_prompt_ids
from specdrafter.eval.acceptance import (
    DriftCorrectedSpeedup,
    SideBySideSpeedup,
    Speedup,
    cycle_metrics,
    range_of,
    speedup_of,
)
from specdrafter.eval.report import write_report
from specdrafter.inference.autotune import (
    PassCosts,
    TreeSizeTuner,
    measure_pass_costs,
    relative_spread,
    time_passes,
)
from specdrafter.inference.decoder import build_decoder
from specdrafter.jobs.recipe import target_args
from specdrafter.kinds import kind_of

log = logging.getLogger("specdrafter")


# --------------------------------------------------------------------------------------------- what to evaluate
def find_run_checkpoints(cfg: DictConfig) -> List[Checkpoint]:
    """eval.checkpoint as a list of checkpoints, oldest first (core/checkpoints.py: a training checkpoint, a run
    directory, or a bare drafter folder); a self-draft needs none."""
    kind, path = cfg.drafter.kind, cfg.eval.checkpoint or cfg.drafter.path
    if path is None:
        if not kind_of(cfg).decoding.needs_folder:
            return [Checkpoint(kind, None, None)]
        raise SpecdrafterError("recipe key 'eval.checkpoint' is required: a checkpoint, a drafter folder or a run directory "
                               "(checkpoint=... on the command line)")
    found = find_checkpoints(path)
    for c in found:
        if c.state.get("drafter") not in (None, kind):
            raise SpecdrafterError(f"checkpoint {str(c.drafter.parent)!r} holds a {c.state['drafter']} drafter, but the "
                                   f"recipe's drafter.kind is {kind}")
    return found


def default_output_dir(cfg: DictConfig, checkpoints: List[Checkpoint]) -> Path:
    if cfg.eval.output_dir:
        return Path(cfg.eval.output_dir)
    drafter = checkpoints[-1].drafter
    if drafter is None:
        return Path(cfg.output_dir) / "eval"
    if drafter.parent.parent.name == "checkpoints":  # run/checkpoints/step-N/drafter → run/eval
        return drafter.parent.parent.parent / "eval"
    return drafter.parent / "eval"


def load_sets(e: DictConfig) -> Dict[str, List[dict]]:
    sets = {}
    for name in e.sets:
        records = load_prompt_set(name)[: e.num_prompts]
        if not records:
            raise SpecdrafterError(f"recipe key 'eval.sets': prompt set {name!r} is empty")
        sets[Path(name).stem if Path(name).suffix else name] = records
    return sets


def settings(cfg: DictConfig) -> dict:
    """The knobs every number in results.json depends on; a rerun with other values is refused."""
    e, inf = cfg.eval, cfg.inference
    return {"num_prompts": e.num_prompts, "max_new_tokens": e.max_new_tokens, "top_k": inf.top_k, "top_p": inf.top_p,
            "seed": inf.seed, "tree": OmegaConf.to_container(inf.tree),
            "dynamic_tree": OmegaConf.to_container(inf.dynamic_tree), "typical": OmegaConf.to_container(inf.typical),
            "target": cfg.target.model, "repeats": e.repeats}


def results_header(cfg: DictConfig) -> dict:
    """results.json's "target", "drafter" and "settings": a rerun with others is refused (Results)."""
    return {"target": cfg.target.model, "drafter": cfg.drafter.kind, "settings": settings(cfg)}


@dataclass(frozen=True)
class EvalJob:
    """What the eval job reads from its recipe, once, whatever engines measure (engines/evaluate.py:evaluate hands it
    to each): nothing is written, no model loads."""

    checkpoints: List[Checkpoint]  # oldest first (find_run_checkpoints)
    sets: Dict[str, List[dict]]  # prompt set name → its first eval.num_prompts records
    out: Path  # the evaluation folder (eval.output_dir, or beside the run)
    header: dict  # results_header
    target: dict  # data/assets.py:load_target's arguments (jobs/recipe.py:target_args)


def eval_job(cfg: DictConfig) -> EvalJob:
    """The recipe read for the eval job; bad input (a missing checkpoint, an empty prompt set) is refused here, before
    any model loads."""
    checkpoints = find_run_checkpoints(cfg)
    sets = load_sets(cfg.eval)
    return EvalJob(checkpoints, sets, default_output_dir(cfg, checkpoints), results_header(cfg), target_args(cfg))



@dataclass(frozen=True)
class Cell:
    """One planned cell: what to decode (its results.json row begins with `row()`)."""

    checkpoint: Checkpoint
    set: str  # the prompt set's name
    temperature: float
    verifier: str  # chain, asd, tree or typical
    k: Union[int, str]  # the block length, or "auto"
    asd: Optional[ASDConfig] = None  # ASD cells only
    sweep: bool = False  # a cell of the speedup-vs-k sweep

    @property
    def is_chain(self) -> bool:
        """It decodes a chain of k drafts (chain, asd), else a tree (tree, typical)."""
        return EvalVerifier(self.verifier).is_chain

    @property
    def id(self) -> str:
        cell_id = f"{self.checkpoint.name}|{self.set}|T={self.temperature}|{self.verifier}"
        cell_id += f"|k={self.k}" if self.is_chain else ""
        if self.asd is not None:
            cell_id += "|asd=" + ",".join(f"{x:g}" for x in self._asd_values())
        return cell_id

    @property
    def baseline_id(self) -> str:
        """The key of its target-only baseline in results.json's "baselines"."""
        return f"{self.set}|T={self.temperature}"

    def _asd_values(self) -> Optional[list]:
        """The ASD setting as results.json stores it: [budget, gate, max_mismatches]."""
        return None if self.asd is None else [self.asd.budget, self.asd.gate, self.asd.max_mismatches]

    def row(self) -> dict:
        """The cell's keys of its results.json row (the checkpoint by name and step)."""
        return {"id": self.id, "checkpoint": self.checkpoint.name, "step": self.checkpoint.step, "set": self.set,
                "temperature": self.temperature, "verifier": self.verifier, "k": self.k, "asd": self._asd_values(),
                "sweep": self.sweep}


# ------------------------------------------------------------------------------------------------- the job
class Results:
    """results.json, written atomically after every cell."""

    def __init__(self, folder: Path, header: dict):
        """`header`: results_header of the recipe."""
        self.folder, self.path = folder, folder / "results.json"
        fresh = {"schema": 1, **header, "machine": {}, "baselines": {}, "cells": []}
        self.data = self._read() if self.path.is_file() else None
        if self.data is not None:
            saved = self.data.get("settings", {})
            changed = [k for k, v in fresh["settings"].items() if saved.get(k) != v]
            if self.data.get("drafter") != fresh["drafter"] or changed:
                what = ", ".join(changed) or "drafter.kind"
                raise SpecdrafterError(f"{self.path} was made with other settings ({what}); use another eval.output_dir "
                                       "or remove it")
        else:
            self.data = fresh

    def _read(self) -> Optional[dict]:
        """results.json as saved, or None after moving a damaged one aside (results.json.damaged): its checksum of
        itself is missing or does not match, or it is not JSON."""
        try:
            data = json.loads(self.path.read_bytes().decode())
            problem = None if isinstance(data, dict) else "not a JSON object"
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            data, problem = None, f"not valid JSON: {first_line(e)}"
        if problem is None and data.pop("sha256", None) != json_digest(data):
            problem = "it does not match its checksum"
        if problem is None:
            return data
        dest = move_aside(self.path)
        log.warning(f"{self.path} is damaged ({problem}): moved aside to {dest.name}; every cell is evaluated afresh")
        return None

    def cell(self, cell_id: str) -> Optional[dict]:
        return next((c for c in self.data["cells"] if c["id"] == cell_id and (self.folder / c["outputs"]).is_file()), None)

    def add(self, cell: dict) -> None:
        self.data["cells"] = [c for c in self.data["cells"] if c["id"] != cell["id"]] + [cell]
        self.save()

    def save(self) -> None:
        atomic_write_json(self.path, {**self.data, "sha256": json_digest(self.data)})


@dataclass(frozen=True)
class Drafting:
    """A checkpoint's proposer (inference/proposers.py) and the recipe it was built from: as a chain for the chain
    cells (core/recipe_checks.py:as_chain), as it is for the tree cells."""

    recipe: DictConfig
    proposer: object


@dataclass(frozen=True)
class CellContext:
    """What a cell is decoded with and measured against: shared by every cell of a checkpoint and prompt set, except
    `step_s`, the target step timed just before the cell."""

    target: torch.nn.Module  # the model that verifies (the target, or a Medusa-2 checkpoint's backbone)
    chain: Drafting  # the chain cells'
    tree: Optional[Drafting]  # the tree cells', or None
    prompts: List[List[int]]  # the set's prompt ids
    eos: List[int]
    tokenizer: object
    step_s: float  # seconds of one target step, just before the cell
    machine: PassCosts  # v(n) (fitted monotone) and its spread, measured once per results.json
    out: Path  # the evaluation folder


def run_eval(cfg: DictConfig, job: EvalJob) -> Path:
    """Evaluate every cell not yet in results.json; write results.json, report.md and the plots. Returns the folder.
    `job`: eval_job(cfg) (the eval job's entry, engines/evaluate.py, reads it and saves the recipe)."""
    e, checkpoints, sets, out = cfg.eval, job.checkpoints, job.sets, job.out
    (out / "outputs").mkdir(parents=True, exist_ok=True)
    results = Results(out, job.header)
    verifiers = [v.value for v in e.verifiers]
    target, tokenizer = load_target(**job.target)
    prompts = {name: [user_prompt_ids(tokenizer, r["turns"][0]) for r in records] for name, records in sets.items()}
    check_room(cfg, sets, prompts, target.config.max_position_embeddings)  # before any pass: one line, nothing lost
    eos = eos_token_ids(target, tokenizer)

    plan = _plan(cfg, checkpoints, list(sets), verifiers)
    todo = [cell for cell in plan if results.cell(cell.id) is None]
    log.info(f"evaluation: {len(plan)} cells ({len(plan) - len(todo)} already in {results.path}) → {out}")
    if todo:
        _measure_machine(cfg, results, target, prompts[next(iter(prompts))][0], todo)
    machine = machine_costs(results.data["machine"]) if todo else None  # nothing to decode: "machine" may be {}

    bar = tqdm(total=len(todo), desc="eval cells", unit="cell")
    loaded: Dict[str, tuple] = {}
    for cell in todo:
        base_id, ckpt = cell.baseline_id, cell.checkpoint
        if ckpt.name not in loaded:
            loaded.clear()  # one checkpoint's proposers in memory at a time
            loaded[ckpt.name] = _proposers(cfg, ckpt, target, verifiers)
        serving, chain, tree = loaded[ckpt.name]
        context = CellContext(serving, chain, tree, prompts[cell.set], eos, tokenizer, 0.0, machine, out)
        if e.repeats > 1:
            measured, base, speedup = _side_by_side(cfg, cell, context, target)
            results.data["baselines"].setdefault(base_id, base)
        else:
            if base_id not in results.data["baselines"]:
                results.data["baselines"][base_id] = _baseline(target, prompts[cell.set], cell.temperature,
                                                               e.max_new_tokens, eos, out, base_id, tokenizer)
                results.save()
            measured = _timed_cell(cfg, cell, context, target)
            speedup = _compare_with_baseline(measured, results.data["baselines"][base_id])
        _add_speedup(measured, speedup)
        measured["answer_accuracy"] = answer_accuracy(out / measured["outputs"], sets[cell.set])
        results.add(measured)
        bar.update()
        bar.set_postfix(cell=cell.id, tau=measured["tau"], alpha=measured["alpha"])
    bar.close()

    write_report(results.data, out)
    if e.wandb:
        _log_wandb(cfg, results.data, out)
    log.info(closing_line(results.data, checkpoints[-1].name, out))
    return out


def closing_line(data: dict, newest: str, out: Path) -> str:
    """The job's last line: the cells, the headline of the newest checkpoint (its first cell: the first set, temperature
    and verifier) and where the report is."""
    first = next((c for c in data["cells"] if c["checkpoint"] == newest and not c["sweep"]), None)
    speedup = speedup_of(first) if first else None
    headline = (f"; {newest}, {first['set']} T={first['temperature']:g} {first['verifier']}: τ {first['tau']:.2f}, "
                f"α {first['alpha']:.3f}" + (f", speedup {speedup.value:.2f}×" if speedup else "") if first else "")
    n = len(data["cells"])
    return f"evaluation: {n} cell{'s' * (n != 1)}{headline} → {out / 'report.md'}"


def _measure_machine(cfg: DictConfig, results: Results, target, prompt: List[int], todo: List[Cell]) -> None:
    """v(n) for every pass size a planned cell needs (up to k_max + 1 when a block length is auto-tuned, the tree's
    size and an auto-sized tree's grid), measured once per results.json so that every cell shares one v(n)."""
    e, k = cfg.eval, cfg.inference.k
    tree_size = _tree_size(cfg) if any(not cell.is_chain for cell in todo) else 0
    auto = k == "auto" or bool(e.k_sweep)  # an auto-tuned cell will run: its tuner needs v(n) up to k_max + 1
    longest = max([0 if k == "auto" else k, *e.k_sweep, cfg.inference.k_max if auto else 0])
    tuner = _tree_tuner(cfg, None) if tree_size else None  # an auto-sized tree: v(n) on the tuner's grid too
    sizes = {*range(1, longest + 2), *([tree_size] if tree_size else []), *(tuner.sizes() if tuner else [])}
    known = results.data["machine"].get("v", {})
    if all(str(n) in known for n in sizes):
        return
    costs = measure_pass_costs(target, prompt, sorted({*sizes, *map(int, known)}))
    results.data["machine"] = {
        "target_step_s": costs.step_s, "target_step_spread": round(costs.step_spread, 4), "v_repeats": costs.repeats,
        "v": {str(n): x for n, x in costs.v.items()}, "v_raw": {str(n): x for n, x in costs.v_raw.items()},
        "v_spread": {str(n): round(x, 4) for n, x in costs.spread.items()}}
    results.save()


def machine_costs(machine: dict) -> PassCosts:
    """results.json's "machine" (as _measure_machine writes it) as the tuners and predictions use it."""
    return PassCosts(machine["target_step_s"], {int(n): x for n, x in machine["v_raw"].items()},
                     {int(n): x for n, x in machine["v_spread"].items()}, machine["target_step_spread"],
                     machine["v_repeats"])


def _timed_cell(cfg: DictConfig, cell: Cell, context: CellContext, target, beside=None) -> dict:
    """The cell decoded once, with the target step timed around it: the machine's speed, and how far it moved."""
    before = step_times(target, context.prompts[0])
    measured = _run_cell(cfg, cell, replace(context, step_s=statistics.median(before)), beside)
    steps = before + step_times(target, context.prompts[0])
    measured.update(target_step_s=round(statistics.median(steps), 5),
                    target_step_spread=round(relative_spread(steps), 4))
    return measured


def _side_by_side(cfg: DictConfig, cell: Cell, context: CellContext, target) -> Tuple[dict, dict, SideBySideSpeedup]:
    """eval.repeats rounds of the cell, each with target-only decoding of every prompt right beside the cell's
    decoding of it, so that each round's ratio of speeds sees one machine speed. The cell's row is the round with
    the median ratio (the lower middle one for an even count). Returns (the row, that round's baseline, the
    speedup: that median with the range of the rounds' ratios)."""
    rounds = []
    for _ in range(cfg.eval.repeats):
        runs = {}  # prompt i → target-only (new tokens, seconds), decoded beside the cell's prompt i

        def beside(i: int) -> None:
            runs[i] = _target_only(target, context.prompts[i], i, cell.temperature, cfg.eval.max_new_tokens,
                                   context.eos)

        measured = _timed_cell(cfg, cell, context, target, beside)
        base = _baseline_row([runs[i] for i in sorted(runs)], context.out, cell.baseline_id, context.tokenizer,
                             measured["target_step_s"], measured["target_step_spread"])
        rounds.append((measured["tokens_per_s"] / base["tokens_per_s"], measured, base))
    ratios = [ratio for ratio, _, _ in rounds]
    ratio = statistics.median_low(ratios)
    measured, base = next((m, b) for r, m, b in rounds if r == ratio)
    return measured, base, SideBySideSpeedup(round(ratio, 3), round(range_of(ratios), 3), [round(x, 3) for x in ratios],
                                             base["tokens_per_s"])


def _compare_with_baseline(row: dict, base: dict) -> DriftCorrectedSpeedup:
    """A measured cell's speedups over its baseline, and the spread of the drift-corrected one."""
    uncorrected = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
    # the baseline's speed had the machine run as fast as during this cell (uniform drift: speeds ∝ 1 / step)
    drift = base["target_step_s"] / row["target_step_s"] if base.get("target_step_s") else 1.0
    corrected = round(row["tokens_per_s"] / (base["tokens_per_s"] * drift), 3)
    # how far the machine's speed moved around the cell and around the baseline bounds what the ratio can tell
    spreads = [row.get("target_step_spread"), base.get("target_step_spread")]
    return DriftCorrectedSpeedup(corrected, None if None in spreads else round(corrected * sum(spreads), 3), uncorrected)


def _add_speedup(row: dict, speedup: Speedup) -> None:
    """A measured cell's row gets its speedup's fields, and the speedup over the formula's prediction."""
    row.update(speedup.row())
    if row["predicted_speedup"]:
        row["measured_over_predicted"] = round(speedup.value / row["predicted_speedup"], 3)


def _plan(cfg: DictConfig, checkpoints: List[Checkpoint], sets: List[str], verifiers: List[str]) -> List[Cell]:
    """Every cell to evaluate, in order: each checkpoint × set × temperature × verifier; then, on the newest
    checkpoint, the speedup-vs-k sweep (first set, T = 0) and the ASD audit (T = 0: strict vs each ASD setting)."""
    e, k, inf = cfg.eval, cfg.inference.k, cfg.inference
    plan = []

    def add(ckpt, name, temperature, verifier, k=k, asd=None, sweep=False):
        cell = Cell(ckpt, name, float(temperature), verifier, k, asd, sweep)
        if all(c.id != cell.id for c in plan):
            plan.append(cell)

    for ckpt in checkpoints:
        for name in sets:
            for temperature in e.temperatures:
                for verifier in verifiers:
                    if verifier != "asd":
                        add(ckpt, name, temperature, verifier)
    newest = checkpoints[-1]
    for kk in [*e.k_sweep, "auto"] if e.k_sweep else []:  # the auto-tuned block length beside the fixed ones
        add(newest, sets[0], 0.0, "chain", k=kk, sweep=True)
    if "asd" in verifiers:
        a = inf.asd
        for name in sets:
            add(newest, name, 0.0, "chain")  # the strict reference
            for setting in [[a.budget, a.gate, a.max_mismatches], *e.asd_sweep]:
                add(newest, name, 0.0, "asd", asd=ASDConfig(float(setting[0]), float(setting[1]), int(setting[2])))
    return plan


def _proposers(cfg: DictConfig, ckpt: Checkpoint, target, verifiers: List[str]):
    """(the model to verify with, the chain cells' Drafting, the tree cells' or None) for one checkpoint. A Medusa-2
    checkpoint brings its fine-tuned backbone, which is what it serves."""
    c = cfg.copy()
    path = c.drafter.path = str(ckpt.drafter) if ckpt.drafter else None
    decoding = kind_of(c).decoding
    serving = decoding.serving_target(ckpt.drafter, target)
    tree = Drafting(c, decoding.proposer(c, serving, path)) if {"tree", "typical"} & set(verifiers) else None
    chain = as_chain(c)
    return serving, Drafting(chain, decoding.proposer(chain, serving, path)), tree


def cell_decoding(drafting: Drafting, cell: Cell) -> DictConfig:
    """The inference section a cell decodes with: its proposer's (`drafting`: the chain's for a chain cell) with its
    temperature, verifier, k and ASD setting, eval.max_new_tokens."""
    inf = drafting.recipe.inference.copy()
    inf.temperature, inf.max_new_tokens = cell.temperature, drafting.recipe.eval.max_new_tokens
    inf.verifier = EvalVerifier(cell.verifier).rule
    if cell.is_chain:
        inf.k = cell.k
    if cell.asd is not None:
        inf.asd.budget, inf.asd.gate, inf.asd.max_mismatches = cell.asd.budget, cell.asd.gate, cell.asd.max_mismatches
    return inf


def step_times(target, prompt: List[int], repeats: int = 5) -> List[float]:
    """Seconds of `repeats` target decode steps right now: the yardstick that corrects speeds measured minutes apart
    for the machine's drift, and (its spread) how far the machine's speed moved meanwhile."""
    return time_passes(target, prompt, [1], repeats)[1]


@torch.no_grad()
def _target_only(target, prompt: List[int], i: int, temperature: float, max_new_tokens: int, eos) -> tuple:
    """HF `generate` on the set's prompt i (seeded by i): (its new tokens, seconds)."""
    sample = dict(do_sample=temperature > 0, **({"temperature": temperature, "top_k": 0} if temperature else {}))
    torch.manual_seed(i)
    start = time.perf_counter()
    ids = target.generate(torch.tensor([prompt], device=target.device), max_new_tokens=max_new_tokens, eos_token_id=eos,
                          pad_token_id=eos[0] if eos else None, **sample)[0, len(prompt):].tolist()
    return ids, time.perf_counter() - start


def _baseline(target, prompts, temperature, max_new_tokens, eos, out: Path, base_id: str, tokenizer) -> dict:
    """Target-only decoding of the same prompts with HF `generate`: the speed every speedup is measured against,
    with the target step measured around it."""
    before = step_times(target, prompts[0])
    runs = [_target_only(target, prompt, i, temperature, max_new_tokens, eos) for i, prompt in enumerate(prompts)]
    steps = before + step_times(target, prompts[0])
    return _baseline_row(runs, out, base_id, tokenizer, statistics.median(steps), relative_spread(steps))


def _baseline_row(runs: List[tuple], out: Path, base_id: str, tokenizer, step_s: float, step_spread: float) -> dict:
    """results.json's baseline entry from the runs [(new tokens, seconds)] per prompt; their texts go to a JSONL."""
    tokens, seconds = sum(len(ids) for ids, _ in runs), sum(s for _, s in runs)
    name = f"outputs/baseline-{_slug(base_id)}.jsonl"
    atomic_write_text(out / name, "".join(json.dumps({"tokens": ids, "text": tokenizer.decode(ids, skip_special_tokens=True)})
                                          + "\n" for ids, _ in runs))
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 3), "outputs": name,
            "target_step_s": round(step_s, 5), "target_step_spread": round(step_spread, 4)}


def _run_cell(cfg: DictConfig, cell: Cell, context: CellContext, beside: Optional[Callable[[int], None]] = None) -> dict:
    """Decode every prompt of the planned `cell` through the loop and measure it: the cell's row of results.json
    (without the comparison with its baseline, which `run_eval` adds). `beside(i)`, if given, runs next to prompt i,
    outside the timing: before it for even i, after it for odd i, so that neither side always goes first."""
    verifier, prompts = cell.verifier, context.prompts
    # One decoder for the whole cell: its tuners (k = auto, an auto-sized tree; fresh per cell, acceptance differs with
    # T) start from the v(n) the job measured (their own calibration would be timed here).
    costs = replace(context.machine, step_s=context.step_s)
    drafting = context.chain if cell.is_chain else context.tree
    decoder = build_decoder(cell_decoding(drafting, cell), context.target, drafting.proposer, context.eos, costs,
                            record_tv=verifier == "chain")
    cycles, rows, seconds, regret = [], [], 0.0, 0.0
    for i, prompt in enumerate(prompts):
        if beside and i % 2 == 0:
            beside(i)
        generator = torch.Generator().manual_seed(cfg.inference.seed + i)
        start = time.perf_counter()
        r = decoder(prompt, generator)
        seconds += time.perf_counter() - start - sum(c.tv_s for c in r.cycles)  # the D_TV audit is not decoding time
        if beside and i % 2 == 1:
            beside(i)
        cycles += r.cycles
        regret += r.asd_regret
        rows.append({"id": i, "tokens": r.tokens, "text": context.tokenizer.decode(r.tokens, skip_special_tokens=True)})
    tokens = sum(len(r["tokens"]) for r in rows)
    chain = cell.is_chain
    metrics = cycle_metrics(cycles, tokens, context.step_s, context.machine.v, chain).rounded()
    del metrics["verifier_per_token_vs_target_step"]  # the decode benchmark's column, not results.json's
    name = f"outputs/{_slug(cell.id)}.jsonl"
    atomic_write_text(context.out / name, "".join(json.dumps(r) + "\n" for r in rows))
    return {**cell.row(), "tree_size": None if chain else _tree_size(cfg), "prompts": len(prompts), **metrics,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 3), "measured_over_predicted": None,
            "asd_regret": round(regret / len(prompts), 4) if cell.asd is not None else None, "outputs": name}


def final_number(text: str) -> Optional[str]:
    """The answer of a GSM8K-style solution: the number after '####' if there is one, else the last number."""
    tail = text.rsplit("####", 1)[-1]
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", tail)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def answer_accuracy(outputs: Path, records: List[dict]) -> Optional[float]:
    """Share of outputs whose final number equals the reference's, for sets whose references end in '#### N'
    (GSM8K); None for other sets."""
    refs = [r["reference"][0] for r in records if r.get("reference")]
    if len(refs) != len(records) or not all("####" in ref for ref in refs):
        return None
    texts = [json.loads(line)["text"] for line in outputs.read_text().splitlines() if line.strip()]
    return round(sum(final_number(t) == final_number(ref) for t, ref in zip(texts, refs)) / len(refs), 4)


def _tree_tuner(cfg: DictConfig, costs: Optional[PassCosts]) -> Optional[TreeSizeTuner]:
    """The dynamic tree's size tuner with the job's measured costs, or None (a static tree, or auto_size off)."""
    dyn = cfg.inference.dynamic_tree
    return TreeSizeTuner(dyn.total_tokens, step_costs=costs) if dyn.total_tokens and dyn.auto_size else None


def check_room(cfg: DictConfig, sets: Dict[str, List[dict]], prompts: Dict[str, List[List[int]]], context: int) -> None:
    """Every prompt must leave the target's context room for eval.max_new_tokens and the largest draft block or tree
    a cell verifies: found after an hour of measuring, it would stop the job; found here, it is one line."""
    inf = cfg.inference
    k_sweep = list(cfg.eval.k_sweep) if "chain" in [v.value for v in cfg.eval.verifiers] else []
    block = max([inf.k_max if inf.k == "auto" else inf.k, *k_sweep, _tree_size(cfg) - 1])
    room = context - cfg.eval.max_new_tokens - block
    for name, ids in prompts.items():
        for record, prompt in zip(sets[name], ids):
            if len(prompt) > room:
                raise SpecdrafterError(f"prompt {record['id']!r} of eval set {name!r} has {len(prompt)} tokens: with "
                                       f"eval.max_new_tokens {cfg.eval.max_new_tokens} and draft blocks of up to {block} "
                                       f"it exceeds the target's context of {context} tokens; remove it or lower "
                                       "eval.max_new_tokens")


def _tree_size(cfg: DictConfig) -> int:
    inf = cfg.inference
    return inf.dynamic_tree.total_tokens + 1 if inf.dynamic_tree.total_tokens else len(inf.tree) + 1


def _slug(cell_id: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-.=," else "_" for ch in cell_id)


def _log_wandb(cfg: DictConfig, data: dict, out: Path) -> None:
    import wandb  # optional: only when eval.wandb is set
    w = cfg.train.wandb
    run = wandb.init(project=w.project, name=f"{w.name or Path(cfg.output_dir).name}-eval", mode=w.mode.value,
                     dir=str(out), job_type="eval", config={"eval": OmegaConf.to_container(cfg.eval, resolve=True)})
    speedup = "speedup_median" if cfg.eval.repeats > 1 else "speedup_drift_corrected"
    columns = ["id", "step", "set", "temperature", "verifier", "k", "tau", "alpha", "tokens_per_s", speedup,
               "predicted_speedup", "alpha_tv_gap"]
    run.log({"cells": wandb.Table(columns=columns, data=[[c.get(k) for k in columns] for c in data["cells"]]),
             **{f"plots/{p.stem}": wandb.Image(str(p)) for p in sorted(out.glob("*.png"))}})
    run.finish()
