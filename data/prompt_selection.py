"""The data job's first step: which prompts a dataset is made of. The first user turns of a prompt set, in one
seeded shuffled order, length-filtered, deduplicated, with every prompt of the evaluation sets (data.exclude) kept
out — equal to an evaluation turn, or containing or contained in a long one — and over-long ones skipped or cut
(data.overlong), until data.num_conversations are collected; the counts of each say why prompts were dropped.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

from omegaconf import DictConfig

from specdrafter.data.assets import load_prompt_set


@dataclass
class PromptSelection:
    prompts: List[dict]  # {"id", "text", "truncated"}
    counts: Dict[str, int] = field(default_factory=dict)


def normalise_text(text: str) -> str:
    return " ".join(text.lower().split())


def evaluation_texts(names: Sequence[str]) -> List[str]:
    return [normalise_text(t) for name in names for r in load_prompt_set(name) for t in r["turns"]]


def is_eval_prompt(text: str, eval_exact: set, eval_long: List[str]) -> bool:
    """Equal to an evaluation turn, or containing / contained in a long one (ShareGPT quotes benchmarks)."""
    return text in eval_exact or any(e in text or (len(text) >= 40 and text in e) for e in eval_long)


def select_prompts(records: List[dict], tokenizer, cfg: DictConfig, max_prompt_tokens: int,
                   eval_texts: Sequence[str]) -> PromptSelection:
    """First user turns, in a seeded shuffled order: length-filtered, deduplicated, evaluation prompts excluded,
    over-long ones skipped or truncated per `data.overlong`, until `data.num_conversations` are collected."""
    counts = dict(considered=0, too_short=0, overlong_skipped=0, truncated=0, duplicates=0, eval_excluded=0)
    eval_exact = set(eval_texts)
    eval_long = [e for e in eval_exact if len(e) >= 40]
    order = list(range(len(records)))
    random.Random(cfg.seed).shuffle(order)
    seen, chosen = set(), []
    for i in order:
        if len(chosen) == cfg.num_conversations:
            break
        counts["considered"] += 1
        text = records[i]["turns"][0].strip()
        key = normalise_text(text)
        if key in seen:
            counts["duplicates"] += 1
            continue
        seen.add(key)
        if is_eval_prompt(key, eval_exact, eval_long):
            counts["eval_excluded"] += 1
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < cfg.min_prompt_tokens:
            counts["too_short"] += 1
            continue
        truncated = len(ids) > max_prompt_tokens
        if truncated and cfg.overlong.value == "skip":
            counts["overlong_skipped"] += 1
            continue
        if truncated:
            counts["truncated"] += 1
            text = tokenizer.decode(ids[:max_prompt_tokens])
        chosen.append({"id": records[i]["id"], "text": text, "truncated": truncated, "turns": records[i]["turns"],
                       "reference": records[i].get("reference")})
    counts["selected"] = len(chosen)
    return PromptSelection(chosen, counts)

