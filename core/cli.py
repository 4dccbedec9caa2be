"""The command line every launcher shares: `script.py RECIPE [key=value ...] [--print-config]`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

from omegaconf import DictConfig, OmegaConf

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import load_recipe


def cli(main: Callable[[DictConfig], Any], argv: Optional[List[str]] = None,
        check: Optional[Callable[[DictConfig], None]] = None) -> None:
    """Entry point shared by the launch scripts: `script.py RECIPE [key=value ...] [--print-config]`.

    Loads and checks the recipe (core/recipe.py: load_recipe, then `check`, the job's own checks before anything
    heavy loads), prints the resolved recipe, runs `main(cfg)`, and turns a SpecdrafterError or Ctrl-C into one line on
    stderr and a non-zero exit status (1 for bad input, 130 for an interrupt).
    """
    argv = sys.argv[1:] if argv is None else argv
    argv = [a for a in argv if not a.startswith("--local_rank")]  # added by the `deepspeed` launcher
    print_only = "--print-config" in argv
    args = [a for a in argv if a != "--print-config"]
    if not args or args[0].startswith("-") or "=" in args[0]:
        prog = Path(sys.argv[0]).name
        sys.exit(f"usage: {prog} RECIPE.yaml [key=value ...] [--print-config]")
    try:
        cfg = load_recipe(args[0], args[1:])
        if check is not None:
            check(cfg)
        if os.environ.get("RANK", "0") == "0":  # one copy of the recipe under a multi-rank launcher
            print(OmegaConf.to_yaml(cfg), end="", file=sys.stderr if not print_only else sys.stdout)
        if print_only:
            return
        main(cfg)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("interrupted: finished shards are kept; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
