"""The speculative generation loops (batch size 1): draft → verify → commit → roll back both caches.

Target cache invariant: it holds every committed token except the newest one. Each cycle feeds
[newest_committed, d_1, ..., d_k] so row i-1 scores d_i and row k is the bonus row (docs/algorithms.md §Conventions).

The loops only decode. What else a cycle is used for — its timings, the TV audit, the tuners' learning — happens in
one `CycleObserver` the loop calls once per cycle with what the cycle did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from transformers import DynamicCache

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import ASDConfig
from specdrafter.inference.autotune import BlockLengthTuner, TreeSizeTuner
from specdrafter.inference.proposers import Proposal, Proposer, TreeProposer, device_of
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


# ------------------------------------------------------------------------------------------ one request
@dataclass(frozen=True)
class Request:
    """One decoding request as the loops take it: the prompt, how many new tokens at most, the tokens that end it."""
    prompt_ids: Sequence[int]
    max_new_tokens: int
    eos: frozenset = frozenset()


class Laps:
    """The clock of one cycle: `mark()` where each phase (draft, target pass, acceptance rule) ends."""

    def __init__(self):
        self.marks = [time.perf_counter()]

    def mark(self) -> None:
        self.marks.append(time.perf_counter())

    def seconds(self) -> List[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


@dataclass
class Cycle:
    """What one cycle did, as the observer sees it once the cycle is committed."""
    drafted: int  # draft tokens the target verified: k for a chain, the tree's depth for a tree
    accepted: int  # draft tokens accepted
    size: int  # tokens in the target pass
    laps: Laps  # draft, target pass, acceptance rule
    proposal: Optional[Proposal] = None  # the chain's drafts (None for a tree)
    logits: Optional[torch.Tensor] = None  # the chain's target logits [k+1, V]
    shape: Optional[TreeShape] = None  # the verified tree (None for a chain)
    accepted_nodes: Sequence[int] = ()  # the tree's accepted path (root excluded)


class CycleObserver:
    """Everything a decoding cycle is used for besides decoding: its statistics and timings (`stats`), the
    block-length or tree-size tuner's learning, and the α = 1 − D_TV audit (`params` given: D_TV(p, q) recorded at
    every chain position the verifier tried; costs time, which `tv_s` reports apart)."""

    def __init__(self, tuner: Optional[BlockLengthTuner] = None, sizer: Optional[TreeSizeTuner] = None,
                 tree_probs: Optional[Callable[[], torch.Tensor]] = None, audit: Optional[SamplingParams] = None):
        self.tuner, self.sizer, self.tree_probs, self.audit = tuner, sizer, tree_probs, audit
        self.stats: List[CycleStats] = []

    def __call__(self, cycle: Cycle) -> None:
        draft_s, pass_s, rule_s = cycle.laps.seconds()
        stats = CycleStats(cycle.drafted, cycle.accepted, draft_s, pass_s + rule_s, rule_s, size=cycle.size)
        self.stats.append(stats)
        if self.tuner is not None:
            self.tuner.update(cycle.drafted, cycle.accepted, draft_s)
        if self.sizer is not None:
            self.sizer.update(cycle.shape.parents, self.tree_probs(), cycle.accepted_nodes, draft_s)
        if self.audit is not None:
            start = time.perf_counter()
            stats.tv = drafted_tv(cycle.proposal, cycle.logits, min(cycle.accepted + 1, cycle.drafted), self.audit)
            stats.tv_s = time.perf_counter() - start


# --------------------------------------------------------------------------------------- the chain loop
@torch.no_grad()
def speculative_generate(target: nn.Module, proposer: Proposer, prompt_ids: Sequence[int], max_new_tokens: int,
                         params: SamplingParams = SamplingParams(0.0), k: int = 4,
                         eos_token_ids: Sequence[int] = (), asd: Optional[ASDConfig] = None,
                         generator: Optional[torch.Generator] = None, record_tv: bool = False,
                         tuner: Optional[BlockLengthTuner] = None) -> GenerationResult:
    """Decode up to `max_new_tokens` after `prompt_ids`, drafting k tokens per cycle with `proposer`.

    Greedy (params.temperature == 0) uses `verify_greedy` (or `verify_asd` when `asd` is given); otherwise
    exact speculative sampling, so the output is distributed exactly as the target's own sampling.
    `record_tv` stores D_TV(p, q) of every position the verifier tried (an audit of α = 1 − D_TV; costs time).
    With a `tuner` (a BlockLengthTuner, inference/autotune.py) the block length of every cycle is the tuner's choice
    from the cycles before it (it calibrates the target's v(n) on this prompt the first time), and `k` is unused.
    """
    check_request(target, prompt_ids, max_new_tokens)
    if tuner is None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise SpecdrafterError(f"block length k must be an integer >= 1, got {k!r}")
    for model in (tuner, proposer.confidence_length):  # v(n) for k = auto, a block drafter's length
        if model is not None and not model.calibrated:
            model.calibrate(target, prompt_ids)
    if asd is not None and not params.greedy:
        raise SpecdrafterError("ASD is defined for greedy decoding only (temperature 0)")
    request = Request(prompt_ids, max_new_tokens, frozenset(eos_token_ids))
    rule = ChainRule(params, generator, RegretLedger(asd.budget) if asd else None, asd)
    lengths = BlockLength(k, tuner)
    observer = CycleObserver(tuner, audit=params if record_tv and asd is None else None)
    with capture_features(target, proposer.feature_layers) as features:  # EAGLE / Medusa read target features
        result = _chain_loop(target, Drafting(proposer, features), request, rule, lengths, observer)
    result.cycles, result.asd_regret = observer.stats, rule.regret
    return result


def _chain_loop(target, drafting: "Drafting", request: Request, rule: "ChainRule", lengths: "BlockLength",
                observe: CycleObserver) -> GenerationResult:
    committed, cache = _prefill(target, request, lengths.max_k)
    drafting.start()
    result, done = GenerationResult([]), False
    while not done:
        k = lengths.choose()  # from past cycles only: exactness holds for any k
        laps = Laps()
        proposal = drafting.proposer.propose(committed, k, rule.params, rule.generator)
        laps.mark()
        ids = torch.tensor([[committed[-1]] + proposal.tokens.tolist()], device=device_of(target))  # [1, k+1]
        saved = snapshot(cache)  # a recurrent layer's state before the pass (None for attention-only targets)
        logits = target(input_ids=ids, cache=cache, use_cache=True).logits[0].cpu()  # [k+1, V], verified on the CPU
        laps.mark()
        verdict = rule(proposal, logits, room=request.max_new_tokens - len(result.tokens), eos=request.eos)
        laps.mark()
        kept = range(verdict.num_accepted + 1)  # newest_committed + the accepted drafts
        rollback(target, cache, ids, kept, saved)  # rollback: the target cache drops the rejected drafts
        new = proposal.tokens[:verdict.num_accepted].tolist() + [verdict.next_token]
        drafting.advance(len(committed) + len(new), kept)
        observe(Cycle(len(proposal.tokens), verdict.num_accepted, ids.shape[1], laps, proposal, logits))
        done = _commit(new, committed, result, request)
    return result


@dataclass
class Drafting:
    """The proposer and the target features it reads (captured by the target's pass; None when it reads none)."""
    proposer: Proposer
    features: Optional[Dict[int, torch.Tensor]]

    def start(self) -> None:
        """A new request: the proposer forgets the last one and reads the prompt's features."""
        self.proposer.reset()
        self._observe(slice(None))

    def advance(self, num_committed: int, kept) -> None:
        """After a verdict: the proposer drops what was rejected and reads the target features of the kept rows."""
        self.proposer.rollback(num_committed)  # rollback: the drafter's own state beyond the committed prefix
        self._observe(list(kept))

    def _observe(self, rows) -> None:
        if self.features:  # empty when the proposer reads no features, or a 1-token prompt needed no prefill pass
            self.proposer.observe({k: h[0, rows] for k, h in self.features.items()})
            self.features.clear()


@dataclass
class BlockLength:
    """The chain's k each cycle: fixed, or the tuner's choice from the cycles before (never from this one's drafts)."""
    k: int
    tuner: Optional[BlockLengthTuner] = None

    @property
    def max_k(self) -> int:
        return self.tuner.max_k if self.tuner else self.k

    def choose(self) -> int:
        return self.tuner.choose() if self.tuner else self.k


@dataclass
class ChainRule:
    """The chain's acceptance rule: greedy, exact speculative sampling, or ASD with the request's regret ledger."""
    params: SamplingParams
    generator: Optional[torch.Generator] = None
    ledger: Optional[RegretLedger] = None  # ASD only
    asd: Optional[ASDConfig] = None

    @property
    def regret(self) -> float:
        return self.ledger.spent if self.ledger else 0.0

    def __call__(self, proposal: Proposal, logits: torch.Tensor, room: int, eos: frozenset) -> Verdict:
        if self.asd is not None:  # only drafts that can still be emitted may spend the budget: none past room or EOS
            usable = min(len(proposal.tokens), room)
            usable = next((i + 1 for i, x in enumerate(proposal.tokens[:usable].tolist()) if x in eos), usable)
            return verify_asd(proposal.tokens[:usable], logits[:usable + 1], self.ledger, self.asd.gate,
                              self.asd.max_mismatches)
        if self.params.greedy:
            return verify_greedy(proposal.tokens, logits)
        return verify_sampling(proposal.tokens, proposal.probs, sampling_probs(logits, self.params), self.generator)


# ---------------------------------------------------------------------------------------- the tree loop
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
            verdict = verify_tree_sampling(shape.parents, tokens, sampling_probs(logits, params), generator)
        return verdict.accepted_nodes, verdict.next_token
    return accept


@torch.no_grad()
def tree_speculative_generate(target: nn.Module, proposer: TreeProposer, prompt_ids: Sequence[int], max_new_tokens: int,
                              params: SamplingParams = SamplingParams(0.0),
                              eos_token_ids: Sequence[int] = (),
                              generator: Optional[torch.Generator] = None,
                              accept: Optional[TreeAcceptance] = None,
                              sizer: Optional[TreeSizeTuner] = None) -> GenerationResult:
    """Like `speculative_generate`, but each cycle verifies a whole draft tree in one target pass (tree
    attention). The proposer returns a static or a dynamic (EAGLE-2) tree each cycle; its children are chosen
    deterministically by the draft, so T > 0 uses the exact deterministic-top-k rule. `accept` replaces that rule
    (Medusa's typical acceptance: inference/medusa.py:typical_generate). A `sizer` (TreeSizeTuner) decides how much
    of each dynamic tree is verified, from the cycles before, and learns from each one."""
    check_request(target, prompt_ids, max_new_tokens)
    check_tree_target(target.config)
    if sizer is not None and not sizer.calibrated:
        sizer.calibrate(target, prompt_ids)
    request = Request(prompt_ids, max_new_tokens, frozenset(eos_token_ids))
    observer = CycleObserver(sizer=sizer, tree_probs=lambda: proposer.node_probs)
    with capture_features(target, proposer.feature_layers) as features:
        result = _tree_loop(target, Drafting(proposer, features), request, accept or exact_tree_acceptance(params, generator),
                            sizer, observer)
    result.cycles = observer.stats
    return result


def _tree_loop(target, drafting: Drafting, request: Request, accept: TreeAcceptance, sizer: Optional[TreeSizeTuner],
               observe: CycleObserver) -> GenerationResult:
    committed, cache = _prefill(target, request, drafting.proposer.max_tree_size)
    drafting.start()
    result, done = GenerationResult([]), False
    while not done:
        laps = Laps()
        shape, tokens = drafting.proposer.propose_tree(committed, sizer)  # tokens: [N+1]
        laps.mark()
        logits = tree_pass(target, cache, shape, tokens, past=len(committed) - 1)  # [N+1, V]
        laps.mark()
        accepted, next_token = accept(shape, tokens, logits)
        laps.mark()
        kept = [0] + accepted  # tree slots to keep: the root and the accepted path
        rollback(target, cache, tokens[None], kept, None)  # rollback: the target cache drops the rejected branches
        new = [int(tokens[j]) for j in accepted] + [next_token]
        drafting.advance(len(committed) + len(new), kept)
        observe(Cycle(max(shape.depths), len(accepted), shape.size, laps, shape=shape, accepted_nodes=accepted))
        done = _commit(new, committed, result, request)
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


# ------------------------------------------------------------------------------------ shared by both loops
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


def _prefill(target: nn.Module, request: Request, block: int) -> Tuple[List[int], DynamicCache]:
    """Check the prompt fits with max_new_tokens and one draft `block` (k, or a tree's nodes) more positions, and fill
    the target cache with all but its newest token."""
    prompt_ids = request.prompt_ids
    context = getattr(target.config, "max_position_embeddings", None)
    need = len(prompt_ids) + request.max_new_tokens + block
    if context and need > context:
        raise ContextOverflow(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) + one draft "
                              f"block or tree ({block}) = {need} positions, which exceeds the target's context of "
                              f"{context} tokens: the draft block must fit too (shorten the prompt, or lower "
                              "max_new_tokens or k)")
    committed, cache = list(prompt_ids), new_cache(target)
    if len(committed) > 1:
        target(input_ids=torch.tensor([committed[:-1]], device=device_of(target)), cache=cache, use_cache=True,
               logits_to_keep=1)
    return committed, cache


def _commit(new: List[int], committed: List[int], result: GenerationResult, request: Request) -> bool:
    """Append a verdict's tokens; True once EOS or max_new_tokens is reached (later tokens are dropped)."""
    for token in new:
        committed.append(token)
        result.tokens.append(token)
        if token in request.eos or len(result.tokens) == request.max_new_tokens:
            return True
    return False


def drafted_tv(proposal, logits: torch.Tensor, tried: int, params: SamplingParams) -> List[float]:
    """D_TV(p_i, q_i) = ½ Σ |p_i − q_i| at the first `tried` draft positions, p and q processed alike (at T = 0
    both are one-hot: the draft's token vs the target's argmax)."""
    p = sampling_probs(logits[:tried], params)  # [tried, V]
    if proposal.probs is None or params.greedy:
        q = torch.nn.functional.one_hot(proposal.tokens[:tried], p.shape[-1]).to(p.dtype)
    else:
        q = proposal.probs[:tried].to(p.dtype)
    return (0.5 * (p - q).abs().sum(-1)).tolist()
