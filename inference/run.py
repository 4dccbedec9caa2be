"""Decoding jobs from a recipe: build the drafter, chat-template the prompt(s), decode speculatively, report."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Union

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from specdrafter.core.io import SpecdrafterError, atomic_write_text
from specdrafter.core.recipe import save_recipe
from specdrafter.data.assets import load_prompt_set, load_target
from specdrafter.data.chat import eos_token_ids, user_prompt_ids
from specdrafter.inference.autotune import BlockLengthTuner
from specdrafter.inference.decode import (
    ASDSettings,
    ContextOverflow,
    GenerationResult,
    speculative_generate,
    tree_speculative_generate,
)
from specdrafter.inference.medusa import typical_generate
from specdrafter.inference.sampling import SamplingParams
from specdrafter.kinds import drafter_path, kind_of

log = logging.getLogger("specdrafter")


def load_serving_target(cfg: DictConfig):
    """(model, tokenizer) that decoding verifies with: the recipe's target, or what the drafter folder brings to
    serve in its place (Medusa-2's fine-tuned backbone: kinds/: serving_target)."""
    path = drafter_path(cfg)  # a missing, damaged or wrong-kind drafter folder fails before the target loads
    target, tokenizer = load_target(cfg.target.model, cfg.target.dtype.value, cfg.target.device)
    return kind_of(cfg).serving_target(Path(path) if path else None, target), tokenizer


def block_length(inference: DictConfig) -> Union[int, BlockLengthTuner]:
    """inference.k as the loop takes it: a number, or a tuner for `auto` (keep one per stream of requests: it
    learns from every cycle)."""
    return BlockLengthTuner(inference.k_max) if inference.k == "auto" else inference.k


def build_proposer(cfg: DictConfig, target):
    """The proposer a recipe asks for: a chain, a static tree (inference.tree) or an EAGLE-2 dynamic tree
    (inference.dynamic_tree.total_tokens > 0). Tree proposers have `propose_tree`."""
    kind = kind_of(cfg)
    kind.check_recipe(cfg)  # a tree the kind cannot draft is one line (recipes built in code come here unchecked)
    return kind.proposer(cfg, target, drafter_path(cfg))


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


@dataclass
class Decoder:
    """A recipe's decoding set up once for any number of requests: the target, the drafter, the sampling settings."""
    cfg: DictConfig
    target: torch.nn.Module
    tokenizer: object
    proposer: object  # inference/proposers.py: a Proposer, or a TreeProposer when the recipe asks for a tree
    eos: List[int]
    generator: torch.Generator
    block: Union[int, BlockLengthTuner] = field(init=False)  # a tuner (k = auto) learns across the requests

    def __post_init__(self):
        self.block = block_length(self.cfg.inference)

    def __call__(self, prompt: List[int]) -> GenerationResult:
        """One request: prompt ids → the new tokens and per-cycle statistics."""
        inf, target, n = self.cfg.inference, self.target, self.cfg.inference.max_new_tokens
        if inf.verifier.value == "typical":
            return typical_generate(target, self.proposer, prompt, n, inf.temperature, inf.typical.eps, inf.typical.delta,
                                    self.eos, self.generator)
        params = SamplingParams(inf.temperature, inf.top_k, inf.top_p)
        if inf.tree or inf.dynamic_tree.total_tokens:
            return tree_speculative_generate(target, self.proposer, prompt, n, params, self.eos, self.generator)
        asd = ASDSettings(**inf.asd) if inf.verifier.value == "asd" else None
        return speculative_generate(target, self.proposer, prompt, n, params, self.block, self.eos, asd, self.generator)


def build_decoder(cfg: DictConfig) -> Decoder:
    inf = cfg.inference
    target, tokenizer = load_serving_target(cfg)
    return Decoder(cfg, target, tokenizer, build_proposer(cfg, target), eos_token_ids(target, tokenizer),
                   torch.Generator().manual_seed(inf.seed))


def decode(cfg: DictConfig) -> DecodeReport:
    """inference.prompt through the decoding loop."""
    if not cfg.inference.prompt.strip():
        raise SpecdrafterError("recipe key 'inference.prompt' is empty")
    decoder = build_decoder(cfg)
    start = time.perf_counter()
    result = decoder(user_prompt_ids(decoder.tokenizer, cfg.inference.prompt))
    seconds = time.perf_counter() - start
    return DecodeReport(decoder.tokenizer.decode(result.tokens, skip_special_tokens=True), result, seconds)


def decode_file(cfg: DictConfig, on_prompt: Optional[Callable[[int], None]] = None) -> dict:
    """Every prompt of inference.prompts (its first user turn) through the decoding loop, one JSON row each in
    <output_dir>/decode.jsonl, appended as it goes: a rerun skips the prompts already written (a row cut short by a
    kill is dropped). A prompt that leaves no room for max_new_tokens in the target's context gets a row saying why
    instead of stopping the job. Returns the totals; `on_prompt(i)` is called after each prompt."""
    records = load_prompt_set(cfg.inference.prompts)
    if not records:
        raise SpecdrafterError(f"recipe key 'inference.prompts': {cfg.inference.prompts!r} holds no prompts")
    out = Path(cfg.output_dir).expanduser() / "decode.jsonl"
    done = _rows_written(out)
    save_recipe(cfg, out.parent)
    decoder = build_decoder(cfg)
    totals = dict(prompts=len(records), decoded=0, skipped=0, resumed=len(done), tokens=0, passes=0, accepted=0,
                  drafted=0, seconds=0.0)
    with open(out, "a") as f, tqdm(total=len(records), initial=len(done), desc="decode", unit="prompt") as bar:
        for i, record in enumerate(records):
            if record["id"] in done:
                continue
            prompt = user_prompt_ids(decoder.tokenizer, record["turns"][0])  # the loader refuses empty turns
            row = {"id": record["id"], "prompt_tokens": len(prompt)}
            start = time.perf_counter()
            try:
                r = decoder(prompt)
            except ContextOverflow as e:  # room for max_new_tokens and one draft block or tree is checked first
                r, row["skipped"] = None, str(e)
            seconds = time.perf_counter() - start
            if "skipped" not in row:
                row.update(text=decoder.tokenizer.decode(r.tokens, skip_special_tokens=True), tokens=len(r.tokens),
                           passes=len(r.cycles), accepted=sum(c.accepted for c in r.cycles),
                           drafted=sum(c.drafted for c in r.cycles), seconds=round(seconds, 4))
                for key in ("tokens", "passes", "accepted", "drafted", "seconds"):
                    totals[key] += row[key]
            totals["skipped" if "skipped" in row else "decoded"] += 1
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            bar.update(1)
            if on_prompt is not None:
                on_prompt(i)
    t = totals
    log.info(f"decode: {t['decoded']} prompts ({t['resumed']} done before, {t['skipped']} skipped), {t['tokens']} tokens in "
             f"{t['seconds']:.1f} s; τ = {t['tokens'] / max(t['passes'], 1):.2f}, α = {t['accepted'] / max(t['drafted'], 1):.3f} "
             f"→ {out}")
    return totals


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
