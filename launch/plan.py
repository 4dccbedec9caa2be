"""Plan a training run before it starts: memory per GPU, disk, data, recipe sanity — in seconds, no weights, no hub.

    python launch/plan.py recipes/llama8b.yaml [key=value ...] [--nodes N] [--gpus-per-node G]

Defaults: one node with 8 GPUs for a hub target, 1 for the built-in one. Exits 1 when a check fails (the FAIL
lines say which key to change). The training launchers run the same check on CUDA before loading anything.
"""

import sys

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import load_recipe
from specdrafter.train.plan import Setup, format_plan, make_plan

USAGE = "usage: plan.py RECIPE.yaml [key=value ...] [--nodes N] [--gpus-per-node G]"


def take_flags(argv):
    """(--nodes, --gpus-per-node or None, the other arguments)."""
    flags, rest, it = {"--nodes": 1, "--gpus-per-node": None}, [], iter(argv)
    for a in it:
        name, eq, value = a.partition("=")
        if name in flags:
            value = value if eq else next(it, "")
            if not value.isdigit() or int(value) < 1:
                sys.exit(f"error: {name} needs a positive integer, got {value!r}")
            flags[name] = int(value)
        else:
            rest.append(a)
    return flags["--nodes"], flags["--gpus-per-node"], rest


def main(cfg, recipe, nodes, gpus):
    if gpus is None:
        gpus = 1 if cfg.target.model == "smollm2-135m-instruct" else 8
    plan = make_plan(cfg, recipe, Setup(world=nodes * gpus, gpus_per_node=gpus, device="cuda"))
    print(format_plan(plan, cfg))
    if plan.problems():
        raise SpecdrafterError(plan.problems()[0])


if __name__ == "__main__":
    nodes, gpus, args = take_flags(sys.argv[1:])
    if not args or args[0].startswith("-") or "=" in args[0]:
        sys.exit(USAGE)
    try:  # not core/recipe.py:cli: the plan is the output, without the resolved recipe before it
        main(load_recipe(args[0], args[1:]), args[0], nodes, gpus)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
