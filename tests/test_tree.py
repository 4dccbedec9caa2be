"""Trees: shapes from choice lists, ancestor masks, and tree attention over an HF Llama matching chain decoding."""

from collections import Counter

import pytest
import torch
from conftest import assert_first_two_tokens_follow, tiny_llama_config
from transformers import DynamicCache, LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.decode import tree_speculative_generate
from specdrafter.inference.proposers import DraftModelTreeProposer, DynamicTreeProposer
from specdrafter.inference.sampling import SamplingParams
from specdrafter.inference.tree import cartesian_choices, tree_attention, tree_from_choices, tree_from_parents, tree_positions


def test_tree_from_choices_is_breadth_first_with_parents_and_paths():
    shape = tree_from_choices([[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert shape.choices == ((), (0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert shape.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert shape.depths == [0, 1, 1, 2, 2, 2, 3]
    assert shape.leaf_paths() == [[1, 4], [2, 5], [1, 3, 6]]
    mask = shape.ancestors_mask()
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert mask[:, 0].all() and mask.diagonal().all() and not mask[2, 1]


def test_tree_from_parents_records_sibling_ranks():
    shape = tree_from_parents([-1, 0, 0, 1, 1, 2])
    assert shape.choices == ((), (0,), (1,), (0, 0), (0, 1), (1, 0))
    with pytest.raises(SpecdrafterError, match="parents must come first"):
        tree_from_parents([-1, 2, 0])


def test_cartesian_choices():
    assert cartesian_choices([2, 2]) == [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]]
    assert tree_from_choices(cartesian_choices([3, 2, 1])).size == 1 + 3 + 6 + 6


def test_bad_choices_are_refused():
    with pytest.raises(SpecdrafterError, match=r"needs 3 draft heads but only 2 exist"):
        tree_from_choices([[0], [0, 0], [0, 0, 0]], num_heads=2)
    with pytest.raises(SpecdrafterError, match="without its parent"):
        tree_from_choices([[0], [1, 0]])
    with pytest.raises(SpecdrafterError, match="non-negative"):
        tree_from_choices([[0], [-1]])


@torch.no_grad()
def test_tree_attention_logits_match_chain_decoding_on_a_llama():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(300, num_hidden_layers=3)).eval()
    past = [5, 17, 42, 9, 100]
    shape = tree_from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    tokens = [past[-1], 11, 12, 13, 21, 22, 23, 31]  # node tokens (root = newest committed)
    cache = DynamicCache()
    model(input_ids=torch.tensor([past[:-1]]), cache=cache, use_cache=True)
    n_past = len(past) - 1
    logits = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True,
                   attention_mask=tree_attention(shape.ancestors_mask(), n_past),
                   position_ids=tree_positions(shape.depths, n_past)).logits[0]  # [N+1, V]
    for node in range(shape.size):
        path, j = [], node
        while j > 0:
            path.append(tokens[j])
            j = shape.parents[j]
        chain = model(input_ids=torch.tensor([past + path[::-1]])).logits[0, -1]
        torch.testing.assert_close(logits[node], chain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("choices", [[[0], [1], [0, 0], [1, 0], [0, 0, 0]], cartesian_choices([3, 2])])
def test_greedy_tree_decoding_is_token_identical_to_target_generate(choices):
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config(300, num_hidden_layers=4)).eval()
    torch.manual_seed(1)
    draft = LlamaForCausalLM(tiny_llama_config(300, num_hidden_layers=1)).eval()
    shape = tree_from_choices(choices)
    for proposer in (DraftModelTreeProposer(draft, shape), DraftModelTreeProposer(target, shape)):
        for prompt in ([5, 17, 42, 9], [250], list(range(3, 40))):
            ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=[2],
                                  pad_token_id=2)[0, len(prompt):].tolist()
            result = tree_speculative_generate(target, proposer, prompt, 20, eos_token_ids=[2])
            assert result.tokens == ref
    assert result.tau > 1  # the target as its own tree draft accepts whole paths


def test_the_tree_loop_refuses_what_it_cannot_decode_in_one_line():
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config(300, num_hidden_layers=1)).eval()
    proposer = DraftModelTreeProposer(target, tree_from_choices([[0], [1]]))
    with pytest.raises(SpecdrafterError, match=r"max_new_tokens must be an integer >= 1, got 0"):
        tree_speculative_generate(target, proposer, [5, 17], 0)  # used to decode forever
    with pytest.raises(SpecdrafterError, match=r"prompt token 300 is not a token id of the target"):
        tree_speculative_generate(target, proposer, [5, 300], 4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_tree_decoding_samples_from_the_target_at_temperature_1(dynamic):
    """First two emitted tokens of tree decoding (static and EAGLE-2 dynamic trees) vs the target's own
    distribution (χ², level 1e-4)."""
    torch.manual_seed(0)
    V = 8
    target = LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=1, hidden_size=16, intermediate_size=32)).eval()
    torch.manual_seed(1)
    draft = LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=1, hidden_size=16, intermediate_size=32)).eval()
    prompt, n = [3, 5], 1500
    proposer = DynamicTreeProposer(draft, depth=2, top_k=2, total_tokens=4) if dynamic else \
        DraftModelTreeProposer(draft, tree_from_choices(cartesian_choices([2, 1])))
    gen = torch.Generator().manual_seed(0)
    counts = Counter(tuple(tree_speculative_generate(target, proposer, prompt, 2, SamplingParams(1.0),
                                                     generator=gen).tokens) for _ in range(n))
    assert_first_two_tokens_follow(target, prompt, counts, n)


def test_dynamic_tree_is_closed_under_ancestors_and_decodes_greedy_exactly():
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config(300, num_hidden_layers=4)).eval()
    torch.manual_seed(1)
    draft = LlamaForCausalLM(tiny_llama_config(300, num_hidden_layers=1)).eval()
    proposer = DynamicTreeProposer(draft, depth=4, top_k=3, total_tokens=10)
    proposer.reset()
    shape, tokens = proposer.propose_tree([5, 17, 42, 9])
    assert shape.size == 11 and tokens.shape == (11,) and max(shape.depths) <= 4
    assert all(0 <= p < j for j, p in enumerate(shape.parents) if j)
    assert proposer.cache.get_seq_length() == 4  # tree nodes rolled back: only the committed prefix remains
    for proposer in (DynamicTreeProposer(draft, 4, 3, 10), DynamicTreeProposer(target, 3, 2, 6)):
        for prompt in ([5, 17, 42, 9], [250]):
            ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=[2],
                                  pad_token_id=2)[0, len(prompt):].tolist()
            assert tree_speculative_generate(target, proposer, prompt, 20, eos_token_ids=[2]).tokens == ref
