"""Decode speculatively with a drafter: one prompt (print the text, tokens/s, τ and α), or every prompt of a file.

    python launch/generate.py recipes/smollm2-135m-generate.yaml inference.prompt="..." [key=value ...]
    python launch/generate.py recipes/smollm2-135m-generate.yaml inference.prompts=PROMPTS.jsonl   (→ decode.jsonl)
"""

import logging

from specdrafter.core.cli import cli
from specdrafter.inference.run import decode, decode_file


def main(cfg):
    if cfg.inference.prompts:
        t = decode_file(cfg)
        print(f"{t['decoded']} prompts decoded ({t['resumed']} already done, {t['skipped']} skipped): {t['tokens']} tokens "
              f"in {t['seconds']:.1f} s; τ = {t['tokens'] / max(t['passes'], 1):.2f}, "
              f"α = {t['accepted'] / max(t['drafted'], 1):.3f} → {cfg.output_dir}/decode.jsonl")
        return
    report = decode(cfg)
    print(report.text)
    print(report.summary())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli(main)
