"""P-EAGLE (train/peagle.py): an EAGLE-3 head that drafts K tokens in one pass, trained with COD subsampling. It is
an EAGLE-3 folder to the engines (vLLM serves it with `parallel_drafting: true`), so it trains with the EAGLE family
(launch/train_eagle.py), reads drafter.eagle for the head and drafter.peagle for its depths, and exports through the
EAGLE-3 writer in vLLM's layout only."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Tuple

from omegaconf import DictConfig, OmegaConf

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import EvalVerifier
from specdrafter.inference.peagle import PEagleProposer
from specdrafter.kinds.base import ArmSpec, Export, Family, Kind
from specdrafter.kinds.eagle import Eagle3Planning, Eagle3Training, EagleDecoding
from specdrafter.train import memory
from specdrafter.train.memory import Shapes
from specdrafter.train.peagle import PEagleDrafter, is_peagle, load_peagle


@dataclass(frozen=True)
class PEagleTraining(Eagle3Training):
    def drafter(self, cfg, target, data=None, tokenizer=None):
        return PEagleDrafter(cfg, target, data, tokenizer)


@dataclass(frozen=True, kw_only=True)
class PEagleDecoding(EagleDecoding):
    """A chain only: one pass gives each depth's row of the committed context, not a tree's branches."""
    trees: Tuple[str, ...] = ()

    def proposer(self, cfg, target, path):
        head = self.load(path, target.dtype).to(target.device)
        k = cfg.inference.k
        if k != "auto" and k > head.num_depths:
            raise SpecdrafterError(f"recipe key 'inference.k' ({k}) exceeds the {head.num_depths} tokens the P-EAGLE "
                                   f"head in {str(path)!r} drafts in one pass (trained with drafter.peagle.depths="
                                   f"{head.num_depths}): set inference.k <= {head.num_depths} or auto")
        return PEagleProposer(head, target)

    def bench_arms(self, cfg: DictConfig, name: str) -> List[ArmSpec]:
        inf, k = cfg.inference, cfg.inference.k
        return [ArmSpec(f"{name}_chain", f"k={k}", EvalVerifier.chain, k=k),
                ArmSpec(f"{name}_asd", f"k={k} B={inf.asd.budget:g}", EvalVerifier.asd, k=k)]


def cod_share(cfg: DictConfig) -> float:
    """Elements of the flat COD sequence per position: 1 + Σ_j max(r^j, r_min) over depths 1 … K − 1."""
    p = cfg.drafter.peagle
    return 1 + sum(max(p.cod_ratio ** j, p.cod_ratio_min) for j in range(1, p.depths))


@dataclass(frozen=True)
class PEaglePlanning(Eagle3Planning):
    def activations(self, act, m) -> None:
        """Sized as an EAGLE-3 head unrolled over ceil(share) steps: the flat sequence holds share · T elements, each
        with a TTT step's saved tensors, and its attention scores lie within the unrolled steps' (an estimate)."""
        cfg = OmegaConf.merge(m.cfg, {"drafter": {"eagle": {"ttt_steps": math.ceil(cod_share(m.cfg))}}})
        memory.eagle3(act, dataclasses.replace(m, cfg=cfg))

    def checks(self, cfg, T: Shapes, config_of):
        p = cfg.drafter.peagle
        last = cfg.train.max_length + p.depths - 1  # depth j of the last position sits at rotary position t + j
        return super().checks(cfg, T, config_of)[:3] + [
            (p.mask_token_id < T.vocab, f"recipe key 'drafter.peagle.mask_token_id' ({p.mask_token_id}) is outside the "
                                        f"target's embedding of {T.vocab} rows" if p.mask_token_id >= T.vocab else
             f"mask token {p.mask_token_id} within the target's {T.vocab} rows"),
            (not T.positions or last <= T.positions,
             f"recipe keys 'train.max_length' ({cfg.train.max_length}) and 'drafter.peagle.depths' ({p.depths}) reach "
             f"position {last}, beyond the head's max_position_embeddings ({T.positions})"
             if T.positions and last > T.positions else
             f"P-EAGLE positions up to {last} within the head's {T.positions or 'unbounded'}")]

    def activation_label(self, cfg: DictConfig) -> str:
        return f", {cfg.drafter.peagle.depths} depths (COD: {cod_share(cfg):.2f} elements per position)"


PEAGLE = Kind(
    "peagle", "a P-EAGLE head", "P-EAGLE draft head",
    recognises=is_peagle,
    training=PEagleTraining("eagle", "smollm2-135m-peagle.yaml"),
    decoding=PEagleDecoding(load=load_peagle),
    planning=PEaglePlanning({"activations": "drafter.peagle.cod_ratio",
                             "teacher logits": "drafter.eagle.draft_vocab_size"}),
    # vLLM >= 0.16 (#32887) serves it as an EAGLE-3 head with parallel_drafting; SGLang 0.5.23 and speculators'
    # loader have no P-EAGLE we could check, and llama.cpp 11434 no parallel EAGLE-3 graph
    export=Export(Family.eagle, ("vllm",), card_tag="peagle"))
