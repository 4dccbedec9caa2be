"""EAGLE-1 head: greedy decoding through its chain and tree proposers is token-identical to target.generate,
its drafts come from the target's own norm + lm_head on the predicted feature, and checkpoints round-trip.
Training (a few steps of the project's loop lower its loss, feature regression + ce_weight · objective, and the saved
head decodes like the target) is tested with the other drafters' training, on their shared data: tests/test_train.py,
test_eagle1_trains_its_loss_falls_and_the_saved_head_decodes_like_the_target."""

import pytest
import torch
from conftest import tiny_llama_config
from transformers import LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.decode import speculative_generate, tree_speculative_generate
from specdrafter.inference.eagle import EagleProposer, EagleTreeProposer
from specdrafter.inference.sampling import SamplingParams
from specdrafter.models.eagle import Eagle1Head, eagle1_config, load_eagle1, save_eagle3
from specdrafter.models.features import capture_features

V = 96
PROMPTS = [[5, 17, 42, 9], [1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=3)).eval()


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(1)
    return Eagle1Head(eagle1_config(target.config)).eval()


def test_config_and_weight_names(head, target):
    assert head.config.architectures == ["LlamaForCausalLMEagle"] and head.aux_layer_ids == [3]
    keys = set(head.state_dict())
    assert {"fc.weight", "fc.bias", "self_attn.q_proj.weight", "mlp.down_proj.weight", "d2t"} <= keys
    assert not any(k.startswith(("lm_head", "norm.", "embed")) for k in keys)  # borrowed from the target
    assert head.fc.weight.shape == (32, 64)


def test_greedy_chain_and_tree_are_token_identical_to_the_target(target, head):
    for prompt in PROMPTS:
        reference = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=None,
                                    pad_token_id=2)[0, len(prompt):].tolist()
        chain = speculative_generate(target, EagleProposer(head, target), prompt, 10, SamplingParams(0.0), k=3)
        tree = tree_speculative_generate(target, EagleTreeProposer(head, target, depth=3, top_k=2, total_tokens=6),
                                         prompt, 10, SamplingParams(0.0))
        assert chain.tokens == reference and tree.tokens == reference


def test_first_draft_is_the_target_head_on_the_predicted_feature(target, head):
    committed = PROMPTS[1]
    with capture_features(target, [3]) as features, torch.no_grad():
        target(input_ids=torch.tensor([committed[:-1]]))
        f = features[3][0]  # [n-1, d]
    proposer = EagleProposer(head, target)
    proposer.observe({3: f})
    draft = proposer.propose(committed, 1, SamplingParams(0.0)).tokens.tolist()
    with torch.no_grad():
        n = f.shape[0]
        predicted, _ = head(f[None], target.get_input_embeddings()(torch.tensor([committed[1:]])), torch.arange(n)[None],
                            torch.ones(n, n, dtype=torch.bool).tril()[None, None])
        expected = target.lm_head(target.model.norm(predicted[0, -1])).argmax()
    assert draft == [int(expected)]


def test_checkpoint_round_trip_and_refusals(tmp_path, target, head):
    save_eagle3(head, tmp_path / "eagle1")
    loaded = load_eagle1(tmp_path / "eagle1")
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(SpecdrafterError, match="needs its target's norm and lm_head"):
        loaded.logits(torch.zeros(1, 32))
    other = LlamaForCausalLM(tiny_llama_config(V + 1, num_hidden_layers=3))
    with pytest.raises(SpecdrafterError, match="vocabulary"):
        EagleProposer(loaded, other)
