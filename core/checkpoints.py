"""What a user points at when a job needs a trained drafter: a training checkpoint (…/checkpoints/step-N), a run
directory (its complete checkpoints, oldest first), or a bare drafter folder (a checkpoint's drafter/, an export).
The evaluation job takes every checkpoint found; export takes the newest."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from specdrafter.core.io import SpecdrafterError, complete_checkpoints, read_checkpoint_state
from specdrafter.core.weights import check_model_folder


@dataclass
class Checkpoint:
    name: str  # "step-000279", or a bare drafter folder's name
    step: Optional[int]  # optimizer steps taken (None: a bare drafter folder)
    drafter: Optional[Path]  # the drafter itself: config.json + weights (None: a self-draft, nothing to load)
    state: dict = field(default_factory=dict)  # trainer_state.json: {"step", "tokens", "drafter", "metrics"} ({}: bare)
    recipe: Optional[Path] = None  # the run's resolved recipe.yaml beside it, if there is one
    run: Optional[Path] = None  # the run directory (its eval/ results live there)


def find_checkpoints(path: str | os.PathLike) -> List[Checkpoint]:
    """Every checkpoint at `path`, oldest first; a damaged or incomplete one is one line naming the file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise SpecdrafterError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise SpecdrafterError(f"checkpoint {str(path)!r} is a file: expected a checkpoint, a drafter folder or a run "
                               "directory")
    if (path / "checkpoints").is_dir() and complete_checkpoints(path / "checkpoints"):
        return [training_checkpoint(p) for p in complete_checkpoints(path / "checkpoints")]
    if (path / "trainer_state.json").is_file():
        return [training_checkpoint(path)]
    if (path / "config.json").is_file():
        if (path.parent / "trainer_state.json").is_file():  # a checkpoint's drafter/: the checkpoint knows its step
            return [training_checkpoint(path.parent)]
        return [bare_drafter(path)]
    if (path / "drafter" / "config.json").is_file():  # a run whose checkpoints were removed: its published drafter
        return [bare_drafter(path / "drafter")]
    if (path / "checkpoints").is_dir():
        raise SpecdrafterError(f"run directory {str(path)!r} has no complete checkpoint yet")
    raise SpecdrafterError(f"{str(path)!r} is not a checkpoint, a drafter folder or a run directory "
                           "(no trainer_state.json, config.json or checkpoints/ in it)")


def training_checkpoint(folder: Path) -> Checkpoint:
    state = read_checkpoint_state(folder, only=("drafter/", "recipe.yaml"))  # damaged: one line naming the file
    exported = not (folder / "drafter").is_dir() and (folder / "config.json").is_file()  # the drafter at top level
    drafter = folder if exported else folder / "drafter"
    if not (drafter / "config.json").is_file():
        raise SpecdrafterError(f"checkpoint {str(folder)!r} has no drafter/config.json: it is incomplete")
    check_model_folder(drafter, "drafter folder")
    recipe = folder / "recipe.yaml"
    return Checkpoint(folder.name, state.get("step"), drafter, state, recipe if recipe.is_file() else None,
                      folder if exported else folder.parent.parent)


def bare_drafter(folder: Path) -> Checkpoint:
    check_model_folder(folder, "drafter folder")
    recipe = folder.parent / "recipe.yaml"  # <run>/drafter: the run's recipe lies beside it
    name = folder.name if folder.name != "drafter" else folder.parent.name
    return Checkpoint(name, None, folder, {}, recipe if recipe.is_file() else None, folder.parent)
