"""Block drafters' folders: the config.json and model.safetensors a DFlash, DSpark, DFlash2 or Domino drafter
(models/block.py) is saved as and loaded from — ours, and the engines' layouts (vLLM / SGLang's `dflash_config`, speculators'
`transformer_layer_config`, recognised by the Variant's class names), mapped to ours at this boundary and nowhere else
(`engine_layout`); a setting of an engine's folder our model does not compute is refused (`unsupported_setting`)
rather than drafted wrongly. Everything wrong with a folder is one SpecdrafterError.
"""

import json
from pathlib import Path
from typing import Dict, Optional

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import Qwen3Config

from specdrafter.core.io import SpecdrafterError, json_file_problem
from specdrafter.core.weights import read_safetensors, save_config_and_weights
from specdrafter.models.block import (
    DEFAULT_CORRECTION,
    DEFAULT_SELECTOR,
    VARIANTS,
    BlockDrafter,
    BlockDrafterConfig,
    Variant,
    check_config,
)

# The engines' folders (export/block.py writes them; z-lab's DFlash and DeepSpec's DSpark checkpoints share the
# vLLM / SGLang layout), recognised by the Variant's class names.
CONFIG_KEYS = set(Qwen3Config().to_dict()) | set(BlockDrafterConfig.__dataclass_fields__)  # what engine_layout keeps


def block_variant(config: dict) -> Optional[Variant]:
    """The block drafter variant a config.json holds: ours, or an engine's layout (`engine_layout`); None: neither."""
    variant = VARIANTS.get(config.get("variant")) if isinstance(config.get("variant"), str) else None
    if variant is not None and variant.named(config.get("architectures"), variant.projector):  # ours name it
        return variant
    ours = engine_layout(config)
    return VARIANTS[ours["variant"]] if ours else None


def engine_layout(config: dict) -> Optional[dict]:
    """Our config.json for a folder in an engine's layout (None: not one). vLLM / SGLang (z-lab, DeepSpec): the layer
    config at top level, `dflash_config` holding target_layer_ids (layer outputs: ours − 1) and mask_token_id.
    speculators: `transformer_layer_config`, and aux_hidden_state_layer_ids (layer inputs, as ours)."""
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    if isinstance(config.get("dflash_config"), dict):
        projector = config["dflash_config"].get("projector_type")  # Domino's "domino" on a DFlash architecture
        variant = next((v for v in VARIANTS.values() if v.named(archs, projector)), None)
        layer, outputs = dict(config), config["dflash_config"].get("target_layer_ids")
        ids, mask = [k + 1 for k in outputs] if isinstance(outputs, list) else None, config["dflash_config"].get("mask_token_id")
    elif isinstance(config.get("transformer_layer_config"), dict):
        # speculators names the model class its trainer saves (DFlashDraftModel, DSparkDraftModel) or, in the
        # config's default, DFlashSpeculator / DSparkSpeculator; speculators_model_type says which, whatever the name
        variant = VARIANTS.get(config.get("speculators_model_type")) or next(
            (v for v in VARIANTS.values() if v.speculators_architecture in archs or v.named(archs)), None)
        layer, ids = dict(config["transformer_layer_config"]), config.get("aux_hidden_state_layer_ids")
        mask = config.get("mask_token_id")
        layer.pop("num_target_layers", None)  # not the verifier's: speculators does not record its depth
    else:
        return None
    if variant is None:
        return None
    fields = ("block_size", "num_target_layers", "target_hidden_size", "draft_vocab_size", "markov_rank",
              "enable_confidence_head")
    ours = {k: v for k, v in layer.items() if k in CONFIG_KEYS}
    ours.update({k: config[k] for k in fields if k in config})
    if variant.selector:  # DFlash2's sizes: in dflash_config (vLLM, llama.cpp), a top-level key wins as there
        sizes = {**(config.get("dflash_config") or {}), **config}
        ours.update({k: sizes[k] for k in DEFAULT_SELECTOR if k in sizes})
    if variant.projector:  # Domino's sizes: dflash_config's win, where vLLM reads them (SpecForge repeats emb_dim on top)
        sizes = {**config, **(config.get("dflash_config") or {})}
        ours.update({k: sizes[k] for k in DEFAULT_CORRECTION if k in sizes})
    if ours.get("draft_vocab_size") == ours.get("vocab_size"):
        ours["draft_vocab_size"] = None  # the full vocabulary
    ours.pop("rope_theta", None)
    ours.pop("rope_scaling", None)
    return {**ours, "variant": variant.name, "architectures": [variant.architecture], "aux_layer_ids": ids,
            "mask_token_id": mask, "tie_word_embeddings": False}


def unsupported_setting(config: dict, variant: Variant) -> Optional[str]:
    """A setting of an engine's folder (`engine_layout`) that our model does not compute, as "key = value: why"
    (None: none). Loading such a folder would draft with other attention or heads than it was trained with."""
    speculators = isinstance(config.get("transformer_layer_config"), dict)
    layer, where = (config["transformer_layer_config"], "transformer_layer_config.") if speculators else (config, "")
    anchor = config.get("sample_from_anchor", variant.label_shift)
    if anchor is not variant.label_shift:
        return (f"sample_from_anchor = {json.dumps(anchor)}: a {variant.name} drafter "
                + ("drafts from the anchor slot too (true)" if variant.label_shift else
                   "drafts from the masked slots only (false)"))
    shift = (config.get("dflash_config") or {}).get("shift_label", False)  # SpecForge's default
    if variant.projector and shift is not True:
        return (f"dflash_config.shift_label = {json.dumps(shift)}: our {variant.name} drafter's slot k predicts "
                "x_{a+k+1} (shift_label true, the published checkpoints' and the one Model-Optimizer trains)")
    types = layer.get("layer_types") or []
    windowed = next((i for i, t in enumerate(types) if t != "full_attention"), None)
    if windowed is not None or (not types and layer.get("use_sliding_window")):
        causal = "bidirectional" if config.get("sliding_window_non_causal") else "causal"
        value = f"layer_types = {json.dumps(types)}" if types else "use_sliding_window = true"
        return (f"{where}{value}: draft layer {windowed or 0} attends through a sliding window of "
                f"{layer.get('sliding_window')} ({causal} inside a block, by sliding_window_non_causal); our block "
                "drafter attends to the whole context and bidirectionally inside the block (speculators: train with "
                "--full-attention-indices naming every draft layer)")
    if variant.heads and config.get("markov_rank", 0):
        head = config.get("markov_head_type", "vanilla")
        if head != "vanilla":
            return f"markov_head_type = {json.dumps(head)}: our Markov head is the vanilla one, logits + W2(W1[prev])"
        # speculators builds [h ; W1[prev]] by default; vLLM's own layout defaults it to false
        with_markov = config.get("confidence_head_with_markov", speculators)
        if config.get("enable_confidence_head") and with_markov is not True:
            return (f"confidence_head_with_markov = {json.dumps(with_markov)}: our confidence head reads "
                    "[h ; W1[prev]], the backbone's state beside the Markov head's embedding of the previous token")
    return None


def engine_weights(weights: Dict[str, torch.Tensor], config: dict) -> Dict[str, torch.Tensor]:
    """An engine folder's tensors as ours: its `lm_head` rows (the target's, copied for a pruned vocabulary) dropped
    — we read the target's own — and the identity d2t / t2d a full-vocabulary folder leaves out."""
    weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    V = config["vocab_size"]
    if "d2t" not in weights and not config.get("draft_vocab_size"):
        weights["d2t"] = torch.zeros(V, dtype=torch.long)
    if "t2d" not in weights and "d2t" in weights:  # marks the target ids of the draft vocabulary
        d2t = weights["d2t"].long()
        weights["t2d"] = torch.zeros(V, dtype=torch.bool)
        weights["t2d"][torch.arange(len(d2t)) + d2t] = True
    return weights


def save_block_drafter(drafter: BlockDrafter, folder: str | Path) -> Path:
    """config.json + model.safetensors (without the target's embedding and lm_head), published atomically."""
    return save_config_and_weights(drafter, Path(folder))


def load_block_drafter(folder: str | Path, variant: Optional[Variant] = None, dtype: torch.dtype = torch.float32) -> BlockDrafter:
    """The block drafter a folder holds (`variant`: refuse another). Anything wrong is one SpecdrafterError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SpecdrafterError(f"could not load the block drafter in {str(folder)!r}: no such folder")
    problem = json_file_problem(folder / "config.json")
    if problem:
        raise SpecdrafterError(f"{str(folder / 'config.json')!r} {problem}")
    raw = json.loads((folder / "config.json").read_text())
    found = block_variant(raw)
    if found is None:
        raise SpecdrafterError(f"{str(folder)!r} is not a block drafter folder (architectures: "
                               f"{raw.get('architectures')}, variant: {raw.get('variant')!r})")
    if variant is not None and found != variant:
        raise SpecdrafterError(f"{str(folder)!r} holds a {found.name} drafter, not a {variant.name} one")
    weights = read_safetensors(folder / "model.safetensors")
    engine = raw.get("variant") != found.name  # an engine's folder: its config mapped to ours, its extra tensors dropped
    if engine:
        setting = unsupported_setting(raw, found)
        if setting:
            raise SpecdrafterError(f"{str(folder / 'config.json')!r}: {setting}; refused rather than drafted wrongly")
        raw = engine_layout(raw)
        weights = engine_weights(weights, raw)
    elif "target_layer_ids" in raw:
        raise SpecdrafterError(f"{str(folder / 'config.json')!r}: target_layer_ids is the engines' spelling (layer "
                               "outputs); a specdrafter folder names its features aux_layer_ids, the layer inputs "
                               f"(here {[k + 1 for k in raw['target_layer_ids']]})")
    try:
        config = BlockDrafterConfig.from_dict(raw)
    except (StrictDataclassError, TypeError, ValueError) as e:  # a value of another type than the field's
        raise SpecdrafterError(f"{str(folder / 'config.json')!r}: {' '.join(str(e).split())[:200]}") from None
    check_config(config, repr(str(folder / "config.json")))
    drafter = BlockDrafter(config)
    expected = set(drafter.state_dict())
    missing, unknown = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unknown:
        parts = ([f"missing {', '.join(missing[:4])}"] if missing else []) + (
            [f"{', '.join(unknown[:4])} not in a {found.name} drafter"] if unknown else [])
        raise SpecdrafterError(f"the weights in {str(folder)!r} do not fit its config.json: {'; '.join(parts)}")
    try:
        drafter.load_state_dict(weights)
    except RuntimeError as e:  # a tensor of another shape than config.json describes
        raise SpecdrafterError(f"the weights in {str(folder)!r} do not fit its config.json: "
                               f"{' '.join(str(e).split())[:200]}") from None
    return drafter.to(dtype).eval()
