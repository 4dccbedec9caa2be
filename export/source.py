"""What an export reads: the drafter folder and what its run left beside it (`Source`), and the target it was
trained for, named as the engines and the Hub know it (`Target`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from huggingface_hub import try_to_load_from_cache
from omegaconf import DictConfig, OmegaConf

from specdrafter.core.checkpoints import find_checkpoints
from specdrafter.core.io import SpecdrafterError, json_file_problem
from specdrafter.core.recipe import load_saved_recipe
from specdrafter.data.assets import HUB_IDS, SMOLLM2_DIR, cache_dir
from specdrafter.data.gguf_assets import GGUF_TARGETS
from specdrafter.kinds import KINDS, Kind, kind_of_config

# built-in target → its converted folder (data/assets.py, data/gguf_assets.py) and its architecture
BUILTIN_DIRS = {"smollm2-135m-instruct": SMOLLM2_DIR, **{name: t.folder for name, t in GGUF_TARGETS.items()}}
BUILTIN_ARCHITECTURES = {"smollm2-135m-instruct": "LlamaForCausalLM",
                         **{name: t.architecture for name, t in GGUF_TARGETS.items()}}


# ------------------------------------------------------------------------------------------------ source
@dataclass
class Source:
    """What to export: the drafter folder and whatever the training left beside it."""
    drafter: Path
    kind: Kind
    recipe: Optional[DictConfig]  # the resolved recipe of the run (None: a bare drafter folder without one)
    state: dict = field(default_factory=dict)  # trainer_state.json: {"step", "drafter", "metrics", ...}
    eval_results: Optional[Path] = None  # <run>/eval/results.json, if an evaluation ran


def find_source(path: str | os.PathLike) -> Source:
    """The newest checkpoint at `path` (core/checkpoints.py: a checkpoint folder, a run's output_dir or a bare
    drafter folder), with the recipe and evaluation results the run left beside it."""
    newest = find_checkpoints(path)[-1]
    recipe = load_saved_recipe(newest.recipe) if newest.recipe is not None else None
    results = newest.run / "eval" / "results.json"
    name = newest.state.get("drafter")
    kind = KINDS[name] if name in KINDS else drafter_kind(newest.drafter)
    return Source(newest.drafter, kind, recipe, newest.state,
                  results if results.is_file() and json_file_problem(results) is None else None)


def drafter_kind(folder: Path) -> Kind:
    """The kind of a drafter folder, from its config.json (for folders without a trainer_state.json)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as e:
        raise SpecdrafterError(f"{str(folder / 'config.json')!r} is not valid JSON ({e})") from None
    kind = kind_of_config(config)
    if kind is None:
        raise SpecdrafterError(f"{str(folder)!r} holds no drafter specdrafter can export "
                               f"(architectures: {config.get('architectures') or []})")
    return kind


@dataclass
class Target:
    hub_id: Optional[str]  # None: a local model without a known Hub id
    name: str  # what to call it in the card: the Hub id, or the local folder's name (never its path)
    architectures: List[str]
    num_layers: Optional[int] = None  # num_hidden_layers of its config.json, where this machine has one
    folder: Optional[Path] = None  # where its files are on this machine (read, never written into an export)


def target_of(recipe: Optional[DictConfig]) -> Target:
    """The target the drafter was trained for, as a Hub id where one is known (a local folder's path is never
    written: it means nothing elsewhere and can name a user). A local folder has a known Hub id only when it is
    specdrafter's converted copy of a built-in target: any other may differ from every Hub model."""
    model = OmegaConf.select(recipe, "target.model") if recipe is not None else None
    if model is None:
        return Target(None, "unknown target", [])
    local = Path(model).expanduser()
    if model not in HUB_IDS and (model.startswith(("/", ".", "~")) or local.exists()):
        local, config = local.resolve(), read_config(local / "config.json")
        hub_id = builtin_hub_id(local)
        return Target(hub_id, hub_id or local.name, config.get("architectures") or [], config.get("num_hidden_layers"),
                      local if local.is_dir() else None)
    folder = hub_folder(model)
    config = read_config(folder / "config.json") if folder is not None else {}
    default = [BUILTIN_ARCHITECTURES[model]] if model in BUILTIN_ARCHITECTURES else []
    return Target(HUB_IDS.get(model, model), HUB_IDS.get(model, model), config.get("architectures") or default,
                  config.get("num_hidden_layers"), folder)


def builtin_hub_id(folder: Path) -> Optional[str]:
    """The Hub id a local folder converts, if it is a built-in target's converted copy (data/assets.py names the
    folder and writes conversion_check.json into it), else None."""
    name = next((n for n, d in BUILTIN_DIRS.items() if folder.name == d), None)
    return HUB_IDS[name] if name and (folder / "conversion_check.json").is_file() else None


def hub_folder(model: str) -> Optional[Path]:
    """The folder holding a built-in name's or Hub id's config.json where this machine already has it (the
    built-in's converted copy, the Hugging Face cache's snapshot); nothing is downloaded. None if none."""
    if model in BUILTIN_DIRS and read_config(cache_dir() / "models" / BUILTIN_DIRS[model] / "config.json"):
        return cache_dir() / "models" / BUILTIN_DIRS[model]
    try:
        cached = try_to_load_from_cache(HUB_IDS.get(model, model), "config.json")
    except ValueError:  # not a valid repo id
        cached = None
    return Path(cached).parent if isinstance(cached, str) and read_config(Path(cached)) else None


def read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


