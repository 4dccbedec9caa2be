"""The one launcher behind launch/train_draft.py, train_medusa.py and train_eagle.py: the recipe's drafter kind must be
one the script trains (`python -m specdrafter.train.command` trains any) and the recipe's checks against the target's
config.json pass (also with --print-config); on CUDA the memory plan runs before anything loads; then the loop."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from specdrafter.core.cli import cli
from specdrafter.core.io import SpecdrafterError
from specdrafter.kinds import KINDS, kind_of, trainable_by
from specdrafter.train.loop import train
from specdrafter.train.plan import check_training_recipe, preflight


def train_command(any_kind: bool = False) -> None:
    """`script.py RECIPE.yaml [key=value ...]`, under `deepspeed` or as one process; reruns resume. The recipe's
    drafter kind must be one this script trains (kinds/: launcher), or any trainable kind with `any_kind`."""
    script = Path(sys.argv[0]).name
    kinds = [k for k in KINDS.values() if k.trainable] if any_kind else trainable_by(script)

    def check(cfg: DictConfig) -> None:
        kind = kind_of(cfg)
        if kind not in kinds:
            trains = " or ".join(k.name for k in kinds) or "no drafter kind"
            raise SpecdrafterError(f"recipe key 'drafter.kind' is {kind.name}, but {script} trains {trains}")
        check_training_recipe(cfg)

    def main(cfg: DictConfig) -> None:
        preflight(cfg)  # on CUDA: the memory plan before anything loads (CPU: nothing)
        train(cfg)
    cli(main, check=check)


if __name__ == "__main__":  # python -m specdrafter.train.command (eval/scaling.py, eval/bench_train.py)
    train_command(any_kind=True)
