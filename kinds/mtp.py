"""A target's own MTP / NextN layer (train/mtp.py) as the drafter: fine-tuned against the frozen target, decoded as a
chain (inference/mtp.py), saved under the target's own tensor names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from omegaconf import DictConfig

from specdrafter.core.recipe import EvalVerifier, RecipeError
from specdrafter.inference.mtp import MtpProposer
from specdrafter.kinds.base import ArmSpec, Decoding, Kind, NoExport, Planning, Training
from specdrafter.train import memory
from specdrafter.train.memory import Shapes
from specdrafter.train.mtp import MtpDrafter, load_mtp, recognises, target_folder


@dataclass(frozen=True)
class MtpTraining(Training):
    def drafter(self, cfg, target, data=None, tokenizer=None):
        return MtpDrafter(cfg, target, data, tokenizer)


@dataclass(frozen=True)
class MtpDecoding(Decoding):
    """A chain only: the layer's fed-back state makes a tree a chain per branch, which nothing here drafts yet."""
    trees: tuple = ()
    needs_folder: bool = False  # without drafter.path: the target's own MTP layer, as it shipped

    def proposer(self, cfg, target, path):
        return MtpProposer(load_mtp(path or target_folder(cfg.target.model), target), target)

    def bench_arms(self, cfg: DictConfig, name: str) -> List[ArmSpec]:
        k = cfg.inference.k
        return [ArmSpec(f"{name}_chain", f"k={k}", EvalVerifier.chain, k=k),
                ArmSpec(f"{name}_asd", f"k={k} B={cfg.inference.asd.budget:g}", EvalVerifier.asd, k=k)]

    def check_recipe(self, cfg: DictConfig, description: str) -> None:
        if cfg.drafter.mtp.steps > cfg.train.max_length - 2:
            raise RecipeError(f"recipe key 'drafter.mtp.steps' ({cfg.drafter.mtp.steps}): a sequence of "
                              f"train.max_length {cfg.train.max_length} has no token to predict at that step")


@dataclass(frozen=True)
class MtpPlanning(Planning):
    def activations(self, act, m) -> None:
        """Per chained step: one decoder layer of the target's width and its full-vocabulary prediction."""
        memory.full_vocab_teacher(act, m)
        one_layer = Shapes(**{**m.T.__dict__, "layers": 1})
        for _ in range(m.cfg.drafter.mtp.steps):
            memory.causal_lm(act, m, one_layer)
            memory.prediction(act, m, m.T.vocab)

    def activation_label(self, cfg: DictConfig) -> str:
        return f", {cfg.drafter.mtp.steps} chained MTP steps"


MTP = Kind(
    "mtp", "a target's own MTP layer", "MTP layer (fine-tuned)",
    recognises=recognises,
    training=MtpTraining("eagle"),  # launch/train_eagle.py: an EAGLE-style head on the target's state
    decoding=MtpDecoding(),
    planning=MtpPlanning({"activations": "drafter.mtp.steps"}),
    export=NoExport("the drafter folder is already the target's own layout (mtp.safetensors: the target's tensor "
                    "names); copy it into the target's folder and list its tensors in model.safetensors.index.json"))
