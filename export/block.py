"""Block drafters (models/block.py: DFlash, DSpark, DFlash2, Domino) exported for vLLM, SGLang and the speculators
library, through `export/formats.py:export` (docs/formats.md#dflash-and-dspark says where each key and name comes from).

    --format vllm, sglang  the layout vLLM (models/qwen3_dflash.py, qwen3_dspark.py) and SGLang (srt/models/dflash.py,
                           dspark.py) load, z-lab's DFlash and DeepSpec's DSpark checkpoints: our Qwen3 layer config
                           (rope_theta spelled out) + architectures, block_size, num_target_layers, target_hidden_size,
                           draft_vocab_size, dflash_config {mask_token_id, target_layer_ids}; DSpark adds markov_rank,
                           markov_head_type "vanilla", enable_confidence_head, confidence_head_with_markov and
                           sample_from_anchor true; DFlash2 adds conv_kernel_size, conv_group_size, selector_rank and
                           selector_top_k to dflash_config (where vLLM's qwen3_dflash2.py and llama.cpp's converter
                           read them); Domino is a DFlashDraftModel folder whose dflash_config adds projector_type
                           "domino", gru_hidden_dim, emb_dim, pure_draft_prefix_len and shift_label true (where vLLM's
                           qwen3_dflash.py and SGLang's DFlash worker read them). Tensors under our names.
    --format speculators   the speculators library's DFlashSpeculator / DSparkSpeculator: speculators_model_type,
                           speculators_config (verifier, speculative_tokens), transformer_layer_config, and
                           aux_hidden_state_layer_ids = our ids (it names a layer's input, as we do); `vllm serve DIR`.

Layer ids. Ours are layer inputs (HF hidden_states[k], models/features.py). DFlash's `dflash_config.target_layer_ids`
name layer outputs, so the vllm / sglang folders carry our ids − 1 — the one place the convention changes (`engine_keys`)
— and the engines add the 1 back (vLLM's get_eagle3_aux_layers_from_config; SGLang's set_dflash_layers_to_capture
captures before layer k + 1); speculators' aux_hidden_state_layer_ids are layer inputs, ours unchanged.

Vocabulary. A full-vocabulary drafter ships no lm_head, d2t or t2d: every engine borrows the target's lm_head (and
vLLM fails on a d2t it has no parameter for). A pruned one needs its own lm_head [Vd, d] and d2t (vLLM refuses a
reduced-vocabulary DSpark without them; speculators saves both): the target's lm_head rows of the draft vocabulary
are written, read from the target's weights on this machine. SGLang's drafts always use the target's full lm_head
(its Markov head is full-vocabulary too), so `--format sglang` refuses a pruned vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

import torch
from safetensors import safe_open

from specdrafter.core.io import SpecdrafterError, atomic_write_json
from specdrafter.core.weights import save_weights
from specdrafter.export.layer_config import with_rope_keys
from specdrafter.models.block import DEFAULT_CORRECTION, DEFAULT_SELECTOR, BlockDrafter
from specdrafter.models.block_folders import load_block_drafter

if TYPE_CHECKING:  # annotations only
    from specdrafter.export.source import Source, Target
    from specdrafter.kinds.block import BlockExport

FORMATS = ("vllm", "sglang", "speculators")
MARKOV_HEAD_TYPE = "vanilla"  # ours: logits += W2(W1[prev]), no gate, no recurrence
# config.json keys that are not the backbone layer's: ours only, or written again where each layout puts them
NOT_LAYER = ("variant", "aux_layer_ids", "mask_token_id", "markov_rank", "enable_confidence_head", "draft_vocab_size",
             "block_size", "num_target_layers", "target_hidden_size", "architectures", "_name_or_path",
             *DEFAULT_SELECTOR, *DEFAULT_CORRECTION)


# ------------------------------------------------------------------------------------------------ writer
def write_block(src: Source, folder: Path, target: Target, fmt: str) -> None:
    """config.json + model.safetensors of a DFlash or DSpark drafter in `fmt`'s layout."""
    export = src.kind.export  # kinds/block.py:BlockExport
    drafter = load_block_drafter(src.drafter, export.variant)  # refuses a folder that does not load as this kind
    c = drafter.config
    problem = format_problem(export, drafter, fmt)
    if problem:
        raise SpecdrafterError(f"--format {fmt} cannot express {str(src.drafter)!r}: {problem}")
    raw = json.loads((src.drafter / "config.json").read_text())
    layer = layer_config(raw)
    config = (speculators_config(export, c, layer, target, src) if fmt == "speculators" else
              {**layer, "architectures": [export.variant.architecture], **engine_keys(export, c)})
    save_weights(engine_weights(drafter, target, src), folder / "model.safetensors")
    atomic_write_json(folder / "config.json", config)


def format_problem(export: BlockExport, drafter: BlockDrafter, fmt: str) -> Optional[str]:
    """Why `fmt`'s engine cannot serve this drafter as trained (None: it can)."""
    c, V, Vd = drafter.config, drafter.config.vocab_size, len(drafter.d2t)
    if fmt != "sglang":
        return None
    if Vd < V:
        return (f"its draft vocabulary is pruned ({Vd} of {V} tokens), and SGLang's {export.engines.sglang_algorithm} "
                "drafts over the target's full lm_head (it reads no lm_head or d2t of the drafter); export --format "
                "vllm or speculators, or retrain with drafter.block.draft_vocab_size=0")
    algorithm = export.engines.sglang_algorithm
    if export.variant.heads and c.markov_rank <= 0:
        return f"SGLang's {algorithm} refuses markov_rank 0 (its draft needs the Markov head); export --format vllm"
    if export.variant.heads and not c.enable_confidence_head:
        return (f"SGLang's {algorithm} builds the confidence head whatever enable_confidence_head says and refuses a "
                "checkpoint without its weights; export --format vllm")
    return None


def layer_config(raw: dict) -> dict:
    """The backbone's Qwen3 layer settings: our own keys removed, `rope_theta` (and `rope_scaling`) spelled out beside
    transformers 5's `rope_parameters`, since engines read either (vLLM's DFlash layer defaults a missing theta to 10⁶)."""
    layer = with_rope_keys({k: v for k, v in raw.items() if k not in NOT_LAYER}, raw)
    return {**layer, "model_type": "qwen3", "tie_word_embeddings": False}


def engine_keys(export: BlockExport, c) -> dict:
    """What vLLM's and SGLang's loaders read beside the layer config. `target_layer_ids` are DFlash's layer outputs:
    our layer inputs − 1 (both engines add the 1 back themselves)."""
    keys = {"block_size": c.block_size, "num_target_layers": c.num_target_layers,
            "target_hidden_size": c.target_hidden_size or c.hidden_size,
            "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
            "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": [k - 1 for k in c.aux_layer_ids],
                              # DFlash2's sizes, where vLLM's qwen3_dflash2.py and llama.cpp's converter read them
                              **({k: getattr(c, k) for k in DEFAULT_SELECTOR} if export.variant.selector else {}),
                              **(correction_keys(export, c) if export.variant.projector else {})}}
    return {**keys, **head_keys(export, c)}


def correction_keys(export: BlockExport, c) -> dict:
    """Domino's, in dflash_config: the projector the engines' DFlash path switches on, its sizes, and that slot k
    predicts x_{a+k+1} (shift_label; SpecForge's default is false)."""
    return {"projector_type": export.variant.projector, **{k: getattr(c, k) for k in DEFAULT_CORRECTION},
            "shift_label": export.variant.label_shift}


def head_keys(export: BlockExport, c) -> dict:
    """DSpark's: its heads, and that the anchor slot drafts (every engine reads these at top level). vLLM defaults
    confidence_head_with_markov to false, which would give the head the wrong input width: written out."""
    if not export.variant.heads:
        return {}
    return {"markov_rank": c.markov_rank, "markov_head_type": MARKOV_HEAD_TYPE,
            "enable_confidence_head": c.enable_confidence_head,
            "confidence_head_with_markov": c.enable_confidence_head and c.markov_rank > 0,
            "sample_from_anchor": export.variant.label_shift}


def speculators_config(export: BlockExport, c, layer: dict, target: Target, src: Source) -> dict:
    if target.hub_id is None and src.recipe is None:
        raise SpecdrafterError("--format speculators names the verifier: export from a checkpoint folder or run "
                               "(whose recipe.yaml names the target), not a bare drafter folder")
    drafts = export.drafts_per_block(c.block_size)
    return {"architectures": [export.variant.speculators_architecture], "speculators_model_type": export.engines.method,
            "speculators_config": {
                "algorithm": export.engines.method, "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafts, "verifier_accept_k": 1,
                                      "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": target.hub_id or target.name, "architectures": target.architectures}},
            "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
            "target_hidden_size": c.target_hidden_size or c.hidden_size, "block_size": c.block_size,
            "aux_hidden_state_layer_ids": list(c.aux_layer_ids),  # layer inputs, as ours
            "mask_token_id": c.mask_token_id, "sample_from_anchor": export.variant.label_shift,
            **{k: v for k, v in head_keys(export, c).items() if k != "sample_from_anchor"}}


# ----------------------------------------------------------------------------------------------- weights
def engine_weights(drafter: BlockDrafter, target: Target, src: Source) -> Dict[str, torch.Tensor]:
    """Our tensors under our names (the engines' own), without d2t / t2d for a full vocabulary and with the
    target's lm_head rows for a pruned one."""
    weights = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    V, Vd = drafter.config.vocab_size, len(drafter.d2t)
    if Vd == V:
        if weights["d2t"].any() or not weights["t2d"].all():
            raise SpecdrafterError(f"{str(src.drafter)!r} has a full draft vocabulary ({V} tokens) but d2t/t2d are not "
                                   "the identity: engines drop them for a full vocabulary, so its drafts would name "
                                   "other tokens")
        return {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    return {**weights, "lm_head.weight": draft_lm_head(drafter, target, src)}


def draft_lm_head(drafter: BlockDrafter, target: Target, src: Source) -> torch.Tensor:
    """[Vd, d]: the rows of the target's lm_head our drafts use (target id = i + d2t[i]), in the target's dtype."""
    V, Vd = drafter.config.vocab_size, len(drafter.d2t)
    need = (f"{str(src.drafter)!r} drafts over a pruned vocabulary ({Vd} of {V} tokens), whose rows of the target's "
            "lm_head the engines read from the drafter's folder")
    weight = target_lm_head(target.folder) if target.folder is not None else None
    if weight is None:
        raise SpecdrafterError(f"{need}, but the weights of the target ({target.name}) are not on this machine; "
                               "export where the run's target folder (or its Hugging Face cache) is")
    if tuple(weight.shape) != (V, drafter.config.hidden_size):
        raise SpecdrafterError(f"{need}, but the target's lm_head is {list(weight.shape)}, not [{V}, "
                               f"{drafter.config.hidden_size}]: the recipe's target is not the one it was trained on")
    return weight[drafter.draft_ids].contiguous()


def target_lm_head(folder: Path) -> Optional[torch.Tensor]:
    """The target's output embedding [V, d] from its safetensors (one file or an index), or its input embedding
    when the two are tied; None if neither is there."""
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    names = ["lm_head.weight"] + (["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else [])
    index = folder / "model.safetensors.index.json"
    files = (json.loads(index.read_text()).get("weight_map", {}) if index.is_file() else
             {name: "model.safetensors" for name in names})
    for name in names:
        path = folder / files.get(name, "")
        if name in files and path.is_file():
            with safe_open(str(path), "pt") as f:
                if name in f.keys():
                    return f.get_tensor(name)
    return None


# -------------------------------------------------------------------------------------------- model card
def engine_versions(export: BlockExport, fmt: str) -> str:
    """The engine releases that load this folder, as the card's **Engine versions** line says them."""
    e = export.engines
    if not e.checked:
        vllm = (f"vLLM {e.vllm_since} (`{e.vllm_file}`, method `{e.method}`; read from its source, not yet loaded by "
                "the pinned vLLM 0.33.0)")
        sglang = (f"SGLang {e.sglang_since} (`--speculative-algorithm {e.sglang_algorithm}`; read from its description, "
                  "not yet loaded by the pinned SGLang 0.5.23)")
        return sglang if fmt == "sglang" else vllm
    vllm = (f"vLLM {e.vllm_since} or later (`qwen3_{e.method}.py`, method `{e.method}`; checked: 0.32.0 and 0.33.0, "
            "the engines' own loaders on CPU)")
    if fmt == "sglang":
        return (f"SGLang {e.sglang_since} or later (`--speculative-algorithm {e.sglang_algorithm}`; checked: 0.5.23, "
                "its weight loader's name mapping on CPU, the module needs CUDA)")
    if fmt == "speculators":
        return f"{vllm}; the speculators library {e.speculators_since} or later (checked: 0.9.0, its own loader)"
    return vllm


def serving(fmt: str, src: Source, target: Target, model: str) -> List[str]:
    """The card's serving commands: num_speculative_tokens = the block's drafts (DFlash B − 1, DSpark B); SGLang's
    --speculative-num-draft-tokens counts the verified window, drafts + 1."""
    export = src.kind.export  # kinds/block.py:BlockExport
    raw = json.loads((src.drafter / "config.json").read_text())
    drafts = export.drafts_per_block(raw["block_size"])
    verifier = target.hub_id or ("<target model>" if src.recipe is None else f"<path to {target.name}>")
    spec = json.dumps({"method": export.engines.method, "model": model, "num_speculative_tokens": drafts})
    vllm = ["```bash", f"vllm serve {verifier} --speculative-config '{spec}'", "```"]
    sglang = ["```bash", f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm "
              f"{export.engines.sglang_algorithm} --speculative-draft-model-path {model} --speculative-num-draft-tokens "
              f"{drafts + 1}", "```"]
    lines = [f"**Engine versions:** {engine_versions(export, fmt)}.", "",
             f"Each block drafts {drafts} tokens (block size {raw['block_size']}); a smaller "
             "`num_speculative_tokens` verifies fewer of them.", ""]
    if fmt == "sglang":
        return lines + ["SGLang:", "", *sglang, "", "vLLM loads this folder too (`--format vllm` writes the same "
                                                      "files for a full vocabulary):", "", *vllm]
    if fmt == "speculators" and target.hub_id is None:  # `vllm serve DIR` would look the folder name up on the Hub
        return lines + [(f"The target is a local model, so the config's `speculators_config.verifier.name_or_path` "
                         f"holds only its folder name `{target.name}`, which `vllm serve {model}` alone would look up "
                         "on the Hugging Face Hub. Pass the target's path explicitly (or write it into "
                         "`verifier.name_or_path`):"), "", *vllm]
    if fmt == "speculators":
        return lines + ["vLLM (the config names the verifier and the number of speculative tokens):", "", "```bash",
                        f"vllm serve {model}", "```", "", "or explicitly:", "", *vllm]
    pruned = raw.get("draft_vocab_size") not in (None, raw.get("vocab_size"))
    return lines + ["vLLM:", "", *vllm, "", ("SGLang cannot serve this drafter's pruned vocabulary (its drafts use "
                                             "the target's full lm_head)." if pruned else "SGLang loads this folder "
                                             "too (`--format sglang` writes the same files):"),
                    *([] if pruned else ["", *sglang])]


def convention(folder: Path, fmt: str) -> str:
    """What the folder's layer ids mean to the engine that reads them."""
    config = json.loads((folder / "config.json").read_text())
    if fmt == "speculators":
        ids = config["aux_hidden_state_layer_ids"]
        return (f"`aux_hidden_state_layer_ids` = {ids} in speculators' reading: id k is the **input** to target layer "
                f"k (HF `hidden_states[k]`), i.e. the outputs of layers {[k - 1 for k in ids]}, which the drafter was "
                "trained on. vLLM's speculators adapter turns them back into DFlash's `target_layer_ids` (k − 1).")
    ids = config["dflash_config"]["target_layer_ids"]
    return (f"`dflash_config.target_layer_ids` = {ids}: id k is the **output** of target layer k (HF "
            f"`hidden_states[k + 1]`, DFlash's convention), which the drafter was trained on. vLLM and SGLang read "
            f"them the same way and capture the inputs to layers {[k + 1 for k in ids]} (vLLM adds 1 in "
            "`get_eagle3_aux_layers_from_config`, SGLang in `set_dflash_layers_to_capture`), so this one folder is "
            "right for both. They are specdrafter's `aux_layer_ids` {[k + 1 for k in ids]} − 1. The last layer's output is "
            "never among them: HF reports it after the final norm.")
