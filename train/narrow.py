"""A narrower draft model initialised from a wider one (`drafter.hidden_size`): the residual stream projected onto its
leading principal directions, every other width kept (attention heads, MLP).

Where a draft model's head is as wide as the target's vocabulary (llama.cpp serves a draft only with the target's
token list, 151,936 rows for Qwen2.5), the head is most of what a draft step costs, and it costs in proportion to the
residual width d. Narrowing d keeps the trained weights' function as far as a linear cut can:

1. fold each RMSNorm's weight into the matrices that read its output (q, k, v after the input norm; gate and up after
   the post-attention norm; the head after the final norm): an RMSNorm with unit weight commutes with any rotation Q
   of the residual stream (rms(Qx) = rms(x));
2. rotate the residual stream by Q, the eigenvectors of its covariance measured on calibration sequences (pooled over
   the inputs of every layer and the final state), and keep the first d: P = Q[:, :d]. Every matrix writing to the
   stream (embeddings, o_proj, down_proj) is multiplied by Pᵀ on its output side, every matrix reading it (q, k, v,
   gate, up, the head) by P on its input side;
3. an RMSNorm over d coordinates divides by ‖Pᵀx‖/√d instead of ‖x‖/√D: its weight becomes √(D/d), so that where the
   dropped directions carry little, each layer sees what it saw.

For llama.cpp, choose d a multiple of 32 (Q8_0 blocks; 256 for K-quants) as well as of the heads: the converter keeps
a matrix whose rows do not split into blocks in F16, and a 252-wide Qwen draft cost more than a 448-wide one
(docs/results). 448 = 14 heads × 32 suits Qwen2.5's 0.5B.

This is the slicing of SliceGPT (Ashkboos et al., 2024) with one rotation for the whole stream instead of one per
layer. The result is a plain causal LM of the same architecture (config.hidden_size = d, config.head_dim kept; a
Qwen2 becomes the Llama it is, see QWEN2_ONLY), which training then distils like any draft model.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from specdrafter.core.io import SpecdrafterError

# architectures whose decoder layers are Llama's: RMSNorm(weight) before attention and MLP, q/k/v/o and gate/up/down
NARROWABLE = ("llama", "mistral", "qwen2", "qwen3")
# A narrowed Qwen2 is written as a Llama with q/k/v biases (Qwen2's computation exactly, its sliding-window settings
# off as in every Qwen2.5 checkpoint): llama.cpp 11434's qwen2 graph requires the attention width to equal the
# residual width (src/models/qwen2.cpp: q as n_embd × n_embd), its llama graph takes any head_dim.
QWEN2_ONLY = ("model_type", "architectures", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
READS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
WRITES = ("self_attn.o_proj", "mlp.down_proj")


@torch.no_grad()
def residual_basis(model: nn.Module, sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    """Q [D, D]: the residual stream's principal directions, most variance first, from `sequences` (token ids)."""
    D = model.config.hidden_size
    cov = torch.zeros(D, D, dtype=torch.float64)
    for ids in sequences:
        states = model(input_ids=ids[None], output_hidden_states=True).hidden_states  # inputs of each layer, final
        for h in states:
            x = h[0].double()  # [T, D]
            cov += x.T @ x
    eigenvalues, vectors = torch.linalg.eigh(cov)  # ascending
    return vectors.flip(-1).float()


@torch.no_grad()
def narrowed(model: nn.Module, d: int, sequences: Sequence[torch.Tensor]) -> nn.Module:
    """`model` with its residual stream cut to `d` directions (module docstring); `sequences` calibrate the basis."""
    config = model.config
    D = config.hidden_size
    if config.model_type not in NARROWABLE:
        raise SpecdrafterError(f"recipe key 'drafter.hidden_size': narrowing a {config.model_type} draft is not "
                               f"supported (its layers must be Llama's: {', '.join(NARROWABLE)})")
    if not 0 < d <= D:  # d = D: a rotation only, the same function (tests/test_train.py checks it)
        raise SpecdrafterError(f"recipe key 'drafter.hidden_size': {d} must be at most the draft's own width {D}")
    heads = config.num_attention_heads
    if d % heads:  # transformers' Llama config requires it (whatever head_dim is)
        raise SpecdrafterError(f"recipe key 'drafter.hidden_size': {d} must be a multiple of the draft's {heads} "
                               f"attention heads (e.g. {d // heads * heads})")
    if not sequences:
        raise SpecdrafterError("recipe key 'drafter.hidden_size': no training sequences to calibrate the narrowing with")
    P = residual_basis(model, sequences)[:, :d]  # [D, d]
    old = {k: v.float() for k, v in model.state_dict().items()}
    head_dim = getattr(config, "head_dim", None) or D // config.num_attention_heads
    facts = {**config.to_dict(), "hidden_size": d, "head_dim": head_dim, "tie_word_embeddings": False}
    if config.model_type == "qwen2":  # written as the Llama it is (below): q/k/v biases, a zero o_proj bias
        facts = {k: v for k, v in facts.items() if k not in QWEN2_ONLY}
        facts.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=True, mlp_bias=False)
    narrow = AutoModelForCausalLM.from_config(AutoConfig.for_model(**facts)).to(torch.float32)
    scale = math.sqrt(D / d)
    new = {"model.embed_tokens.weight": old["model.embed_tokens.weight"] @ P,
           "model.norm.weight": torch.full((d,), scale),
           "lm_head.weight": (old.get("lm_head.weight", old["model.embed_tokens.weight"]) * old["model.norm.weight"]) @ P}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        norm_of = {"self_attn": old[layer + "input_layernorm.weight"], "mlp": old[layer + "post_attention_layernorm.weight"]}
        for name in READS:
            new[layer + name + ".weight"] = (old[layer + name + ".weight"] * norm_of[name.split(".")[0]]) @ P
        for name in WRITES:
            new[layer + name + ".weight"] = P.T @ old[layer + name + ".weight"]
            if layer + name + ".bias" in old:  # a bias written to the stream (Llama's attention_bias, mlp_bias)
                new[layer + name + ".bias"] = P.T @ old[layer + name + ".bias"]
        new[layer + "input_layernorm.weight"] = torch.full((d,), scale)
        new[layer + "post_attention_layernorm.weight"] = torch.full((d,), scale)
    for key, value in old.items():  # biases of q, k, v, and anything inside the heads (Qwen3's q_norm, k_norm)
        if key not in new and key in narrow.state_dict() and narrow.state_dict()[key].shape == value.shape:
            new[key] = value
    for key, value in narrow.state_dict().items():  # a Qwen2 written as a Llama: Llama's o_proj bias is zero
        if key.endswith("self_attn.o_proj.bias") and key not in new:
            new[key] = torch.zeros_like(value)
    missing = [k for k in narrow.state_dict() if k not in new]
    if missing:
        raise SpecdrafterError(f"could not narrow the draft model: no weights for {missing[0]}")
    narrow.load_state_dict(new)
    narrow.generation_config = model.generation_config
    return narrow
