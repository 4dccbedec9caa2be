"""Export a trained drafter to the folders serving engines load unchanged (docs/formats.md), with a model card, and push
it to the Hugging Face Hub.

    python launch/export.py <checkpoint | run output_dir | drafter folder> --format F --out DIR [--overwrite]
                            [--push-to-hub REPO_ID [--private]]

    drafter kind  --format     what DIR holds
    eagle3        vllm         HF-style EAGLE-3 folder (LlamaForCausalLMEagle3; midlayer.*, fc, norm, lm_head, and d2t,
                               t2d unless the draft vocabulary is the full one); aux-layer ids in vLLM's reading, id k =
                               the input to target layer k (= ours), at top level and in eagle_config
                  sglang       the same layout, ids in SGLang's reading, in eagle_config only: SGLang captures the input
                               to layer id + 1 (sglang/srt/models/llama.py, set_eagle3_layers_to_capture), so ours are
                               written as k − 1; ids 0 and L (= the target's num_hidden_layers) are refused
                  speculators  the speculators library's Eagle3Speculator (`vllm serve DIR`): weights layers.0.*
    medusa        medusa-vllm  vLLM's MedusaModel (our native layout): blocks.{i}.layers.{j}.*, lm_heads.{i}.weight
                  medusa       the Medusa repo's layout: medusa_lm_head.safetensors with {i}.{j}.linear.*,
                               {i}.{L}.weight; 5 heads only (the repo's loader builds 5 whatever the config says)
    draft_model   hf-draft     a plain HF causal LM with the target's tokenizer
    dflash,       vllm         the z-lab / DeepSpec layout vLLM and SGLang load (export/block.py): layers.N.*, fc,
    dspark        sglang       hidden_norm, norm (DSpark: markov_head.*, confidence_head.*); our layer ids − 1 as
                               dflash_config.target_layer_ids; a pruned vocabulary adds the target's lm_head rows
                               and d2t (vllm only: SGLang cannot read one)
                  speculators  the speculators library's DFlash / DSpark speculator (`vllm serve DIR`)

One --format name serves every kind it lists: `--format vllm` writes an EAGLE-3 head, a DFlash or a DSpark drafter
in the layout vLLM loads for that kind (the kind's `export.family` picks the writer, WRITERS).

Each export carries only the keys its engine reads (no specdrafter-only keys), so the model card says what happens
when a folder is served by the other engine. ENGINES lists the engine versions known to load each format (for DFlash
and DSpark, export/block.py:engine_versions from the kinds' BlockEngines).

Every export also holds README.md (the model card: acceptance, serving commands, the aux-layer convention, the
recipe), recipe.yaml and trainer_state.json (the training step). Medusa-2 heads come with the fine-tuned
backbone in backbone/, which must be served as the target. Local paths and tokens never enter an export: the
recipe is scrubbed, and the finished folder is scanned before it is published (temp folder + rename).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError
from omegaconf import OmegaConf
from safetensors.torch import load_file

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError, atomic_write_json, atomic_write_text, publish_dir, temp_dir_beside
from specdrafter.core.weights import save_weights
from specdrafter.eval.acceptance import speedup_of
from specdrafter.export import block as block_export
from specdrafter.export.engines import check_engine_target
from specdrafter.export.gguf import GGUF_TYPES, OUTTYPE, read_gguf, write_gguf
from specdrafter.export.gguf import serving as gguf_serving
from specdrafter.export.layer_config import with_rope_keys
from specdrafter.export.source import (
    Source,
    Target,
    find_source,
    target_of,
)
from specdrafter.kinds import KINDS, Kind
from specdrafter.kinds.base import Family
from specdrafter.models.eagle import EAGLE31_FLAGS, check_aux_order, eagle31_flags
from specdrafter.models.medusa import load_medusa

_ALL_FORMATS = dict.fromkeys(f for k in KINDS.values() for f in k.export.formats)  # in the order the kinds name them
FORMATS: Dict[str, Tuple[Kind, ...]] = {f: tuple(k for k in KINDS.values() if f in k.export.formats)
                                        for f in _ALL_FORMATS}  # --format → the drafter kinds it exports
ENGINE_K = 4  # speculative tokens written for engines when the recipe's inference.k is auto (they take a number)
LIBRARIES = {"vllm": "vllm", "sglang": "sglang", "speculators": "vllm", "medusa-vllm": "vllm", "medusa": "transformers",
             "hf-draft": "transformers", "gguf": "gguf"}
MEDUSA_REPO_HEADS = 5  # the Medusa repo's MedusaModel.from_pretrained builds this many heads whatever the config says
ENGINES = {  # --format → the engine versions known to load it (their own code on CPU: launch/conformance.py), for the model card
    "vllm": "vLLM 0.32.0 and 0.33.0 load this folder unchanged (other versions are not checked)",
    "sglang": ("SGLang 0.5.23 loads this folder unchanged: its weight loader maps every tensor (checked on CPU; its "
               "module needs CUDA and was not built; other versions are not checked)"),
    "speculators": ("vLLM 0.32.0 and 0.33.0 and the speculators library's own loader load this folder unchanged "
                    "(other versions are not checked)"),
    "medusa-vllm": ("vLLM 0.32.0 loads this folder unchanged; vLLM 0.33 has no Medusa method (`medusa` is not an "
                    "allowed speculative method): pin `vllm==0.32.0`, or train an EAGLE-3 head "
                    "(`drafter.kind=eagle3`), which current vLLM and SGLang serve"),
    "medusa": ("none checked: the Medusa repo's own loader needs the one-line conversion below; TGI and TensorRT-LLM "
               "read the files as they are"),
    "hf-draft": "transformers loads this folder (assisted generation); vLLM and SGLang draft-model serving is not checked",
    "gguf": (f"llama.cpp {llamacpp.LLAMA_CPP_VERSION} (the PyPI source sdist {llamacpp.SDIST.name}=={llamacpp.SDIST.version}, "
             "built by `specdrafter-llamacpp install`) converted this file with its own converter and serves it"),
}
AUX_LAYER_FORMATS = ("vllm", "sglang", "speculators")  # the EAGLE-3 formats: they name target layers to capture
EAGLE_REPO = ("The EAGLE repo's own `EaModel` is not supported: with `target_hidden_size` in the config (always "
              "written here) it does not give the head the target's token embeddings.")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def scrub(value):
    """Absolute local paths → their final component, anywhere in a recipe or config tree. A path is one word that
    starts with / ~ or a drive letter (a prompt such as "/help me" keeps its spaces and stays). Never applied to a
    tokenizer's files, whose vocabulary holds tokens like "/*"."""
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    if isinstance(value, str) and re.fullmatch(r"(/|~|[A-Za-z]:[\\/])\S*", value):
        return Path(value.replace("\\", "/")).name or "<local path>"
    return value


# ------------------------------------------------------------------------------------------------ export
def export(checkpoint: str | os.PathLike, fmt: str, out: str | os.PathLike, overwrite: bool = False,
           repo_id: Optional[str] = None, gguf_type: str = OUTTYPE) -> Path:
    """Write the drafter of `checkpoint` in format `fmt` to `out` (built in a temp folder beside it, scanned for
    local paths and tokens, then renamed into place). `repo_id` only names the model in the card's commands."""
    out = Path(out).expanduser()
    if fmt not in FORMATS:
        raise SpecdrafterError(f"unknown format {fmt!r} (valid: {', '.join(FORMATS)})")
    if gguf_type != OUTTYPE and (fmt != "gguf" or gguf_type not in GGUF_TYPES):
        raise SpecdrafterError(f"--gguf-type {gguf_type}: a weight type of --format gguf ({', '.join(GGUF_TYPES)})")
    src = find_source(checkpoint)
    check_kind(src, fmt)
    if src.drafter.resolve().is_relative_to(out.resolve()):
        raise SpecdrafterError(f"--out {str(out)!r} would replace the checkpoint being exported")
    check_out(out, overwrite)
    target = target_of(src.recipe)
    check_engine_target(fmt, src.kind.export.family, src.kind.description, target.architectures, eagle_ids(src))
    tmp = temp_dir_beside(out)
    try:
        write = WRITERS[src.kind.export.family].write
        if fmt == "gguf":  # the kind's convertible folder through llama.cpp's own converter
            write_gguf(src, tmp, target, write, gguf_type)
        else:
            write(src, tmp, target, fmt)
        if (src.drafter / "backbone").is_dir():  # Medusa-2: the heads read this fine-tuned backbone, not the target
            copy_hf_folder(src.drafter / "backbone", tmp / "backbone")
        recipe = None
        if src.recipe is not None:
            recipe = scrub(OmegaConf.to_container(src.recipe, resolve=True))
            if "target" in recipe:
                recipe["target"]["model"] = target.hub_id or target.name
            atomic_write_text(tmp / "recipe.yaml", OmegaConf.to_yaml(OmegaConf.create(recipe)))
        if src.state:
            atomic_write_json(tmp / "trainer_state.json", scrub(src.state))
        atomic_write_text(tmp / "README.md", model_card(src, fmt, target, recipe, repo_id or f"./{out.name}", tmp))
        check_no_leaks(tmp, [tmp, out.resolve().parent, src.drafter.resolve(), Path.cwd(), Path.home()])
        check_out(out, overwrite)  # again: a user may have put files into --out while the export was written
        return publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


CARD_MARK = "Trained with specdrafter (drafter kind `"  # a line every model card (README.md) has had


def check_out(out: Path, overwrite: bool) -> None:
    """--out may be new, or (with --overwrite) an earlier export, which is then replaced whole. Anything else there,
    a file or a folder holding files no export wrote, is refused in one line and left as it is."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise SpecdrafterError(f"--out {str(out)!r} is a file, not a folder; choose another --out")
    if not out.exists():
        return
    foreign = not_exported(out)
    if foreign:
        raise SpecdrafterError(f"{str(out)!r} is not an export folder specdrafter wrote (it holds {foreign}); choose "
                               "another --out or remove it yourself")
    if not overwrite:
        raise SpecdrafterError(f"{str(out)!r} exists; pass --overwrite to replace it")


def not_exported(folder: Path) -> str:
    """What in `folder` no export wrote ("" if nothing: an empty folder, or an earlier export as it was written).
    An export is recognised by its model card, whose Files section lists every file the export wrote, so a file a
    user added to an export folder is found too. Exports of every earlier version have this card."""
    listed = card_files(folder / "README.md")
    if listed is None:  # only the top level is named: --out might be a large folder such as a home directory
        return described(sorted(p.name for p in folder.iterdir()))
    parents = {parent.as_posix() for name in listed for parent in Path(name).parents}
    entries = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
    return described([e for e in entries if e not in listed and e not in parents])


def described(names: List[str], shown: int = 3) -> str:
    """The first few of `names` (relative paths), the contents of a folder among them left out (it is named)."""
    named = set(names)
    tops = [n for n in names if not any(p.as_posix() in named for p in Path(n).parents)]
    return ", ".join(tops[:shown]) + ("…" if len(tops) > shown else "")


def card_files(card: Path) -> Optional[set]:
    """The files a specdrafter model card lists in its Files section, or None if `card` is not such a card."""
    try:
        text = card.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if CARD_MARK not in text or "\n## Files\n" not in text:
        return None
    section = text.split("\n## Files\n", 1)[1].strip("\n").split("\n\n", 1)[0]
    return set(re.findall(r"^- `(.+)`$", section, re.M))


def eagle_ids(src: Source) -> Optional[List[int]]:
    """An EAGLE-3 folder's aux layer ids as its config.json names them (None for other kinds)."""
    if src.kind.export.family is not Family.eagle:
        return None
    raw = json.loads((src.drafter / "config.json").read_text())
    return (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")


def check_kind(src: Source, fmt: str) -> None:
    export = src.kind.export
    if fmt == "gguf" and not export.llamacpp:
        raise SpecdrafterError(f"--format gguf: llama.cpp serves no drafter like {src.kind.description} (its "
                               "--spec-type has draft, draft-eagle3, draft-dflash and draft-dspark)")
    if not export.formats:
        raise SpecdrafterError(f"{str(src.drafter)!r} holds {src.kind.description}, which has no engine format here: "
                               f"{export.why}")
    if src.kind not in FORMATS[fmt]:
        raise SpecdrafterError(f"--format {fmt} exports {' or '.join(k.description for k in FORMATS[fmt])}, but "
                               f"{str(src.drafter)!r} holds {src.kind.description} (drafter kind {src.kind.name}); "
                               f"use --format {' or '.join(export.formats)}")


# ---------------------------------------------------------------------------------------------- EAGLE-3
def write_eagle3(src: Source, folder: Path, target: Target, fmt: str) -> None:
    """config.json + model.safetensors of an EAGLE-3 head, with what its engine reads. Our head keeps the
    un-normalised hidden state as the residual (EAGLE-3, SGLang), i.e. norm_before_residual = false, written out
    because speculators configs default to true."""
    raw = json.loads((src.drafter / "config.json").read_text())
    if not (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        raise SpecdrafterError(f"{str(src.drafter)!r} has no eagle_config.eagle_aux_hidden_state_layer_ids: the target "
                               "layers it reads are unknown")
    ids = src.kind.decoding.load(src.drafter).aux_layer_ids  # refuses a folder that is not a loadable head of its kind
    check_aux_order(ids, f"{str(src.drafter)!r}: drafter.eagle.aux_layer_ids", "retrain the head with three "
                    "distinct ids, low to high")
    written = sglang_ids(ids, target) if fmt == "sglang" else ids
    layer, weights = draft_layer_config(raw), engine_weights(src.drafter, raw)
    eagle = {"draft_vocab_size": raw["draft_vocab_size"], "target_hidden_size": raw.get("target_hidden_size")
             or raw["hidden_size"], "norm_before_residual": False,
             **eagle31_flags(raw)}  # EAGLE-3.1: top-level fc_norm / norm_output / norm_before_fc, as every engine reads
    if fmt == "speculators":
        config = speculators_config(src, target, layer, eagle, ids)
        weights = {re.sub(r"^midlayer\.", "layers.0.", name): t for name, t in weights.items()}
    else:  # SGLang reads eagle_config only; vLLM the top-level ids first, and eagle_config.use_aux_hidden_state
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], **eagle,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": written, "use_aux_hidden_state": True}}
        if fmt == "vllm":
            config["eagle_aux_hidden_state_layer_ids"] = ids
    save_weights(weights, folder / "model.safetensors")
    atomic_write_json(folder / "config.json", config)


def speculators_config(src: Source, target: Target, layer: dict, eagle: dict, ids: List[int]) -> dict:
    if target.hub_id is None and src.recipe is None:
        raise SpecdrafterError("--format speculators names the verifier: export from a checkpoint folder or run "
                               "(whose recipe.yaml names the target), not a bare drafter folder")
    return {"architectures": ["Eagle3Speculator"], "model_type": "speculators", "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": engine_block_length(src),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": target.hub_id or target.name, "architectures": target.architectures}},
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
            **eagle, "eagle_aux_hidden_state_layer_ids": ids}


def sglang_ids(ids: List[int], target: Target) -> List[int]:
    """Our ids (id k = the input to target layer k) in SGLang's reading: it captures the input to layer id + 1, so
    ours are written as k − 1. The embeddings (0) and the last layer's output (L) have no id there."""
    if 0 in ids:
        raise SpecdrafterError(f"aux layer id 0 (the token embedding) cannot be written for SGLang (ids {ids}): in its "
                               "reading it would be −1, and whether SGLang captures the embeddings is unverified; "
                               "export --format vllm or speculators instead")
    L = target.num_layers
    if L is None:
        raise SpecdrafterError(f"--format sglang checks the aux layer ids against the target's layer count, but no "
                               f"config.json of the target ({target.name}) is on this machine; export from the run's "
                               "checkpoint where the target (its folder or the Hugging Face cache) is available")
    if L in ids:
        raise SpecdrafterError(f"aux layer id {L} (the last layer's output) cannot be written for SGLang (ids {ids}): "
                               f"as {L - 1} in its reading SGLang would capture the input to layer {L}, which its "
                               f"{L}-layer loop never reaches, and the first draft step crashes; --format vllm and "
                               f"speculators carry id {L} (vLLM 0.33.0 captures the last layer's output before the "
                               "final norm, as trained)")
    return [k - 1 for k in ids]


def engine_weights(drafter: Path, raw: dict) -> Dict[str, torch.Tensor]:
    """The head's tensors as the engines load them: a full-vocabulary head (draft_vocab_size = vocab_size) without
    d2t / t2d, since vLLM then has no draft-to-target map to load them into and fails."""
    weights = load_file(str(drafter / "model.safetensors"))
    if raw.get("draft_vocab_size") != raw.get("vocab_size"):
        return weights
    if weights["d2t"].any() or not weights["t2d"].all():
        raise SpecdrafterError(f"{str(drafter)!r} has a full draft vocabulary ({raw['vocab_size']} tokens) but d2t/t2d "
                               "are not the identity: engines drop them for a full vocabulary, so its lm_head rows "
                               "would name other tokens")
    return {name: t for name, t in weights.items() if name not in ("d2t", "t2d")}


def engine_block_length(src: Source) -> int:
    """The recipe's inference.k when it is a number, else ENGINE_K."""
    k = OmegaConf.select(src.recipe, "inference.k", default=None) if src.recipe is not None else None
    return k if isinstance(k, int) else ENGINE_K


def draft_layer_config(raw: dict) -> dict:
    """The head's own decoder layer as a plain LlamaConfig dict: the EAGLE keys removed, `rope_theta` (and
    `rope_scaling`) spelled out beside transformers 5's `rope_parameters`, since engines read either — a
    missing rope_theta would silently fall back to 10000."""
    drop = {"architectures", "draft_vocab_size", "target_hidden_size", "eagle_config", "norm_before_residual",
            "eagle_aux_hidden_state_layer_ids", "_name_or_path", *EAGLE31_FLAGS}
    layer = with_rope_keys({k: v for k, v in raw.items() if k not in drop}, raw)
    return {**layer, "model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False}


# ---------------------------------------------------------------------------------------------- Medusa
def write_medusa(src: Source, folder: Path, target: Target, fmt: str) -> None:
    heads = load_medusa(src.drafter)  # refuses a folder that is not a loadable set of Medusa heads
    c = heads.config
    base = target.hub_id or target.name
    if fmt == "medusa-vllm":
        raw = json.loads((src.drafter / "config.json").read_text())
        config = {**scrub(raw), "architectures": ["MedusaModel"], "model_type": "medusa",
                  "medusa_fc_bias": c.medusa_fc_bias, "base_model_name_or_path": base}
        config.pop("_name_or_path", None)
        shutil.copyfile(src.drafter / "model.safetensors", folder / "model.safetensors")
        atomic_write_json(folder / "config.json", config)
        return
    if c.num_heads != MEDUSA_REPO_HEADS:
        n, repo = c.num_heads, MEDUSA_REPO_HEADS
        lost = (f"{heads_named(n + 1, repo)} would stay untrained" if n < repo
                else f"{heads_named(repo + 1, n)} would be dropped")
        raise SpecdrafterError(f"--format medusa cannot express {c.num_heads} heads: the Medusa repo's loader builds "
                               f"{MEDUSA_REPO_HEADS} whatever config.json says and loads them with strict=False, so "
                               f"{lost}; train drafter.medusa.num_heads={MEDUSA_REPO_HEADS} or export --format "
                               "medusa-vllm")
    L = c.num_hidden_layers
    for i, block in enumerate(heads.blocks):
        if any(not torch.equal(layer.weight, block.layers[0].weight) for layer in block.layers[1:]):
            raise SpecdrafterError(f"head {i} has {L} distinct ResBlocks, but the Medusa repo's model repeats one "
                                   "ResBlock per head ([ResBlock] * medusa_num_layers) and would load only one of "
                                   "them; export --format medusa-vllm instead")
    weights = {}
    for i, (block, lm_head) in enumerate(zip(heads.blocks, heads.lm_heads)):
        for j, layer in enumerate(block.layers):
            weights[f"{i}.{j}.linear.weight"] = layer.weight
            # the repo's ResBlock always has a bias (nn.Linear default): a bias-free head exports zeros
            weights[f"{i}.{j}.linear.bias"] = layer.bias if layer.bias is not None else torch.zeros_like(layer.weight[:, 0])
        weights[f"{i}.{L}.weight"] = lm_head.weight
    save_weights({k: v.detach().contiguous() for k, v in weights.items()}, folder / "medusa_lm_head.safetensors")
    atomic_write_json(folder / "config.json", {"medusa_num_heads": c.num_heads, "medusa_num_layers": L,
                                               "base_model_name_or_path": base})


def heads_named(first: int, last: int) -> str:
    return f"head {first}" if first == last else f"heads {first}..{last}"


# ------------------------------------------------------------------------------------------ draft model
def write_hf_draft(src: Source, folder: Path, target: Target, fmt: str) -> None:
    missing = [f for f in ("model.safetensors", "tokenizer_config.json") if not (src.drafter / f).is_file()]
    if missing:
        raise SpecdrafterError(f"{str(src.drafter)!r} lacks {missing[0]}: a draft model exports with its weights and "
                               "the target's tokenizer")
    copy_hf_folder(src.drafter, folder)


def copy_hf_folder(source: Path, folder: Path) -> None:
    """An HF causal-LM folder's weights, model configs (rewritten without local paths) and tokenizer files
    (copied byte for byte; the leak check reads them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.name in ("config.json", "generation_config.json"):
            atomic_write_json(folder / path.name, scrub(json.loads(path.read_text())))
        elif path.suffix == ".safetensors" or path.name == "model.safetensors.index.json" or path.name in TOKENIZER_FILES:
            shutil.copyfile(path, folder / path.name)


# -------------------------------------------------------------------------------------------- model card
def model_card(src: Source, fmt: str, target: Target, recipe: Optional[dict], model: str, folder: Path) -> str:
    """README.md: YAML front matter the Hub indexes, then acceptance, serving, the aux-layer convention and the recipe."""
    kind, step = src.kind, src.state.get("step")
    front = ([f"base_model: {target.hub_id}"] if target.hub_id else []) + [
        f"library_name: {LIBRARIES[fmt]}", "tags:", "- speculative-decoding", f"- {kind.export.card_tag}"]
    lines = ["---", *front, "---", "", f"# {kind.title} for {target.name}", "",
             f"Trained with specdrafter (drafter kind `{kind.name}`"
             + (f", training step {step}" if step is not None else "") + f") and exported as `{fmt}`."
             + ("" if target.hub_id else f" The target is a local model (`{target.name}`) without a known Hub id."), ""]
    if (src.drafter / "backbone").is_dir():
        lines += [("**Medusa-2:** the heads were trained jointly with a fine-tuned copy of the target, saved in "
                   "`backbone/`. That backbone **must be served as the target model** (the engine's target, or the "
                   "base model a Medusa loader opens): the heads read its hidden states, and decoding verifies against "
                   "it. With the original target the heads' acceptance drops."), ""]
    writer = WRITERS[kind.export.family]
    commands = (gguf_serving(kind.export.llamacpp.spec_type, engine_block_length(src)) if fmt == "gguf" else
                writer.serving(fmt, src, target, model))
    lines += ["## Acceptance", "", acceptance_table(src), "", "## Serving", "", *commands, ""]
    if writer.convention is not None and fmt != "gguf":
        lines += [f"## {writer.convention_title}", "", writer.convention(folder, fmt), ""]
    lines += ["## Files", "", *files_section(folder), ""]
    if recipe is not None:
        lines += ["## Recipe", "", ("The resolved training recipe (local paths reduced to their final component), "
                                    "also in `recipe.yaml`:"),
                  "", "```yaml", OmegaConf.to_yaml(OmegaConf.create(recipe)).rstrip(), "```", ""]
    return "\n".join(lines)


def acceptance_table(src: Source) -> str:
    """The last evaluation's cells for this checkpoint (eval/results.json), else the held-out metrics the training
    logged with the checkpoint (simulated α and top-1 agreement per head / TTT step)."""
    cells = []
    if src.eval_results is not None:
        try:
            cells = json.loads(src.eval_results.read_text()).get("cells")
        except (ValueError, AttributeError):
            cells = None
    cells = [c for c in cells or [] if isinstance(c, dict) and not c.get("sweep")]  # the k sweep stays in the report
    step = src.state.get("step")
    shown = [c for c in cells if step is not None and c.get("step") == step]
    if not shown and cells:  # no cell of this step: the newest evaluated checkpoint's, said so
        newest = max((c.get("step") or 0) for c in cells)
        shown = [c for c in cells if (c.get("step") or 0) == newest]
    # the speedup of whichever kind the cell measured (eval.repeats: drift-corrected, or the side-by-side median)
    shown = [{**c, "speedup": measured.value} if (measured := speedup_of(c)) else c for c in shown]
    columns = [("set", "set"), ("T", "temperature"), ("verifier", "verifier"), ("k", "k"), ("α", "alpha"),
               ("τ", "tau"), ("speedup", "speedup")]
    columns = [(name, key) for name, key in columns if any(key in c for c in shown)]
    if shown and columns:
        which = "this checkpoint" if shown[0].get("step") == step else f"training step {shown[0].get('step')}"
        return (f"Measured on {which} by specdrafter's acceptance evaluation (α: accepted drafts / draft positions "
                "tried; τ: tokens per target pass):\n\n" + markdown_table([name for name, _ in columns],
                                                         [[c.get(key) for _, key in columns] for c in shown]))
    metrics = src.state.get("metrics") or {}
    names = [k.split("/", 1)[1] for k in metrics if k.startswith("alpha/") and k != "alpha/mean"]
    if not names:
        return "No evaluation was recorded for this checkpoint."
    rows = [[n, metrics.get(f"alpha/{n}"), metrics.get(f"top1/{n}")] for n in names]
    return ("Held-out metrics logged at this training step (simulated acceptance α̂ = Σ min(p, q) at the training "
            "temperature, and top-1 agreement with the target), per prediction:\n\n"
            + markdown_table(["prediction", "α̂", "top-1"], rows))


def markdown_table(header: List[str], rows: List[list]) -> str:
    def cell(v):
        return "–" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def serving(fmt: str, src: Source, target: Target, model: str) -> List[str]:
    """Command lines for the engines that load this format (`model`: the Hub repo id, or ./<folder>), the engine
    versions known to load it, and what a local target needs."""
    k = engine_block_length(src)
    lines, verifier = [], target.hub_id or ("<target model>" if src.recipe is None else f"<path to {target.name}>")
    if (src.drafter / "backbone").is_dir():  # Medusa-2: the fine-tuned backbone is the model to serve
        if not model.startswith("./"):
            local = f"./{model.split('/')[-1]}"
            lines, model = ["```bash", f"hf download {model} --local-dir {local}", "```", ""], local
        verifier = f"{model}/backbone"
    spec = {"method": {"vllm": "eagle3", "speculators": "eagle3", "medusa-vllm": "medusa"}.get(fmt, "draft_model"),
            "model": model, "num_speculative_tokens": k}
    if json.loads((src.drafter / "config.json").read_text()).get("parallel_drafting") is True:  # P-EAGLE: K in one pass
        spec["parallel_drafting"] = True
    spec = json.dumps(spec)
    vllm = ["vLLM:", "", "```bash", f"vllm serve {verifier} --speculative-config '{spec}'", "```"]
    sglang = ["SGLang:", "", "```bash", f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm "
              + {"sglang": "EAGLE3", "hf-draft": "STANDALONE"}.get(fmt, "") + f" --speculative-draft-model-path {model} "
              f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}", "```"]
    versions = [f"**Engine versions:** {ENGINES[fmt]}." + (" " + EAGLE_REPO if fmt in AUX_LAYER_FORMATS else ""), ""]
    return lines + versions + engine_commands(fmt, src, target, model, vllm, sglang)


def engine_commands(fmt: str, src: Source, target: Target, model: str, vllm: List[str], sglang: List[str]) -> List[str]:
    if fmt == "vllm":
        return vllm + ["", "For SGLang use the `sglang` export: SGLang reads the aux-layer ids differently."]
    if fmt == "sglang":
        return sglang + ["", ("For vLLM use the `vllm` or `speculators` export: vLLM reads the aux-layer ids "
                              "differently.")]
    if fmt == "speculators" and target.hub_id is None:  # `vllm serve DIR` would look the folder name up on the Hub
        return [(f"The target is a local model, so the config's `speculators_config.verifier.name_or_path` holds "
                 f"only its folder name `{target.name}`, which `vllm serve {model}` alone would look up on the Hugging "
                 "Face Hub and fail. Pass the target's path explicitly (or write it into `verifier.name_or_path`):"),
                "", *vllm[2:]]
    if fmt == "speculators":
        return ["vLLM (the config names the verifier and the number of speculative tokens):", "", "```bash",
                f"vllm serve {model}", "```", "", "or explicitly:", "", *vllm[2:]]
    if fmt == "medusa-vllm":
        return vllm + ["", "SGLang does not serve Medusa heads."]
    if fmt == "medusa":
        local = [] if target.hub_id else ["", (f"`base_model_name_or_path` in `config.json` holds only the local "
                                               f"target's folder name `{target.name}`: set it to the target's path.")]
        return [("The Medusa repo's own loader (`MedusaModel.from_pretrained`) reads only `medusa_lm_head.pt` and "
                 f"builds {MEDUSA_REPO_HEADS} heads, as many as this export has. Write that file once:"), "", "```bash",
                ("python -c \"import torch, safetensors.torch as st; torch.save(st.load_file("
                 "'medusa_lm_head.safetensors'), 'medusa_lm_head.pt')\""), "```", "",
                ("TGI reads `medusa_lm_head.safetensors` and the base model named in `config.json` (TensorRT-LLM's "
                 "Medusa converter reads the same two files):"), "", "```bash",
                f"text-generation-launcher --model-id {model}", "```", *local]
    return vllm + ["", *sglang, "", "transformers (assisted generation):", "", "```python",
                   f"draft = AutoModelForCausalLM.from_pretrained({model!r})",
                   "model.generate(**inputs, assistant_model=draft)", "```"]


def aux_convention(folder: Path, fmt: str) -> str:
    """The ids as written, what they mean to the engine this folder is for, and what the other engine would capture."""
    config = json.loads((folder / "config.json").read_text())
    ids = config.get("eagle_aux_hidden_state_layer_ids") or config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    if fmt == "sglang":
        return (f"`eagle_config.eagle_aux_hidden_state_layer_ids` = {ids} in SGLang's reading: id k is the **output** "
                f"of target layer k (SGLang captures the input to layer k + 1). In vLLM's reading (id k = the input "
                f"to layer k, specdrafter's own) the head was trained on {[k + 1 for k in ids]}. **Served by vLLM** "
                "this folder captures the wrong layers without an error: vLLM looks for a top-level "
                "`eagle_aux_hidden_state_layer_ids`, which this folder lacks, and either reads these ids as layer "
                "inputs (one layer earlier than trained) or falls back to its default layers; acceptance drops. Use "
                "the `vllm` or `speculators` export for vLLM.")
    text = (f"`eagle_aux_hidden_state_layer_ids` = {ids} in vLLM's reading: id k is the **input** to target layer k "
            f"(the output of layer k − 1); id 0 is the token embedding, which vLLM captures, and id L (the target's "
            f"num_hidden_layers) is the last layer's output.")
    if fmt == "speculators":
        return text + " For SGLang use the `sglang` export (SGLang reads ids as layer outputs)."
    return text + (f" **Served by SGLang** this folder captures the wrong layers: SGLang reads "
                   f"`eagle_config.eagle_aux_hidden_state_layer_ids` as layer outputs and captures the inputs to "
                   f"layers {[k + 1 for k in ids]}, one layer later than trained, so acceptance drops without an error "
                   f"(an id of L − 1 or L asks for a layer SGLang never reaches and crashes the first draft step). Use "
                   "the `sglang` export for SGLang.")


def files_section(folder: Path) -> List[str]:
    return [f"- `{p.relative_to(folder)}`" for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")] \
        + ["- `README.md`"]


# -------------------------------------------------------------------------------------------- leak check
LEAKY = ("/root", "/home", "/tmp")  # local path prefixes no authored file may contain (a tokenizer's vocabulary might)
TOKEN_PATTERN = re.compile(r"\bhf_[A-Za-z0-9]{20,}")


def check_no_leaks(folder: Path, local_paths: List[Path]) -> None:
    """Refuse to publish an export whose text (or safetensors header) holds a local path or a token: a model
    card or config naming /home/<user>, or an HF token, would be pushed to the world."""
    secrets = [v for k, v in os.environ.items() if v and (v.startswith("hf_") or k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"))]
    paths = [str(p) for p in local_paths if len(p.parts) > 1]
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.suffix == ".safetensors":  # only the JSON header: raw weight bytes match anything by chance
            with open(path, "rb") as f:
                text = f.read(int.from_bytes(f.read(8), "little")).decode("utf-8", "replace")
        elif path.suffix == ".gguf":  # its metadata, not its weights nor the target's vocabulary (Qwen's has "/root")
            text = json.dumps(read_gguf(path)["fields"])
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
        authored = path.name not in TOKENIZER_FILES
        if any(s in text for s in secrets) or (authored and TOKEN_PATTERN.search(text)):
            raise SpecdrafterError(f"the export's {path.relative_to(folder)} contains a token; nothing was written")
        found = next((p for p in paths + list(LEAKY if authored else ()) if p in text), None)
        if found is not None:
            raise SpecdrafterError(f"the export's {path.relative_to(folder)} contains the local path {found!r}; "
                                   "nothing was written")


# ------------------------------------------------------------------------------------------------- push
def push_to_hub(folder: str | os.PathLike, repo_id: str, private: bool = False) -> str:
    """Upload an export folder (create the repo if needed). The token comes from HF_TOKEN or a saved login and is
    never printed; the local folder is only read, so a failed push leaves the export as it was."""
    folder = Path(folder)
    keep = f"the export in {str(folder)!r} is complete; push it later"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise SpecdrafterError(f"cannot push to {repo_id}: HF_HUB_OFFLINE is set ({keep})")
    token = get_token()
    if not token:
        raise SpecdrafterError(f"cannot push to {repo_id}: no Hugging Face token (set HF_TOKEN or run `hf auth login`; {keep})")
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                          commit_message="Upload speculative-decoding drafter exported by specdrafter")
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        reason = {401: "the token was rejected", 403: f"this token may not write to {repo_id}",
                  409: f"{repo_id} conflicts with an existing repository"}.get(status, f"the Hub answered {status}")
        raise SpecdrafterError(f"could not push to {repo_id}: {reason} ({_first_line(e, token)}; {keep})") from None
    except Exception as e:  # network failures arrive as the HTTP client's own errors (httpx, httpx2 or requests)
        raise SpecdrafterError(f"could not reach the Hub to push {repo_id}: {_first_line(e, token)} ({keep})") from None
    return str(url)


def _first_line(e: Exception, token: str) -> str:
    return ((str(e).strip().splitlines() or [type(e).__name__])[0]).replace(token, "***")


# ------------------------------------------------------------------------------------------------ writers
@dataclass(frozen=True)
class Writer:
    """One model family's writer (a kind's `export.family` names it) and what the model card says about its exports."""
    write: Callable[[Source, Path, Target, str], None]  # (src, folder, target, fmt): the files of the export
    formats: Tuple[str, ...]  # the --format names it writes
    serving: Callable[[str, Source, Target, str], List[str]]  # (fmt, src, target, model) → the card's Serving lines
    convention: Optional[Callable[[Path, str], str]] = None  # (folder, fmt) → the card's layer-id section
    convention_title: str = "Aux-layer convention"


WRITERS: Dict[Family, Writer] = {  # a kind's `export.family` → its family's writer
    Family.eagle: Writer(write_eagle3, AUX_LAYER_FORMATS, serving, aux_convention),
    Family.medusa: Writer(write_medusa, ("medusa-vllm", "medusa"), serving),
    Family.hf: Writer(write_hf_draft, ("hf-draft",), serving),
    Family.block: Writer(block_export.write_block, block_export.FORMATS, block_export.serving, block_export.convention,
                    "Layer-id convention"),
}
