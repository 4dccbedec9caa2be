"""The table of drafter kinds, the one place a kind is registered (the recipe's drafter.kind is checked against it).
Every stage that depends on the kind — training, the planner, decoding, the eval job, the benchmarks, export,
serving, conformance — looks the recipe's kind up here and asks the record of its concern (kinds/base.py); no other
module branches on a kind's name. Adding a kind: docs/architecture.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional

from omegaconf import DictConfig

from specdrafter.core.checkpoints import Checkpoint, find_checkpoints
from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import RecipeError, load_saved_recipe
from specdrafter.core.weights import check_model_folder
from specdrafter.inference.tree import tree_from_choices
from specdrafter.kinds.base import ArmSpec, Kind
from specdrafter.kinds.block import DFLASH2_KIND, DFLASH_KIND, DOMINO_KIND, DSPARK_KIND
from specdrafter.kinds.draft import DRAFT_MODEL, SELF_DRAFT
from specdrafter.kinds.eagle import EAGLE1, EAGLE3
from specdrafter.kinds.medusa import MEDUSA
from specdrafter.kinds.mtp import MTP
from specdrafter.kinds.peagle import PEAGLE

# In the order a folder's config.json is matched: P-EAGLE before EAGLE-3 (its folder is an EAGLE-3 folder that says
# parallel_drafting), a target's MTP layer before a draft model (any *ForCausalLM), which is last.
KINDS: Dict[str, Kind] = {k.name: k for k in (PEAGLE, EAGLE3, EAGLE1, MEDUSA, DFLASH_KIND, DSPARK_KIND, DFLASH2_KIND,
                                              DOMINO_KIND, MTP, DRAFT_MODEL, SELF_DRAFT)}

__all__ = ["KINDS", "ArmSpec", "Kind", "kind_of", "kind_of_config", "kind_of_gguf", "drafter_path",
           "check_drafter_folder", "build_drafter", "check_recipe", "newest_trained", "feature_layers", "layers_read",
           "trainable_by"]


def kind_of(cfg: DictConfig) -> Kind:
    """The recipe's drafter kind."""
    name = cfg.drafter.kind
    if name not in KINDS:
        raise RecipeError(f"recipe key 'drafter.kind': Invalid value {name!r}, expected one of [{', '.join(KINDS)}]")
    return KINDS[name]


def kind_of_config(config: dict) -> Optional[Kind]:
    """The kind a drafter folder's config.json describes (None: not recognised)."""
    return next((k for k in KINDS.values() if k.recognises(config)), None)


def kind_of_gguf(facts: dict) -> Optional[Kind]:
    """The kind a drafter GGUF holds (export/gguf.py:read_gguf's facts), asked of the kinds llama.cpp serves in the
    table's order (a draft model, of any architecture, last); None: no kind llama.cpp serves."""
    return next((k for k in KINDS.values() if k.export.llamacpp and k.export.llamacpp.serves(facts)), None)


def check_recipe(cfg: DictConfig) -> None:
    """The rules that need the drafter side of the code: a static tree's shape (inference.tree), then the kind's own
    (jobs/recipe.py:checked_recipe runs them after the schema's, before anything loads), for the drafter that
    decodes: drafter.run's newest checkpoint where it holds one trained for target.model (it decodes in drafter.kind's
    place: jobs/decode.py, resolve_drafter), else drafter.kind's. First: drafter.kind names a kind of the table."""
    kind_of(cfg)
    if cfg.inference.tree:
        try:
            tree_from_choices([list(c) for c in cfg.inference.tree])
        except SpecdrafterError as e:
            raise RecipeError(f"recipe key 'inference.tree': {e}") from None
    trained = None
    if cfg.drafter.run and not cfg.drafter.path:
        try:
            trained = newest_trained(cfg)
        except SpecdrafterError:  # none yet (the decoding job says why): drafter.kind decodes
            pass
    if trained is None:
        kind_of(cfg).check_recipe(cfg)
        return
    kind = KINDS[trained.state["drafter"]]
    try:
        kind.check_recipe(cfg)
    except RecipeError as e:
        raise RecipeError(f"{e}: drafter.run {cfg.drafter.run} holds {kind.description} ({trained.drafter}), which "
                          f"decodes in place of drafter.kind={cfg.drafter.kind} (drafter.run=null decodes with "
                          "drafter.kind)") from None


def newest_trained(cfg: DictConfig) -> Checkpoint:
    """drafter.run's newest checkpoint, when it holds a drafter of a known kind trained for target.model; else a
    SpecdrafterError saying why not."""
    run = cfg.drafter.run
    if not Path(run).expanduser().exists():
        raise SpecdrafterError(f"{run} holds no trained drafter yet")
    newest = find_checkpoints(run)[-1]
    if newest.state.get("drafter") not in KINDS:
        raise SpecdrafterError(f"{newest.drafter} has no trainer_state.json naming its drafter kind")
    trained = load_saved_recipe(newest.recipe).target.model if newest.recipe else None
    if trained != cfg.target.model:
        raise SpecdrafterError(f"{run} was trained for target {trained!r}, not {cfg.target.model!r}")
    return newest


def build_drafter(cfg: DictConfig, target, data=None, tokenizer=None):
    """The recipe's training drafter, initialised from the target (and, for EAGLE-3's draft vocabulary, the data)."""
    kind = kind_of(cfg)
    if not kind.training:
        trainable = ", ".join(k.name for k in KINDS.values() if k.training)
        raise SpecdrafterError(f"recipe key 'drafter.kind': {kind.name} is not trainable (valid: {trainable})")
    return kind.training.drafter(cfg, target, data, tokenizer)


def feature_layers(cfg: DictConfig, target_config) -> List[int]:
    """The target layers the recipe's drafter reads, for a target with `target_config`."""
    return layers_read(cfg, target_config.num_hidden_layers)


def layers_read(cfg: DictConfig, num_layers: int) -> List[int]:
    """The target layers the recipe's drafter reads (its training's feature_layers), of a target with `num_layers`
    layers; a kind that trains nothing reads the last layer's output only."""
    kind = kind_of(cfg)
    return kind.training.feature_layers(cfg, num_layers) if kind.training else [num_layers]


def drafter_path(cfg: DictConfig) -> Optional[str]:
    """drafter.path checked for decoding: required by every kind but the self-draft; a local folder must be
    complete and hold the recipe's kind. A hub id is passed on as it is."""
    kind = kind_of(cfg)
    if not kind.decoding.needs_folder:
        return None
    if not cfg.drafter.path:
        raise SpecdrafterError(f"recipe key 'drafter.path' is required to decode with a trained {kind.name} "
                               "(a checkpoint's drafter/ folder or an export)")
    path = cfg.drafter.path
    if path.startswith(("/", ".", "~")) or os.path.exists(path):  # a local folder, not a hub id
        check_drafter_folder(Path(path).expanduser(), kind)
    return path


def check_drafter_folder(folder: Path, kind: Kind) -> None:
    """A drafter folder a user points at: complete and intact (core/io.py:check_model_folder) and of `kind`."""
    check_model_folder(folder, "drafter folder")
    found = kind_of_config(json.loads((folder / "config.json").read_text()))
    if found is not None and found is not kind:
        raise SpecdrafterError(f"drafter folder {str(folder)!r} holds {found.description}, but recipe key "
                               f"'drafter.kind' is {kind.name}")


def trainable_by(trainer: Optional[str]) -> List[Kind]:
    """The kinds of a training family (what launch/train_<trainer>.py trains); None: every trainable kind."""
    return [k for k in KINDS.values() if k.training and trainer in (None, k.training.trainer)]
