"""The eval job, whatever engines it measures: its one entry point.

    python launch/eval_acceptance.py RECIPE.yaml checkpoint=RUN [eval.engines=[loop,llama.cpp]] [eval.*=...]
    python -m specdrafter.engines.evaluate RECIPE.yaml checkpoint=RUN ...                         (the same)

`checkpoint=X` is short for eval.checkpoint=X. Each engine of eval.engines measures the checkpoint into the same
results.json and report: `loop`, our decoding loop (eval/job.py:run_eval, every checkpoint of a run); `llama.cpp`,
the newest checkpoint served by llama-server beside the target alone (engines/llamacpp_eval.py). llama.cpp's arm is
prepared first (export, conversion, calibration), so that its bad input costs seconds, not the loop's minutes.
Rerunning the same command skips the cells already measured.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import List, Optional

from omegaconf import DictConfig

from specdrafter.core.recipe import EvalEngine, save_recipe
from specdrafter.engines.llamacpp_eval import check_served, prepare, run_arm
from specdrafter.eval.job import eval_job, run_eval
from specdrafter.jobs.cli import cli


def evaluate(cfg: DictConfig) -> Path:
    """Every engine of eval.engines: the recipe read once for all (eval/job.py:eval_job), llama.cpp's arm prepared
    first, the recipe saved in the evaluation folder, the loop's cells, then the arm. Returns the evaluation folder."""
    engines = set(cfg.eval.engines)
    if EvalEngine.llamacpp in engines:
        check_served(cfg)
    job = eval_job(cfg)
    arm = prepare(cfg, job) if EvalEngine.llamacpp in engines else None
    save_recipe(cfg, job.out)
    out = run_eval(cfg, job) if EvalEngine.loop in engines else None
    return run_arm(cfg, job, *arm) if arm is not None else out


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    cli(evaluate, [("eval." + a if a.startswith("checkpoint=") else a) for a in argv])


if __name__ == "__main__":
    main()
