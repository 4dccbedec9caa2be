"""Train a draft model on target-generated data under DeepSpeed.

    deepspeed [--num_accelerators 2] launch/train_draft.py RECIPE.yaml [key=value ...]   (CPU: DS_ACCELERATOR=cpu)
    python launch/train_draft.py RECIPE.yaml [key=value ...]                             (one process)

Rerun the same command after an interruption to resume from the last checkpoint.
"""

from specdrafter.jobs.train import train_command

if __name__ == "__main__":
    train_command("draft")  # the kinds whose trainer is "draft"
