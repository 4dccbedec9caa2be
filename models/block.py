"""Block drafters (docs/block-drafters.md): DFlash, DSpark, DFlash2 and Domino, which draft a whole block of tokens in one
forward pass of a small transformer that reads the target's hidden states.

The backbone. `num_hidden_layers` decoder layers at the target's width, each a Qwen3-style layer (per-head RMSNorm
on queries and keys). The target features — the inputs of the target layers `aux_layer_ids` — are concatenated
and fused once, H = hidden_norm(fc(concat)), fc: m·d_t → d without bias. Every layer attends from the block's slots
over [its own keys of H ; its keys of the block] (k_norm and RoPE on both; H does not pass through the layer's input
norm); the queries come from the block only. A block at anchor position a is [x_a, MASK × (B−1)], embedded with the
target's frozen token embedding, at positions a .. a+B−1 (one RoPE table for context and block). It attends to
every context position < a — the target has not yet run on x_a when decoding drafts from it — and bidirectionally
to its own slots. The last hidden states go through `norm` and the target's frozen lm_head (over the draft
vocabulary when it is pruned: target id = i + d2t[i], as EAGLE-3 does).

The variants. Draft j (0-based) of a block always predicts x_{a+1+j}:
    dflash  slot k predicts x_{a+k}; the anchor slot predicts nothing: γ = B − 1 drafts, from slots 1..B−1
    dspark  label shift, slot k predicts x_{a+k+1}: γ = B drafts, from slots 0..B−1; then a rank-r Markov head,
            logits_j = U_j + W2(W1[prev_j]) with prev_0 = the anchor and prev_j = draft j−1 (the true token in
            training), and a confidence head c_j = σ(proj([h_j ; W1[prev_j]]))
    dflash2 DFlash's slots, plus a two-sided dynamic convolution along the block around each sublayer
            (`DynamicConv`) and a candidate selector (`CandidateSelector`): draft j is one of the top K of its slot's
            logits, scored given the draft before it (the anchor for the first); trained with a K-way CE of its own
    domino  DSpark's label shift (γ = B drafts) without its heads, plus a causal correction of the logits: a GRU
            (no bias) reads the target's embeddings of the anchor and the drafts so far, and from draft
            pure_draft_prefix_len on, logits_j = U_j + W_b·SiLU(W_a·[h_j ; g_j]) with g_j its state after the
            token before draft j (the true tokens in training; `DominoCorrection`)

Layer ids. `aux_layer_ids` are the project's one convention (models/features.py): id k is the *input* to target
layer k, HF's `hidden_states[k]`. The engines' `dflash_config.target_layer_ids` name layer outputs (id − 1); the
exports and `engine_layout` (models/block_folders.py) convert at that boundary and nowhere else. Valid ids are
1..L − 1: id 0 (the token embedding) has no output spelling, and id L, the last layer's output, is one HF reports
after the final norm and the engines' capture loops never reach.

Tensor names are the ones vLLM's DFlashDraftModel loads: layers.N.self_attn.{q,k,v,o}_proj, layers.N.self_attn.
{q_norm,k_norm}, layers.N.mlp.{gate,up,down}_proj, layers.N.{input_layernorm,post_attention_layernorm}, fc,
hidden_norm, norm, d2t, t2d; DSpark adds markov_head.{markov_w1,markov_w2} and confidence_head.proj; DFlash2
layers.N.{attention_conv,mlp_conv}.{base_kernel,kernel_projection} and candidate_selector.{predecessor_codebook,
successor_codebook,hidden_projection} (vLLM's qwen3_dflash2.py, llama.cpp's DFlash2 tensors); Domino
prefix_gru.{weight_ih_l0,weight_hh_l0} and embed_proj.{0,2}.weight (vLLM's qwen3_dflash.py DominoHead). The target's
embedding and lm_head are passed in and never saved. The folders it is saved as and loaded from, ours and the
engines': models/block_folders.py.
"""

# No `from __future__ import annotations`: @strict checks a config field's type only when its annotation is a real type.
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from specdrafter.core.io import SpecdrafterError
from specdrafter.models.targets import global_rope, mlp_activation

KV = Tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Variant:
    """What tells DFlash and DSpark apart in the model, and the class names the engines know its folders by (the one
    table of them; kinds/block.py holds how the engines serve it)."""
    name: str  # the config's `variant` and the recipe's drafter.kind
    architecture: str  # config.json's architectures: the class vLLM and SGLang register (our folder says it too)
    speculators_architecture: str  # the speculators library's class, `architectures` of its folder
    label_shift: bool  # slot k predicts x_{a+k+1} (DSpark: the anchor slot drafts too), else x_{a+k} (DFlash)
    heads: bool  # the Markov and confidence heads exist (by default on)
    selector: bool = False  # DFlash2: the dynamic convolutions around each sublayer and the candidate selector
    # Domino: the GRU correction of the logits; the engines know it as DFlash with dflash_config.projector_type
    projector: Optional[str] = None
    also_named: Tuple[str, ...] = ()  # other architectures a folder of it carries (read, never written)

    def named(self, architectures, projector: Optional[str] = None) -> bool:
        """Whether a config.json's `architectures` list names this variant's engine class, with the engines'
        dflash_config.projector_type `projector` (Domino's "domino"; None for the others)."""
        return (isinstance(architectures, list) and bool({self.architecture, *self.also_named} & set(architectures))
                and projector == self.projector)


DFLASH = Variant("dflash", "DFlashDraftModel", "DFlashSpeculator", label_shift=False, heads=False)
# DeepSpec's name for the dense Qwen3 DSpark draft, which vLLM's qwen3_dspark.py and SGLang's models/dspark.py
# register; specdrafter's own folders said DSparkDraftModel before (vLLM maps that name to DeepSeek-V4's DSpark
# unless the config is a qwen3 one)
DSPARK = Variant("dspark", "Qwen3DSparkModel", "DSparkSpeculator", label_shift=True, heads=True,
                 also_named=("DSparkDraftModel",))
# z-lab's / Inco AI's DFlash2 (vLLM's qwen3_dflash2.py, SGLang's DFlash2 path and llama.cpp's DFlash graph register it)
DFLASH2 = Variant("dflash2", "DFlash2DraftModel", "DFlash2Speculator", label_shift=False, heads=False, selector=True)
# Domino (arXiv 2605.29707; SpecForge's domino.py): a DFlash folder to vLLM's and SGLang's dflash path, told apart by
# dflash_config.projector_type "domino"; SpecForge's own checkpoints say DominoDraftModel
DOMINO = Variant("domino", "DFlashDraftModel", "DominoSpeculator", label_shift=True, heads=False, projector="domino",
                 also_named=("DominoDraftModel",))
VARIANTS = {v.name: v for v in (DFLASH, DSPARK, DFLASH2, DOMINO)}
DEFAULT_MASK_TOKEN_ID = 16  # SmolLM2's <empty_output>: a special token chat text does not use
DEFAULT_MARKOV_RANK = 256  # DSpark's; DFlash has no Markov head
# DFlash2's published sizes (z-lab's Qwen3 checkpoints, the peers' defaults): 2 taps, 16 channels per dynamic
# coefficient, a rank-256 selector choosing among each draft's top 16
DEFAULT_SELECTOR = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)
# Domino's published sizes (SpecForge's and Model-Optimizer's Qwen3 configs): a 1024-wide GRU, a 256-wide correction,
# the first draft left uncorrected
DEFAULT_CORRECTION = dict(gru_hidden_dim=1024, emb_dim=256, pure_draft_prefix_len=1)


@strict
class BlockDrafterConfig(Qwen3Config):
    """A Qwen3 config (the backbone's layers) plus the block drafter's own fields. model_type stays "qwen3", the
    layer type the engines build for DFlash."""
    variant: str = "dflash"  # "dflash" | "dspark" (VARIANTS)
    block_size: int = 16  # slots per block: the anchor and block_size − 1 masks
    mask_token_id: int = DEFAULT_MASK_TOKEN_ID  # an unused row of the target's embedding
    aux_layer_ids: list[int] | None = None  # the target features read: id k = the input to layer k, increasing
    num_target_layers: int = 0  # 0: unknown until the drafter meets its target (inference/block.py fills it in)
    target_hidden_size: int | None = None  # the features' width d_t (None: hidden_size)
    draft_vocab_size: int | None = None  # None: the full vocabulary
    markov_rank: int = 0  # r of DSpark's Markov head; 0: none
    enable_confidence_head: bool = False  # DSpark's confidence head
    conv_kernel_size: int = 0  # DFlash2: taps of the convolution around each sublayer (0: none)
    conv_group_size: int = 0  # DFlash2: channels that share one dynamic tap coefficient
    selector_rank: int = 0  # DFlash2: rank of the candidate selector's codebooks (0: no selector)
    selector_top_k: int = 0  # DFlash2: candidates per draft the selector chooses among
    gru_hidden_dim: int = 0  # Domino: width of the GRU over the block's previous tokens (0: no correction)
    emb_dim: int = 0  # Domino: width of the correction's hidden layer
    pure_draft_prefix_len: int = 0  # Domino: the first drafts, drawn from the backbone's logits uncorrected


def config_problem(c: BlockDrafterConfig) -> Optional[str]:
    """What makes `c` a drafter we cannot build or that would read the wrong features (None: nothing)."""
    L, ids = c.num_target_layers, list(c.aux_layer_ids or [])
    if c.variant not in VARIANTS:
        return f"variant = {c.variant!r} (known: {', '.join(map(repr, VARIANTS))})"
    if c.num_hidden_layers < 1:
        return f"num_hidden_layers = {c.num_hidden_layers}; the backbone has at least one layer"
    if c.block_size < 2:
        return f"block_size = {c.block_size}; a block is the anchor and at least one masked slot (block_size >= 2)"
    if not 0 <= c.mask_token_id < c.vocab_size:
        return f"mask_token_id = {c.mask_token_id} is outside the target's embedding (rows 0..{c.vocab_size - 1})"
    if not ids:
        return "aux_layer_ids is empty; the drafter reads at least one target layer"
    if L and L in ids:  # num_target_layers 0: not known yet (a speculators folder), checked against the target
        return (f"aux_layer_ids names {L}, the last layer's output, which the target reports after its final norm; "
                f"use layer inputs 1..{L - 1}")
    bad = next((k for k in ids if not 1 <= k <= (L - 1 if L else k)), None)
    if bad is not None:
        return f"aux_layer_ids names {bad}, outside 1..{L - 1} (the layer inputs of a target with {L} layers)"
    if ids != sorted(set(ids)):
        return f"aux_layer_ids = {ids} {'repeat a layer' if len(set(ids)) < len(ids) else 'are not increasing'}"
    if c.draft_vocab_size is not None and not 1 <= c.draft_vocab_size <= c.vocab_size:
        return f"draft_vocab_size = {c.draft_vocab_size}; expected 1..{c.vocab_size} (the target's vocabulary)"
    if c.markov_rank < 0:
        return f"markov_rank = {c.markov_rank}; expected >= 0 (0: no Markov head)"
    if not VARIANTS[c.variant].heads and (c.markov_rank or c.enable_confidence_head):
        name = c.variant.replace("dflash", "DFlash")
        return f"a {name} drafter has no Markov or confidence head (markov_rank 0, enable_confidence_head false)"
    return selector_problem(c) or correction_problem(c)


def selector_problem(c: BlockDrafterConfig) -> Optional[str]:
    """DFlash2's convolution and selector settings: all set for it, none for the other variants."""
    sizes = {k: getattr(c, k) for k in DEFAULT_SELECTOR}
    if not VARIANTS[c.variant].selector:
        return (None if not any(sizes.values()) else
                f"a {c.variant} drafter has no convolutions or candidate selector ({', '.join(sizes)} must be 0)")
    bad = next((k for k, v in sizes.items() if v < 1), None)
    if bad is not None:
        return f"{bad} = {sizes[bad]}; a dflash2 drafter needs its convolutions and selector (>= 1)"
    if c.hidden_size % c.conv_group_size:
        return f"conv_group_size = {c.conv_group_size} does not divide hidden_size {c.hidden_size}"
    if c.selector_top_k > c.vocab_size:
        return f"selector_top_k = {c.selector_top_k} exceeds the vocabulary ({c.vocab_size})"
    if c.draft_vocab_size is not None and c.draft_vocab_size < c.vocab_size:
        # the selector's codebooks and the engines' top-k read the target's whole vocabulary (vLLM, llama.cpp)
        return f"draft_vocab_size = {c.draft_vocab_size}; a dflash2 drafter drafts over the full vocabulary"
    return None


def correction_problem(c: BlockDrafterConfig) -> Optional[str]:
    """Domino's correction settings: set for it, none for the other variants."""
    sizes = {k: getattr(c, k) for k in DEFAULT_CORRECTION}
    if VARIANTS[c.variant].projector is None:
        return (None if not any(sizes.values()) else
                f"a {c.variant} drafter has no GRU correction ({', '.join(sizes)} must be 0)")
    bad = next((k for k in ("gru_hidden_dim", "emb_dim") if sizes[k] < 1), None)
    if bad is not None:
        return f"{bad} = {sizes[bad]}; a domino drafter needs its GRU correction (>= 1)"
    if not 0 <= c.pure_draft_prefix_len < c.block_size:
        return (f"pure_draft_prefix_len = {c.pure_draft_prefix_len}; expected 0..{c.block_size - 1} (uncorrected "
                f"drafts of the {c.block_size} in a block)")
    if c.draft_vocab_size is not None and c.draft_vocab_size < c.vocab_size:
        # the correction's output layer spans the target's whole vocabulary (vLLM's DominoHead, SpecForge)
        return f"draft_vocab_size = {c.draft_vocab_size}; a domino drafter drafts over the full vocabulary"
    return None


def check_config(c: BlockDrafterConfig, where: str) -> None:
    problem = config_problem(c)
    if problem:
        raise SpecdrafterError(f"{where}: {problem}")


def default_aux_layer_ids(num_layers: int, count: int = 5) -> List[int]:
    """The upstream trainers' default, the outputs of layers round(linspace(1, L − 3, count)) (Python's round, half
    to even), as layer inputs: [2, 9, 15, 21, 28] for SmolLM2's 30 layers. Never the last layer's output."""
    span = num_layers - 4
    outputs = [round(1 + i * span / (count - 1)) for i in range(count)] if count > 1 else [1]
    if span < 0 or len(set(outputs)) < count:
        raise SpecdrafterError(f"a target with {num_layers} layers has no {count} distinct default feature layers "
                               f"between 2 and L − 2; pass aux_layer_ids")
    return [k + 1 for k in outputs]


def block_config(target_config, variant: Variant, num_layers: int = 1, block_size: int = 16,
                 aux_layer_ids: Optional[Sequence[int]] = None, mask_token_id: int = DEFAULT_MASK_TOKEN_ID,
                 markov_rank: Optional[int] = None, enable_confidence_head: Optional[bool] = None,
                 draft_vocab_size: int = 0, num_features: int = 5,
                 selector: Optional[Dict[str, int]] = None,
                 correction: Optional[Dict[str, int]] = None) -> BlockDrafterConfig:
    """A block drafter of `num_layers` layers with the target's dimensions. aux_layer_ids: layer inputs (None:
    `default_aux_layer_ids(L, num_features)`); markov_rank / enable_confidence_head: None = the variant's own (DSpark
    256 and on, DFlash 0 and off); draft_vocab_size 0 = the full vocabulary; selector: DFlash2's sizes
    (`DEFAULT_SELECTOR`'s keys; None: its defaults), correction: Domino's (`DEFAULT_CORRECTION`'s keys), each ignored
    by the other variants."""
    t = target_config
    L = t.num_hidden_layers
    heads = variant.heads
    config = BlockDrafterConfig(
        architectures=[variant.architecture], variant=variant.name, num_hidden_layers=num_layers, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads, hidden_act=mlp_activation(t),
        rms_norm_eps=t.rms_norm_eps, rope_parameters=global_rope(t),
        max_position_embeddings=t.max_position_embeddings, initializer_range=t.initializer_range,
        vocab_size=t.vocab_size, draft_vocab_size=draft_vocab_size or None, block_size=block_size,
        mask_token_id=mask_token_id,
        aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(L, num_features),
        num_target_layers=L, target_hidden_size=t.hidden_size,
        markov_rank=(DEFAULT_MARKOV_RANK if heads else 0) if markov_rank is None else markov_rank,
        enable_confidence_head=heads if enable_confidence_head is None else enable_confidence_head,
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, pad_token_id=getattr(t, "pad_token_id", None),
        **({**DEFAULT_SELECTOR, **(selector or {})} if variant.selector else {}),
        **({**DEFAULT_CORRECTION, **(correction or {})} if variant.projector else {}))
    check_config(config, "block drafter config")
    return config


# ------------------------------------------------------------------------------------------------ the model
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, heads, n, hd] with cos, sin [B, n, hd] of its positions."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class BlockAttention(nn.Module):
    """Qwen3 attention whose keys and values are the context's (computed once, `keys_values` of H) followed by the
    block's own; the queries are the block's."""

    def __init__(self, config: BlockDrafterConfig):
        super().__init__()
        d, bias = config.hidden_size, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, rope: KV) -> KV:
        """k-normed, rotated keys and the values of x [B, n, d]: [B, kvh, n, hd] each."""
        B, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)  # [B, kvh, n, hd]
        v = self.v_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, n, hd]
        return _rotate(k, *rope), v

    def forward(self, x: torch.Tensor, rope: KV, context: KV, block_size: int,
                unseen: Optional[torch.Tensor]) -> torch.Tensor:
        """x [B, N·S, d]: N blocks of S = block_size slots. Every slot attends over the context keys its block may see
        (unseen [B, 1, 1, N·S, T] bool, True = hidden: `slot_mask`; None: all of them) and over its own block's S slots,
        never another block's:
        scores [.., N·S, T + S], not [.., N·S, T + N·S] — what lets training put hundreds of blocks in one pass."""
        B, n, _ = x.shape
        S, h, kvh, hd = block_size, self.num_heads, self.num_kv_heads, self.head_dim
        N, g = n // S, h // kvh  # query head i reads kv head i // g (grouped-query attention)
        q = self.q_norm(self.q_proj(x).view(B, n, h, hd)).transpose(1, 2)  # [B, h, n, hd]
        q = _rotate(q, *rope).reshape(B, kvh, g * n, hd) * hd ** -0.5  # a kv head's g query heads side by side
        k, v = self.keys_values(x, rope)  # [B, kvh, n, hd] the blocks' own
        context_k, context_v = context  # [B, kvh, T, hd]
        T = context_k.shape[2]
        on_context = (q @ context_k.transpose(-1, -2)).view(B, kvh, g, n, T)
        if unseen is not None:
            on_context = on_context.masked_fill(unseen, float("-inf"))
        on_block = q.view(B, kvh, g, N, S, hd) @ k.view(B, kvh, 1, N, S, hd).transpose(-1, -2)  # [B, kvh, g, N, S, S]
        weights = torch.cat([on_context, on_block.reshape(B, kvh, g, n, S)], dim=-1).softmax(-1, dtype=torch.float32)
        to_context, to_block = weights.to(v.dtype).split([T, S], dim=-1)  # [B, kvh, g, n, T], [B, kvh, g, n, S]
        out = (to_context.reshape(B, kvh, g * n, T) @ context_v).view(B, kvh, g, n, hd)
        out = out + (to_block.reshape(B, kvh, g, N, S, S) @ v.view(B, kvh, 1, N, S, hd)).reshape(B, kvh, g, n, hd)
        return self.o_proj(out.reshape(B, h, n, hd).transpose(1, 2).reshape(B, n, -1))  # [B, n, d]


class DynamicConv(nn.Module):
    """DFlash2's grouped dynamic depthwise convolution along a block's slots, causal inside the block, around one
    sublayer: out[i, c] = Σ_t (base[t, c] + δ[i, t, c // group_size]) · x[i − t, c], where a tap reaching before the
    block's first slot adds nothing. One projection of the sublayer's (normed) input gives δ for both sides: `prepare`
    convolves that input with side 0 and hands back side 1's δ, with which `finish` convolves the sublayer's output.
    Starts as the identity (tap 0 = 1, the other taps 0, δ = 0: `BlockDrafter._init_weights`). Tensor names and the
    δ layout [.., 2, taps, groups] are vLLM's and llama.cpp's."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def reset(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int, block_size: int) -> torch.Tensor:
        """x [B, N·S, d] (N blocks of S = block_size slots), delta [B, N·S, taps, groups] → [B, N·S, d]."""
        B, n, d = x.shape
        K, G, S = self.kernel_size, self.groups, block_size
        slots = x.view(B, n // S, S, G, d // G)  # [B, N, S, G, gs]
        weight = (self.base_kernel[side].view(K, G, d // G) + delta[..., None]).view(B, n // S, S, K, G, d // G)
        out = weight[..., 0, :, :] * slots
        for tap in range(1, min(K, S)):  # slot i reads slot i − tap of its own block, zeros before the first
            out = out + weight[..., tap, :, :] * F.pad(slots[:, :, :-tap], (0, 0, 0, 0, tap, 0))
        return out.reshape(B, n, d)

    def prepare(self, x: torch.Tensor, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        delta = self.kernel_projection(x).view(*x.shape[:2], 2, self.kernel_size, self.groups)  # [B, n, 2, K, G]
        return self._convolve(x, delta[:, :, 0], 0, block_size), delta[:, :, 1]

    def finish(self, x: torch.Tensor, delta: torch.Tensor, block_size: int) -> torch.Tensor:
        return self._convolve(x, delta, 1, block_size)


class BlockDecoderLayer(nn.Module):
    def __init__(self, config: BlockDrafterConfig):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = BlockAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        convolved = config.conv_kernel_size > 0  # DFlash2
        self.attention_conv = DynamicConv(config.hidden_size, config.conv_kernel_size,
                                          config.conv_group_size) if convolved else None
        self.mlp_conv = DynamicConv(config.hidden_size, config.conv_kernel_size,
                                    config.conv_group_size) if convolved else None

    def forward(self, h: torch.Tensor, rope: KV, context: KV, block_size: int,
                unseen: Optional[torch.Tensor]) -> torch.Tensor:
        attend = lambda x: self.self_attn(x, rope, context, block_size, unseen)  # noqa: E731
        h = h + self._around(self.attention_conv, attend, self.input_layernorm(h), block_size)  # [B, n, d]
        return h + self._around(self.mlp_conv, self.mlp, self.post_attention_layernorm(h), block_size)

    @staticmethod
    def _around(conv: Optional[DynamicConv], sublayer, x: torch.Tensor, block_size: int) -> torch.Tensor:
        """The sublayer on x, inside DFlash2's convolutions when the layer has them (the block's own keys and values
        come from the convolved input; the context's never pass through it)."""
        if conv is None:
            return sublayer(x)
        x, delta = conv.prepare(x, block_size)
        return conv.finish(sublayer(x), delta, block_size)


class MarkovHead(nn.Module):
    """logits += W2(W1[prev]): a rank-r bigram correction from the previous token. W1 [V, r] is indexed by target
    ids (the anchor, the drafts); W2: r → Vd writes over the draft vocabulary."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """The logit of c_j, σ of which estimates whether draft j will be accepted, from [h_j ; W1[prev_j]]."""

    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1)


class CandidateSelector(nn.Module):
    """DFlash2's path selector over each draft's top-K candidates (target ids): the score of candidate c after the
    token p drafted before it, at a slot whose final hidden state is h, is
        s(p, c) = U(c) + ⟨A[p] ⊙ P·h, B[c]⟩,
    U the slot's own logits, A and B [V, r] codebooks of predecessors and successors, P: d → r. Tensor names are vLLM's
    and llama.cpp's (the codebooks bare parameters, not embeddings)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, unary: torch.Tensor, candidates: torch.Tensor, hidden: torch.Tensor,
               prev: torch.Tensor) -> torch.Tensor:
        """unary [..., K] the logits of candidates [..., K], hidden [..., d] of their slot, prev [...] the token before
        (target ids) → the candidates' scores [..., K] (float32)."""
        gate = self.hidden_projection(hidden.to(self.successor_codebook.dtype)) * self.predecessor_codebook[prev]  # [..., r]
        pair = (self.successor_codebook[candidates] @ gate[..., None])[..., 0]  # [..., K]
        return unary.float() + pair.float()


def domino_correction(hidden_size: int, vocab_size: int, gru_hidden_dim: int,
                      emb_dim: int) -> Tuple[nn.GRU, nn.Sequential]:
    """Domino's causal correction of a block's logits: a GRU without biases over the target's embeddings of the tokens
    before each draft (the anchor, then the drafts), and the projection that turns [h_j ; g_j] — the slot's final
    hidden state and the GRU's state after the token before draft j — into the draft's additive logits,
        δ_j = W_b · SiLU(W_a · [h_j ; g_j])
    (`BlockDrafter.correct` in training, `read` and `heads` in decoding). Returns (prefix_gru, embed_proj)."""
    gru = nn.GRU(hidden_size, gru_hidden_dim, num_layers=1, batch_first=True, bias=False)
    project = nn.Sequential(nn.Linear(hidden_size + gru_hidden_dim, emb_dim, bias=False), nn.SiLU(),
                            nn.Linear(emb_dim, vocab_size, bias=False))
    return gru, project


@dataclass
class BlockDrafts:
    """What a block drafter says about its γ drafts per block; draft j predicts x_{a+1+j}."""
    logits: torch.Tensor  # [..., γ, Vd] over the draft vocabulary
    hidden: torch.Tensor  # [..., γ, d] the final-norm hidden states they come from
    confidence: Optional[torch.Tensor] = None  # [..., γ] confidence logits (c = σ of them), DSpark's head only
    base: Optional[torch.Tensor] = None  # [..., γ, V] Domino's backbone logits before its correction (training)


@dataclass
class ContextCache:
    """Per-layer keys (k-normed, rotated) and values of the fused context at positions 0..length−1, [B, kvh, T, hd]
    each. A block's own keys are never stored, so each cycle only adds the newly committed positions."""
    keys: List[torch.Tensor]
    values: List[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def context(self, layer: int) -> KV:
        return self.keys[layer], self.values[layer]


def context_mask(anchors: torch.Tensor, context_len: int) -> torch.Tensor:
    """bool [B, N, T], True = may attend: block n of sequence b sees the context positions before its anchor,
    anchors [B, N]. The context is masked by position; a block's own slots are told apart by block, not by position
    (BlockAttention): overlapping blocks share positions, and a positional rule would let one see another's slots."""
    return torch.arange(context_len, device=anchors.device) < anchors[..., None]


def slot_mask(sees_context: torch.Tensor, block_size: int) -> torch.Tensor:
    """`context_mask` [B, N, T] as BlockAttention takes it: per slot, True where the context is hidden, [B, 1, 1, N·S, T]."""
    return ~sees_context.repeat_interleave(block_size, dim=1)[:, None, None]


def token_windows(tokens: torch.Tensor, anchors: torch.Tensor, offset: int, width: int, fill: int) -> torch.Tensor:
    """tokens[b, anchors[b, n] + offset + i] for i < width, `fill` past the end: [B, N, width] from tokens [B, T]."""
    T = tokens.shape[1]
    at = anchors[..., None] + offset + torch.arange(width, device=anchors.device)  # [B, N, width]
    picked = tokens.gather(1, at.clamp(max=T - 1).flatten(1)).view_as(at)  # [B, N, width]
    return picked.masked_fill(at >= T, fill)


class BlockDrafter(nn.Module):
    def __init__(self, config: BlockDrafterConfig):
        super().__init__()
        check_config(config, "block drafter config")
        self.config = config
        d, V = config.hidden_size, config.vocab_size
        Vd, r = config.draft_vocab_size or V, config.markov_rank
        self.layers = nn.ModuleList(BlockDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.aux_layer_ids) * (config.target_hidden_size or d), d, bias=False)
        self.hidden_norm = Qwen3RMSNorm(d, config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(d, config.rms_norm_eps)
        self.markov_head = MarkovHead(V, Vd, r) if r else None
        self.confidence_head = ConfidenceHead(d + r) if config.enable_confidence_head else None
        self.candidate_selector = CandidateSelector(V, d, config.selector_rank) if config.selector_rank else None
        # Domino's correction, at top level under the names vLLM loads (prefix_gru.*, embed_proj.{0,2}.weight)
        self.prefix_gru, self.embed_proj = (domino_correction(d, V, config.gru_hidden_dim, config.emb_dim)
                                            if config.gru_hidden_dim else (None, None))
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.full((V,), Vd == V))  # the full vocabulary: the identity maps
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """As HF initialises a Qwen3 model: normal(0, initializer_range) weights, zero biases, unit norms."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, DynamicConv):  # after its projection (apply visits children first): the identity
            module.reset()
        if isinstance(module, CandidateSelector):
            nn.init.normal_(module.predecessor_codebook, std=self.config.initializer_range)
            nn.init.normal_(module.successor_codebook, std=self.config.initializer_range)

    # ---------------------------------------------------------------------------------------- what it reads
    @property
    def variant(self) -> Variant:
        return VARIANTS[self.config.variant]  # check_config: a known one

    @property
    def num_drafts(self) -> int:
        """γ: drafts per block."""
        return self.config.block_size - self._first_slot

    @property
    def _first_slot(self) -> int:
        return 0 if self.variant.label_shift else 1  # DFlash's anchor slot predicts nothing

    @property
    def feature_layers(self) -> List[int]:
        """The target features read (models/features.py ids)."""
        return list(self.config.aux_layer_ids)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target token id of each draft-vocabulary entry, [Vd]."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Prune the vocabulary to `target_ids` [Vd] (increasing target ids): d2t[i] = target_ids[i] − i, t2d marks them."""
        if target_ids.shape != self.d2t.shape or not bool((target_ids[1:] > target_ids[:-1]).all()):
            raise SpecdrafterError(f"a draft vocabulary of this drafter is {len(self.d2t)} increasing target ids")
        self.d2t.copy_(target_ids - torch.arange(len(target_ids), device=target_ids.device))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def context_features(self, captured: Dict[int, torch.Tensor]) -> torch.Tensor:
        """The concatenated features [B, T, m·d_t] from `capture_features(target, drafter.feature_layers)`."""
        return torch.cat([captured[k] for k in self.feature_layers], dim=-1)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # [..., m·d_t] → [..., d]

    # ------------------------------------------------------------------------------------------ the passes
    def _layers(self, x: torch.Tensor, positions: torch.Tensor, contexts: Sequence[KV],
                unseen: Optional[torch.Tensor]) -> torch.Tensor:
        rope = self.rotary_emb(x, positions)
        for layer, context in zip(self.layers, contexts):
            x = layer(x, rope, context, self.config.block_size, unseen)
        return self.norm(x)  # [B, n, d]

    def _context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> List[KV]:
        """Each layer's keys and values of the fused context [B, T, d] at `positions` [B, T]."""
        rope = self.rotary_emb(fused, positions)
        return [layer.self_attn.keys_values(fused, rope) for layer in self.layers]

    def _embed(self, ids: torch.Tensor, target: nn.Module) -> torch.Tensor:
        return target.get_input_embeddings()(ids).to(self.fc.weight.dtype)  # [..., d]

    def draft_head(self, target: nn.Module) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The target's lm_head over the draft vocabulary, (weight [Vd, d], bias [Vd] or None): its own tensors for
        the full vocabulary, else a copy of its rows — which decoding takes once (inference/block.py), not per block:
        gathering 8,192 rows of SmolLM2's lm_head costs a tenth of a target step on a CPU."""
        lm_head = target.get_output_embeddings()
        if len(self.d2t) == self.config.vocab_size:
            return lm_head.weight, lm_head.bias
        ids = self.draft_ids
        return lm_head.weight[ids], None if lm_head.bias is None else lm_head.bias[ids]

    def _drafts(self, hidden: torch.Tensor, target: nn.Module, head: Optional[Tuple] = None) -> BlockDrafts:
        """The backbone's drafts from the final hidden states of whole blocks [..., S, d] (head: `draft_head`'s, or
        taken from the target now)."""
        hidden = hidden[..., self._first_slot:, :]  # [..., γ, d]
        weight, bias = head if head is not None else self.draft_head(target)  # [Vd, d], [Vd] or None
        return BlockDrafts(F.linear(hidden.to(weight.dtype), weight, bias), hidden)  # logits [..., γ, Vd]

    def backbone(self, context: torch.Tensor, block_ids: torch.Tensor, anchors: torch.Tensor, target: nn.Module,
                 fused: bool = False) -> BlockDrafts:
        """All blocks of a batch in one pass, before DSpark's heads. context: features [B, T, m·d_t] (or already
        fused, [B, T, d], with fused=True) of positions 0..T−1; block_ids [B, N, S] (`block_inputs`); anchors [B, N],
        the position of each block's first slot. Blocks may overlap; each sees the context before its anchor."""
        B, N, S = block_ids.shape
        H = context.to(self.fc.weight.dtype) if fused else self.fuse(context)  # [B, T, d]
        T = H.shape[1]
        contexts = self._context_kv(H, torch.arange(T, device=H.device).expand(B, T))
        positions = (anchors[..., None] + torch.arange(S, device=anchors.device)).reshape(B, N * S)  # [B, N·S]
        x = self._embed(block_ids.reshape(B, N * S), target)  # [B, N·S, d]
        hidden = self._layers(x, positions, contexts, slot_mask(context_mask(anchors, T), S))  # [B, N·S, d]
        return self._drafts(hidden.view(B, N, S, -1), target)

    def heads(self, logits: torch.Tensor, hidden: torch.Tensor, prev: Optional[torch.Tensor],
              detach_confidence: bool = False, select: bool = True, state: Optional[torch.Tensor] = None,
              draft: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """DSpark's Markov and confidence heads, DFlash2's candidate selector or Domino's correction, on backbone
        drafts: logits [..., Vd], hidden [..., d] and the previous token of each, prev [...] (target ids). Returns
        (logits [..., Vd], confidence logits [...] or None); DFlash: the logits unchanged. DFlash2 (with `select`): the
        selector's scores of the draft's top-K candidates after prev, −inf elsewhere — the row its draft is drawn from
        and verified with. Domino: draft number `draft` (0-based) corrected from the GRU state [1, ..., g] after prev
        (`read`), unless it is one of the first pure_draft_prefix_len. detach_confidence (training): the confidence
        head reads its inputs detached."""
        if self.prefix_gru is not None:
            if state is None:
                raise ValueError("a Domino drafter's correction needs the GRU state after each draft's previous token")
            if draft < self.config.pure_draft_prefix_len:
                return logits, None
            delta = self.embed_proj(torch.cat([hidden, state[0].to(hidden.dtype)], dim=-1))  # [..., V]
            return logits + delta.to(logits.dtype), None
        if self.candidate_selector is not None and select:
            if prev is None:
                raise ValueError("a DFlash2 drafter's selector needs the previous token of each draft (prev)")
            return self.select(logits, hidden, prev), None
        if self.markov_head is None and self.confidence_head is None:
            return logits, None
        if prev is None:
            raise ValueError("a DSpark drafter's heads need the previous token of each draft (prev)")
        markov = (self.markov_head.markov_w1(prev) if self.markov_head is not None
                  else hidden.new_zeros(*prev.shape, 0))  # [..., r]
        if self.markov_head is not None:
            logits = logits + self.markov_head.markov_w2(markov).to(logits.dtype)  # [..., Vd]
        reads = torch.cat([hidden, markov], dim=-1)  # [..., d + r]
        confidence = (self.confidence_head.proj(reads.detach() if detach_confidence else reads)[..., 0]
                      if self.confidence_head is not None else None)  # [...]
        return logits, confidence

    def select(self, logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """DFlash2: logits [..., V] → the selector's scores [..., V] (float32) of their top-K ids after prev [...],
        −inf off the candidates."""
        unary, candidates = logits.topk(self.config.selector_top_k, dim=-1)  # [..., K] (full vocabulary: target ids)
        scores = self.candidate_selector.scores(unary, candidates, hidden, prev)  # [..., K]
        return torch.full(logits.shape, float("-inf"), device=logits.device).scatter(-1, candidates, scores)

    def read(self, state: Optional[torch.Tensor], prev: torch.Tensor, target: nn.Module) -> Optional[torch.Tensor]:
        """Domino: the GRU state [1, B, g] after it reads prev [B] (target ids) from `state` (None: the start of a
        block, before the anchor). None for the other variants, which carry nothing from draft to draft."""
        if self.prefix_gru is None:
            return None
        embedded = self._embed(prev[:, None], target).to(self.prefix_gru.weight_hh_l0.dtype)  # [B, 1, d]
        return self.prefix_gru(embedded, state)[1]  # [1, B, g]

    def correct(self, logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor,
                target: nn.Module) -> torch.Tensor:
        """Domino's corrected logits of whole blocks, teacher-forced: logits [B, N, γ, V], hidden [B, N, γ, d] and
        prev [B, N, γ], the true token before each draft (`teacher_prev`). The GRU runs over each block's prev; draft j
        from pure_draft_prefix_len on adds its correction from the state after prev_j — what `read` and `heads`
        compute one draft at a time."""
        B, N, γ = prev.shape
        P = self.config.pure_draft_prefix_len
        embedded = self._embed(prev.reshape(B * N, γ), target).to(self.prefix_gru.weight_hh_l0.dtype)  # [B·N, γ, d]
        states = self.prefix_gru(embedded)[0].view(B, N, γ, -1)  # [B, N, γ, g] after x_a .. x_{a+j}
        delta = self.embed_proj(torch.cat([hidden[..., P:, :], states[..., P:, :].to(hidden.dtype)], -1))  # [.., γ−P, V]
        return torch.cat([logits[..., :P, :], logits[..., P:, :] + delta.to(logits.dtype)], dim=-2)

    def forward(self, context: torch.Tensor, block_ids: torch.Tensor, anchors: torch.Tensor, target: nn.Module,
                prev_ids: Optional[torch.Tensor] = None, fused: bool = False,
                detach_confidence: bool = False) -> BlockDrafts:
        """The training pass: `backbone`, then DSpark's heads or Domino's correction teacher-forced on prev_ids
        [B, N, γ] (`teacher_prev`). DFlash2's logits stay the backbone's: its selector has a loss of its own
        (train/block.py)."""
        drafts = self.backbone(context, block_ids, anchors, target, fused)
        if self.prefix_gru is not None:
            if prev_ids is None:
                raise ValueError("a Domino drafter's correction needs the true token before each draft (prev_ids)")
            return BlockDrafts(self.correct(drafts.logits, drafts.hidden, prev_ids, target), drafts.hidden,
                               base=drafts.logits)
        logits, confidence = self.heads(drafts.logits, drafts.hidden, prev_ids, detach_confidence, select=False)
        return BlockDrafts(logits, drafts.hidden, confidence)

    # ---------------------------------------------------------------------------------- training inputs
    def block_inputs(self, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[B, N, S] blocks [x_a, MASK × (S−1)] of tokens [B, T] at anchors [B, N]."""
        ids = torch.full((*anchors.shape, self.config.block_size), self.config.mask_token_id, dtype=tokens.dtype,
                         device=tokens.device)  # [B, N, S]
        ids[..., 0] = tokens.gather(1, anchors)
        return ids

    def draft_labels(self, tokens: torch.Tensor, anchors: torch.Tensor, ignore: int = -100) -> torch.Tensor:
        """[B, N, γ] the tokens the drafts predict, x_{a+1..a+γ}; `ignore` past the end of the sequence."""
        return token_windows(tokens, anchors, 1, self.num_drafts, ignore)

    def teacher_prev(self, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[B, N, γ] the true previous token of each draft, x_{a..a+γ−1} (the mask token past the end)."""
        return token_windows(tokens, anchors, 0, self.num_drafts, self.config.mask_token_id)

    # ------------------------------------------------------------------------------------------ decoding
    def new_cache(self, batch: int = 1) -> ContextCache:
        c, p = self.config, self.fc.weight
        empty = [p.new_zeros(batch, c.num_key_value_heads, 0, c.head_dim) for _ in self.layers]
        return ContextCache(keys=list(empty), values=list(empty))

    def extend_context(self, cache: ContextCache, context: torch.Tensor, fused: bool = False) -> None:
        """Add the features [B, n, m·d_t] (or fused [B, n, d]) of the next n committed positions to the cache."""
        H = context.to(self.fc.weight.dtype) if fused else self.fuse(context)  # [B, n, d]
        B, n, _ = H.shape
        positions = (cache.length + torch.arange(n, device=H.device)).expand(B, n)  # [B, n]
        for layer, (k, v) in enumerate(self._context_kv(H, positions)):
            cache.keys[layer] = torch.cat([cache.keys[layer], k], dim=2)  # [B, kvh, T + n, hd]
            cache.values[layer] = torch.cat([cache.values[layer], v], dim=2)

    def draft_block(self, cache: ContextCache, anchor_ids: torch.Tensor, target: nn.Module,
                    head: Optional[Tuple] = None) -> BlockDrafts:
        """One block at the position after the cached context, from anchor_ids [B] (the newest committed token, whose
        features the target has not produced yet): the backbone's drafts [B, γ, ...] (head: `draft_head(target)`,
        taken once by a decoder). DSpark samples draft j from `heads(logits[:, j], hidden[:, j], prev)`, prev being
        the anchor, then the draft before."""
        B, S = anchor_ids.shape[0], self.config.block_size
        ids = torch.full((B, S), self.config.mask_token_id, dtype=anchor_ids.dtype, device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        positions = (cache.length + torch.arange(S, device=ids.device)).expand(B, S)  # [B, S]
        contexts = [cache.context(layer) for layer in range(len(self.layers))]
        return self._drafts(self._layers(self._embed(ids, target), positions, contexts, None), target, head)


# ------------------------------------------------------------------------------------------- helpers
def copy_target_layers(drafter: BlockDrafter, target: nn.Module) -> List[str]:
    """Start the drafter's n layers from the target's last n (drafter layer i ← target layer L − n + i): every tensor
    the two layers name alike, which must have the same shape. Tensors the target's layers lack (q_norm and k_norm
    of a Llama target) keep their initial values. Returns the drafter's names copied."""
    source, n = target.model.layers, len(drafter.layers)
    if n > len(source):
        raise SpecdrafterError(f"the drafter has {n} layers, the target only {len(source)} to copy from")
    copied = []
    for i, layer in enumerate(drafter.layers):
        theirs, ours = source[len(source) - n + i].state_dict(), layer.state_dict()
        shared = [name for name in ours if name in theirs]
        misfit = next((name for name in shared if theirs[name].shape != ours[name].shape), None)
        if misfit is not None:
            raise SpecdrafterError(f"cannot copy target layer {len(source) - n + i} into drafter layer {i}: {misfit} is "
                                   f"{list(theirs[misfit].shape)} in the target, {list(ours[misfit].shape)} here; set "
                                   "drafter.block.init_from_target=false to start the drafter's layers fresh")
        layer.load_state_dict({name: theirs[name] for name in shared}, strict=False)
        copied += [f"layers.{i}.{name}" for name in shared]
    return copied
