"""A model's config without its weights, for the planner (jobs/plan.py builds target and drafter from it on the meta
device): the converted SmolLM2 folder, a local model folder, or a hub id's public config.json shipped in
recipes/targets/<Name>.json."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import BUILTIN_TARGETS
from specdrafter.data.assets import SMOLLM2_DIR, cache_dir
from specdrafter.data.gguf_assets import GGUF_TARGETS
from specdrafter.recipes import RECIPES_DIR

TARGETS_DIR = RECIPES_DIR / "targets"


def target_config(name: str):
    """A model's config without its weights: the built-in SmolLM2 folder, a local folder, a shipped
    recipes/targets/<Name>.json, or (last) transformers' own lookup, which may use the hub cache or network."""
    from transformers import AutoConfig

    path = _config_path(name)
    try:
        return AutoConfig.from_pretrained(str(path) if path else name)
    except (OSError, ValueError) as e:
        shipped = TARGETS_DIR / f"{name.rstrip('/').split('/')[-1]}.json"
        raise SpecdrafterError(f"no config for model {name!r} ({str(e).splitlines()[0]}); put its config.json in "
                               f"{shipped.relative_to(RECIPES_DIR.parent)} or point the recipe at a local folder") from None


def _config_path(name: str) -> Optional[Path]:
    if name in BUILTIN_TARGETS or name in GGUF_TARGETS:
        folder = cache_dir() / "models" / (GGUF_TARGETS[name].folder if name in GGUF_TARGETS else SMOLLM2_DIR)
        if not (folder / "config.json").is_file():
            raise SpecdrafterError(f"the built-in target {name!r} is not converted yet: run python launch/fetch_assets.py"
                                   f"{' ' + name if name in GGUF_TARGETS else ''}")
        return folder
    local = Path(name).expanduser()
    if (local / "config.json").is_file():
        return local
    shipped = TARGETS_DIR / f"{name.rstrip('/').split('/')[-1]}.json"
    return shipped if shipped.is_file() else None
