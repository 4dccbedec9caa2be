"""Train an EAGLE-3 (or, with drafter.kind=eagle1, an EAGLE-1) head on target-generated data under DeepSpeed.

    deepspeed [--num_accelerators 2] launch/train_eagle.py RECIPE.yaml [key=value ...]   (CPU: DS_ACCELERATOR=cpu)
    python launch/train_eagle.py RECIPE.yaml [key=value ...]                             (one process)

Rerun the same command after an interruption to resume from the last checkpoint.
"""

from specdrafter.jobs.train import train_command

if __name__ == "__main__":
    train_command("eagle")  # the kinds whose trainer is "eagle"
