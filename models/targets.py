"""What differs by target architecture, in one place: the layer types a decoding loop must treat differently, the cache
that holds them, how it rolls back after a rejection, and the tree masks each layer type needs.

Three kinds of layer matter to speculative decoding (transformers names them in `config.layer_types`):
- `full_attention`: the KV cache is cropped back to the committed prefix after a rejection; a draft tree is verified in
  one pass with a 4D mask (each node sees the past and its ancestors);
- `sliding_attention` (Mistral, Gemma 3, gpt-oss): the same, but a node at position p sees only keys at positions
  > p − window. A tree mask that ignored the window would let those layers attend further back than they were trained
  to: silently wrong logits. The cache keeps every position (a plain DynamicCache); the masks apply the window.
- `linear_attention` (Qwen3-Next's Gated DeltaNet): a recurrent state over the sequence, not a cache of positions. It
  cannot be cropped, so a chain rolls back by restoring the state saved before the verify pass and feeding the kept
  tokens again (one extra pass of accepted + 1 tokens per rejecting cycle); a tree cannot be verified in one pass (the
  recurrence runs in sequence order, blind to a tree mask), so tree decoding is refused for such a target.
"""

from __future__ import annotations

import difflib
from typing import Dict, List, Optional, Sequence, Union

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from specdrafter.core.io import SpecdrafterError

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"

# The architectures of the target matrix (docs/targets.md), by config.model_type: each row is decoded exactly by the
# tests (tests/test_targets.py). Anything else is refused in one line unless target.untested_architecture is set.
MATRIX = {"llama": "Llama 3", "qwen2": "Qwen2 / Qwen2.5", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE", "mistral": "Mistral",
          "gemma3_text": "Gemma 3 (text)", "gpt_oss": "gpt-oss", "deepseek_v3": "DeepSeek-V3", "qwen3_next": "Qwen3-Next"}
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def tiny_config(name: str, vocab_size: int = 16, window: int = 8):
    """A toy config of matrix row `name` (a model_type, "gemma3" for Gemma 3's text model) with the architecture's own
    features on — Qwen2's attention biases, MoE routing, a sliding window of `window`, gpt-oss's sinks, MLA,
    linear-attention layers — at 4 layers and width 64: what the tests and benchmarks build random targets of each row
    from."""
    import transformers
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    experts = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    rows = {
        "llama": ("LlamaConfig", {}),
        "qwen2": ("Qwen2Config", {}),  # biases on q, k and v (transformers' Qwen2 always has them), none on o
        "qwen3": ("Qwen3Config", dict(head_dim=16)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, **experts)),
        "mistral": ("MistralConfig", dict(sliding_window=window)),
        "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=window,
                                            layer_types=[SLIDING, FULL] * 2)),
        "gpt_oss": ("GptOssConfig", dict(head_dim=16, sliding_window=window, num_local_experts=4,
                                         num_experts_per_tok=2)),
        "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                                                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                                 n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1,
                                                 **experts)),
        "qwen3_next": ("Qwen3NextConfig", dict(head_dim=16, num_experts=4, linear_num_value_heads=4,
                                               linear_num_key_heads=2, linear_key_head_dim=16,
                                               linear_value_head_dim=16, **experts)),
    }
    if name not in rows:
        raise SpecdrafterError(f"no tiny config for {name!r}: the matrix rows are {', '.join(rows)}")
    cls, own = rows[name]
    return getattr(transformers, cls)(**{**common, **own})


# What llama.cpp assumes of rows its converter does not describe in full (core/llamacpp.py:check_served_as_is), as
# changes to `tiny_config`: Gemma 3 in the published layout (one full-attention layer after five sliding ones) with
# its attention scaled by the head size, Mistral without a sliding window (it converts as Llama).
LLAMACPP_LAYOUT = {"gemma3": {"num_hidden_layers": 6, "layer_types": [SLIDING] * 5 + [FULL], "query_pre_attn_scalar": 16},
                   "mistral": {"sliding_window": None}}


def layer_types(config) -> List[str]:
    """The attention type of each layer: `config.layer_types` where the config has it, else every layer sliding when
    the config sets a sliding window it uses (Mistral), else every layer full."""
    config = getattr(config, "text_config", None) or config
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return [SLIDING if window else FULL] * config.num_hidden_layers


def sliding_window(config) -> Optional[int]:
    config = getattr(config, "text_config", None) or config
    return getattr(config, "sliding_window", None) if SLIDING in layer_types(config) else None


def recurrent(config) -> bool:
    """The target has layers whose state cannot be cropped back (linear attention)."""
    return LINEAR in layer_types(config)


def serving_cache_bytes(config, context: int, value_bytes: int = 2) -> int:
    """What a serving engine keeps per sequence of `context` tokens, in bytes at `value_bytes` per value (2: bf16),
    layer by layer: full attention keys and values for every position (2 · kv_heads · head_dim each); a sliding
    window only its last `sliding_window` positions; MLA (DeepSeek-V3: kv_lora_rank set) the compressed latent and
    the RoPE key (kv_lora_rank + qk_rope_head_dim per position, what vLLM, SGLang and llama.cpp cache, not
    transformers' expanded keys); a linear-attention layer its recurrent state and convolution window, whatever the
    context."""
    c = getattr(config, "text_config", None) or config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    window = getattr(c, "sliding_window", None)
    total = 0
    for kind in layer_types(c):
        if kind == LINEAR:  # Gated DeltaNet: a [v_heads, k_dim, v_dim] state and the causal conv's last kernel − 1 inputs
            key_dim = c.linear_num_key_heads * c.linear_key_head_dim
            value_dim = c.linear_num_value_heads * c.linear_value_head_dim
            state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
            total += (state + (2 * key_dim + value_dim) * (c.linear_conv_kernel_dim - 1)) * value_bytes
            continue
        positions = min(context, window) if kind == SLIDING and window else context
        per_position = (c.kv_lora_rank + c.qk_rope_head_dim if getattr(c, "kv_lora_rank", None)
                        else 2 * heads * head_dim)
        total += positions * per_position * value_bytes
    return total


def mlp_activation(config) -> str:
    """The target's MLP activation, for a drafter layer built at its width (Gemma names it hidden_activation)."""
    return getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"


def global_rope(config) -> dict:
    """The target's RoPE for a drafter layer that attends over the whole context; for a target with one per layer type
    (Gemma 3: local and global), its full-attention one."""
    rope = config.rope_parameters
    if isinstance(rope, dict) and "full_attention" in rope and isinstance(rope["full_attention"], dict):
        return dict(rope["full_attention"])
    return dict(rope) if rope else rope


def language_model_only(model):
    """A multimodal target (Gemma 3 from 4B up: Gemma3ForConditionalGeneration, which AutoModelForCausalLM loads) as
    the causal LM of its language model: the same decoder and LM head modules (moved, not copied), no vision tower, so
    the loops, the drafters and their exports see what they see for a text-only target. On text both give the same
    logits (tests/test_targets.py). A text-only model is returned as it is."""
    inner = getattr(getattr(model, "model", None), "language_model", None)
    text = model.config.get_text_config()
    if inner is None or text is model.config:
        return model
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():  # a shell: its meta weights are replaced by the loaded modules
        lm = AutoModelForCausalLM.from_config(text)
    lm.model, lm.lm_head = inner, model.lm_head
    lm.generation_config = model.generation_config
    lm.config._name_or_path = model.config._name_or_path
    return lm


def check_architecture(config, untested_ok: bool = False) -> None:
    """One line for a target whose architecture the matrix does not cover, naming the nearest one it does."""
    kind = getattr(getattr(config, "text_config", None) or config, "model_type", None)
    if kind in MATRIX or untested_ok:
        return
    near = nearest_architecture(config)
    raise SpecdrafterError(f"target architecture {kind!r} is not in the target matrix ({', '.join(MATRIX)}; "
                           f"docs/targets.md); the nearest supported one is {near!r} ({MATRIX[near]}). Set "
                           "target.untested_architecture=true to run it anyway, untested")


def nearest_architecture(config) -> str:
    """The matrix row whose mechanics `config` shares: recurrent layers, MLA, experts, sliding windows; else the
    closest model_type by name (ministral → mistral), else llama."""
    config = getattr(config, "text_config", None) or config
    types = set(layer_types(config))
    experts = any(getattr(config, k, None) for k in EXPERT_KEYS)
    if LINEAR in types:
        return "qwen3_next"
    if getattr(config, "kv_lora_rank", None):
        return "deepseek_v3"
    if experts:
        return "gpt_oss" if SLIDING in types else "qwen3_moe"
    if SLIDING in types:
        return "gemma3_text" if FULL in types else "mistral"
    close = difflib.get_close_matches(str(getattr(config, "model_type", "")), list(MATRIX), n=1, cutoff=0.6)
    return close[0] if close else "llama"


def new_cache(model) -> DynamicCache:
    """The cache a decoding loop fills for `model`: a plain DynamicCache of every position, except for a model with
    recurrent layers, whose cache must hold their states (transformers builds it from the config)."""
    config = getattr(model, "config", None)
    return DynamicCache(config=config) if config is not None and recurrent(config) else DynamicCache()


# ------------------------------------------------------------------------------------------------ rollback
Snapshot = Dict[int, tuple]  # layer index → (conv states, recurrent states) of a linear-attention layer


def snapshot(cache: DynamicCache) -> Optional[Snapshot]:
    """The recurrent layers' states, saved before a verify pass (None: the cache has none, cropping suffices)."""
    saved = {i: ({s: t.clone() for s, t in layer.conv_states.items() if t is not None},
                 {s: t.clone() for s, t in layer.recurrent_states.items() if t is not None})
             for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)}
    return saved or None


def drop_last(cache: DynamicCache, n: int, saved: Optional[Snapshot]) -> None:
    """Remove the last `n` positions of the verify pass from the cache: attention layers are cropped; recurrent layers
    go back to `saved` (their state before the whole pass, which the caller then feeds its kept tokens again)."""
    if saved is None:
        if n:
            cache.crop(-n)
        return
    for i, layer in enumerate(cache.layers):
        if i in saved:
            conv, rec = saved[i]
            layer.conv_states.update({s: t.clone() for s, t in conv.items()})
            layer.recurrent_states.update({s: t.clone() for s, t in rec.items()})
        if isinstance(layer, DynamicLayer) and n:  # an attention layer (or the attention half of a hybrid layer)
            DynamicLayer.crop(layer, -n)


def rollback(target, cache: DynamicCache, ids: torch.Tensor, kept: Sequence[int], saved: Optional[Snapshot]) -> None:
    """After a verify pass over `ids` [1, n], keep only the pass positions `kept` (ascending) in the cache: a chain
    keeps a prefix (0, 1, …, accepted), a tree its root and accepted path. Attention layers move the kept entries
    together and are cropped; a target with recurrent layers (chains only) is put back to `saved` and fed the kept
    ids again."""
    n, kept = ids.shape[1], list(kept)
    if saved is None:
        if kept != list(range(len(kept))):
            _compact(cache, kept, n)
        drop_last(cache, n - len(kept), None)
        return
    if kept != list(range(len(kept))):
        raise ValueError("a target with recurrent layers can only keep a prefix of its verify pass")
    if len(kept) == n:
        return
    drop_last(cache, n, saved)
    target(input_ids=ids[:, :len(kept)], cache=cache, use_cache=True, logits_to_keep=1)


def _compact(cache: DynamicCache, kept: List[int], n: int) -> None:
    """Move the entries of pass positions `kept` (of the last `n` in every layer) to the front of the pass."""
    for layer in cache.layers:
        start = layer.keys.shape[-2] - n  # where this layer's copy of the pass begins
        index = torch.tensor([start + j for j in kept], device=layer.keys.device)
        layer.keys[:, :, start:start + len(kept)] = layer.keys[:, :, index]  # [B, H, n, D]
        layer.values[:, :, start:start + len(kept)] = layer.values[:, :, index]


# ------------------------------------------------------------------------------------------------- trees
def check_tree_target(config) -> None:
    """A draft tree is verified in one masked pass: every layer must attend through a mask."""
    if recurrent(config):
        kind = getattr(config, "model_type", "this target")
        raise SpecdrafterError(f"tree verification needs every layer to attend through a mask, and {kind} has "
                               "linear-attention layers (a recurrent state read in sequence order): decode it with a "
                               "chain (inference.tree=[], inference.dynamic_tree.total_tokens=0; eval.verifiers=[chain])")


def check_tree_draft(config) -> None:
    """A draft model drafts a tree level by level with a plain 4D mask: full-attention layers only."""
    other = sorted(set(layer_types(config)) - {FULL})
    if other:
        kind = getattr(config, "model_type", "this draft model")
        raise SpecdrafterError(f"drafting a tree with a draft model needs full-attention layers only, and {kind} has "
                               f"{' and '.join(other)} layers: draft a chain with it (inference.tree=[], "
                               "inference.dynamic_tree.total_tokens=0)")


def tree_masks(config, allowed: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> Union[torch.Tensor, Dict[str, torch.Tensor]]:
    """The additive 4D mask(s) [1, 1, Q, K] of a tree pass: `allowed` [Q, K] (past + ancestors), and for sliding
    layers also key position > query position − window. One mask when every layer has one type; else one per layer
    type, as the models with mixed layers take them (gpt-oss, Gemma 3: {"full_attention": ..., "sliding_attention": ...})."""
    def additive(ok: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ok.shape, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min)[None, None]

    types = set(layer_types(config))
    masks = {FULL: additive(allowed)} if FULL in types else {}
    if SLIDING in types:
        window = sliding_window(config)
        masks[SLIDING] = additive(allowed & (key_positions[None, :] > query_positions[:, None] - window))
    return next(iter(masks.values())) if len(masks) == 1 else masks
