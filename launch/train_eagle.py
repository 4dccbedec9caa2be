"""Train an EAGLE-3 (or, with drafter.kind=eagle1, an EAGLE-1) head on target-generated data under DeepSpeed.

    deepspeed [--num_accelerators 2] launch/train_eagle.py RECIPE.yaml [key=value ...]   (CPU: DS_ACCELERATOR=cpu)
    python launch/train_eagle.py RECIPE.yaml [key=value ...]                             (one process)

Rerun the same command after an interruption to resume from the last checkpoint.
"""

from data.io import SpecdrafterError
from data.recipe import cli
from train.loop import train
from train.plan import preflight


def main(cfg):
    if cfg.drafter.kind.value not in ("eagle3", "eagle1"):
        raise SpecdrafterError(f"recipe key 'drafter.kind' is {cfg.drafter.kind.value}, but this script trains eagle3 or eagle1")
    preflight(cfg)  # on CUDA: recipe sanity and the memory plan before anything loads (CPU: nothing)
    train(cfg)


if __name__ == "__main__":
    cli(main)
