"""The τ-vs-target-tokens curve of EAGLE-3 (eval/scaling.py): data, training and evaluation per budget.

    nohup python launch/scaling.py recipes/smollm2-135m-scaling.yaml > scaling.log 2>&1 &

Hours on a laptop CPU: run it in the background; rerunning the same command resumes every step. The report
(scaling.md, tau_vs_tokens.png, scaling.json) is rewritten in output_dir after every evaluated budget.
"""

import logging
import sys

from specdrafter.core.cli import cli
from specdrafter.eval.scaling import run_scaling
from specdrafter.train.plan import check_against_target


def main(cfg):
    run_scaling(cfg, sys.argv[1], [a for a in sys.argv[2:] if "=" in a])


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli(main, check=check_against_target)  # before the first data job: what would stop its trainings
