"""Export a trained drafter for vLLM / SGLang / speculators / Medusa / HF, with a model card; optionally push it.
EAGLE-3, DFlash and DSpark drafters all export with --format vllm, sglang or speculators (the checkpoint's kind
picks the layout).

    python launch/export.py CHECKPOINT --format {sglang,vllm,speculators,medusa-vllm,medusa,hf-draft} --out DIR
                            [--overwrite] [--push-to-hub REPO_ID [--private]]

CHECKPOINT: a checkpoint folder (…/checkpoints/step-NNNNNN), a run's output_dir (its newest complete checkpoint) or
a drafter folder. The Hub token comes from HF_TOKEN or `hf auth login`.
"""

import argparse
import sys

from specdrafter.core.io import SpecdrafterError
from specdrafter.export.formats import FORMATS, export, push_to_hub
from specdrafter.export.gguf import GGUF_TYPES, OUTTYPE

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--format", required=True, choices=list(FORMATS))
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--gguf-type", default=OUTTYPE, choices=GGUF_TYPES,
                   help="--format gguf: the drafter's weight type (default %(default)s, as trained; q8_0: as draft "
                        "models are served)")
    p.add_argument("--push-to-hub", metavar="REPO_ID")
    p.add_argument("--private", action="store_true")
    a = p.parse_args()
    if a.private and not a.push_to_hub:
        p.error("--private needs --push-to-hub")
    try:
        if a.gguf_type != OUTTYPE and a.format != "gguf":
            p.error("--gguf-type is a setting of --format gguf")
        folder = export(a.checkpoint, a.format, a.out, a.overwrite, a.push_to_hub, a.gguf_type)
        print(f"exported {a.format}: {folder}")
        if a.push_to_hub:
            print(f"pushed: {push_to_hub(folder, a.push_to_hub, a.private)}")
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
