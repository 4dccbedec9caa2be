"""The one launcher behind launch/train_draft.py, train_medusa.py and train_eagle.py: the recipe's drafter kind must be
one the script trains (`python -m specdrafter.train.command` trains any); on CUDA the plan's sanity and memory checks
run before anything loads; then the loop."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from specdrafter.core.cli import cli
from specdrafter.core.io import SpecdrafterError
from specdrafter.kinds import KINDS, kind_of, trainable_by
from specdrafter.train.loop import train
from specdrafter.train.plan import preflight


def train_command(any_kind: bool = False) -> None:
    """`script.py RECIPE.yaml [key=value ...]`, under `deepspeed` or as one process; reruns resume. The recipe's
    drafter kind must be one this script trains (kinds/: launcher), or any trainable kind with `any_kind`."""
    script = Path(sys.argv[0]).name
    kinds = [k for k in KINDS.values() if k.trainable] if any_kind else trainable_by(script)

    def main(cfg: DictConfig) -> None:
        kind = kind_of(cfg)
        if kind not in kinds:
            trains = " or ".join(k.name for k in kinds) or "no drafter kind"
            raise SpecdrafterError(f"recipe key 'drafter.kind' is {kind.name}, but {script} trains {trains}")
        preflight(cfg)  # on CUDA: recipe sanity and the memory plan before anything loads (CPU: nothing)
        train(cfg)
    cli(main)


if __name__ == "__main__":  # python -m specdrafter.train.command (eval/scaling.py, eval/bench_train.py)
    train_command(any_kind=True)
