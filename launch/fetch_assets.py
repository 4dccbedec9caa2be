"""Fetch and verify the offline assets: the SmolLM2-135M-Instruct target (converted from GGUF and checked)
and the MT-Bench, HumanEval, GSM8K and ShareGPT prompt sets, under $SPECDRAFTER_CACHE.

    python launch/fetch_assets.py
"""

import logging
import sys

from specdrafter.core.io import SpecdrafterError
from specdrafter.data.assets import ensure_all

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        for name, path in ensure_all().items():
            print(f"{name:10s} {path}")
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
