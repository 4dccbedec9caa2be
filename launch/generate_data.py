"""Regenerate training conversations with the target (and optionally cache its hidden states).

    python launch/generate_data.py recipes/smollm2-135m-data.yaml [key=value ...] [--print-config]
"""

import logging

from specdrafter.core.cli import cli
from specdrafter.data.regenerate import generate_dataset


def main(cfg):
    generate_dataset(cfg)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli(main)
