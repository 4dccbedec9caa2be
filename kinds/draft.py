"""Draft models: a small causal LM sharing the target's tokenizer (trained, or any HF model), and the self-draft
(the target's first layers, training-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from omegaconf import DictConfig
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import EvalVerifier
from specdrafter.inference.proposers import (
    DraftModelProposer,
    DraftModelTreeProposer,
    DynamicTreeProposer,
    check_vocabularies,
    self_draft,
)
from specdrafter.inference.tree import tree_from_choices
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
    never,
)
from specdrafter.train import memory
from specdrafter.train.drafters import DraftModelDrafter, cut_config
from specdrafter.train.memory import Shapes


class DraftLlamaCpp(LlamaCpp):
    """llama.cpp's draft-simple: a draft model of any architecture, reading tokens only."""

    def serves(self, facts: dict) -> bool:
        """A causal LM of any architecture (the table asks this kind last): token embeddings and a block count."""
        return "token_embd.weight" in facts["tensors"] and f"{facts['arch']}.block_count" in facts["fields"]

    def check_config(self, config: dict) -> None:
        if set(config.get("layer_types") or ["?"]) == {"linear_attention"}:
            raise SpecdrafterError("--format gguf: this draft model's layers are all linear_attention, and "
                                   "llama-server aborts at start-up on a model with no KV-cache layer "
                                   "(GGML_ASSERT(buffer)); train it with enough layers to include an attention one "
                                   "(drafter.num_layers)")


@dataclass(frozen=True)
class CausalDecoding(Decoding):
    """A causal LM with the target's vocabulary (`assistant_model`) drafting on its own: a chain, a static or a
    dynamic tree. This one is a draft model's folder (or hub id)."""

    def assistant_model(self, cfg: DictConfig, target: nn.Module, path) -> nn.Module:
        """The draft *model* itself (also HF generate's `assistant_model`), in the target's dtype, beside it."""
        try:
            draft = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device).eval()
        except (OSError, ValueError) as e:
            raise SpecdrafterError(f"could not load draft model {cfg.drafter.path!r}: {str(e).splitlines()[0]}") from None
        check_vocabularies(target, draft)
        return draft

    def proposer(self, cfg, target, path):
        draft, inf = self.assistant_model(cfg, target, path), cfg.inference
        dyn = inf.dynamic_tree
        if inf.tree:
            return DraftModelTreeProposer(draft, tree_from_choices([list(c) for c in inf.tree]))
        if dyn.total_tokens:
            return DynamicTreeProposer(draft, dyn.depth, dyn.top_k, dyn.total_tokens)
        return DraftModelProposer(draft)

    def bench_arms(self, cfg: DictConfig, name: str) -> List[ArmSpec]:
        """HF assisted generation with the draft model, our chain, and the recipe's static tree."""
        inf, k = cfg.inference, cfg.inference.k
        arms = [ArmSpec("hf_assisted", f"k={k}", EvalVerifier.chain, hf_assisted=True),
                ArmSpec(f"{name}_chain", f"k={k}", EvalVerifier.chain, k=k)]
        if inf.tree:
            size = len(inf.tree) + 1
            arms.append(ArmSpec(f"{name}_tree", f"tree {size}", EvalVerifier.tree,
                                {"tree": [list(c) for c in inf.tree]}, tree_size=size))
        return arms


@dataclass(frozen=True)
class SelfDraftDecoding(CausalDecoding):
    """The target's first layers, training-free: inference/proposers.py:self_draft checks num_layers where it builds one."""
    needs_folder: bool = False

    def assistant_model(self, cfg: DictConfig, target: nn.Module, path) -> nn.Module:
        return self_draft(target, cfg.drafter.num_layers)


@dataclass(frozen=True)
class DraftTraining(Training):
    def drafter(self, cfg, target, data=None, tokenizer=None):
        return DraftModelDrafter(cfg, target, data, tokenizer)


@dataclass(frozen=True)
class DraftPlanning(Planning):
    def module(self, cfg, target, config_of, training):
        """A draft model named by drafter.path, or narrowed, is built from its config (no weights); else the target's
        layers."""
        dr = cfg.drafter
        if dr.path or dr.hidden_size:  # built from its config: no weights, no calibration
            dconf = config_of(dr.path) if dr.path else target.config
            if dr.layers or not dr.path:  # cut to those of its layers
                dconf = cut_config(dconf, list(dr.layers) or list(range(dr.num_layers)))
            if dr.hidden_size:  # narrowed: the residual width only (train/narrow.py)
                dconf.head_dim = getattr(dconf, "head_dim", None) or dconf.hidden_size // dconf.num_attention_heads
                dconf.hidden_size, dconf.tie_word_embeddings = dr.hidden_size, False
            module = AutoModelForCausalLM.from_config(dconf).to(torch.float32)
            if dr.lora.r > 0:
                module = get_peft_model(module, LoraConfig(r=dr.lora.r, lora_alpha=dr.lora.alpha, task_type="CAUSAL_LM",
                                                           target_modules=list(dr.lora.target_modules)))
            return module, Shapes.of(dconf)
        t = Shapes.of(target.config)
        return training.drafter(cfg, target).module, Shapes(**{**t.__dict__, "layers": len(dr.layers) or dr.num_layers})

    def activations(self, act, m) -> None:
        memory.draft_model(act, m)

    def checks(self, cfg, T: Shapes, config_of):
        dr = cfg.drafter
        source = config_of(dr.path) if dr.path else None
        width = source.hidden_size if source is not None else T.hidden
        if dr.hidden_size and dr.hidden_size > width:
            return [(False, f"recipe key 'drafter.hidden_size': {dr.hidden_size} must be at most the width of the model "
                            f"it is narrowed from ({width})")]
        heads = source.num_attention_heads if source is not None else T.heads
        if dr.hidden_size and dr.hidden_size % heads:
            return [(False, f"recipe key 'drafter.hidden_size': {dr.hidden_size} must be a multiple of the draft's "
                            f"{heads} attention heads (e.g. {dr.hidden_size // heads * heads})")]
        if not dr.path:
            layers = list(dr.layers) or list(range(dr.num_layers))
            ok = 1 <= len(layers) <= T.layers and all(0 <= j < T.layers for j in layers)
            return [(ok, f"draft copies target layers {layers}" if ok else
                     f"recipe keys 'drafter.layers' / 'drafter.num_layers': the draft copies 1..{T.layers} of the "
                     f"target's layers 0..{T.layers - 1}, got {layers}")]
        D = Shapes.of(source)
        bad = [j for j in dr.layers if not 0 <= j < D.layers]
        if bad:
            return [(False, f"recipe key 'drafter.layers': {dr.path!r} has layers 0..{D.layers - 1}, got {bad[0]}")]
        ok = D.vocab == T.vocab and (not D.positions or cfg.train.max_length <= D.positions)
        return [(ok, f"draft vocabulary {D.vocab} = {T.vocab}, max_length within its {D.positions} positions" if ok else
                 f"recipe key 'drafter.path': {dr.path!r} has {D.vocab} tokens and {D.positions} positions; "
                 f"the target has {T.vocab} tokens and train.max_length is {cfg.train.max_length}")]


@dataclass(frozen=True)
class DraftConformance(Conformance):
    def reference_step(self, module, target, hidden_states, ids) -> dict:
        """Its logits on the prompt."""
        return {"ids": ids[0], "logits": module(ids).logits[0]}


def causal_lm(config: dict) -> bool:
    """Whether a config.json holds any *ForCausalLM."""
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    return any(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs)


DRAFT_MODEL = Kind(
    "draft_model", "a draft model", "Draft model",
    recognises=causal_lm,
    training=DraftTraining("draft", "smollm2-135m-draft.yaml"),
    decoding=CausalDecoding(),
    planning=DraftPlanning(bench_overrides=("train.micro_batch_size=2", "train.max_length=256")),
    export=Export(Family.hf, ("hf-draft",), card_tag="draft-model",
                  llamacpp=DraftLlamaCpp("draft-simple", converts="hf-draft", reads_layer_inputs=False)),
    conformance=DraftConformance({"draft": ["drafter.num_layers=2"]}))

SELF_DRAFT = Kind(
    "self_draft", "a self-draft", "Drafter",
    recognises=never,
    decoding=SelfDraftDecoding(),
    export=NoExport("a self-draft is the target's own first layers: there is nothing to export"))
