"""The data job's command: `python -m specdrafter.jobs.data RECIPE.yaml [key=value ...] [--print-config]`
(launch/generate_data.py); the job itself is data/regenerate.py:generate_dataset."""

from __future__ import annotations

import logging
from typing import List, Optional

from specdrafter.data.regenerate import generate_dataset
from specdrafter.jobs.cli import cli


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli(generate_dataset, argv)


if __name__ == "__main__":
    main()
