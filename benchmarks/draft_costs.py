"""What a draft model cut from a smaller model of the target's family costs in llama.cpp, by depth and GGUF type.

    python benchmarks/draft_costs.py TARGET.gguf --draft-dir HF_DIR [--layers 2 4 8] [--types q8_0 f16]
        [--widths 512 256] [--stock DRAFT.gguf] [--threads 2] [--out runs/draft-costs]

Each cut keeps the draft's embeddings, its first n layers, final norm and head (train/drafters.py:
draft_model_from_target, as `drafter.layers` does in training), optionally narrowed to each of --widths
(train/narrow.py, as `drafter.hidden_size` does, calibrated on ShareGPT's first programming requests), is converted
by llama.cpp's converter at each type,
and timed by llama-bench beside the target: one pass over 1 token (c₁, what a drafted token costs) and over 2, 3 and
5 tokens (what llama-server's re-evaluation of a k + 1-token verify batch costs the draft: docs/llamacpp.md), at a
depth of 128 cached tokens, in milliseconds and in target steps (the target's own one-token pass). Untrained cuts:
the cost does not depend on the weights. Run it on a quiet machine, one process at a time.
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError, publish_dir, temp_dir_beside
from specdrafter.data.assets import load_prompt_set
from specdrafter.data.chat import user_prompt_ids
from specdrafter.eval.llamacpp import DEPTH, pass_ms
from specdrafter.train.drafters import draft_model_from_target
from specdrafter.train.narrow import narrowed

SIZES = (1, 2, 3, 5)


def cut_gguf(draft_dir: Path, layers: int, outtype: str, out: Path, width: int = 0) -> Path:
    """The draft cut to its first `layers` layers (narrowed to `width`), as a GGUF of `outtype` (made once under
    `out`)."""
    name = f"cut{layers}" + (f"-w{width}" if width else "")
    gguf = out / f"{name}-{outtype}.gguf"
    if gguf.is_file():
        return gguf
    folder = out / name
    if not (folder / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(draft_dir)
        draft = draft_model_from_target(model, list(range(layers)))
        if width:
            calibration = [torch.tensor(user_prompt_ids(tokenizer, r["turns"][0])[:256])
                           for r in load_prompt_set("sharegpt-code")[:16]]
            draft = narrowed(draft, width, calibration)
        stage = temp_dir_beside(folder)
        draft.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        publish_dir(stage, folder)
    tmp = gguf.with_suffix(".tmp")
    llamacpp.convert(folder, tmp, outtype=outtype)
    tmp.replace(gguf)
    return gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("--draft-dir", type=Path, required=True, help="the smaller model's HF folder")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--types", nargs="+", default=["q8_0"], choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--widths", type=int, nargs="*", default=[], help="also narrowed to these residual widths")
    parser.add_argument("--stock", type=Path, help="the whole draft's own GGUF, timed beside the cuts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/draft-costs"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    drafts = [(f"{n} layers{f', width {w}' if w else ''}, {t}", cut_gguf(args.draft_dir, n, t, args.out, w))
              for n in args.layers for w in [0, *args.widths] for t in args.types]
    if args.stock:
        drafts.append((f"stock ({args.stock.name})", args.stock))
    target = pass_ms(args.target, 1, args.threads)
    print(f"target {args.target.name}: {target:.1f} ms per one-token pass; threads {args.threads}, depth {DEPTH}")
    print(f"{'draft':40s} " + " ".join(f"{f'ms({n})':>8}" for n in SIZES) + " " +
          " ".join(f"{f'c({n})':>6}" for n in SIZES))
    for name, gguf in drafts:
        ms = [pass_ms(gguf, n, args.threads) for n in SIZES]
        print(f"{name:40s} " + " ".join(f"{m:8.1f}" for m in ms) + " " + " ".join(f"{m / target:6.3f}" for m in ms))


if __name__ == "__main__":
    try:
        main()
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
