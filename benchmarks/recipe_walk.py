"""Which of the repository's files a recipe passes through in one decode or one eval job (docs/architecture.md's walk).

    python benchmarks/recipe_walk.py eagle3 | dflash | dspark                       (one decode: launch/generate.py)
    python benchmarks/recipe_walk.py eagle3 --job eval                              (the eval job, eval.engines=[loop])
    python benchmarks/recipe_walk.py eagle3 --job eval-llamacpp                     (eval.engines=[loop,llama.cpp])

One decode: a tiny random target (8 layers, SmolLM2's tokenizer) and a random drafter of the kind, saved to a temp
folder, are decoded through launch/generate.py's main. The eval job: a run folder holding one checkpoint of a random
drafter built from the kind's recipe beside a tiny sharpened target (as tests/conftest.py's drafter_run_of builds it)
is evaluated through the eval job's entry (specdrafter.engines.evaluate:main, what launch/eval_acceptance.py runs) on
two MT-Bench prompts, 4 new tokens, T = 0, no k sweep (one cell), one repeat; eval-llamacpp adds llama.cpp's arm
(GGUF export, llama-server; needs `specdrafter-llamacpp install`, skipped saying so without it).

A profile hook records each call, in the repository, of a function that holds a recipe (a DictConfig) among its
locals (this process only: the GGUF converter and llama-server run as subprocesses). Prints the files entered in
order, how many, and the re-entries (an entry into a file already entered before, after leaving it).
"""

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdrafter.data.assets import ensure_smollm2
from specdrafter.jobs.cli import cli
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import KINDS, build_drafter
from specdrafter.kinds.block import BlockExport

REPO = Path(__file__).resolve().parents[1]


def saved_pair(kind: str, root: Path) -> list:
    """A tiny target and a random drafter of `kind` under `root`; the recipe overrides that decode them."""
    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2))
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    if not isinstance(KINDS[kind].export, BlockExport):  # an EAGLE-3 head
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


# The smallest drafter of each kind on a 6-layer target (tests/conftest.py's TINY); draft_vocab_size=0: llama.cpp
# serves an EAGLE-3 head only over the target's whole vocabulary
TINY = ["drafter.num_layers=1", "drafter.eagle.aux_layer_ids=[1,3,5]", "drafter.eagle.draft_vocab_size=0",
        "drafter.block.num_layers=1", "drafter.block.block_size=4", "drafter.block.aux_layer_ids=[1,3,5]",
        "drafter.block.markov_rank=8", "inference.k=3", "train.wandb.mode=disabled", "target.dtype=float32"]
# One prompt set, two prompts, a few new tokens, one temperature, no k sweep (one cell: the chain at inference.k),
# one repeat, no extra confidence cuts. Two prompts, not one: llama.cpp's arm takes the range of its per-prompt
# ratios and fails on one prompt (eval/llamacpp.py:side_by_side rounds range_of's None)
SMALL = ["eval.sets=[mtbench]", "eval.num_prompts=2", "eval.max_new_tokens=4", "eval.temperatures=[0]",
         "eval.verifiers=[chain]", "eval.k_sweep=[]", "eval.repeats=1", "eval.llamacpp.threads=1",
         "eval.llamacpp.p_min_sweep=[]"]


def saved_run(kind: str, root: Path) -> tuple:
    """A run folder under `root` holding one checkpoint (step-000004) of a random drafter of `kind` built from the
    kind's recipe beside a 6-layer random Llama (hidden 64, SmolLM2's tokenizer, lm_head × 30 so greedy is decisive):
    the recipe file and the overrides that evaluate it."""
    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=False))
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    recipe = REPO / "recipes" / f"smollm2-135m-{kind}.yaml"
    run = root / "run"
    overrides = [f"output_dir={run}", f"target.model={root / 'target'}", f"drafter.kind={kind}", *TINY]
    cfg = load_recipe(recipe, overrides)
    drafter = build_drafter(cfg, target.eval(), None, tok)
    folder = run / "checkpoints" / "step-000004"
    drafter.save(drafter.module, folder / "drafter", tok)
    (folder / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
    (folder / "trainer_state.json").write_text(json.dumps({"step": 4, "drafter": kind, "metrics": {}}))
    return recipe, [*overrides, *SMALL, f"checkpoint={run}"]


def walk(overrides: list, job: str = "decode", recipe: Path = None) -> list:
    """(file, function) of each entry into a repository file by a call that holds the recipe, in order."""
    entries = []

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event != "call" or not path.startswith(str(REPO)) or "/benchmarks/" in path:
            return
        if any(isinstance(v, DictConfig) for v in frame.f_locals.values()):
            name = str(Path(path).relative_to(REPO))
            if not entries or entries[-1][0] != name:
                entries.append((name, frame.f_code.co_name))

    if job == "decode":
        sys.path.insert(0, str(REPO / "launch"))
        import generate
        sys.argv = ["generate.py", str(REPO / "recipes" / "smollm2-135m-generate.yaml"), *overrides]
        run = lambda: cli(generate.main)  # noqa: E731
    else:  # the eval job's one entry, as launch/eval_acceptance.py calls it
        from specdrafter.engines.evaluate import main as evaluate_main
        engines = "[loop]" if job == "eval" else "[loop,llama.cpp]"
        sys.argv = ["eval_acceptance.py", str(recipe), *overrides, f"eval.engines={engines}"]
        run = evaluate_main
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", nargs="?", default="eagle3", help="eagle3, dflash or dspark")
    parser.add_argument("--job", default="decode", choices=["decode", "eval", "eval-llamacpp"])
    args = parser.parse_args()
    kind, job = args.kind, args.job
    root = Path(tempfile.mkdtemp(prefix="recipe-walk-"))
    if job == "decode":
        entries = walk(saved_pair(kind, root))
    else:
        if job == "eval-llamacpp":
            from specdrafter.core import llamacpp
            if not llamacpp.installed():
                sys.exit("recipe_walk: --job eval-llamacpp skipped: llama.cpp is not built "
                         "(specdrafter-llamacpp install)")
        recipe, overrides = saved_run(kind, root)
        entries = walk(overrides, job, recipe)
    per_file = collections.Counter(name for name, _ in entries)
    head = {"kind": kind} if job == "decode" else {"kind": kind, "job": job}  # the decode's output as it was
    print(json.dumps({**head, "files": len(per_file), "entries": len(entries),
                      "re_entries": len(entries) - len(per_file), "most_entries_of_one_file": max(per_file.values()),
                      "per_file": per_file, "walk": [f"{name}:{function}" for name, function in entries]}, indent=1))


if __name__ == "__main__":
    main()
