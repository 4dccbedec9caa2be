"""Evaluate a checkpoint (or every checkpoint of a run): acceptance, τ, speed vs the formula; report + plots.

    python launch/eval_acceptance.py recipes/smollm2-135m-eagle3.yaml checkpoint=runs/smollm2-135m/eagle3 [eval.*=...]

`checkpoint=X` is short for eval.checkpoint=X. Rerunning the same command skips the cells already measured.
"""

import logging
import sys

from specdrafter.core.cli import cli
from specdrafter.eval.job import run_eval

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli(run_eval, [("eval." + a if a.startswith("checkpoint=") else a) for a in sys.argv[1:]])
