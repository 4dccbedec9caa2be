"""Decode speculatively with a drafter: one prompt (print the text, tokens/s, τ and α), or every prompt of a file.

    python launch/generate.py recipes/smollm2-135m-generate.yaml inference.prompt="..." [key=value ...]
    python launch/generate.py recipes/smollm2-135m-generate.yaml inference.prompts=PROMPTS.jsonl   (→ decode.jsonl)
"""

import logging

from specdrafter.jobs.cli import cli
from specdrafter.jobs.decode import decode, decode_file


def main(cfg):
    if cfg.inference.prompts:
        decode_file(cfg)
        return
    report = decode(cfg)
    print(report.text)
    print(report.summary())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli(main)
