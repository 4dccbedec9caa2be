"""EAGLE heads: EAGLE-3 (three fused target layers, training-time test, pruned vocabulary) and EAGLE-1 (the last
layer's feature, regressed). EAGLE-3.1 is EAGLE-3 with config flags (drafter.eagle.fc_norm, norm_output,
norm_before_fc; models/eagle.py:EAGLE31_FLAGS), as every engine and trainer treats it: the same kind, architecture
and --spec-type, the flags in the folder's config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch
from omegaconf import DictConfig

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import EvalVerifier, RecipeError
from specdrafter.inference.eagle import EagleProposer, EagleTreeProposer
from specdrafter.kinds.base import (
    ArmSpec,
    Conformance,
    Decoding,
    Export,
    Family,
    Kind,
    LlamaCpp,
    NoExport,
    Planning,
    Training,
)
from specdrafter.models.eagle import (
    EAGLE1_ARCH,
    EAGLE31_FLAGS,
    aux_order_problem,
    default_aux_layers,
    eagle3_layout,
    eagle31_flags,
    load_eagle1,
    load_eagle3,
)
from specdrafter.train import memory
from specdrafter.train.drafters import Eagle1Drafter, Eagle3Drafter
from specdrafter.train.memory import Shapes

DEFAULT_DYNAMIC_TREE = {"total_tokens": 16, "depth": 4, "top_k": 4}  # the bench's tree verified whole, unless the recipe has one
AUTO_DYNAMIC_TREE = {"total_tokens": 32, "depth": 5, "top_k": 6}  # candidates the bench's tree-size tuner sizes from


class Eagle3LlamaCpp(LlamaCpp):
    """llama.cpp's EAGLE-3 graph: the aux layers from the folder's top-level key, no attention biases."""

    def check_config(self, config: dict) -> None:
        if config.get("attention_bias"):
            raise SpecdrafterError("--format gguf: this EAGLE-3 head has attention biases (attention_bias true, as its "
                                   "target has), and llama.cpp's EAGLE-3 layer has none: train the head with "
                                   "drafter.eagle.attention_bias=false to serve it in llama.cpp")
        unserved = [key for key in ("fc_norm", "norm_output") if config.get(key) is True]
        if unserved:  # src/models/eagle3.cpp: an input_norm over the concatenation, the pre-norm state fed back
            raise SpecdrafterError(f"--format gguf: this EAGLE-3.1 head has {' and '.join(unserved)}, and llama.cpp "
                                   "11434's EAGLE-3 graph has neither (it reads norm_before_fc, one RMSNorm over the "
                                   "concatenated features, and feeds the pre-norm state back): serve it in vLLM or "
                                   "SGLang, or train with drafter.eagle.norm_before_fc=true and norm_output=false")
        if not config.get("eagle_aux_hidden_state_layer_ids"):  # the only key its converter reads
            raise SpecdrafterError("the EAGLE-3 folder has no top-level eagle_aux_hidden_state_layer_ids: llama.cpp's "
                                   "converter would serve the head on its default layers")

    def trained_layers(self, config: dict) -> List[int]:
        return list(config["eagle_aux_hidden_state_layer_ids"])


@dataclass(frozen=True, kw_only=True)
class EagleDecoding(Decoding):
    """One head beside the target, decoding as a chain or a dynamic tree."""
    load: Callable  # (folder, dtype) → the head
    trees: Tuple[str, ...] = ("dynamic",)
    eagle31: bool = True  # the head takes EAGLE-3.1's flags (drafter.eagle.fc_norm, norm_output, norm_before_fc)

    def check_recipe(self, cfg: DictConfig, description: str) -> None:
        e, asked = cfg.drafter.eagle, [key for key in EAGLE31_FLAGS if cfg.drafter.eagle[key]]
        if asked and not self.eagle31:
            raise RecipeError(f"recipe key 'drafter.eagle.{asked[0]}': EAGLE-3.1's norms are an EAGLE-3 head's "
                              f"(drafter.kind=eagle3); {description} has none")
        if e.fc_norm and e.norm_before_fc:
            raise RecipeError("recipe keys 'drafter.eagle.fc_norm' and 'drafter.eagle.norm_before_fc' exclude each "
                              "other (a norm per aux layer, or one over the three concatenated): set one")

    def proposer(self, cfg, target, path):
        head = self.load(path, target.dtype).to(target.device)
        has = eagle31_flags(head.config)
        asked = [key for key in EAGLE31_FLAGS if cfg.drafter.eagle[key] and not has.get(key)]
        if asked:  # the recipe expects EAGLE-3.1 of a folder trained without it: it would decode another head
            raise SpecdrafterError(f"recipe key 'drafter.eagle.{asked[0]}' asks for EAGLE-3.1's {asked[0]}, but the "
                                   f"head in {str(path)!r} was trained without it (its config.json has no "
                                   f"{asked[0]}: true): evaluate it with drafter.eagle.{asked[0]}=false, or train one "
                                   "with it")
        dyn = cfg.inference.dynamic_tree
        if not dyn.total_tokens:
            return EagleProposer(head, target)
        return EagleTreeProposer(head, target, dyn.depth, dyn.top_k, dyn.total_tokens)

    def bench_arms(self, cfg: DictConfig, name: str) -> List[ArmSpec]:
        """The chain, the dynamic tree verified whole and auto-sized, and ASD (T = 0) on the chain."""
        inf, k = cfg.inference, cfg.inference.k
        recipe_tree = {key: inf.dynamic_tree[key] for key in DEFAULT_DYNAMIC_TREE} if inf.dynamic_tree.total_tokens else {}
        whole = {**DEFAULT_DYNAMIC_TREE, **recipe_tree, "auto_size": False}  # the recipe's dynamic tree, or the default
        auto = {**whole, **AUTO_DYNAMIC_TREE, "auto_size": True}
        return [ArmSpec(f"{name}_chain", f"k={k}", EvalVerifier.chain, k=k),
                _dynamic_arm(f"{name}_tree", whole), _dynamic_arm(f"{name}_tree_auto", auto),
                ArmSpec(f"{name}_asd", f"k={k} B={inf.asd.budget:g}", EvalVerifier.asd, k=k)]


@dataclass(frozen=True)
class Eagle3Training(Training):
    def drafter(self, cfg, target, data=None, tokenizer=None):
        return Eagle3Drafter(cfg, target, data, tokenizer)

    def feature_layers(self, cfg: DictConfig, num_layers: int) -> List[int]:
        return sorted(set(cfg.drafter.eagle.aux_layer_ids or default_aux_layers(num_layers)) | {num_layers})


@dataclass(frozen=True)
class Eagle3Planning(Planning):
    def activations(self, act, m) -> None:
        memory.eagle3(act, m)

    def checks(self, cfg, T: Shapes, config_of):
        e = cfg.drafter.eagle
        aux = list(e.aux_layer_ids) or default_aux_layers(T.layers)
        bad = [k for k in aux if not 0 <= k <= T.layers]
        default = "" if e.aux_layer_ids else f" (the default for a {T.layers}-layer target)"
        disorder = aux_order_problem(aux, f"recipe key 'drafter.eagle.aux_layer_ids'{default}")
        Vd = e.draft_vocab_size or T.vocab
        last = cfg.train.max_length + e.ttt_steps - 1  # TTT step j sits at rotary position t + j
        return [(not bad, f"recipe key 'drafter.eagle.aux_layer_ids': layer id {bad[0]} is out of range for a target "
                          f"with {T.layers} layers (valid: 0..{T.layers})" if bad else
                 f"aux layers {aux} within the target's 0..{T.layers}"),
                (disorder is None, disorder or f"aux layers {aux} distinct, low to high"),
                (Vd <= T.vocab, f"recipe key 'drafter.eagle.draft_vocab_size' ({Vd}) exceeds the target's vocabulary "
                                f"of {T.vocab} tokens" if Vd > T.vocab else f"draft vocabulary {Vd} <= {T.vocab}"),
                (not T.positions or last <= T.positions,
                 f"recipe keys 'train.max_length' ({cfg.train.max_length}) and 'drafter.eagle.ttt_steps' "
                 f"({e.ttt_steps}) reach position {last}, beyond the head's max_position_embeddings "
                 f"({T.positions})" if T.positions and last > T.positions else
                 f"TTT positions up to {last} within the head's {T.positions or 'unbounded'}")]

    def activation_label(self, cfg: DictConfig) -> str:
        return f", {cfg.drafter.eagle.ttt_steps} TTT steps"


@dataclass(frozen=True)
class Eagle3Conformance(Conformance):
    def perturb(self, module, name: str, vocab_size: int) -> None:
        """A pruned draft vocabulary that is not the first Vd ids, so that d2t / t2d must be read right."""
        if name != "eagle3-pruned":
            return
        Vd = len(module.d2t)
        keep = torch.randperm(vocab_size)[:Vd].sort().values
        module.d2t.copy_(keep - torch.arange(Vd))
        module.t2d.zero_()
        module.t2d[keep] = True

    def reference_step(self, module, target, hidden_states, ids) -> dict:
        """One position (the engines' attention core is not run on CPU; with a single key, attention returns its
        value, so the step needs no KV cache)."""
        t = 4
        feats = torch.cat([hidden_states[k][:, t:t + 1] for k in module.aux_layer_ids], -1)  # [1, 1, 3·d_t]
        embeds = target.get_input_embeddings()(ids[:, t + 1:t + 2])
        hidden, _ = module(module.fuse_concatenated(feats), embeds, torch.tensor([[t]]))  # EAGLE-3.1's norms too
        draft = module.logits(hidden)[0]  # [1, Vd]
        full = torch.full((1, target.config.vocab_size), float("-inf"))
        full[:, module.draft_ids] = draft
        return {"features": feats[0], "embeds": embeds[0], "logits": full,
                "target_embed": target.get_input_embeddings().weight}


@dataclass(frozen=True)
class Eagle1Training(Training):
    def drafter(self, cfg, target, data=None, tokenizer=None):
        return Eagle1Drafter(cfg, target, data, tokenizer)


@dataclass(frozen=True)
class Eagle1Planning(Planning):
    def activations(self, act, m) -> None:
        memory.eagle1(act, m)


EAGLE3 = Kind(
    "eagle3", "an EAGLE-3 head", "EAGLE-3 draft head",
    recognises=lambda config: eagle3_layout(config) is not None,  # ours, and SpecForge's, the EAGLE repo's, speculators'
    training=Eagle3Training("eagle", "smollm2-135m-eagle3.yaml"),
    decoding=EagleDecoding(load=load_eagle3),
    planning=Eagle3Planning({"activations": "drafter.eagle.ttt_steps", "teacher logits": "drafter.eagle.draft_vocab_size"}),
    export=Export(Family.eagle, ("vllm", "sglang", "speculators"), card_tag="eagle3",
                  llamacpp=Eagle3LlamaCpp("draft-eagle3", converts="vllm", gguf_arch="eagle3")),
    conformance=Eagle3Conformance({"eagle3-pruned": ["drafter.eagle.draft_vocab_size=1024"],
                                   "eagle3-full": ["drafter.eagle.draft_vocab_size=0"],
                                   "eagle31": ["drafter.eagle.draft_vocab_size=1024", "drafter.eagle.fc_norm=true",
                                               "drafter.eagle.norm_output=true"]}))

EAGLE1 = Kind(
    "eagle1", "an EAGLE-1 head", "EAGLE-1 draft head",
    recognises=lambda config: EAGLE1_ARCH in _architectures(config),
    training=Eagle1Training("eagle"),
    decoding=EagleDecoding(load=load_eagle1, eagle31=False),
    planning=Eagle1Planning(),
    export=NoExport("vLLM and SGLang serve EAGLE-1 only in the EAGLE repo's own layout, which has no writer here; train "
                    "an EAGLE-3 head instead"))


def _dynamic_arm(name: str, tree: dict) -> ArmSpec:
    label = f"dynamic {tree['total_tokens']}/{tree['depth']}/{tree['top_k']}" + (" auto" if tree["auto_size"] else "")
    return ArmSpec(name, label, EvalVerifier.tree, {"dynamic_tree": tree}, tree_size=tree["total_tokens"] + 1)


def _architectures(config: dict) -> List[str]:
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    return [a for a in archs if isinstance(a, str)]
