"""The proposers that draft with Medusa heads (models/medusa.py, offsets explained there) and the typical-acceptance loop."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import TypicalConfig
from specdrafter.inference.decode import GenerationResult, TreeAcceptance, tree_speculative_generate
from specdrafter.inference.proposers import Proposal, check_vocabularies
from specdrafter.inference.sampling import SamplingParams, sample, sampling_probs
from specdrafter.inference.tree import TreeShape
from specdrafter.inference.verify import verify_typical
from specdrafter.models.medusa import MedusaHeads, check_heads_fit

log = logging.getLogger("specdrafter")


def serving_backbone(drafter_folder: Path, target):
    """The target, or the Medusa-2 backbone saved in `drafter_folder/backbone` (on the target's device and dtype)."""
    folder = Path(drafter_folder) / "backbone"
    if not folder.is_dir():
        return target
    try:
        backbone = AutoModelForCausalLM.from_pretrained(folder, dtype=target.dtype).to(target.device).eval()
    except (OSError, ValueError) as e:
        raise SpecdrafterError(f"could not load the Medusa-2 backbone {str(folder)!r}: {str(e).splitlines()[0]}") from None
    check_vocabularies(target, backbone)
    log.info(f"Medusa-2: serving the backbone fine-tuned with the heads ({folder}) in place of the target")
    return backbone


class MedusaProposer:
    """Chain drafting: draft token i + 1 is head i's choice at the newest observed target feature (position
    n - 2, see the module docstring). Stateless between cycles: `observe` replaces the feature, so `rollback`
    has nothing to undo."""

    confidence_length = None  # drafts the k it is asked for

    def __init__(self, heads: MedusaHeads, target):
        check_heads_fit(heads, target)
        self.heads = heads.eval()
        self.norm = target.model.norm  # heads read the normed state, as the target's own lm_head does
        self.feature_layers = [target.config.num_hidden_layers]  # id L: the last layer's output, pre-norm
        self.reset()

    def reset(self) -> None:
        self.feature: torch.Tensor | None = None  # [d] normed h at the newest position with a known successor

    @torch.no_grad()
    def observe(self, features: dict[int, torch.Tensor]) -> None:
        """Features {L: [n, d]} of newly committed positions; only the last row matters to Medusa."""
        last = features[self.feature_layers[0]][-1]  # [d]
        self.feature = self.norm(last).to(self.heads.lm_heads[0].weight.dtype)

    @torch.no_grad()
    def head_logits(self) -> torch.Tensor:
        """[H, V]: row i scores the token i + 1 places after the newest committed one."""
        if self.feature is None:
            raise SpecdrafterError("Medusa drafting needs target features of at least one position (a prompt of >= 2 tokens)")
        return self.heads(self.feature).cpu()

    @torch.no_grad()
    def propose(self, committed: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        if k > self.heads.num_heads:
            raise SpecdrafterError(f"block length k = {k} needs {k} Medusa heads but only {self.heads.num_heads} exist")
        logits = self.head_logits()[:k]  # [k, V]; heads are independent given the feature
        if params.greedy:
            return Proposal(logits.argmax(-1), None)
        q = sampling_probs(logits, params)  # [k, V]
        return Proposal(torch.tensor([sample(row, generator) for row in q]), q)  # each token drawn from its q row

    def rollback(self, num_committed: int) -> None:
        pass  # nothing drafted is cached; the next observe brings the feature of the new newest position


class MedusaTreeProposer(MedusaProposer):
    """Static Medusa tree: the node with choice path (c_1, ..., c_d) holds the c_d-th most likely token of head
    d - 1 (whatever its parent). Children are deterministic top-k choices, so T > 0 is exact with
    `verify_tree_sampling`; `typical_generate` verifies the same tree with typical acceptance."""

    def __init__(self, heads: MedusaHeads, target, shape: TreeShape):
        super().__init__(heads, target)
        depth, width = max(shape.depths), 1 + max(c[-1] for c in shape.choices[1:])
        if depth > heads.num_heads:
            raise SpecdrafterError(f"tree of depth {depth} needs {depth} Medusa heads but only {heads.num_heads} exist")
        if width > heads.config.vocab_size:
            raise SpecdrafterError(f"tree rank {width - 1} exceeds the vocabulary of {heads.config.vocab_size} tokens")
        self.shape, self.width, self.max_tree_size = shape, width, shape.size

    @torch.no_grad()
    def propose_tree(self, committed: list[int], sizer=None) -> tuple[TreeShape, torch.Tensor]:
        """The tree's shape and node tokens [N+1] (node 0 = the newest committed token); a static tree is verified
        whole, whatever `sizer`."""
        ranked = self.head_logits().topk(self.width, dim=-1).indices  # [H, width] each head's best tokens first
        tokens = [committed[-1]] + [int(ranked[len(c) - 1, c[-1]]) for c in self.shape.choices[1:]]
        return self.shape, torch.tensor(tokens)


def typical_inputs(paths: list[list[int]], tokens: torch.Tensor,
                   logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_typical`'s inputs from one tree pass: the leaf `paths` (tree nodes, root excluded) as candidate
    tokens [P, D] and their target rows [P, D+1, V+1] (row i scores candidate i; node tokens [N+1], logits
    [N+1, V]). Shorter paths are padded with an extra token id V whose logit is -inf in every row, so padding is
    never accepted and sampling over the real V tokens is unchanged."""
    D, V = max(len(p) for p in paths), logits.shape[-1]
    nodes = torch.tensor([[0] + p + [-1] * (D - len(p)) for p in paths])  # [P, D+1] node per row, -1 = pad
    pad = nodes[:, 1:] < 0  # [P, D]
    candidates = tokens[nodes[:, 1:].clamp_min(0)].masked_fill(pad, V)  # [P, D]
    extended = torch.cat([logits, logits.new_full((logits.shape[0], 1), float("-inf"))], dim=-1)  # [N+1, V+1]
    return candidates, extended[nodes.clamp_min(0)]  # [P, D], [P, D+1, V+1]; rows past a leaf are never a bonus row


def typical_acceptance(paths: list[list[int]], temperature: float, eps: float, delta: float,
                       generator: torch.Generator | None = None) -> TreeAcceptance:
    """Medusa's typical acceptance as the tree loop's acceptance rule: the longest typical prefix among the static
    tree's leaf `paths` (ties: highest Σ log p), then a token sampled from the next row."""
    def accept(shape: TreeShape, tokens: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
        candidates, path_logits = typical_inputs(paths, tokens, logits)  # [P, D], [P, D+1, V+1]
        verdict = verify_typical(candidates, path_logits, temperature, eps, delta, generator)
        return paths[verdict.accepted_nodes[0]][:verdict.num_accepted], verdict.next_token
    return accept


def typical_generate(target: nn.Module, proposer: MedusaTreeProposer, prompt_ids: Sequence[int], max_new_tokens: int,
                     temperature: float, eps: float = TypicalConfig.eps, delta: float = TypicalConfig.delta,
                     eos_token_ids: Sequence[int] = (),
                     generator: torch.Generator | None = None) -> GenerationResult:
    """Medusa's typical-acceptance decoding (lossy, docs/algorithms.md §Medusa): the tree loop with
    `typical_acceptance` in place of exact verification. At temperature 0 a token is typical iff it is the argmax,
    so the output equals greedy decoding."""
    if temperature < 0:
        raise SpecdrafterError(f"temperature must be >= 0, got {temperature}")
    accept = typical_acceptance(proposer.shape.leaf_paths(), temperature, eps, delta, generator)
    return tree_speculative_generate(target, proposer, prompt_ids, max_new_tokens, eos_token_ids=eos_token_ids,
                                     accept=accept)
