"""Decoding jobs from a recipe: build the drafter, chat-template the prompt(s), decode speculatively, report."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from specdrafter.core.io import SpecdrafterError, atomic_write_text
from specdrafter.core.recipe import read_yaml, save_recipe
from specdrafter.core.recipe_checks import as_chain
from specdrafter.data.assets import load_prompt_set, load_target
from specdrafter.data.chat import eos_token_ids, user_prompt_ids
from specdrafter.inference.decode import ContextOverflow, GenerationResult, acceptance_rate, alpha_per_token, positions_tried
from specdrafter.inference.decoder import Decoder, build_decoder
from specdrafter.jobs.recipe import checked_recipe, target_args
from specdrafter.kinds import KINDS, Kind, drafter_path, kind_of, newest_trained
from specdrafter.recipes import RECIPES_DIR

log = logging.getLogger("specdrafter")


def load_serving_target(cfg: DictConfig, path: Optional[str], kind: Optional[Kind] = None):
    """(model, tokenizer) that decoding verifies with: the recipe's target, or what the drafter folder at `path`
    (kinds.drafter_path, checked before the target loads) brings to serve in its place (Medusa-2's fine-tuned
    backbone: kinds/: decoding.serving_target). `kind`: the recipe's, when the caller has it."""
    target, tokenizer = load_target(**target_args(cfg))
    return (kind or kind_of(cfg)).decoding.serving_target(Path(path) if path else None, target), tokenizer


@dataclass
class ChosenDrafter:
    cfg: DictConfig  # the recipe as it decodes: drafter.kind and drafter.path of the drafter chosen
    line: str  # which drafter, in one line


def resolve_drafter(cfg: DictConfig) -> ChosenDrafter:
    """The drafter a decoding job uses: drafter.path when set; else the newest checkpoint of drafter.run once it holds
    one trained for target.model (its kind replaces drafter.kind; one that cannot decode what the recipe asks, e.g. a
    static tree from an EAGLE-3 head, is refused in one line, never swapped for drafter.kind); else drafter.kind,
    saying why and what trains the one drafter.run names."""
    dr = cfg.drafter
    if dr.path or not dr.run:
        return ChosenDrafter(cfg, f"drafter: {_described(cfg)}")
    try:
        newest = newest_trained(cfg)
    except SpecdrafterError as why:
        return ChosenDrafter(cfg, f"drafter: {_described(cfg)}: {why}{_trainer_of(dr.run)}")
    chosen = cfg.copy()
    chosen.drafter.kind, chosen.drafter.path = newest.state["drafter"], str(newest.drafter)
    try:
        chosen = checked_recipe(chosen)  # a new recipe: e.g. a static tree, which an EAGLE-3 head does not draft
    except SpecdrafterError as why:
        raise SpecdrafterError(f"the newest checkpoint of drafter.run {dr.run} holds "
                               f"{KINDS[newest.state['drafter']].description}, which cannot decode this recipe: {why} "
                               f"(drafter.run=null decodes with {_described(cfg)})") from None
    return ChosenDrafter(chosen, f"drafter: {_described(chosen)} (the newest checkpoint of drafter.run {dr.run})")


def _described(cfg: DictConfig) -> str:
    kind = kind_of(cfg)
    return f"{kind.description}, {cfg.drafter.path}" if cfg.drafter.path else f"{kind.description} (drafter.kind={kind.name})"


def _trainer_of(run: str) -> str:
    """How to train the drafter a recipe of recipes/ writes to `run` (kinds/: its training's launcher and recipe), or ""."""
    for t in [k.training for k in KINDS.values() if k.training and k.training.recipe]:
        if (RECIPES_DIR / t.recipe).is_file() and \
                Path(str(read_yaml(RECIPES_DIR / t.recipe).get("output_dir"))).resolve() == Path(run).expanduser().resolve():
            return f"; python launch/{t.launcher} recipes/{t.recipe} trains one there"
    return ""


@dataclass
class DecodeReport:
    text: str
    result: GenerationResult
    seconds: float

    def summary(self) -> str:
        r = self.result
        return (f"decode: {len(r.tokens)} tokens in {self.seconds:.2f} s = {len(r.tokens) / self.seconds:.1f} tok/s; "
                f"τ = {r.tau:.2f} tokens per target pass; α = {r.alpha:.3f} (accepted ÷ draft positions tried)"
                + (f"; ASD regret {r.asd_regret:.2f}" if r.asd_regret else ""))


def build_proposer(cfg: DictConfig, target):
    """The recipe's proposer (kinds/: decoding.proposer) around its drafter.path, beside `target` on its device."""
    return kind_of(cfg).decoding.proposer(cfg, target, drafter_path(cfg))


def load_decoder(cfg: DictConfig) -> "LoadedDecoder":
    """The recipe's decoding (inference/decoder.py:build_decoder) with the drafter resolve_drafter chooses (named in
    one log line): its folder checked once, then the target, the proposer beside it, one decoder for every request."""
    chosen = resolve_drafter(cfg)
    log.info(chosen.line)
    cfg = chosen.cfg
    path, kind = drafter_path(cfg), kind_of(cfg)  # a missing, damaged or wrong-kind folder fails before the target loads
    target, tokenizer = load_serving_target(cfg, path, kind)
    decoder = build_decoder(cfg.inference, target, kind.decoding.proposer(cfg, target, path), eos_token_ids(target, tokenizer))
    return LoadedDecoder(decoder, tokenizer, torch.Generator().manual_seed(cfg.inference.seed))


@dataclass
class LoadedDecoder:
    """A recipe's decoder with its target's tokenizer and the stream's generator (seeded by inference.seed)."""
    decoder: Decoder
    tokenizer: object
    generator: torch.Generator

    @property
    def block_length(self):
        return self.decoder.block_length

    def calibrate(self, prompt: List[int]) -> None:
        self.decoder.calibrate(prompt)

    def __call__(self, prompt: List[int]) -> GenerationResult:
        return self.decoder(prompt, self.generator)


def decode(cfg: DictConfig) -> DecodeReport:
    """inference.prompt through the decoding loop."""
    if not cfg.inference.prompt.strip():
        raise SpecdrafterError("recipe key 'inference.prompt' is empty")
    decoder = load_decoder(cfg)
    prompt = user_prompt_ids(decoder.tokenizer, cfg.inference.prompt)
    decoder.calibrate(prompt)
    start = time.perf_counter()
    result = decoder(prompt)
    seconds = time.perf_counter() - start
    return DecodeReport(decoder.tokenizer.decode(result.tokens, skip_special_tokens=True), result, seconds)


ROW_COUNTS = ("tokens", "passes", "accepted", "tried", "drafted")  # per decode.jsonl row; summed into the totals


def decode_file(cfg: DictConfig, on_prompt: Optional[Callable[[int], None]] = None) -> dict:
    """Every prompt of inference.prompts (its first user turn) through the decoding loop, one JSON row each in
    <output_dir>/decode.jsonl, appended as it goes: a rerun skips the prompts already written (a row cut short by a
    kill is dropped). A row holds the text and ROW_COUNTS (`tried`: draft positions tried, so any reader computes
    α = acceptance_rate(accepted, tried) as the loop does) and seconds. A prompt that leaves no room for
    max_new_tokens in the target's context gets a row saying why instead of stopping the job. Returns the totals of
    the prompts decoded now, with their α; `on_prompt(i)` is called after each prompt."""
    records = load_prompt_set(cfg.inference.prompts)
    if not records:
        raise SpecdrafterError(f"recipe key 'inference.prompts': {cfg.inference.prompts!r} holds no prompts")
    out = Path(cfg.output_dir).expanduser() / "decode.jsonl"
    done = _rows_written(out)
    save_recipe(cfg, out.parent)
    decoder = load_decoder(cfg)
    totals = dict(prompts=len(records), decoded=0, skipped=0, resumed=len(done), **dict.fromkeys(ROW_COUNTS, 0),
                  seconds=0.0)
    with open(out, "a") as f, tqdm(total=len(records), initial=len(done), desc="decode", unit="prompt") as bar:
        for i, record in enumerate(records):
            if record["id"] in done:
                continue
            prompt = user_prompt_ids(decoder.tokenizer, record["turns"][0])  # the loader refuses empty turns
            row = {"id": record["id"], "prompt_tokens": len(prompt)}
            decoder.calibrate(prompt)  # on the first prompt decoded: its seconds are decoding only
            start = time.perf_counter()
            try:
                r = decoder(prompt)
            except ContextOverflow as e:  # room for max_new_tokens and one draft block or tree is checked first
                r, row["skipped"] = None, str(e)
            seconds = time.perf_counter() - start
            if "skipped" not in row:
                row.update(text=decoder.tokenizer.decode(r.tokens, skip_special_tokens=True), tokens=len(r.tokens),
                           passes=len(r.cycles), accepted=sum(c.accepted for c in r.cycles),
                           tried=positions_tried(r.cycles), drafted=sum(c.drafted for c in r.cycles),
                           seconds=round(seconds, 4))
                for key in ROW_COUNTS + ("seconds",):
                    totals[key] += row[key]
            totals["skipped" if "skipped" in row else "decoded"] += 1
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            bar.update(1)
            if on_prompt is not None:
                on_prompt(i)
    totals["alpha"] = acceptance_rate(totals["accepted"], totals["tried"])
    log.info(file_summary(totals, str(out.parent)))
    return totals


def file_summary(totals: dict, out: str) -> str:
    """decode_file's closing line, from its totals (the same τ and α as DecodeReport.summary)."""
    return (f"decode: {totals['decoded']} prompts ({totals['resumed']} done before, {totals['skipped']} skipped), "
            f"{totals['tokens']} tokens in {totals['seconds']:.1f} s; τ = {totals['tokens'] / max(totals['passes'], 1):.2f}, "
            f"α = {totals['alpha']:.3f} (accepted ÷ draft positions tried) → {out}/decode.jsonl")


def _rows_written(path: Path) -> set:
    """The ids already in decode.jsonl; a last line cut short by a kill is removed so the file stays valid JSONL."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        return set()
    lines = path.read_text().splitlines(keepends=True)
    ids, good = set(), []
    for line in lines:
        try:
            ids.add(json.loads(line)["id"])
            good.append(line)
        except (ValueError, KeyError, TypeError):
            break  # only the last line can be cut short: rows are appended one at a time
    if len(good) < len(lines):
        atomic_write_text(path, "".join(good))
    return ids


# ----------------------------------------------------------------------------- training's decode check
MAX_PROMPTS = 2  # a check, not an evaluation: the eval job (eval/job.py) measures a checkpoint properly


@torch.no_grad()
def decode_check(cfg: DictConfig, folder: Path, target, tokenizer) -> Dict[str, float]:
    """The drafter saved in `folder` decodes the first eval.num_prompts ≤ MAX_PROMPTS prompts of eval.sets[0] (greedy,
    a chain of block length inference.k) with the training process's `target`: {"decode/tau", "decode/alpha"} over
    all their cycles (α as `inference/decode.py:acceptance_rate` defines it)."""
    c = as_chain(cfg)
    c.drafter.path = str(folder)
    c.inference.temperature, c.inference.verifier, c.inference.max_new_tokens = 0.0, "exact", cfg.eval.max_new_tokens
    decoding = kind_of(c).decoding
    serving = decoding.serving_target(folder, target)
    proposer = decoding.proposer(c, serving, str(folder))  # the drafter in the target's dtype, beside it on its device
    decoder = build_decoder(c.inference, serving, proposer, eos_token_ids(target, tokenizer))
    tokens, cycles = 0, []
    for record in load_prompt_set(cfg.eval.sets[0])[: min(cfg.eval.num_prompts, MAX_PROMPTS)]:
        r = decoder(user_prompt_ids(tokenizer, record["turns"][0]))
        tokens, cycles = tokens + len(r.tokens), cycles + r.cycles
    return {"decode/tau": tokens / max(len(cycles), 1), "decode/alpha": alpha_per_token(cycles)}
