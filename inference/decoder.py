"""One decoder per stream of requests, chosen once from a recipe's inference section: the loop (chain or tree), the
acceptance rule (exact, ASD, Medusa's typical acceptance), the loop's options and the tuners. The decode CLI, the
eval job, the decode benchmark and training's decode check all build theirs with `build_decoder`.

The three tuners, one name each (inference/autotune.py):
    block_length       BlockLengthTuner   the chain's k every cycle (inference.k = auto); the decoder's own
    confidence_length  ConfidenceLength   how many of a block drafter's drafts to verify (the proposer's)
    tree_size          TreeSizeTuner      how much of each dynamic tree to verify (dynamic_tree.auto_size); the
                                          decoder's own, handed to the tree loop with each request
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence

import torch
from omegaconf import DictConfig
from torch import nn

from specdrafter.core.recipe import ASDConfig, TypicalConfig
from specdrafter.core.recipe_checks import is_tree
from specdrafter.inference.autotune import BlockLengthTuner, PassCosts, TreeSizeTuner
from specdrafter.inference.decode import GenerationResult, speculative_generate, tree_speculative_generate
from specdrafter.inference.medusa import typical_generate
from specdrafter.inference.proposers import Proposer
from specdrafter.inference.sampling import SamplingParams


@dataclass
class Decoder:
    """`decoder(prompt, generator)` decodes one request: prompt ids → the new tokens and per-cycle statistics."""
    target: nn.Module  # the model that verifies (a Medusa-2 folder's backbone, else the target)
    proposer: Proposer  # a TreeProposer when `tree`
    eos: Sequence[int]
    max_new_tokens: int
    params: SamplingParams
    tree: bool  # the tree loop over the proposer's static or dynamic tree; else the chain
    k: int  # the chain's block length when block_length is None
    block_length: Optional[BlockLengthTuner] = None
    tree_size: Optional[TreeSizeTuner] = None
    asd: Optional[ASDConfig] = None  # approximate greedy verification of the chain (T = 0)
    typical: Optional[TypicalConfig] = None  # Medusa's typical acceptance over the static tree (lossy at T > 0)
    record_tv: bool = False  # the chain records D_TV(p, q) at every position tried (an audit; costs time)

    @property
    def tuners(self) -> List:
        """Every tuner this decoder's requests use: each needs the target's pass costs before it can choose."""
        mine = [self.block_length] if not self.tree else [self.tree_size]
        return [t for t in (*mine, self.proposer.confidence_length) if t is not None]

    def calibrate(self, prompt: Sequence[int]) -> None:
        """Measure the target's pass costs for the tuners on `prompt` now, so that no request's time includes it (a
        tuner would otherwise calibrate within the first request)."""
        for tuner in self.tuners:
            if not tuner.calibrated:
                tuner.calibrate(self.target, prompt)

    def at(self, temperature: float) -> "Decoder":
        """The same decoder at another temperature: the chain's tuners carry over (they learn the drafter's cost and
        acceptance per position); a tree gets a fresh size tuner, its acceptance per draft probability differs with T."""
        fresh = None if self.tree_size is None else TreeSizeTuner(self.tree_size.max_nodes, step_costs=self.tree_size.costs)
        return replace(self, params=replace(self.params, temperature=temperature), tree_size=fresh)

    def __call__(self, prompt: Sequence[int], generator: Optional[torch.Generator] = None) -> GenerationResult:
        if self.tree:
            if self.typical is not None:
                return typical_generate(self.target, self.proposer, prompt, self.max_new_tokens, self.params.temperature,
                                        self.typical.eps, self.typical.delta, self.eos, generator)
            return tree_speculative_generate(self.target, self.proposer, prompt, self.max_new_tokens, self.params,
                                             self.eos, generator, sizer=self.tree_size)
        return speculative_generate(self.target, self.proposer, prompt, self.max_new_tokens, self.params, self.k,
                                    self.eos, self.asd, generator, self.record_tv, tuner=self.block_length)


def build_decoder(inference: DictConfig, target: nn.Module, proposer: Proposer, eos: Sequence[int],
                  costs: Optional[PassCosts] = None, record_tv: bool = False) -> Decoder:
    """The decoder a recipe's `inference` section asks for, around a proposer built for it (kinds/: proposer): a tree
    when inference.tree or inference.dynamic_tree is set, typical acceptance or ASD by inference.verifier, k = auto
    tuned every cycle, an auto-sized dynamic tree. `costs` (the target's pass costs, measured by the job) spares the
    decoder's own tuners their calibration; `record_tv` audits α = 1 − D_TV on the exact chain."""
    verifier = inference.verifier.value
    tree = is_tree(inference)
    dyn = inference.dynamic_tree
    auto = inference.k == "auto" and not tree
    return Decoder(
        target, proposer, list(eos), inference.max_new_tokens,
        SamplingParams(inference.temperature, inference.top_k, inference.top_p), tree,
        k=0 if auto or tree else inference.k,
        block_length=BlockLengthTuner(inference.k_max, step_costs=costs) if auto else None,
        tree_size=TreeSizeTuner(dyn.total_tokens, step_costs=costs) if tree and dyn.total_tokens and dyn.auto_size else None,
        asd=ASDConfig(**inference.asd) if verifier == "asd" else None,
        typical=TypicalConfig(**inference.typical) if verifier == "typical" else None,
        record_tv=record_tv and verifier == "exact" and not tree)
