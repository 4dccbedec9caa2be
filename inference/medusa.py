"""Medusa heads (docs/algorithms.md §Medusa), the proposers that draft with them, and the typical-acceptance loop.

Offsets. The heads read the target's last hidden state *after* the final norm (the input to its lm_head),
h_t at position t. The target's lm_head on h_t predicts x_{t+1}; Medusa head i (0-based) predicts x_{t+i+2}.
In the speculative loops the target cache holds every committed token but the newest, and target features
arrive for exactly those positions, so with n committed tokens the newest feature is at position n - 2: its
lm_head prediction is committed[-1] (already known) and head i drafts the token at position n + i, i.e.
draft token i + 1. A chain of k tokens uses heads 0..k-1; a tree node at depth d is a token of head d - 1.

Checkpoints use vLLM's Medusa layout (docs/formats.md §Medusa): config.json with `architectures: ["MedusaModel"]`,
`model_type: "medusa"`, `num_heads`, `num_hidden_layers` (ResBlocks per head), `hidden_size`, `vocab_size`,
`medusa_fc_bias`; weights `blocks.{i}.layers.{j}.weight/.bias` and `lm_heads.{i}.weight`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from data.features import capture_features
from data.io import SpecdrafterError, read_safetensors, save_config_and_weights
from inference.generate import CycleStats, GenerationResult, _commit, _observe, _prefill, compact_cache, tree_pass
from inference.proposers import Proposal
from inference.sampling import SamplingParams, sample, sampling_probs
from inference.tree import TreeShape
from inference.verify import verify_typical


class MedusaConfig(PretrainedConfig):
    """The fields vLLM's MedusaConfig reads. `medusa_fc_bias` defaults to False as in vLLM, which silently
    drops ResBlock biases unless the config says they exist, so `medusa_config` always writes it."""
    model_type = "medusa"

    def __init__(self, num_heads: int = 5, num_hidden_layers: int = 1, hidden_size: int = 4096,
                 vocab_size: int = 32000, medusa_fc_bias: bool = False, **kwargs):
        kwargs.setdefault("architectures", ["MedusaModel"])
        self.num_heads, self.num_hidden_layers = num_heads, num_hidden_layers
        self.hidden_size, self.vocab_size, self.medusa_fc_bias = hidden_size, vocab_size, medusa_fc_bias
        super().__init__(**kwargs)


def medusa_config(target_config, num_heads: int, num_layers: int = 1,
                  base_model_name_or_path: str | None = None) -> MedusaConfig:
    """`num_heads` heads of `num_layers` ResBlocks each, sized for the target. Pass a hub name (never a local
    path) as `base_model_name_or_path`: it is written into the exported config."""
    if num_heads < 1 or num_layers < 0:
        raise SpecdrafterError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
    extra = {"base_model_name_or_path": base_model_name_or_path} if base_model_name_or_path else {}
    return MedusaConfig(num_heads=num_heads, num_hidden_layers=num_layers, hidden_size=target_config.hidden_size,
                        vocab_size=target_config.vocab_size, medusa_fc_bias=True, **extra)


class ResidualBlock(nn.Module):
    """x ← x + SiLU(W x + b), `num_layers` times."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))  # [..., d]
        return x


class MedusaHeads(nn.Module):
    """H heads; head i maps the normed last hidden state h_t to logits for x_{t+i+2}."""

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        d, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(d, config.num_hidden_layers, config.medusa_fc_bias)
                                    for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(d, V, bias=False) for _ in range(config.num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] (after the target's final norm) → logits [H, ..., V]."""
        return torch.stack([head(block(hidden)) for block, head in zip(self.blocks, self.lm_heads)])


@torch.no_grad()
def init_from_target(heads: MedusaHeads, target) -> MedusaHeads:
    """Training start (Medusa): zero ResBlocks, so every head begins as a copy of the target's lm_head."""
    check_heads_fit(heads, target)
    for block in heads.blocks:
        for layer in block.layers:
            layer.weight.zero_()
            if layer.bias is not None:
                layer.bias.zero_()
    for head in heads.lm_heads:
        head.weight.copy_(target.get_output_embeddings().weight)
    return heads


def check_heads_fit(heads: MedusaHeads, target) -> None:
    t, c = target.config, heads.config
    if c.vocab_size != t.vocab_size:
        raise SpecdrafterError(f"Medusa heads' vocabulary ({c.vocab_size} tokens) differs from the target's ({t.vocab_size} tokens)")
    if c.hidden_size != t.hidden_size:
        raise SpecdrafterError(f"Medusa heads read hidden size {c.hidden_size}, the target has {t.hidden_size}")


def save_medusa(heads: MedusaHeads, folder: str | Path) -> Path:
    """Write config.json + model.safetensors atomically (a temp folder renamed into place)."""
    return save_config_and_weights(heads, folder)


def load_medusa(folder: str | Path, dtype: torch.dtype = torch.float32) -> MedusaHeads:
    folder = Path(folder)
    try:
        raw = json.loads((folder / "config.json").read_text())
        weights = read_safetensors(folder / "model.safetensors")
    except (OSError, ValueError) as e:
        raise SpecdrafterError(f"could not load the Medusa heads in {str(folder)!r}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise SpecdrafterError(f"{str(folder / 'config.json')!r} holds a JSON {type(raw).__name__}, not an object")
    if raw.get("model_type") != "medusa" and "MedusaModel" not in (raw.get("architectures") or []):
        raise SpecdrafterError(f"{str(folder)!r} is not a Medusa checkpoint (model_type: {raw.get('model_type')!r})")
    heads = MedusaHeads(MedusaConfig.from_dict(raw))
    try:
        heads.load_state_dict(weights)
    except RuntimeError as e:
        raise SpecdrafterError(f"Medusa weights in {str(folder)!r} do not match its config.json: "
                               f"{' '.join(str(e).split())[:300]}") from None
    return heads.to(dtype).eval()


class MedusaProposer:
    """Chain drafting: draft token i + 1 is head i's choice at the newest observed target feature (position
    n - 2, see the module docstring). Stateless between cycles: `observe` replaces the feature, so `rollback`
    has nothing to undo."""

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
        return self.heads(self.feature)

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
    `verify_tree_sampling(mode="topk")`; `typical_generate` verifies the same tree with typical acceptance."""

    def __init__(self, heads: MedusaHeads, target, shape: TreeShape):
        super().__init__(heads, target)
        depth, width = max(shape.depths), 1 + max(c[-1] for c in shape.choices[1:])
        if depth > heads.num_heads:
            raise SpecdrafterError(f"tree of depth {depth} needs {depth} Medusa heads but only {heads.num_heads} exist")
        if width > heads.config.vocab_size:
            raise SpecdrafterError(f"tree rank {width - 1} exceeds the vocabulary of {heads.config.vocab_size} tokens")
        self.shape, self.width, self.max_tree_size = shape, width, shape.size

    @torch.no_grad()
    def propose_tree(self, committed: list[int]) -> tuple[TreeShape, torch.Tensor]:
        """The tree's shape and node tokens [N+1] (node 0 = the newest committed token)."""
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


@torch.no_grad()
def typical_generate(target: nn.Module, proposer: MedusaTreeProposer, prompt_ids: Sequence[int], max_new_tokens: int,
                     temperature: float, eps: float = 0.09, delta: float = 0.3, eos_token_ids: Sequence[int] = (),
                     generator: torch.Generator | None = None) -> GenerationResult:
    """Medusa's typical-acceptance decoding (lossy, docs/algorithms.md §Medusa): one tree pass per cycle, the longest
    typical prefix among the leaf paths (ties: highest Σ log p), then a token sampled from the next row.
    At temperature 0 a token is typical iff it is the argmax, so the output equals greedy decoding."""
    if temperature < 0:
        raise SpecdrafterError(f"temperature must be >= 0, got {temperature}")
    paths = proposer.shape.leaf_paths()  # a static tree: the same candidate paths every cycle
    with capture_features(target, proposer.feature_layers) as features:
        committed, cache = _prefill(target, prompt_ids, max_new_tokens + proposer.max_tree_size)
        proposer.reset()
        _observe(proposer, features, slice(None))
        result, eos, done = GenerationResult([]), set(eos_token_ids), False
        while not done:
            t0 = time.perf_counter()
            shape, tokens = proposer.propose_tree(committed)  # tokens: [N+1]
            t1 = time.perf_counter()
            past = len(committed) - 1
            logits = tree_pass(target, cache, shape, tokens, past)  # [N+1, V]
            tv = time.perf_counter()
            candidates, path_logits = typical_inputs(paths, tokens, logits)  # [P, D], [P, D+1, V+1]
            verdict = verify_typical(candidates, path_logits, temperature, eps, delta, generator)
            t2 = time.perf_counter()
            accepted = paths[verdict.accepted_nodes[0]][:verdict.num_accepted]  # tree nodes
            keep = [0] + accepted  # tree slots to keep: the root and the accepted prefix of the chosen path
            compact_cache(cache, [past + j for j in keep], past)
            cache.crop(-(shape.size - len(keep)))  # rollback: drop the rejected nodes
            new = [int(tokens[j]) for j in accepted] + [verdict.next_token]
            proposer.rollback(len(committed) + len(new))
            _observe(proposer, features, keep)  # target features of the root and the accepted path
            result.cycles.append(CycleStats(max(shape.depths), verdict.num_accepted, t1 - t0, t2 - t1, t2 - tv,
                                            size=shape.size))
            done = _commit(new, committed, result, eos, max_new_tokens)
    return result
