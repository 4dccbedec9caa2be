"""Plan a training run before it starts: memory per GPU, disk, data, recipe sanity — in seconds, no weights, no hub.

    python launch/plan.py recipes/llama8b.yaml [key=value ...] [--nodes N] [--gpus-per-node G]

Defaults: one node with 8 GPUs for a hub target, 1 for the built-in one. Exits 1 when a check fails (the FAIL
lines say which key to change). The training launchers run the same check on CUDA before loading anything.
The same command without a checkout: python -m specdrafter.jobs.plan RECIPE.yaml ...
"""

from specdrafter.jobs.plan import main

if __name__ == "__main__":
    main()
