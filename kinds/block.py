"""Block drafters (models/block.py): DFlash, DSpark, DFlash2 and Domino draft a whole block in one pass over several
target layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.llamacpp import SDIST
from specdrafter.core.recipe import EvalVerifier, RecipeError
from specdrafter.inference.autotune import ConfidenceLength
from specdrafter.inference.block import BlockProposer
from specdrafter.kinds.base import (
    ArmSpec,
    Conformance,
    Decoding,
    Export,
    Family,
    Kind,
    LlamaCpp,
    Planning,
    Training,
)
from specdrafter.models.block import (
    DFLASH,
    DFLASH2,
    DOMINO,
    DSPARK,
    BlockDrafter,
    Variant,
    default_aux_layer_ids,
)
from specdrafter.models.block_folders import block_variant, load_block_drafter
from specdrafter.train import memory
from specdrafter.train.block import BlockTrainingDrafter, drafter_config

BLOCK_FORMATS = ("vllm", "sglang", "speculators")
# llama.cpp's converter fails on a block drafter for these targets: its DFlash/DSpark class calls the target's
# vocabulary code as its own method, which fails (TypeError from super()) where that code is Qwen3-MoE's.
BLOCK_CONVERTER_FAILS = {"Qwen3MoeForCausalLM": "Qwen3-MoE"}


@dataclass(frozen=True)
class BlockLlamaCpp(LlamaCpp):
    """llama.cpp's DFlash graph, which DSpark extends with its Markov and confidence heads (both GGUFs say `dflash`
    as their architecture; a DSpark one holds Markov tensors)."""
    markov: bool = False  # DSpark
    selector: bool = False  # DFlash2: the convolutions and the candidate selector

    def serves(self, facts: dict) -> bool:
        tensors = facts["tensors"]
        return (facts["arch"] == self.gguf_arch and self.markov == any("markov" in t for t in tensors)
                and self.selector == any(t.startswith("selector_") for t in tensors))

    def check_config(self, config: dict) -> None:
        """llama.cpp packs a DFlash2 block's candidates and their K × K scores into one hidden-size row per slot,
        and refuses to load a drafter narrower than K·(K + 1)."""
        K = config.get("dflash_config", {}).get("selector_top_k", 0) if self.selector else 0
        if K * (K + 1) > config["hidden_size"]:
            raise SpecdrafterError(f"--format gguf: llama.cpp {SDIST.version} packs a DFlash2 drafter's top-{K} "
                                   f"candidates and their scores into its hidden size, which must be >= {K * (K + 1)} "
                                   f"(this one: {config['hidden_size']}); retrain with a smaller "
                                   "drafter.block.selector_top_k")

    def check_target(self, arch: str, description: str) -> None:
        super().check_target(arch, description)
        if arch in BLOCK_CONVERTER_FAILS:
            raise SpecdrafterError(f"--format gguf: llama.cpp {SDIST.version}'s converter fails on {description} "
                                   f"for a {BLOCK_CONVERTER_FAILS[arch]} target ({arch}: its vocabulary code cannot be "
                                   "called from the DFlash class); EAGLE-3 and a draft model convert there")

    def trained_layers(self, config: dict) -> List[int]:
        return [k + 1 for k in config["dflash_config"]["target_layer_ids"]]  # layer outputs, as layer inputs

    def longest_block(self, facts: dict) -> int:
        """The block's drafts: DFlash's anchor is not a draft; DSpark's anchor slot drafts when it samples from it."""
        block = facts["fields"].get("dflash.block_size")
        if block is None:
            return self.max_k
        anchor_drafts = self.markov and facts["fields"].get("dflash.sample_from_anchor", True)
        return int(block) if anchor_drafts else int(block) - 1

    def confidence_cut(self, facts: dict) -> bool:
        """llama-server refuses --spec-draft-p-min > 0 for a DSpark drafter trained without its confidence head."""
        return not self.markov or bool(facts["fields"].get("dflash.has_confidence_head", True))


# llama.cpp's DFlash converter maps no d2t (its DSpark converter does)
DFLASH_LLAMACPP = BlockLlamaCpp("draft-dflash", converts="vllm", gguf_arch="dflash", pruned_vocab=False)


@dataclass(frozen=True)
class BlockEngines:
    """What the engines call one block-drafter variant (export/block.py writes the folders, docs/formats.md lists
    where each name comes from)."""
    method: str  # vLLM's speculative-config "method", also the speculators library's speculators_model_type
    sglang_algorithm: str  # SGLang's --speculative-algorithm
    vllm_since: str  # the first vLLM release that serves the folder as trained (the model card says it)
    sglang_since: str  # the first SGLang release with the algorithm
    speculators_since: str  # the first speculators release with the model
    vllm_file: str = ""  # vLLM's model file (empty: qwen3_<method>.py)
    checked: bool = True  # the conformance run loaded its folders with the pinned engines' own code


@dataclass(frozen=True, kw_only=True)
class BlockExport(Export):
    """A block drafter's export: its `variant` (models/block.py: the class names, whether the anchor slot drafts and
    the DSpark heads exist) and what the engines call it; export/block.py reads these, never the kind."""
    variant: Variant
    engines: BlockEngines

    def drafts_per_block(self, block_size: int) -> int:
        """γ of a block of `block_size` slots: DFlash's anchor slot drafts nothing, DSpark's does (label shift).
        The engines' num_speculative_tokens. Domino's engines draft B − 1 from its B slots (SGLang #36899: 15 for
        block size 16; SpecForge's own sampler likewise), the last slot's draft unused."""
        return drafts_per_block(self.variant, block_size) - (1 if self.variant.projector else 0)


def drafts_per_block(variant: Variant, block_size: int) -> int:
    return block_size - (0 if variant.label_shift else 1)


def drafts(variant: Variant, cfg: DictConfig) -> int:
    """γ: drafts per block of the recipe."""
    return drafts_per_block(variant, cfg.drafter.block.block_size)


@dataclass(frozen=True, kw_only=True)
class BlockTraining(Training):
    variant: Variant

    def drafter(self, cfg, target, data=None, tokenizer=None):
        return BlockTrainingDrafter(cfg, target, self.variant, data, tokenizer)

    def feature_layers(self, cfg: DictConfig, num_layers: int) -> List[int]:
        """aux_layer_ids and the last layer's output, from which the teacher's logits come."""
        b = cfg.drafter.block
        ids = list(b.aux_layer_ids) or default_aux_layer_ids(num_layers, b.num_features)
        return sorted({*ids, num_layers})

    def check_recipe(self, cfg: DictConfig) -> None:
        b = cfg.drafter.block
        if self.variant.selector and b.draft_vocab_size:
            raise RecipeError(f"recipe key 'drafter.block.draft_vocab_size' ({b.draft_vocab_size}): a dflash2 drafter "
                              "drafts over the full vocabulary (its selector's codebooks and the engines' top-k read "
                              "every target id); set 0")
        if self.variant.projector and b.draft_vocab_size:
            raise RecipeError(f"recipe key 'drafter.block.draft_vocab_size' ({b.draft_vocab_size}): a domino drafter "
                              "drafts over the full vocabulary (its correction's output layer, as the engines load it, "
                              "spans every target id); set 0")
        if self.variant.projector and b.uncorrected_drafts >= b.block_size:
            raise RecipeError(f"recipe key 'drafter.block.uncorrected_drafts' ({b.uncorrected_drafts}): a block has "
                              f"{b.block_size} drafts, and at least one must be corrected (0..{b.block_size - 1})")
        if b.anchors > cfg.train.max_length - 1:
            raise RecipeError(f"recipe key 'drafter.block.anchors' ({b.anchors}): a sequence of train.max_length "
                              f"{cfg.train.max_length} has at most {cfg.train.max_length - 1} anchor positions")


@dataclass(frozen=True, kw_only=True)
class BlockDecoding(Decoding):
    variant: Variant
    trees: Tuple[str, ...] = ()

    def proposer(self, cfg, target, path):
        drafter = load_block_drafter(path, self.variant, target.dtype).to(target.device)
        confidence = cfg.drafter.block.length.value == "confidence"
        return BlockProposer(drafter, target, ConfidenceLength(drafter.num_drafts) if confidence else None)

    def bench_arms(self, cfg: DictConfig, name: str) -> List[ArmSpec]:
        k = cfg.inference.k
        arms = [ArmSpec(f"{name}_chain", f"k={k}", EvalVerifier.chain, k=k)]
        if self.variant.heads and k != "auto":
            arms.append(ArmSpec(f"{name}_confidence", f"k<={k} by confidence", EvalVerifier.chain,
                                drafter={"block": {"length": "confidence"}}, k=k))
        arms.append(ArmSpec(f"{name}_asd", f"k={k} B={cfg.inference.asd.budget:g}", EvalVerifier.asd, k=k))
        return arms

    def check_recipe(self, cfg: DictConfig, description: str) -> None:
        b, inf, gamma = cfg.drafter.block, cfg.inference, drafts(self.variant, cfg)
        if b.length.value == "confidence":
            if not self.variant.heads:
                raise RecipeError(f"recipe key 'drafter.block.length': confidence needs DSpark's confidence head; "
                                  f"{description} has none (use fixed)")
            if inf.k == "auto":
                raise RecipeError("recipe key 'inference.k': with drafter.block.length=confidence the confidence head "
                                  f"sizes each cycle; set k to a number, the most drafts verified (<= {gamma})")
        if inf.k != "auto" and inf.k > gamma:
            raise RecipeError(f"recipe key 'inference.k' ({inf.k}) exceeds the {gamma} drafts of a block "
                              f"(drafter.block.block_size={b.block_size})")


@dataclass(frozen=True, kw_only=True)
class BlockPlanning(Planning):
    variant: Variant
    memory_fixes: Dict[str, str] = field(default_factory=lambda: {
        "activations": "drafter.block.anchors", "teacher logits": "drafter.block.draft_vocab_size"})
    bench_overrides: Tuple[str, ...] = ("train.micro_batch_size=1", "train.max_length=256", "drafter.block.anchors=8")

    def module(self, cfg, target, config_of, training):
        return BlockDrafter(drafter_config(cfg, target.config, self.variant)), None

    def activations(self, act, m) -> None:
        memory.block(act, m, drafts(self.variant, m.cfg), self.variant.heads)

    def checks(self, cfg, T, config_of):
        b = cfg.drafter.block
        try:
            ids = list(b.aux_layer_ids) or default_aux_layer_ids(T.layers, b.num_features)
        except Exception as e:  # too few target layers for the default spread
            return [(False, str(e))]
        bad = [k for k in ids if not 1 <= k <= T.layers - 1]
        return [(not bad, f"recipe key 'drafter.block.aux_layer_ids': layer input {bad[0]} is outside 1..{T.layers - 1}"
                          f" (the last layer's output, {T.layers}, is after the final norm)" if bad else
                 f"target layer inputs {ids} within 1..{T.layers - 1}"),
                (b.mask_token_id < T.vocab, f"recipe key 'drafter.block.mask_token_id' ({b.mask_token_id}) is outside "
                                            f"the target's embedding of {T.vocab} rows" if b.mask_token_id >= T.vocab
                 else f"mask token {b.mask_token_id} within the target's {T.vocab} rows")]

    def activation_label(self, cfg: DictConfig) -> str:
        b = cfg.drafter.block
        return f", {b.anchors} blocks of {b.block_size} per sequence"


@dataclass(frozen=True)
class BlockConformance(Conformance):
    def reference_step(self, module, target, hidden_states, ids) -> dict:
        """One block at position 4 after the context 0..3 (HF hidden_states: index k is the input to layer k). Also
        every layer's states of the context, from which a check picks the features by the engine's own reading of
        the folder's ids, and DSpark's first draft through its heads (prev = the anchor)."""
        t = 4
        context = torch.cat([hidden_states[k][:, :t] for k in module.config.aux_layer_ids], -1)  # [1, t, m·d]
        cache = module.new_cache()
        module.extend_context(cache, context)
        anchor = ids[0, t:t + 1]
        block = module.draft_block(cache, anchor, target)
        first, confidence = module.heads(block.logits[:, 0], block.hidden[:, 0], anchor)  # DFlash: logits unchanged
        return {"context": context[0], "anchor": anchor, "positions": torch.arange(t + module.config.block_size),
                "all_hidden": torch.stack([h[0, :t] for h in hidden_states]),  # [L + 1, t, d]: [i] = input to layer i
                "feature_layers": module.feature_layers, "mask_token_id": module.config.mask_token_id,
                "draft_ids": module.draft_ids, "logits": block.logits[0], "hidden": block.hidden[0], "first": first[0],
                "confidence": confidence[0] if confidence is not None else None,
                "target_embed": target.get_input_embeddings().weight, "target_lm_head": target.get_output_embeddings().weight}

    def perturb(self, module, name: str, vocab_size: int) -> None:
        """A pruned draft vocabulary that is not the first Vd ids, so that d2t and the lm_head rows must be read right."""
        Vd = len(module.d2t)
        if Vd < vocab_size:
            module.set_draft_vocab(torch.randperm(vocab_size)[:Vd].sort().values)


def block_conformance(name: str) -> BlockConformance:
    """A tiny drafter over three target layers with the full vocabulary, and one with a pruned vocabulary
    (which the vllm and speculators exports carry with the target's lm_head rows, and SGLang cannot read)."""
    tiny = ["drafter.block.num_layers=2", "drafter.block.block_size=4", "drafter.block.aux_layer_ids=[1,2,3]",
            "drafter.block.markov_rank=8"]
    return BlockConformance({f"{name}-full": [*tiny, "drafter.block.draft_vocab_size=0"],
                             f"{name}-pruned": [*tiny, "drafter.block.draft_vocab_size=1024"]})


def block_kind(variant: Variant, description: str, title: str, engines: BlockEngines, llamacpp: Optional[BlockLlamaCpp],
               formats: Tuple[str, ...] = BLOCK_FORMATS, conformance: bool = True) -> Kind:
    """A block drafter kind: `variant` is the model's (models/block.py), and its name the kind's; `conformance`: the
    pinned engines' own modules check its folders (benchmarks/conformance.py)."""
    return Kind(
        variant.name, description, title,
        recognises=lambda config: block_variant(config) == variant,
        training=BlockTraining("block", f"smollm2-135m-{variant.name}.yaml", variant=variant),
        decoding=BlockDecoding(variant=variant),
        planning=BlockPlanning(variant=variant),
        export=BlockExport(Family.block, formats, card_tag=variant.name, llamacpp=llamacpp, variant=variant,
                           engines=engines),
        conformance=block_conformance(variant.name) if conformance else None)


# z-lab's layout (qwen3_dflash.py in vLLM, models/dflash.py in SGLang)
# vLLM 0.20-0.21 have the class but read dflash_config.target_layer_ids as layer inputs (one layer early)
DFLASH_KIND = block_kind(DFLASH, "a DFlash block drafter", "DFlash block drafter",
                         BlockEngines("dflash", "DFLASH", vllm_since="0.22.0", sglang_since="0.5.11",
                                      speculators_since="0.5.0"), DFLASH_LLAMACPP)
# vLLM 0.25-0.27 have the class but skip the confidence head's weights
DSPARK_KIND = block_kind(DSPARK, "a DSpark block drafter", "DSpark block drafter",
                         BlockEngines("dspark", "DSPARK", vllm_since="0.28.0", sglang_since="0.5.16",
                                      speculators_since="0.7.0"),
                         BlockLlamaCpp("draft-dspark", converts="vllm", gguf_arch="dflash", markov=True))
# vLLM's qwen3_dflash2.py (#52816), SGLang's DFlash2 path (#35371) and llama.cpp's DFlash graph read the vllm folder
# (architecture DFlash2DraftModel under method/algorithm dflash); not in the conformance run: the pinned engines'
# releases may predate those merges (docs/export.md). No speculators format: vLLM reads no speculators dflash2 config.
DFLASH2_KIND = block_kind(DFLASH2, "a DFlash2 block drafter", "DFlash2 block drafter",
                          BlockEngines("dflash", "DFLASH", vllm_since="builds with #52816 (merged August 2026)",
                                       sglang_since="builds with #35371 (merged August 2026)", speculators_since="none",
                                       vllm_file="qwen3_dflash2.py", checked=False),
                          BlockLlamaCpp("draft-dflash", converts="vllm", gguf_arch="dflash", pruned_vocab=False,
                                        selector=True),
                          formats=("vllm", "sglang"), conformance=False)
# Domino: vLLM's qwen3_dflash.py (DominoHead, #47627's line of work) and SGLang's DFlash V2 worker (#36899) read the vllm
# folder — a DFlash folder whose dflash_config says projector_type "domino" — but not the pinned releases as far as we
# checked (docs/export.md). llama.cpp 11434 has no GRU in its DFlash graph or converter: no gguf. No speculators format.
DOMINO_KIND = block_kind(DOMINO, "a Domino block drafter", "Domino block drafter",
                         BlockEngines("dflash", "DFLASH", vllm_since="builds with Domino's DFlash path (main, 2026)",
                                      sglang_since="builds with #36899 (merged August 2026)", speculators_since="none",
                                      vllm_file="qwen3_dflash.py", checked=False),
                         None, formats=("vllm", "sglang"), conformance=False)
