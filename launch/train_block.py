"""Train a block drafter (DFlash, or DSpark with drafter.kind=dspark) on target-generated data under DeepSpeed.

    deepspeed [--num_accelerators 2] launch/train_block.py RECIPE.yaml [key=value ...]   (CPU: DS_ACCELERATOR=cpu)
    python launch/train_block.py RECIPE.yaml [key=value ...]                             (one process)

Rerun the same command after an interruption to resume from the last checkpoint.
"""

from specdrafter.jobs.train import train_command

if __name__ == "__main__":
    train_command("block")  # the kinds whose trainer is "block"
