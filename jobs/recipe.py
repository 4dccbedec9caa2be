"""The checked recipe: what every job receives. `load_recipe` reads a YAML file; `checked_recipe` is the one
constructor, for a file's mapping and for a recipe a job changes. Both run every check — the schema's and each
section's (core/recipe_checks.py:typed_recipe), then the drafter kind's (kinds/: check_recipe) — once, where the
recipe enters; everything that receives one trusts it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

from omegaconf import DictConfig, OmegaConf

from specdrafter.core.recipe import RecipeError, read_yaml
from specdrafter.core.recipe_checks import typed_recipe
from specdrafter.kinds import check_recipe


def load_recipe(path: str | os.PathLike, overrides: List[str] = ()) -> DictConfig:
    """Merge schema defaults ← YAML file ← `key=value` overrides; validate (checked_recipe); a typed DictConfig."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"recipe {path} is a folder, not a YAML file")
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    return checked_recipe(read_yaml(path), overrides)


def checked_recipe(tree: DictConfig, overrides: List[str] = ()) -> DictConfig:
    """The one constructor of a recipe: `tree` (a YAML file's mapping, or a checked recipe a job changes, such as a
    decoding job switching to the drafter a run holds) with `key=value` overrides, checked; trusted from then on."""
    cfg = typed_recipe(tree, overrides)
    check_recipe(cfg)
    return cfg


def target_args(cfg: DictConfig) -> dict:
    """data/assets.py:load_target's arguments from the recipe's target section, as plain values (what loads the target
    reads no recipe): `load_target(**target_args(cfg))`."""
    t = cfg.target
    return {"name": t.model, "dtype": t.dtype.value, "device": t.device, "untested_architecture": t.untested_architecture,
            "chat_template_kwargs": OmegaConf.to_container(t.chat_template_kwargs)}
