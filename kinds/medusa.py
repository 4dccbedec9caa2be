"""Medusa heads on the target's last hidden state (Medusa-1; Medusa-2 fine-tunes a LoRA copy of the backbone)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from omegaconf import DictConfig

from specdrafter.core.recipe import EvalVerifier, RecipeError
from specdrafter.inference.medusa import MedusaProposer, MedusaTreeProposer, serving_backbone
from specdrafter.inference.tree import tree_from_choices
from specdrafter.kinds.base import ArmSpec, Conformance, Decoding, Export, Family, Kind, Planning, Training
from specdrafter.models.medusa import check_heads_fit, load_medusa, medusa_layout
from specdrafter.train import memory
from specdrafter.train.drafters import MedusaDrafter
from specdrafter.train.memory import Shapes

DEFAULT_MEDUSA_TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]  # the bench's tree when the recipe has none


@dataclass(frozen=True)
class MedusaTraining(Training):
    def drafter(self, cfg, target, data=None, tokenizer=None):
        return MedusaDrafter(cfg, target, data, tokenizer)

    def check_recipe(self, cfg: DictConfig) -> None:
        if cfg.drafter.medusa.stage == 2 and cfg.drafter.lora.r == 0:
            raise RecipeError("recipe key 'drafter.medusa.stage': Medusa-2 fine-tunes the backbone through LoRA; set "
                              "drafter.lora.r > 0")


@dataclass(frozen=True)
class MedusaDecoding(Decoding):
    trees: Tuple[str, ...] = ("static",)
    typical: bool = True

    def proposer(self, cfg, target, path):
        heads = load_medusa(path, target.dtype).to(target.device)
        check_heads_fit(heads, target)
        if cfg.inference.tree:
            return MedusaTreeProposer(heads, target, tree_from_choices([list(c) for c in cfg.inference.tree], heads.num_heads))
        return MedusaProposer(heads, target)

    def serving_target(self, folder: Optional[Path], target):
        """Medusa-2 heads read the backbone fine-tuned with them (`backbone/` in their folder): it is what they serve."""
        return serving_backbone(folder, target) if folder is not None else target

    def bench_arms(self, cfg: DictConfig, name: str) -> List[ArmSpec]:
        """A static tree (the recipe's, or a default one): exact tree verification and typical acceptance."""
        choices = [list(x) for x in cfg.inference.tree] or DEFAULT_MEDUSA_TREE
        size = len(choices) + 1
        return [ArmSpec(f"{name}_tree", f"tree {size}", EvalVerifier.tree, {"tree": choices}, tree_size=size),
                ArmSpec(f"{name}_typical", f"tree {size}", EvalVerifier.typical, {"tree": choices}, tree_size=size)]


@dataclass(frozen=True)
class MedusaPlanning(Planning):
    def module(self, cfg, target, config_of, training):
        drafter = training.drafter(cfg, target)
        return drafter.module, Shapes.of(target.config) if cfg.drafter.medusa.stage == 2 else None

    def activations(self, act, m) -> None:
        memory.medusa(act, m)


@dataclass(frozen=True)
class MedusaConformance(Conformance):
    def reference_step(self, module, target, hidden_states, ids) -> dict:
        """Every position: Medusa reads the target's final-normed last hidden state."""
        h = target.model.norm(hidden_states[-1])[0]
        return {"hidden": h, "logits": torch.stack([lm(b(h)) for b, lm in zip(module.blocks, module.lm_heads)])}


MEDUSA = Kind(
    "medusa", "Medusa heads", "Medusa heads",
    recognises=lambda config: medusa_layout(config) is not None,
    training=MedusaTraining("medusa", "smollm2-135m-medusa.yaml"),
    decoding=MedusaDecoding(),
    planning=MedusaPlanning(bench_overrides=("train.micro_batch_size=1", "train.max_length=256")),
    export=Export(Family.medusa, ("medusa-vllm", "medusa"), card_tag="medusa"),
    conformance=MedusaConformance({"medusa": ["drafter.num_layers=1", "drafter.medusa.num_heads=5"]}))
