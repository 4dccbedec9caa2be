"""Which of the repository's files a recipe passes through in one decode (the walk docs/architecture.md traces).

    python benchmarks/recipe_walk.py eagle3 | dflash | dspark     (an EAGLE-3 head, or a block drafter)

A tiny random target (8 layers, SmolLM2's tokenizer) and a random drafter of the kind, saved to a temp folder, are
decoded through launch/generate.py's main; a profile hook records each call, in the repository, of a function that
holds a recipe (a DictConfig) among its locals. Prints the files entered in order, how many, and the re-entries (an
entry into a file already entered before, after leaving it).
"""

import collections
import json
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdrafter.data.assets import ensure_smollm2
from specdrafter.jobs.cli import cli
from specdrafter.kinds import KINDS
from specdrafter.kinds.block import BlockKind

REPO = Path(__file__).resolve().parents[1]


def saved_pair(kind: str, root: Path) -> list:
    """A tiny target and a random drafter of `kind` under `root`; the recipe overrides that decode them."""
    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2))
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    if not isinstance(KINDS[kind], BlockKind):  # an EAGLE-3 head
        from specdrafter.models.eagle import Eagle3Head, eagle3_config, save_eagle3
        folder = save_eagle3(Eagle3Head(eagle3_config(target.config, [2, 4, 6], len(tok))), root / "drafter")
        drafter = ["drafter.eagle.aux_layer_ids=[2,4,6]"]
    else:
        from specdrafter.models.block import VARIANTS, BlockDrafter, block_config
        from specdrafter.models.block_folders import save_block_drafter
        config = block_config(target.config, VARIANTS[kind], num_layers=1, block_size=4, aux_layer_ids=[2, 4])
        folder = save_block_drafter(BlockDrafter(config), root / "drafter")
        drafter = ["drafter.block.block_size=4", "drafter.block.aux_layer_ids=[2,4]"]
    return [f"target.model={root / 'target'}", "target.dtype=float32", f"drafter.kind={kind}", f"drafter.path={folder}",
            *drafter, "inference.prompt=Hello there", "inference.max_new_tokens=8", "inference.k=3"]


def walk(overrides: list) -> list:
    """(file, function) of each entry into a repository file by a call that holds the recipe, in order."""
    sys.path.insert(0, str(REPO / "launch"))
    import generate

    entries = []

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event != "call" or not path.startswith(str(REPO)) or "/benchmarks/" in path:
            return
        if any(isinstance(v, DictConfig) for v in frame.f_locals.values()):
            name = str(Path(path).relative_to(REPO))
            if not entries or entries[-1][0] != name:
                entries.append((name, frame.f_code.co_name))

    sys.argv = ["generate.py", str(REPO / "recipes" / "smollm2-135m-generate.yaml"), *overrides]
    sys.setprofile(profile)
    try:
        cli(generate.main)
    finally:
        sys.setprofile(None)
    return entries


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "eagle3"
    entries = walk(saved_pair(kind, Path(tempfile.mkdtemp(prefix="recipe-walk-"))))
    per_file = collections.Counter(name for name, _ in entries)
    print(json.dumps({"kind": kind, "files": len(per_file), "entries": len(entries),
                      "re_entries": len(entries) - len(per_file), "most_entries_of_one_file": max(per_file.values()),
                      "per_file": per_file, "walk": [f"{name}:{function}" for name, function in entries]}, indent=1))


if __name__ == "__main__":
    main()
