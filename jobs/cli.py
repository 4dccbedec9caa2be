"""The command line every launcher shares: `script.py RECIPE [key=value ...] [--print-config]`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import datasets
from omegaconf import DictConfig, OmegaConf
from transformers.utils import logging as transformers_logging

from specdrafter.core.io import SpecdrafterError
from specdrafter.jobs.recipe import load_recipe


def cli(main: Callable[..., Any], argv: Optional[List[str]] = None, flags: Optional[Dict[str, Optional[int]]] = None,
        check: Optional[Callable[[DictConfig], None]] = None) -> None:
    """Entry point shared by the launch scripts: `script.py RECIPE [key=value ...] [--print-config]`.

    Loads and checks the recipe (core/recipe.py: load_recipe, then `check`, the command's own checks before anything
    heavy loads), then runs `main(cfg)`; with --print-config prints the resolved recipe instead. The job itself
    names the recipe.yaml it saves beside its outputs. A SpecdrafterError or Ctrl-C becomes one line on stderr and a
    non-zero exit status (1 for bad input, 130 for an interrupt). `flags` names a command's integer options
    (`--nodes 2` or `--nodes=2`, positive) with their defaults; main is then called as `main(cfg, recipe, values)`:
    the recipe file as given, {flag: value}.
    """
    argv = sys.argv[1:] if argv is None else argv
    argv = [a for a in argv if not a.startswith("--local_rank")]  # added by the `deepspeed` launcher
    print_only = "--print-config" in argv
    values, args = _int_flags([a for a in argv if a != "--print-config"], flags or {})
    if not args or args[0].startswith("-") or "=" in args[0]:
        prog = Path(sys.argv[0]).name
        sys.exit(f"usage: {prog} RECIPE.yaml [key=value ...]{''.join(f' [{f} N]' for f in values)} [--print-config]")
    quiet_library_progress_bars()
    try:
        cfg = load_recipe(args[0], args[1:])
        if check is not None:
            check(cfg)
        if print_only:
            print(OmegaConf.to_yaml(cfg), end="")
            return
        if flags:
            main(cfg, args[0], values)
        else:
            main(cfg)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("interrupted: finished shards are kept; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)


def quiet_library_progress_bars() -> None:
    """No bars from transformers and datasets (loading weights, saving shards): a job's own bars say how far it is."""
    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def _int_flags(argv: List[str], defaults: Dict[str, Optional[int]]) -> Tuple[Dict[str, Optional[int]], List[str]]:
    """({flag: value}, the other arguments): `--flag N` or `--flag=N`, N a positive integer."""
    values, rest, it = dict(defaults), [], iter(argv)
    for a in it:
        name, eq, value = a.partition("=")
        if name in values:
            value = value if eq else next(it, "")
            if not value.isdigit() or int(value) < 1:
                sys.exit(f"error: {name} needs a positive integer, got {value!r}")
            values[name] = int(value)
        else:
            rest.append(a)
    return values, rest
