"""Decoding with block drafters (inference/block.py) through the real chain loop: greedy output identical to the
target's own, exact sampling at T = 1 (χ² of the first two tokens, DFlash's marginals, DSpark's Markov rows, and
DSpark with the confidence-sized length), the confidence rule deciding before each draft is drawn, and the drafter's
context cache holding exactly the committed positions."""

import pytest
import torch
from conftest import assert_first_two_tokens_follow, sample_first_two_through_the_loop, tiny_llama_config
from transformers import LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.autotune import ConfidenceLength
from specdrafter.inference.block import BlockProposer
from specdrafter.inference.decode import speculative_generate
from specdrafter.inference.sampling import SamplingParams
from specdrafter.models.block import VARIANTS, BlockDrafter, block_config

GREEDY = SamplingParams(0.0)


def small_target(vocab: int, seed: int = 0, sharpen: float = 1.0):
    torch.manual_seed(seed)
    target = LlamaForCausalLM(tiny_llama_config(vocab, num_hidden_layers=4, hidden_size=16, intermediate_size=32,
                                                tie_word_embeddings=False)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(sharpen)
    return target


def drafter_for(target, variant: str, seed: int = 1, sharpen: float = 1.0, **overrides) -> BlockDrafter:
    torch.manual_seed(seed)
    settings = dict(num_layers=1, block_size=4, aux_layer_ids=[1, 3], mask_token_id=target.config.vocab_size - 1,
                    markov_rank=4 if variant == "dspark" else 0)
    settings.update(overrides)
    drafter = BlockDrafter(block_config(target.config, VARIANTS[variant], **settings)).eval()
    with torch.no_grad():
        drafter.norm.weight.mul_(sharpen)  # the drafts' logits sharper: they agree with the target more often
        if drafter.markov_head is not None:
            drafter.markov_head.markov_w2.weight.mul_(40.0)  # a Markov term that changes what is drafted
        if drafter.confidence_head is not None:
            drafter.confidence_head.proj.weight.mul_(8.0)  # confidences spread over (0, 1)
    return drafter


def target_greedy(target, prompt, n):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    return out[0, len(prompt):].tolist()


def confidence_rule(drafter) -> ConfidenceLength:
    """A length rule on fixed costs (no timing): v(n) = 1 for n ≤ 2, then steep, so that the second draft is kept
    for some previous drafts and not for others."""
    rule = ConfidenceLength(drafter.num_drafts, draft_cost=0.0)
    rule.v = {1: 1.0, 2: 1.0, 3: 1.25, 4: 1.5, 5: 1.75}
    return rule


@pytest.mark.parametrize("variant, confidence", [("dflash", False), ("dspark", False), ("dspark", True)])
def test_greedy_block_decoding_is_token_identical_to_the_target(variant, confidence, one_thread):
    target = small_target(64, sharpen=8.0)
    drafter = drafter_for(target, variant, sharpen=4.0)
    length = confidence_rule(drafter) if confidence else None
    cycles = greedy_cycles(target, BlockProposer(drafter, target, length))
    if confidence:
        assert min(c.drafted for c in cycles) < 3  # the rule shortened some cycles


def greedy_cycles(target, proposer) -> list:
    """Greedy decoding of three prompts with `proposer` at k = 3, asserted token-identical to the target's own greedy
    answer with some drafts accepted (committed, and their features observed); the cycles."""
    cycles = []
    for prompt in ([5], [3, 9, 12], [7, 7, 1, 30, 22, 4]):
        result = speculative_generate(target, proposer, prompt, 24, GREEDY, 3)
        assert result.tokens == target_greedy(target, prompt, 24)
        cycles += result.cycles
    assert max(c.accepted for c in cycles) >= 1
    return cycles


def test_the_context_cache_holds_every_committed_position_but_the_newest():
    target = small_target(64, sharpen=8.0)
    proposer = BlockProposer(drafter_for(target, "dspark", sharpen=4.0), target)
    seen = []
    propose = proposer.propose

    def checked(committed, k, params, generator=None):
        seen.append((proposer.cache.length, len(committed)))
        return propose(committed, k, params, generator)
    proposer.propose = checked
    speculative_generate(target, proposer, [3, 9, 12], 16, GREEDY, 3)
    assert seen and all(cached == n - 1 for cached, n in seen)


@pytest.mark.parametrize("variant, confidence", [("dflash", False), ("dspark", False), ("dspark", True)])
def test_block_decoding_at_temperature_1_samples_the_first_two_tokens_from_the_target(variant, confidence, one_thread):
    """χ² (level 1e-4, fixed seed) over the 64 cells of the first two tokens of an 8-token vocabulary: DFlash's drafts
    drawn from independent marginals, DSpark's from its Markov rows given the draft before, and DSpark with the
    confidence rule choosing 1 or 2 drafts per cycle from the first draft."""
    target = small_target(8, sharpen=6.0)
    drafter = drafter_for(target, variant, sharpen=3.0)
    prompt, n = [3, 5], 1500
    length = split_rule(drafter, target, prompt) if confidence else None
    proposer = BlockProposer(drafter, target, length)
    lengths = []
    propose = proposer.propose

    def recorded(committed, k, params, generator=None):
        proposal = propose(committed, k, params, generator)
        lengths.append(len(proposal.tokens))
        return proposal
    proposer.propose = recorded
    counts, accepted, drafted = sample_first_two_through_the_loop(target, proposer, prompt, n, tree=False)
    assert 0 < accepted < drafted  # both the accepting and the rejecting branches were taken
    if confidence:
        assert {1, 2} <= set(lengths)  # the rule kept the second draft after some first drafts and not after others
    assert_first_two_tokens_follow(target, prompt, counts, n)


def split_rule(drafter, target, prompt) -> ConfidenceLength:
    """A rule on fixed costs that keeps the second draft after about half of the first drafts: v(3) is set to the
    median, over the confidences (c_1, c_2) seen on `prompt`, of the v(3) at which keeping it stops paying."""
    rule = ConfidenceLength(drafter.num_drafts, draft_cost=0.0, min_noise=0.0)
    rule.v = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}  # every draft pays: keep() is asked about each one
    seen, keep = [], rule.keep
    rule.keep = lambda c: seen.append(tuple(c)) or keep(c)
    sample_first_two_through_the_loop(target, BlockProposer(drafter, target, rule), prompt, 100, tree=False)
    del rule.keep
    c1 = seen[0][0]  # the first cycle's first draft always has the same confidence
    breakeven = sorted({(1 + c1 + c1 * c2) / (1 + c1) for first, c2 in (c[:2] for c in seen) if first == c1})
    assert len(breakeven) >= 2, "the confidence of the second draft does not depend on the first"
    rule.v = {1: 1.0, 2: 1.0, 3: breakeven[len(breakeven) // 2] - 1e-9, 4: 2.0, 5: 2.0}
    return rule


def test_the_confidence_rule_decides_before_the_draft_it_sizes():
    """keep() sees c_1..c_j, never draft j: the same confidences give the same answer whatever was drawn."""
    rule = ConfidenceLength(4, draft_cost=0.0)
    rule.v = {1: 1.0, 2: 1.0, 3: 1.2, 4: 1.4, 5: 1.6}
    assert rule.keep([0.9, 0.9]) and not rule.keep([0.9, 0.05])
    assert rule.keep([0.9, 0.9]) == rule.keep([0.9, 0.9])
    uncalibrated = ConfidenceLength(4)
    assert uncalibrated.keep([0.1, 0.01])  # no cost model yet: every draft kept


def test_a_drafter_for_another_target_and_a_length_rule_without_a_head_are_one_line():
    target = small_target(64)
    other = LlamaForCausalLM(tiny_llama_config(64, num_hidden_layers=6, hidden_size=16, intermediate_size=32)).eval()
    with pytest.raises(SpecdrafterError, match="num_target_layers = 4; this target has 6"):
        BlockProposer(drafter_for(target, "dflash"), other)
    with pytest.raises(SpecdrafterError, match="needs a confidence head"):
        BlockProposer(drafter_for(target, "dflash"), target, ConfidenceLength(3))


def test_asd_on_a_block_drafter_with_no_budget_is_the_target_greedy_output_and_with_one_spends_it():
    from specdrafter.core.recipe import ASDConfig
    target = small_target(64, sharpen=8.0)
    proposer = BlockProposer(drafter_for(target, "dspark", sharpen=4.0), target)
    prompt = [3, 9, 12]
    strict = speculative_generate(target, proposer, prompt, 24, GREEDY, 3, asd=ASDConfig(budget=0.0))
    assert strict.tokens == target_greedy(target, prompt, 24) and strict.asd_regret == 0
    loose = speculative_generate(target, proposer, prompt, 24, GREEDY, 3, asd=ASDConfig(budget=50.0, gate=50.0))
    assert 0 < loose.asd_regret <= 50.0 and len(loose.cycles) <= len(strict.cycles)
