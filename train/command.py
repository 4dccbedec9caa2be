"""The one launcher behind launch/train_draft.py, train_medusa.py and train_eagle.py: the recipe's drafter kind must be
one the script trains (`python -m specdrafter.train.command` trains any); on CUDA the plan's sanity and memory checks
run before anything loads; then the loop."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig

from specdrafter.core.cli import cli
from specdrafter.core.io import SpecdrafterError
from specdrafter.train.loop import train
from specdrafter.train.plan import TRAINABLE, preflight


def train_command(kinds: Sequence[str]) -> None:
    """`script.py RECIPE.yaml [key=value ...]`, under `deepspeed` or as one process; reruns resume."""
    def main(cfg: DictConfig) -> None:
        kind = cfg.drafter.kind.value
        if kind not in kinds:
            raise SpecdrafterError(f"recipe key 'drafter.kind' is {kind}, but {Path(sys.argv[0]).name} "
                                   f"trains {' or '.join(kinds)}")
        preflight(cfg)  # on CUDA: recipe sanity and the memory plan before anything loads (CPU: nothing)
        train(cfg)
    cli(main)


if __name__ == "__main__":  # python -m specdrafter.train.command (eval/scaling.py, eval/bench_train.py): any kind
    train_command(TRAINABLE)
