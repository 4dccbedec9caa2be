"""A draft narrowed from a wider model (train/narrow.py): at its own width it is a rotation of the same function (the
folded norms and the basis are exact), narrower it keeps the architecture with the residual width cut; what it cannot
narrow is refused in one line."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specdrafter.core.io import SpecdrafterError
from specdrafter.train.narrow import narrowed, residual_basis

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def model_with_unit_free_norms(model):
    """Random norm weights and biases, so that folding them is exercised (a fresh model's norms are all ones)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


MODELS = {
    "qwen2, tied head": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    "llama, biases written to the stream": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, attention_bias=True,
                                                                                 mlp_bias=True)),
}


@pytest.fixture(scope="module")
def calibration():
    torch.manual_seed(0)
    return [torch.randint(0, 300, (40,)) for _ in range(4)]


@pytest.mark.parametrize("name", MODELS)
def test_at_its_own_width_the_narrowed_model_computes_the_same_logits(name, calibration):
    torch.manual_seed(0)
    model = model_with_unit_free_norms(MODELS[name]())
    ids = torch.randint(0, 300, (1, 30))
    with torch.no_grad():
        assert torch.allclose(narrowed(model, 64, calibration)(ids).logits, model(ids).logits, atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_narrower_it_keeps_the_heads_and_the_mlp_and_saves_as_a_plain_causal_lm(name, calibration, tmp_path):
    torch.manual_seed(0)
    model = model_with_unit_free_norms(MODELS[name]())
    narrow = narrowed(model, 40, calibration)
    c = narrow.config
    assert (c.hidden_size, c.head_dim, c.num_attention_heads, c.intermediate_size) == (40, 16, 4, 128)
    assert c.model_type == "llama"  # a Qwen2 is written as the Llama with q/k/v biases it is (llama.cpp serves it)
    assert narrow.model.layers[0].self_attn.q_proj.weight.shape == (64, 40)
    assert narrow.model.layers[0].mlp.down_proj.weight.shape == (40, 128)
    narrow.save_pretrained(tmp_path)
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, narrow(ids).logits)


def test_the_basis_is_orthonormal_and_ordered_by_variance(calibration):
    model = model_with_unit_free_norms(MODELS["qwen2, tied head"]())
    Q = residual_basis(model, calibration)
    assert torch.allclose(Q.T @ Q, torch.eye(64), atol=1e-5)
    with torch.no_grad():
        states = torch.cat([h[0] for ids in calibration
                            for h in model(input_ids=ids[None], output_hidden_states=True).hidden_states])
    energy = ((states @ Q) ** 2).sum(0)
    assert torch.all(energy[:-1] >= energy[1:] * (1 - 1e-4))


@pytest.mark.parametrize("make, d, sequences, says", [
    (lambda: MODELS["qwen2, tied head"](), 65, True, "65 must be at most the draft's own width 64"),
    (lambda: MODELS["qwen2, tied head"](), 32, False, "no training sequences to calibrate"),
    (lambda: MODELS["qwen2, tied head"](), 30, True, r"30 must be a multiple of the draft's 4 attention heads \(e.g. 28\)"),
    (lambda: GemmaForCausalLM(GemmaConfig(**SHAPE, head_dim=16)), 32, True, "narrowing a gemma draft is not supported"),
])
def test_what_cannot_be_narrowed_is_one_line(make, d, sequences, says, calibration):
    with pytest.raises(SpecdrafterError, match=says) as e:
        narrowed(make(), d, calibration if sequences else [])
    assert "\n" not in str(e.value)
