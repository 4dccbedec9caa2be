"""EAGLE draft heads (docs/algorithms.md §EAGLE): the EAGLE-3 head, the EAGLE-1 head, their configs and folders.

The EAGLE-3 head reads target features — the inputs to three target layers (low, middle, high), concatenated and
fused by `fc` (3·d_t → d) — and, for each position t, the embedding of the next token x_{t+1}; its one decoder
layer attends over concat(norm(embedding), norm(hidden)) and its output hidden state predicts x_{t+2} through
`norm` and a pruned `lm_head` over the draft vocabulary (target id = i + d2t[i]). Later draft steps feed the
head's own output hidden state instead of the target's feature.

EAGLE-3.1 (docs/algorithms.md §EAGLE-3.1) is the same head with config flags, named as vLLM, SGLang, speculators and
llama.cpp read them (EAGLE31_FLAGS): `fc_norm` (an RMSNorm on each aux feature before `fc`, `fc_norm.{i}.weight`),
`norm_output` (the post-norm hidden state fed back to the next draft step; `lm_head` reads it without another norm)
and `norm_before_fc` (one RMSNorm over the concatenated features, `input_norm.weight`; excludes `fc_norm`).

The module's parameter names are the SGLang / vLLM "HF-style" EAGLE-3 names (docs/formats.md §EAGLE-3), so a
checkpoint folder is config.json + model.safetensors that those engines load unchanged. The head borrows the
target's token embedding at run time; it is not part of the checkpoint. Training (train/) and decoding
(inference/) both import the heads from here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.weights import read_safetensors, save_config_and_weights
from specdrafter.models.targets import global_rope, mlp_activation

KV = Tuple[torch.Tensor, torch.Tensor]


class EagleAttention(nn.Module):
    """Llama attention whose q/k/v read `input_size` features (2·d for EAGLE-3). Keys and values come from the
    cache (decoding) and/or `prev_kv`, earlier training-time-test steps laid out before this call's own."""

    def __init__(self, config: LlamaConfig, input_size: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, position_embeddings: KV, mask: Optional[torch.Tensor],
                cache: Optional[DynamicCache] = None, prev_kv: Sequence[KV] = ()) -> Tuple[torch.Tensor, KV]:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, h, T, hd]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, T, hd]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, T, hd]
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        own = (k, v)
        if cache is not None:
            k, v = cache.update(k, v, 0)  # [B, kvh, S, hd] the cached past followed by this call's keys
        if prev_kv:
            k = torch.cat([p[0] for p in prev_kv] + [k], dim=2)  # [B, kvh, S, hd]
            v = torch.cat([p[1] for p in prev_kv] + [v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.num_kv_heads != self.num_heads)  # [B, h, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), own


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(d, eps)  # normalises the token embedding
        self.hidden_norm = LlamaRMSNorm(d, eps)  # normalises the fused feature / previous draft hidden state
        self.self_attn = EagleAttention(config, 2 * d)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden, embeds, position_embeddings, mask, cache=None, prev_kv=()):
        residual = hidden  # the residual stream is the un-normalised hidden state (EAGLE-3, SGLang)
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2d]
        attn, kv = self.self_attn(x, position_embeddings, mask, cache, prev_kv)
        hidden = residual + attn  # [B, T, d]
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, kv


class Eagle3Head(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        target_d = getattr(config, "target_hidden_size", None) or d
        self.fc = nn.Linear(3 * target_d, d, bias=False)
        flags = eagle31_flags(config)
        if flags.get("fc_norm"):  # EAGLE-3.1: one RMSNorm per aux feature (vLLM, SGLang, speculators: fc_norm.{i})
            self.fc_norm = nn.ModuleList([LlamaRMSNorm(target_d, config.rms_norm_eps) for _ in range(3)])
        if flags.get("norm_before_fc"):  # one RMSNorm over the concatenation (speculators' input_norm, llama.cpp)
            self.input_norm = LlamaRMSNorm(3 * target_d, config.rms_norm_eps)
        self.norm_output = bool(flags.get("norm_output"))  # EAGLE-3.1: the post-norm state is fed back
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(d, config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config)

    @property
    def aux_layer_ids(self) -> List[int]:
        return list(self.config.eagle_config["eagle_aux_hidden_state_layer_ids"])

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target token id of each draft-vocabulary entry, [Vd]."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def fuse(self, features: Dict[int, torch.Tensor]) -> torch.Tensor:
        """Concatenate the aux-layer features (low, middle, high) and project them: [..., 3·d_t] → [..., d]."""
        return self.fuse_concatenated(torch.cat([features[k] for k in self.aux_layer_ids], dim=-1))

    def fuse_concatenated(self, x: torch.Tensor) -> torch.Tensor:
        """fc of the concatenated features [..., 3·d_t], after EAGLE-3.1's norms when the head has them."""
        if hasattr(self, "input_norm"):
            x = self.input_norm(x)
        if hasattr(self, "fc_norm"):
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(3, dim=-1))], dim=-1)
        return self.fc(x)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                mask: Optional[torch.Tensor] = None, cache: Optional[DynamicCache] = None,
                prev_kv: Sequence[KV] = ()) -> Tuple[torch.Tensor, KV]:
        """hidden [B, T, d] (fused target features or the head's own outputs), embeds [B, T, d] of the next
        tokens, position_ids [B, T]; mask: bool [B or 1, 1, T, S], True = may attend. Returns the output hidden
        state [B, T, d] fed back at the next draft step — pre-norm (EAGLE-3), or after `norm` with norm_output
        (EAGLE-3.1) — and this call's (keys, values)."""
        position_embeddings = self.rotary_emb(hidden, position_ids)
        hidden, kv = self.midlayer(hidden, embeds, position_embeddings, mask, cache, prev_kv)
        return (self.norm(hidden) if self.norm_output else hidden), kv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft logits [..., Vd] of an output hidden state of `forward` (already normalised with norm_output)."""
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))  # [..., Vd]


EAGLE31_FLAGS = ("fc_norm", "norm_output", "norm_before_fc")  # the config keys, as the engines name them


def eagle31_flags(config) -> Dict[str, bool]:
    """The EAGLE-3.1 flags a head's config (LlamaConfig or config.json dict) sets true."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    return {key: True for key in EAGLE31_FLAGS if get(key) is True}


def eagle3_config(target_config, aux_layer_ids: Sequence[int], draft_vocab_size: int,
                  attention_bias: Optional[bool] = None, flags: Optional[Dict[str, bool]] = None) -> LlamaConfig:
    """The head's config: one decoder layer with the target's dimensions, in the layout engines load (attention
    biases as the target has them, unless `attention_bias` says); `flags`: EAGLE-3.1's (EAGLE31_FLAGS), written only
    when true, so an EAGLE-3 head's config.json is unchanged."""
    t = target_config
    flags = {key: True for key, on in (flags or {}).items() if on}
    if flags.get("fc_norm") and flags.get("norm_before_fc"):
        raise SpecdrafterError("fc_norm and norm_before_fc exclude each other (a norm per aux layer, or one over the "
                               "three concatenated): set one")
    return LlamaConfig(
        **flags, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        hidden_act=mlp_activation(t), rms_norm_eps=t.rms_norm_eps, rope_parameters=global_rope(t),
        max_position_embeddings=t.max_position_embeddings,  # copy the target's: a smaller one collapses acceptance
        attention_bias=getattr(t, "attention_bias", False) if attention_bias is None else attention_bias,
        vocab_size=t.vocab_size, draft_vocab_size=draft_vocab_size,
        target_hidden_size=t.hidden_size, tie_word_embeddings=False, bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id, pad_token_id=getattr(t, "pad_token_id", None),
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True,
                      "aux_layer_id_convention": "input"},  # id k = input to target layer k (vLLM's reading)
    )


def save_eagle3(head: nn.Module, folder: str | Path) -> Path:
    """Write an EAGLE-3 (or EAGLE-1) head's config.json + model.safetensors atomically (temp folder, rename)."""
    return save_config_and_weights(head, folder)


def load_eagle3(folder: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """An EAGLE-3 head in any layout `eagle3_layout` recognises: our training folders, our exports, and what
    SpecForge, the EAGLE repo and speculators save (docs/formats.md §Loading heads trained elsewhere)."""
    folder, what = Path(folder), "EAGLE-3 head"
    raw, weights = _read_head_folder(folder, what)
    layout = eagle3_layout(raw)
    if layout is None:
        raise SpecdrafterError(f"{str(folder)!r} is not an {what} checkpoint (architectures: {raw.get('architectures')}"
                               + (f", speculators_model_type: {raw['speculators_model_type']!r}"
                                  if "speculators_model_type" in raw else "") + ")")
    head = Eagle3Head(_build_config(lambda: eagle3_head_config(raw, layout, str(folder)), folder, what))
    return _fill(head, full_vocab_maps(head, remap_eagle3_weights(weights, layout)), folder, what, dtype)


def load_eagle1(folder: str | Path, dtype: torch.dtype = torch.float32) -> "Eagle1Head":
    folder, what = Path(folder), "EAGLE-1 head"
    raw, weights = _read_head_folder(folder, what)
    if EAGLE1_ARCH not in "".join(a for a in raw.get("architectures") or [] if isinstance(a, str)):
        raise SpecdrafterError(f"{str(folder)!r} is not an {what} checkpoint (architectures: {raw.get('architectures')})")
    return _fill(Eagle1Head(_build_config(lambda: LlamaConfig.from_dict(raw), folder, what)), weights, folder, what,
                 dtype)


def _read_head_folder(folder: Path, what: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """config.json (as written, not through LlamaConfig.from_pretrained, which reads a speculators config's
    transformer_layer_config instead of the file's own keys) and the weights."""
    if not folder.is_dir():
        raise SpecdrafterError(f"could not load the {what} in {str(folder)!r}: no such folder")
    try:
        raw = json.loads((folder / "config.json").read_text())
        weights = read_safetensors(folder / "model.safetensors")  # a damaged file: one line naming it
    except (OSError, ValueError) as e:
        raise SpecdrafterError(f"could not load the {what} in {str(folder)!r}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise SpecdrafterError(f"{str(folder / 'config.json')!r} holds a JSON {type(raw).__name__}, not an object")
    return raw, weights


def _build_config(build, folder: Path, what: str) -> LlamaConfig:
    try:
        return build()
    except (TypeError, ValueError) as e:  # a value LlamaConfig cannot take
        raise SpecdrafterError(f"could not load the {what} in {str(folder)!r}: config.json: "
                               f"{str(e).splitlines()[0]}") from None


def _fill(head: nn.Module, weights: Dict[str, torch.Tensor], folder: Path, what: str, dtype: torch.dtype):
    """Load `weights` into `head`; names or shapes other than its config.json describes are one line."""
    expected = set(head.state_dict())
    missing, unknown = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unknown:
        parts = ([f"missing {', '.join(missing[:4])}"] if missing else []) + (
            [f"{', '.join(unknown[:4])} {'has' if len(unknown) == 1 else 'have'} no counterpart in specdrafter's "
             f"{what}"] if unknown else [])
        raise SpecdrafterError(f"the weights in {str(folder)!r} do not fit an {what} of its config.json: "
                               + "; ".join(parts))
    try:
        head.load_state_dict(weights)
    except RuntimeError as e:  # a tensor of another shape than its config.json describes
        raise SpecdrafterError(f"the weights in {str(folder)!r} do not fit an {what} of its config.json: "
                               f"{' '.join(str(e).split())[:200]}") from None
    return head.to(dtype).eval()


def full_vocab_maps(head: Eagle3Head, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A full-vocabulary head exported without d2t / t2d (engines refuse them when Vd = V) gets the identity maps:
    d2t all zeros [V], t2d all true [V]."""
    if head.config.draft_vocab_size != head.config.vocab_size:
        return weights
    identity = {"d2t": torch.zeros_like(head.d2t), "t2d": torch.ones_like(head.t2d)}
    return {**identity, **weights}


def aux_order_problem(ids: Sequence[int], where: str, fix: str = "list three distinct ids, low to high") -> Optional[str]:
    """Why EAGLE-3 aux-layer ids are unusable, or None. They must be distinct and increasing: the engines capture each
    layer once, in layer order, so `fc` must have been trained on the features in that order (unsorted ids: another
    order, no error; a repeated id: fc gets too few inputs and the engine crashes)."""
    ids = list(ids)
    if ids == sorted(set(ids)):
        return None
    what = "repeat a layer" if len(set(ids)) < len(ids) else "are not in increasing order"
    return (f"{where} = {ids} {what}: engines capture each aux layer once, in layer order, so the head's fc would read "
            f"other features than in training; {fix}")


def check_aux_order(ids: Sequence[int], where: str, fix: str = "list three distinct ids, low to high") -> None:
    problem = aux_order_problem(ids, where, fix)
    if problem:
        raise SpecdrafterError(problem)


def default_aux_layers(num_layers: int) -> List[int]:
    """The aux layers (our reading) an EAGLE-3 head reads when its config names none: low, middle, high. Ours, and
    what SpecForge ([1, L//2 - 1, L - 4] as layer outputs), speculators, vLLM and SGLang default to."""
    return [2, num_layers // 2, num_layers - 3]


# ------------------------------------------------------------------------------ EAGLE-3 layouts we load
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
# Saved beside the head by the public trainers, unused when drafting: the target's frozen token embedding (the
# head borrows the target's; a speculators head that trained its own is refused by its embed_requires_grad) and
# speculators' copies of the verifier's norm and lm_head, which only make training targets.
TRAINER_ONLY_TENSORS = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def eagle3_layout(config: dict) -> Optional[str]:
    """The EAGLE-3 head layout a config.json describes (None: not an EAGLE-3 head), named after the export that
    writes it. They differ in where the aux-layer ids are and how they read (docs/formats.md §Aux-layer ids):

        specdrafter  our training folder: eagle_config.aux_layer_id_convention says how its ids read
        vllm         HF-style (midlayer.*, fc, norm, lm_head, d2t, t2d) with top-level
                     eagle_aux_hidden_state_layer_ids, vLLM's reading (= ours)
        sglang       HF-style with ids in eagle_config only, in SGLang's reading (id k = the output of layer k),
                     or none (the trainers' default): also what SpecForge and the EAGLE repo write, whose configs
                     say LlamaForCausalLMEagle3, or LlamaForCausalLM with a draft_vocab_size
        speculators  the speculators library's Eagle3Speculator: transformer_layer_config, layers.0.*, top-level
                     ids in vLLM's reading
    """
    archs = config.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if "speculators_model_type" in config or "Eagle3Speculator" in archs:
        return "speculators" if config.get("speculators_model_type", "eagle3") == "eagle3" else None
    if not (any("Eagle3" in a for a in archs) or ("LlamaForCausalLM" in archs and config.get("draft_vocab_size"))):
        return None
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    if "aux_layer_id_convention" in eagle:
        return "specdrafter"
    return "vllm" if "eagle_aux_hidden_state_layer_ids" in config else "sglang"


def eagle3_head_config(raw: dict, layout: str, where: str) -> LlamaConfig:
    """Our head's config from a config.json of `layout`, its aux-layer ids in our reading. A setting our head
    cannot compute is one SpecdrafterError naming it. Ids the file leaves out are the trainers' default, which
    depends on the target: `eagle_config.default_aux_layers` marks them for `check_head_fits` to fill in."""
    unsupported = unsupported_eagle3_settings(raw, layout)
    if unsupported:
        raise SpecdrafterError(f"the EAGLE-3 head in {where!r} cannot be loaded: {unsupported}")
    layer = raw["transformer_layer_config"] if layout == "speculators" else raw
    drop = {"architectures", "model_type", "eagle_config", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size",
            "target_hidden_size", "norm_before_residual", "_name_or_path", *EAGLE31_FLAGS}
    config = LlamaConfig.from_dict({**{k: v for k, v in layer.items() if k not in drop}, **eagle31_flags(raw)})
    ids = eagle3_aux_layer_ids(raw, layout, where)
    config.architectures, config.num_hidden_layers, config.tie_word_embeddings = [EAGLE3_ARCH], 1, False
    config.draft_vocab_size = raw.get("draft_vocab_size") or config.vocab_size
    config.target_hidden_size = raw.get("target_hidden_size") or config.hidden_size
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": ids or [], "use_aux_hidden_state": True,
                           "aux_layer_id_convention": "input", **({"default_aux_layers": True} if ids is None else {})}
    return config


def unsupported_eagle3_settings(raw: dict, layout: str) -> Optional[str]:
    """What in a config.json makes its head compute something ours does not (None: nothing). Our head: one Llama
    decoder layer whose residual is the un-normalised hidden state, fc on the concatenated features (after
    EAGLE-3.1's fc_norm or norm_before_fc, not both), norm before lm_head, the pre-norm hidden state fed back (the
    post-norm one with norm_output), the target's token embedding. norm_output reads as vLLM, SGLang, speculators and
    SpecForge since its #879 read it: true = EAGLE-3.1's feedback, false = EAGLE-3."""
    if raw.get("fc_norm") is True and raw.get("norm_before_fc") is True:
        return "fc_norm and norm_before_fc are both true; a head has one or the other (speculators refuses both too)"
    if layout == "speculators":
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            return "its speculators config has no transformer_layer_config"
        model_type = layer.get("model_type", "qwen3")  # speculators builds a Qwen3 layer when none is named
        if model_type != "llama":
            return (f"transformer_layer_config.model_type = {model_type!r}; specdrafter's head is a Llama decoder "
                    "layer")
        flags = {"embed_requires_grad": "a token embedding trained with the head, not the target's"}
        layers_key, layers = "transformer_layer_config.num_hidden_layers", layer.get("num_hidden_layers", 1)
    else:
        flags = {}
        layers_key, layers = "num_hidden_layers", raw.get("num_hidden_layers", 1)  # SpecForge builds one anyway
        eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        if eagle.get("use_aux_hidden_state", True) is False:
            return "eagle_config.use_aux_hidden_state = false; specdrafter's head fuses three target layers"
    flags["norm_before_residual"] = "the normalised hidden state as the residual"
    on = next((key for key in flags if raw.get(key) is True), None)
    if on is not None:
        return f"{on} = true ({flags[on]}); specdrafter's head has no such setting"
    if layers != 1:
        return f"{layers_key} = {layers}; specdrafter's head has one decoder layer"
    return None


def eagle3_aux_layer_ids(raw: dict, layout: str, where: str) -> Optional[List[int]]:
    """The aux-layer ids of a config.json in our reading (id k = the input to target layer k); None: it names none."""
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if layout in ("vllm", "speculators"):
        key, ids, shift = "eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"), 0
    else:
        key, ids = "eagle_config.eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids")
        convention = eagle.get("aux_layer_id_convention", "output")  # SGLang's reading unless the file says
        if convention not in ("input", "output"):
            raise SpecdrafterError(f"{where!r}: eagle_config.aux_layer_id_convention = {convention!r} (known: "
                                   "'input', 'output')")
        shift = 1 if convention == "output" else 0  # the output of layer k is the input to layer k + 1
    if ids is None:
        return None
    if not (isinstance(ids, list) and len(ids) == 3 and all(isinstance(k, int) and k >= 0 for k in ids)):
        raise SpecdrafterError(f"{where!r}: {key} = {ids!r}; an EAGLE-3 head reads three target layers (ids >= 0)")
    return [k + shift for k in ids]


def remap_eagle3_weights(weights: Dict[str, torch.Tensor], layout: str) -> Dict[str, torch.Tensor]:
    """A checkpoint's tensors under our Eagle3Head names: speculators' layers.0.* are midlayer.*; the tensors
    TRAINER_ONLY_TENSORS lists are dropped. Anything else keeps its name (load_eagle3 refuses names it cannot place)."""
    if layout == "speculators":
        weights = {re.sub(r"^layers\.0\.", "midlayer.", name): t for name, t in weights.items()}
    return {name: t for name, t in weights.items() if name not in TRAINER_ONLY_TENSORS}


# ---------------------------------------------------------------------------------------------- EAGLE-1
EAGLE1_ARCH = "LlamaForCausalLMEagle"  # SGLang's EAGLE(-1/-2) head class


class Eagle1Head(nn.Module):
    """EAGLE-1 (docs/algorithms.md §EAGLE): fc(concat(feature f_t, embedding of x_{t+1})) → one Llama decoder layer
    → f̂_{t+1}, the predicted next feature (the target's last-layer output, pre-norm); its logits come from the
    target's own final norm and lm_head, borrowed at run time (`attach`), so the head has the full vocabulary. Later
    draft steps feed f̂ back as the feature."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        d, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.input_layernorm = LlamaRMSNorm(d, eps)
        self.self_attn = EagleAttention(config, d)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps)
        self.mlp = LlamaMLP(config)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.vocab_size, dtype=torch.long))  # full vocabulary: identity
        self._target_head: Tuple[nn.Module, ...] = ()

    def attach(self, target) -> "Eagle1Head":
        self._target_head = (target.model.norm, target.lm_head)  # a tuple: not registered, not saved
        return self

    @property
    def aux_layer_ids(self) -> List[int]:
        return [self.config.eagle_config["eagle_aux_hidden_state_layer_ids"][0]]

    @property
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def fuse(self, features: Dict[int, torch.Tensor]) -> torch.Tensor:
        return features[self.aux_layer_ids[0]]  # [..., d] the last layer's output is the feature itself

    def forward(self, hidden, embeds, position_ids, mask=None, cache=None, prev_kv=()):
        x = self.fc(torch.cat([hidden, embeds], dim=-1))  # [B, T, d]
        attn, kv = self.self_attn(self.input_layernorm(x), self.rotary_emb(x, position_ids), mask, cache, prev_kv)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv  # f̂ [B, T, d]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._target_head:
            raise SpecdrafterError("an EAGLE-1 head needs its target's norm and lm_head: call head.attach(target)")
        norm, lm_head = self._target_head
        return lm_head(norm(hidden).to(lm_head.weight.dtype))  # [..., V]


def eagle1_config(target_config) -> LlamaConfig:
    config = eagle3_config(target_config, [target_config.num_hidden_layers], target_config.vocab_size)
    config.architectures = [EAGLE1_ARCH]
    config.draft_vocab_size = None  # the target's lm_head
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [target_config.num_hidden_layers],
                           "use_aux_hidden_state": False, "aux_layer_id_convention": "input"}
    return config


def check_head_fits(head: nn.Module, target) -> None:
    """Refuse a head made for another target, in one line; a head whose config named no aux layers
    (eagle_config.default_aux_layers, set by load_eagle3) gets the trainers' default for this target."""
    t, c = target.config, head.config
    eagle = getattr(c, "eagle_config", None) or {}
    if eagle.get("default_aux_layers") and not eagle.get("eagle_aux_hidden_state_layer_ids"):
        eagle["eagle_aux_hidden_state_layer_ids"] = default_aux_layers(t.num_hidden_layers)
    if c.vocab_size != t.vocab_size:
        raise SpecdrafterError(f"EAGLE head vocabulary ({c.vocab_size} tokens) differs from the target's ({t.vocab_size} tokens)")
    trained_for = getattr(c, "target_hidden_size", None) or c.hidden_size  # optional in the engines' configs
    if trained_for != t.hidden_size:
        raise SpecdrafterError(f"EAGLE head was trained for hidden size {trained_for}, the target has {t.hidden_size}")
    if not (getattr(c, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids"):
        raise SpecdrafterError("EAGLE head config has no eagle_config.eagle_aux_hidden_state_layer_ids: the target "
                               "layers it reads are unknown")
    bad = [k for k in head.aux_layer_ids if not 0 <= k <= t.num_hidden_layers]
    if bad:
        raise SpecdrafterError(f"EAGLE head reads target layer {bad[0]}, but the target has {t.num_hidden_layers} layers")
