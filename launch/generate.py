"""Decode one prompt speculatively with a drafter; print the text, tokens/s, τ and α.

    python launch/generate.py recipes/smollm2-135m-generate.yaml inference.prompt="..." [key=value ...]
"""

import logging

from specdrafter.core.cli import cli
from specdrafter.inference.run import decode


def main(cfg):
    report = decode(cfg)
    print(report.text)
    print(report.summary())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli(main)
