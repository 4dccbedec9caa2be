"""The speculative generation loop (batch size 1): draft → verify → commit → roll back both caches.

Target cache invariant: it holds every committed token except the newest one. Each cycle feeds
[newest_committed, d_1, ..., d_k] so row i-1 scores d_i and row k is the bonus row (docs/algorithms.md §Conventions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from transformers import DynamicCache

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import ASDConfig
from specdrafter.inference.autotune import BlockLengthTuner
from specdrafter.inference.proposers import Proposer, TreeProposer, device_of
from specdrafter.inference.sampling import SamplingParams, sampling_probs
from specdrafter.inference.tree import TreeShape, tree_allowed, tree_positions
from specdrafter.inference.verify import (
    RegretLedger,
    Verdict,
    verify_asd,
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)
from specdrafter.models.features import capture_features
from specdrafter.models.targets import check_tree_target, new_cache, rollback, snapshot, tree_masks


class ContextOverflow(SpecdrafterError):
    """The prompt leaves the target's context too little room for max_new_tokens and one draft block or tree."""


@dataclass
class CycleStats:
    drafted: int  # k
    accepted: int  # draft tokens accepted (the bonus/correction token not counted)
    draft_s: float
    verify_s: float  # target forward + verifier
    verifier_s: float = 0.0  # the verifier alone (the acceptance rule, after the target's logits exist)
    tv: Optional[List[float]] = None  # D_TV(p_i, q_i) at each draft position tried (record_tv=True only)
    tv_s: float = 0.0  # time spent recording tv (not part of decoding: subtract it from a timing)
    size: int = 0  # tokens in the target pass (k + 1 for a chain; the tree's nodes incl. the root for a tree)


@dataclass
class GenerationResult:
    tokens: List[int]  # new tokens only
    cycles: List[CycleStats] = field(default_factory=list)
    asd_regret: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target pass (bonus included)."""
        return len(self.tokens) / max(len(self.cycles), 1)

    @property
    def alpha(self) -> float:
        """α: accepted drafts / draft positions tried (a cycle tries its accepted ones plus the first rejected)."""
        return alpha_per_token(self.cycles)


def positions_tried(cycles: List[CycleStats]) -> int:
    """Draft positions the verifier tried: each cycle its accepted drafts plus the first rejected one (all k when the
    whole block passed). The drafts after the first rejection were never tried."""
    return sum(min(c.accepted + 1, c.drafted) for c in cycles)


def acceptance_rate(accepted: int, tried: int) -> float:
    """α = accepted drafts / draft positions tried: the one definition every report uses (the eval job, both decode
    CLIs, training's decode check, decode.jsonl's readers). Not accepted / drafted: counting the drafts that were
    never tried would make α fall with k for the same drafter."""
    return accepted / max(tried, 1)


def alpha_per_token(cycles: List[CycleStats]) -> float:
    """α over any cycles (`acceptance_rate` of their accepted drafts and `positions_tried`)."""
    return acceptance_rate(sum(c.accepted for c in cycles), positions_tried(cycles))


@torch.no_grad()
def speculative_generate(target: nn.Module, proposer: Proposer, prompt_ids: Sequence[int], max_new_tokens: int,
                         params: SamplingParams = SamplingParams(0.0), k: Union[int, BlockLengthTuner] = 4,
                         eos_token_ids: Sequence[int] = (), asd: Optional[ASDConfig] = None,
                         generator: Optional[torch.Generator] = None, record_tv: bool = False) -> GenerationResult:
    """Decode up to `max_new_tokens` after `prompt_ids`, drafting k tokens per cycle with `proposer`.

    Greedy (params.temperature == 0) uses `verify_greedy` (or `verify_asd` when `asd` is given); otherwise
    exact speculative sampling, so the output is distributed exactly as the target's own sampling.
    `record_tv` stores D_TV(p, q) of every position the verifier tried (an audit of α = 1 − D_TV; costs time).
    `k` may be a `BlockLengthTuner` (inference/autotune.py): it then picks the block length of every cycle from the
    cycles before it (calibrating the target's v(n) on this prompt the first time) and learns from each one.
    """
    check_request(target, prompt_ids, max_new_tokens)
    tuner = k if isinstance(k, BlockLengthTuner) else None
    if tuner is None and k < 1:
        raise SpecdrafterError(f"block length k must be >= 1, got {k}")
    for model in (tuner, proposer.confidence_length):  # v(n) for k = auto, a block drafter's length
        if model is not None and not model.calibrated:
            model.calibrate(target, prompt_ids)
    if asd is not None and not params.greedy:
        raise SpecdrafterError("ASD is defined for greedy decoding only (temperature 0)")
    taps = proposer.feature_layers  # EAGLE / Medusa read target features; draft models do not
    with capture_features(target, taps) as features:
        return _chain_loop(target, proposer, prompt_ids, max_new_tokens, params, k, eos_token_ids, asd, generator,
                           features if taps else None, record_tv and asd is None)


def _chain_loop(target, proposer, prompt_ids, max_new_tokens, params, block, eos_token_ids, asd, generator,
                features, record_tv=False) -> GenerationResult:
    tuner = block if isinstance(block, BlockLengthTuner) else None
    committed, cache = _prefill(target, prompt_ids, max_new_tokens + (tuner.max_k if tuner else block))
    proposer.reset()
    _observe(proposer, features, slice(None))
    ledger = RegretLedger(asd.budget) if asd else None
    result = GenerationResult([])
    eos = set(eos_token_ids)
    done = False
    while not done:
        k = tuner.choose() if tuner else block  # from past cycles only: exactness holds for any k
        t0 = time.perf_counter()
        proposal = proposer.propose(committed, k, params, generator)
        t1 = time.perf_counter()
        k = len(proposal.tokens)  # a proposer may draft fewer (a block drafter's confidence-sized length)
        ids = torch.tensor([[committed[-1]] + proposal.tokens.tolist()], device=device_of(target))  # [1, k+1]
        saved = snapshot(cache)  # a recurrent layer's state before the pass (None for attention-only targets)
        logits = target(input_ids=ids, cache=cache, use_cache=True).logits[0].cpu()  # [k+1, V], verified on the CPU
        t_logits = time.perf_counter()
        verdict = _verify(proposal, logits, params, ledger, asd, generator,
                          room=max_new_tokens - len(result.tokens), eos=eos)
        t2 = time.perf_counter()
        new = proposal.tokens[:verdict.num_accepted].tolist() + [verdict.next_token]
        rollback(target, cache, ids, verdict.num_accepted + 1, saved)  # rollback: keep newest_committed + accepted
        proposer.rollback(len(committed) + len(new))
        _observe(proposer, features, slice(0, verdict.num_accepted + 1))  # target features of the kept rows
        result.cycles.append(CycleStats(k, verdict.num_accepted, t1 - t0, t2 - t1, t2 - t_logits, size=k + 1))
        if tuner:
            tuner.update(k, verdict.num_accepted, t1 - t0)
        if record_tv:
            result.cycles[-1].tv = drafted_tv(proposal, logits, min(verdict.num_accepted + 1, k), params)
            result.cycles[-1].tv_s = time.perf_counter() - t2
        done = _commit(new, committed, result, eos, max_new_tokens)
    result.asd_regret = ledger.spent if ledger else 0.0
    return result


TreeAcceptance = Callable[[TreeShape, torch.Tensor, torch.Tensor], Tuple[List[int], int]]
"""An acceptance rule for one verified tree: (shape, node tokens [N+1], the target's logits [N+1, V]) → (the accepted
nodes, root excluded, root-to-leaf; the token that follows them: the correction or the bonus)."""


def exact_tree_acceptance(params: SamplingParams, generator: Optional[torch.Generator] = None) -> TreeAcceptance:
    """Exact tree verification: the argmax path at T = 0, otherwise the deterministic-top-k sampling rule
    (docs/algorithms.md §Token trees) — the output is distributed exactly as the target's own sampling."""
    def accept(shape: TreeShape, tokens: torch.Tensor, logits: torch.Tensor) -> Tuple[List[int], int]:
        if params.greedy:
            verdict = verify_tree_greedy(shape.parents, tokens, logits)
        else:
            verdict = verify_tree_sampling(shape.parents, tokens, sampling_probs(logits, params), None, "topk", generator)
        return verdict.accepted_nodes, verdict.next_token
    return accept


@torch.no_grad()
def tree_speculative_generate(target: nn.Module, proposer: TreeProposer, prompt_ids: Sequence[int], max_new_tokens: int,
                              params: SamplingParams = SamplingParams(0.0),
                              eos_token_ids: Sequence[int] = (),
                              generator: Optional[torch.Generator] = None,
                              accept: Optional[TreeAcceptance] = None) -> GenerationResult:
    """Like `speculative_generate`, but each cycle verifies a whole draft tree in one target pass (tree
    attention). The proposer returns a static or a dynamic (EAGLE-2) tree each cycle; its children are chosen
    deterministically by the draft, so T > 0 uses the exact deterministic-top-k rule. `accept` replaces that rule
    (Medusa's typical acceptance: inference/medusa.py:typical_generate)."""
    check_request(target, prompt_ids, max_new_tokens)
    check_tree_target(target.config)
    tuner = proposer.tree_size  # a TreeSizeTuner picks how much of each drafted tree to verify
    if tuner is not None and not tuner.calibrated:
        tuner.calibrate(target, prompt_ids)
    taps = proposer.feature_layers
    with capture_features(target, taps) as features:
        return _tree_loop(target, proposer, prompt_ids, max_new_tokens, accept or exact_tree_acceptance(params, generator),
                          eos_token_ids, features if taps else None)


def _tree_loop(target, proposer: TreeProposer, prompt_ids, max_new_tokens, accept: TreeAcceptance, eos_token_ids,
               features) -> GenerationResult:
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
        t_logits = time.perf_counter()
        accepted, next_token = accept(shape, tokens, logits)
        t2 = time.perf_counter()
        keep = [0] + accepted  # tree slots to keep: the root and the accepted path
        compact_cache(cache, [past + j for j in keep], past)
        cache.crop(-(shape.size - len(keep)))  # rollback: drop the rejected branches
        new = [int(tokens[j]) for j in accepted] + [next_token]
        proposer.rollback(len(committed) + len(new))
        _observe(proposer, features, keep)  # target features of the root and the accepted path
        result.cycles.append(CycleStats(max(shape.depths), len(accepted), t1 - t0, t2 - t1, t2 - t_logits,
                                        size=shape.size))
        if proposer.tree_size is not None:
            proposer.tree_size.update(shape.parents, proposer.node_probs, accepted, t1 - t0)
        done = _commit(new, committed, result, eos, max_new_tokens)
    return result


def tree_pass(target: nn.Module, cache: DynamicCache, shape, tokens: torch.Tensor, past: int) -> torch.Tensor:
    """One target pass over a whole draft tree after `past` cached tokens (tree attention): logits [N+1, V], on the
    CPU where the acceptance rule runs."""
    device = device_of(target)
    positions = tree_positions(shape.depths, past)  # [1, N+1]
    masks = tree_masks(target.config, tree_allowed(shape.ancestors_mask(), past),
                       torch.cat([torch.arange(past), positions[0]]), positions[0])
    masks = {t: m.to(device) for t, m in masks.items()} if isinstance(masks, dict) else masks.to(device)
    return target(input_ids=tokens[None].to(device), cache=cache, use_cache=True, attention_mask=masks,
                  position_ids=positions.to(device)).logits[0].cpu()


def check_request(target: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    """What a decoding loop is given, checked where it enters (one SpecdrafterError, never a hang or torch's
    IndexError): at least one new token to decode, a non-empty prompt of token ids the target's embedding has."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpecdrafterError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if len(prompt_ids) == 0:
        raise SpecdrafterError("empty prompt: a request needs at least one token")
    vocab = target.get_input_embeddings().num_embeddings
    bad = next((t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise SpecdrafterError(f"prompt token {bad!r} is not a token id of the target (0 ≤ id < {vocab})")


def _prefill(target: nn.Module, prompt_ids: Sequence[int], room: int) -> Tuple[List[int], DynamicCache]:
    """Check the prompt fits with `room` more positions, and fill the target cache with all but its newest token."""
    context = getattr(target.config, "max_position_embeddings", None)
    if context and len(prompt_ids) + room > context:
        raise ContextOverflow(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens exceeds the target's context of "
                               f"{context} tokens")
    committed, cache = list(prompt_ids), new_cache(target)
    if len(committed) > 1:
        target(input_ids=torch.tensor([committed[:-1]], device=device_of(target)), cache=cache, use_cache=True,
               logits_to_keep=1)
    return committed, cache


def _observe(proposer, features: Optional[Dict[int, torch.Tensor]], rows) -> None:
    """Hand the proposer the target features [n, d] of the rows just committed (after prefill: the prompt)."""
    if features:  # empty when the proposer reads no features, or a 1-token prompt needed no prefill pass
        proposer.observe({k: h[0, rows] for k, h in features.items()})
        features.clear()


def _commit(new: List[int], committed: List[int], result: GenerationResult, eos: set, max_new_tokens: int) -> bool:
    """Append a verdict's tokens; True once EOS or max_new_tokens is reached (later tokens are dropped)."""
    for token in new:
        committed.append(token)
        result.tokens.append(token)
        if token in eos or len(result.tokens) == max_new_tokens:
            return True
    return False


def compact_cache(cache: DynamicCache, slots: List[int], start: int) -> None:
    """Move the KV entries at `slots` to contiguous positions start, start+1, ... in every layer."""
    index = torch.tensor(slots, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys[:, :, start:start + len(slots)] = layer.keys[:, :, index]  # [B, H, n, D]
        layer.values[:, :, start:start + len(slots)] = layer.values[:, :, index]


def drafted_tv(proposal, logits: torch.Tensor, tried: int, params: SamplingParams) -> List[float]:
    """D_TV(p_i, q_i) = ½ Σ |p_i − q_i| at the first `tried` draft positions, p and q processed alike (at T = 0
    both are one-hot: the draft's token vs the target's argmax)."""
    p = sampling_probs(logits[:tried], params)  # [tried, V]
    if proposal.probs is None or params.greedy:
        q = torch.nn.functional.one_hot(proposal.tokens[:tried], p.shape[-1]).to(p.dtype)
    else:
        q = proposal.probs[:tried].to(p.dtype)
    return (0.5 * (p - q).abs().sum(-1)).tolist()


def _verify(proposal, logits, params, ledger, asd, generator, room: int, eos: set) -> Verdict:
    if asd is not None:  # only drafts that can still be emitted may spend the budget: none past max_new_tokens or EOS
        usable = min(len(proposal.tokens), room)
        usable = next((i + 1 for i, x in enumerate(proposal.tokens[:usable].tolist()) if x in eos), usable)
        return verify_asd(proposal.tokens[:usable], logits[:usable + 1], ledger, asd.gate, asd.max_mismatches)
    if params.greedy:
        return verify_greedy(proposal.tokens, logits)
    return verify_sampling(proposal.tokens, proposal.probs, sampling_probs(logits, params), generator)
