"""Medusa: vLLM's checkpoint layout, fresh heads equal to the target's lm_head, the draft offset (head i at the
feature of position n - 2 drafts token i + 1), greedy chain / tree / typical decoding identical to
target.generate, chain and tree sampling at T = 1 distributed as the target (χ²), and bad input refused in one line."""

import json

import pytest
import torch
from conftest import assert_first_two_tokens_follow, sample_first_two_through_the_loop, tiny_llama_config
from transformers import LlamaConfig, LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.decode import speculative_generate, tree_speculative_generate
from specdrafter.inference.medusa import MedusaProposer, MedusaTreeProposer, typical_generate, typical_inputs
from specdrafter.inference.sampling import SamplingParams
from specdrafter.inference.tree import cartesian_choices, tree_from_choices
from specdrafter.inference.verify import verify_typical
from specdrafter.models.features import capture_features
from specdrafter.models.medusa import MedusaHeads, init_from_target, load_medusa, medusa_config, save_medusa

PROMPTS = [[5, 17, 42, 9], [1, 2, 3, 4, 5, 6, 7, 8]]
RAGGED = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # leaves at depths 2 and 3: typical paths get padded
EOS = [2]


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(300, num_hidden_layers=3, tie_word_embeddings=False)).eval()


@pytest.fixture(scope="module")
def random_heads(target):
    """Heads with random (non-zero) ResBlocks and lm_heads: they draft poorly, so rollback is exercised."""
    torch.manual_seed(1)
    return MedusaHeads(medusa_config(target.config, num_heads=3, num_layers=1)).eval()


def greedy_reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=EOS, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def normed_features(target, ids):
    """The heads' input at every position of `ids`: the last hidden state after the final norm, [T, d]."""
    L = target.config.num_hidden_layers
    with capture_features(target, [L]) as features:
        target(input_ids=torch.tensor([ids]))
    return target.model.norm(features[L][0])


@torch.no_grad()
def oracle_heads(target, seq, shift=2, num_heads=3):
    """Heads fitted (exact least squares; ResBlocks zero) so that on `seq`, the target's greedy trajectory from a
    prompt, head i at position t picks seq[t + i + shift]. shift = 2 is Medusa's offset: every draft is right."""
    h = normed_features(target, seq).double()  # [T, d], T <= d so the fit is exact
    heads = init_from_target(MedusaHeads(medusa_config(target.config, num_heads, 1)), target)
    for i, head in enumerate(heads.lm_heads):
        rows = torch.arange(len(seq) - i - shift)  # positions whose label exists
        labels = torch.tensor(seq[i + shift:])  # [m]
        y = torch.nn.functional.one_hot(labels, target.config.vocab_size).double() * 10  # [m, V] margin 10
        head.weight.copy_(torch.linalg.lstsq(h[rows], y).solution.T)  # [V, d]
    return heads.eval()


def test_checkpoint_uses_vllm_names(tmp_path, target):
    heads = MedusaHeads(medusa_config(target.config, num_heads=3, num_layers=2))
    expected = {f"blocks.{i}.layers.{j}.{p}" for i in range(3) for j in range(2) for p in ("weight", "bias")}
    assert set(heads.state_dict()) == expected | {f"lm_heads.{i}.weight" for i in range(3)}
    assert heads(torch.randn(5, 32)).shape == (3, 5, 300)
    config = json.loads((save_medusa(heads, tmp_path / "medusa") / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (3, 2, 32, 300)
    assert config["medusa_fc_bias"] is True  # vLLM drops the biases without it
    # vLLM's MedusaConfig renames every key holding "num" + "heads"/"layers": only ours may match
    assert [k for k in config if "num" in k and ("heads" in k or "layers" in k)] == ["num_heads", "num_hidden_layers"]


def test_save_load_round_trip_is_bit_identical(tmp_path, random_heads):
    folder = save_medusa(random_heads, tmp_path / "medusa")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["medusa"]  # no temp folder left behind
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_medusa(folder)
    assert loaded.config.to_dict() == random_heads.config.to_dict()
    for (name, a), (_, b) in zip(random_heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_fresh_heads_equal_the_target_lm_head_on_the_normed_feature(target):
    heads = init_from_target(MedusaHeads(medusa_config(target.config, num_heads=2, num_layers=2)), target)
    proposer = MedusaProposer(heads, target)
    ids = PROMPTS[0]
    L = target.config.num_hidden_layers
    with torch.no_grad(), capture_features(target, proposer.feature_layers) as features:
        logits = target(input_ids=torch.tensor([ids])).logits[0, -1]  # [V]
        proposer.observe({L: features[L][0]})
    for row in proposer.head_logits():  # [H, V]
        torch.testing.assert_close(row, logits, atol=1e-5, rtol=1e-5)


def test_heads_draft_from_the_feature_at_position_n_minus_2(target):
    """Oracle heads (head i fitted to x_{t+i+2}) draft the greedy continuation exactly: every cycle accepts all
    k drafts. Heads fitted one place off (x_{t+i+1}, or x_{t+i+3}) are never accepted."""
    prompt, n, k = PROMPTS[0], 15, 3
    reference = greedy_reference(target, prompt, n)
    proposer = MedusaProposer(oracle_heads(target, prompt + reference), target)
    L = target.config.num_hidden_layers
    with torch.no_grad(), capture_features(target, proposer.feature_layers) as features:
        target(input_ids=torch.tensor([prompt[:-1]]))  # the loop's prefill: positions 0..n-2
        proposer.observe({L: features[L][0]})
    assert proposer.propose(prompt, k, SamplingParams(0.0)).tokens.tolist() == reference[:k]
    result = speculative_generate(target, proposer, prompt, n, SamplingParams(0.0), k)
    assert result.tokens == reference and all(c.accepted == k for c in result.cycles[:-1])
    for shift in (1, 3):
        off_by_one = MedusaProposer(oracle_heads(target, prompt + reference, shift), target)
        off = speculative_generate(target, off_by_one, prompt, n, SamplingParams(0.0), k)
        assert off.tokens == reference and off.alpha == 0


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_chain_is_token_identical_to_target_generate(target, random_heads, k):
    for prompt in PROMPTS:
        result = speculative_generate(target, MedusaProposer(random_heads, target), prompt, 16, SamplingParams(0.0),
                                      k, EOS)
        assert result.tokens == greedy_reference(target, prompt, 16)
    assert result.alpha < 1


@pytest.mark.parametrize("choices", [RAGGED, cartesian_choices([2, 2, 2])])
def test_greedy_tree_and_typical_at_t0_are_token_identical_to_target_generate(target, random_heads, choices):
    shape = tree_from_choices(choices, num_heads=3)
    prompt, n = PROMPTS[0], 16
    reference = greedy_reference(target, prompt, n)
    partly_right = oracle_heads(target, prompt + reference)
    with torch.no_grad():
        partly_right.lm_heads[2].weight.copy_(random_heads.lm_heads[2].weight)  # depth 3 is drafted badly
    for heads in (random_heads, partly_right):
        proposer = MedusaTreeProposer(heads, target, shape)
        tree = tree_speculative_generate(target, proposer, prompt, n, eos_token_ids=EOS)
        typical = typical_generate(target, proposer, prompt, n, temperature=0.0, eos_token_ids=EOS)
        assert tree.tokens == reference and typical.tokens == reference
        assert [c.accepted for c in tree.cycles] == [c.accepted for c in typical.cycles]
    assert all(c.accepted >= 2 for c in tree.cycles[:-1])  # accepted paths (depth >= 2) were compacted in the cache


def test_typical_padding_is_never_accepted():
    """A flat target row makes every real token typical; a padded (shorter) path must still stop at its leaf."""
    shape = tree_from_choices([[0], [1], [0, 0]])  # leaves: node 2 (depth 1), node 3 (depth 2)
    tokens, logits = torch.tensor([0, 1, 2, 3]), torch.zeros(4, 4)  # [N+1], [N+1, V] all rows uniform
    candidates, path_logits = typical_inputs(shape.leaf_paths(), tokens, logits)
    assert candidates.tolist() == [[2, 4], [1, 3]] and path_logits.shape == (2, 3, 5)
    verdict = verify_typical(candidates, path_logits, 1.0, generator=torch.Generator().manual_seed(0))
    assert (verdict.num_accepted, verdict.accepted_nodes) == (2, [1]) and verdict.next_token < 4


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampling_at_temperature_1_draws_the_first_two_tokens_from_the_target(tree, one_thread):
    """χ² (level 1e-4, fixed seed) of the first two tokens emitted by the real loop at T = 1 — chain (exact speculative
    sampling with the heads' q) and static tree (deterministic top-k rule) — against the target's own two-token
    distribution. A vocabulary of 8 keeps the 64 cells filled; the target's lm_head is sharpened so that p is far
    from uniform; the random heads' drafts are partly accepted."""
    torch.manual_seed(0)
    small = LlamaForCausalLM(tiny_llama_config(8, num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                               tie_word_embeddings=False)).eval()
    torch.manual_seed(1)
    heads = MedusaHeads(medusa_config(small.config, num_heads=3, num_layers=1)).eval()
    with torch.no_grad():
        small.lm_head.weight.mul_(15.0)
        for head in heads.lm_heads:
            head.weight.mul_(10.0)
    proposer = MedusaTreeProposer(heads, small, tree_from_choices(RAGGED, num_heads=3)) if tree else \
        MedusaProposer(heads, small)
    prompt, n = [3, 5], 2500
    counts, accepted, drafted = sample_first_two_through_the_loop(small, proposer, prompt, n, tree)
    assert 0 < accepted < drafted  # both the accepting and the rejecting branches of the verifier were taken
    assert_first_two_tokens_follow(small, prompt, counts, n)


def test_typical_sampling_runs_with_consistent_stats(target):
    """Typical acceptance at T = 1 is lossy by design (no distribution to test against): lengths and counts only."""
    gen = torch.Generator().manual_seed(0)
    shape = tree_from_choices(RAGGED, num_heads=3)
    prompt, n = PROMPTS[0], 12
    oracle = oracle_heads(target, prompt + greedy_reference(target, prompt, n))
    result = typical_generate(target, MedusaTreeProposer(oracle, target, shape), prompt, n, 1.0, generator=gen)
    emitted = [c.accepted + 1 for c in result.cycles]
    assert len(result.tokens) == n and sum(emitted[:-1]) < n <= sum(emitted)
    assert all(0 <= c.accepted <= c.drafted for c in result.cycles)
    assert all(0 <= t < 300 for t in result.tokens)


def test_bad_input_is_refused_in_one_line(tmp_path, target, random_heads):
    def refused(match, fn, *args, **kwargs):
        with pytest.raises(SpecdrafterError, match=match) as e:
            fn(*args, **kwargs)
        assert "\n" not in str(e.value)

    refused(r"k = 4 needs 4 Medusa heads but only 3 exist", speculative_generate, target,
            MedusaProposer(random_heads, target), PROMPTS[0], 5, SamplingParams(0.0), 4)
    refused(r"tree of depth 4 needs 4 Medusa heads but only 3", MedusaTreeProposer, random_heads, target,
            tree_from_choices([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]))
    refused(r"needs 4 draft heads but only 3 exist", tree_from_choices, [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], 3)
    other = LlamaForCausalLM(tiny_llama_config(320, num_hidden_layers=1)).eval()
    refused(r"vocabulary \(300 tokens\) differs from the target's \(320 tokens\)", MedusaProposer, random_heads, other)
    refused("prompt of >= 2 tokens", speculative_generate, target, MedusaProposer(random_heads, target), [250], 5,
            SamplingParams(0.0), 2)
    refused("could not load the Medusa heads", load_medusa, tmp_path / "missing")
    folder = save_medusa(random_heads, tmp_path / "medusa")
    LlamaConfig(vocab_size=300).save_pretrained(folder)  # a Llama's config.json beside Medusa weights
    refused("is not a Medusa checkpoint", load_medusa, folder)
