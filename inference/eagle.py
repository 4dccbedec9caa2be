"""EAGLE-3 draft head (docs/algorithms.md §EAGLE) and the proposers that decode with it.

The head reads target features — the inputs to three target layers (low, middle, high), concatenated and
fused by `fc` (3·d_t → d) — and, for each position t, the embedding of the next token x_{t+1}; its one decoder
layer attends over concat(norm(embedding), norm(hidden)) and its output hidden state predicts x_{t+2} through
`norm` and a pruned `lm_head` over the draft vocabulary (target id = i + d2t[i]). Later draft steps feed the
head's own output hidden state instead of the target's feature.

The module's parameter names are the SGLang / vLLM "HF-style" EAGLE-3 names (docs/formats.md §EAGLE-3), so a
checkpoint folder is config.json + model.safetensors that those engines load unchanged. The head borrows the
target's token embedding at run time; it is not part of the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from data.io import SpecdrafterError, read_safetensors, save_config_and_weights
from inference.proposers import Proposal
from inference.sampling import SamplingParams, draw
from inference.tree import TreeShape, select_dynamic_tree

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
        return self.fc(torch.cat([features[k] for k in self.aux_layer_ids], dim=-1))

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                mask: Optional[torch.Tensor] = None, cache: Optional[DynamicCache] = None,
                prev_kv: Sequence[KV] = ()) -> Tuple[torch.Tensor, KV]:
        """hidden [B, T, d] (fused target features or the head's own outputs), embeds [B, T, d] of the next
        tokens, position_ids [B, T]; mask: bool [B or 1, 1, T, S], True = may attend. Returns the output hidden
        state [B, T, d] (pre-norm; fed back at the next draft step) and this call's (keys, values)."""
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.midlayer(hidden, embeds, position_embeddings, mask, cache, prev_kv)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # [..., Vd]


def eagle3_config(target_config, aux_layer_ids: Sequence[int], draft_vocab_size: int) -> LlamaConfig:
    """The head's config: one decoder layer with the target's dimensions, in the layout engines load."""
    t = target_config
    return LlamaConfig(
        architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        hidden_act=t.hidden_act, rms_norm_eps=t.rms_norm_eps, rope_parameters=t.rope_parameters,
        max_position_embeddings=t.max_position_embeddings,  # copy the target's: a smaller one collapses acceptance
        attention_bias=getattr(t, "attention_bias", False), vocab_size=t.vocab_size, draft_vocab_size=draft_vocab_size,
        target_hidden_size=t.hidden_size, tie_word_embeddings=False, bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id, pad_token_id=getattr(t, "pad_token_id", None),
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True,
                      "aux_layer_id_convention": "input"},  # id k = input to target layer k (vLLM's reading)
    )


def save_eagle3(head: nn.Module, folder: str | Path) -> Path:
    """Write an EAGLE-3 (or EAGLE-1) head's config.json + model.safetensors atomically (temp folder, rename)."""
    return save_config_and_weights(head, folder)


def load_eagle3(folder: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    return _load_head(folder, dtype, "Eagle3", Eagle3Head, "EAGLE-3 head")


def load_eagle1(folder: str | Path, dtype: torch.dtype = torch.float32) -> "Eagle1Head":
    return _load_head(folder, dtype, EAGLE1_ARCH, Eagle1Head, "EAGLE-1 head")


def _load_head(folder, dtype, arch: str, cls, what: str):
    folder = Path(folder)
    if not folder.is_dir():
        raise SpecdrafterError(f"could not load the {what} in {str(folder)!r}: no such folder")
    try:
        config = LlamaConfig.from_pretrained(folder)
        weights = read_safetensors(folder / "model.safetensors")  # a damaged file: one line naming it
    except (OSError, ValueError) as e:
        raise SpecdrafterError(f"could not load the {what} in {str(folder)!r}: {str(e).splitlines()[0]}") from None
    if arch not in "".join(config.architectures or []):
        raise SpecdrafterError(f"{str(folder)!r} is not an {what} checkpoint (architectures: {config.architectures})")
    head = cls(config)
    try:
        head.load_state_dict(full_vocab_maps(head, weights) if cls is Eagle3Head else weights)
    except RuntimeError as e:  # weights of another layout or shape than its config.json describes
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


def check_aux_order(ids: Sequence[int], where: str, fix: str = "list three distinct ids, low to high") -> None:
    """EAGLE-3 aux-layer ids must be distinct and increasing: the engines capture each layer once, in layer order, so
    `fc` must have been trained on the features in that order (unsorted ids: another order, no error; a repeated
    id: fc gets too few inputs and the engine crashes)."""
    ids = list(ids)
    if ids != sorted(set(ids)):
        what = "repeat a layer" if len(set(ids)) < len(ids) else "are not in increasing order"
        raise SpecdrafterError(f"{where} = {ids} {what}: engines capture each aux layer once, in layer order, so the "
                               f"head's fc would read other features than in training; {fix}")


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
    t, c = target.config, head.config
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


class EagleProposer:
    """Chain drafting with an EAGLE-3 (or EAGLE-1) head.

    The head's cache holds one entry per position t whose pair (target feature f_t, next token x_{t+1}) it has
    seen. The loop hands over features of newly committed positions through `observe`; they wait in `pending`
    until the next `propose`, which feeds them, then k − 1 of its own (hidden state, drafted token) pairs.
    """

    def __init__(self, head: nn.Module, target):
        check_head_fits(head, target)
        if isinstance(head, Eagle1Head):
            head.attach(target)
        self.head = head.eval()
        self.embed = target.get_input_embeddings()
        self.vocab_size = target.config.vocab_size
        self.feature_layers = head.aux_layer_ids
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.cached = 0  # positions whose target-feature pair is in the head's cache
        self.pending: List[torch.Tensor] = []  # fused features [n, d] of the positions after them

    @torch.no_grad()
    def observe(self, features: Dict[int, torch.Tensor]) -> None:
        """Features {layer id: [n, d_t]} of the next n committed positions."""
        self.pending.append(self.head.fuse(features))  # [n, d]

    @torch.no_grad()
    def feed_pending(self, committed: List[int]) -> torch.Tensor:
        """Feed the waiting target features with their next tokens; return the last output hidden state [1, 1, d]."""
        if not self.pending:
            raise SpecdrafterError("EAGLE drafting needs target features of at least one position (a prompt of >= 2 tokens)")
        hidden = torch.cat(self.pending)[None]  # [1, m, d]
        start, m = self.cached, hidden.shape[1]
        ids = torch.tensor([committed[start + 1:start + m + 1]])  # [1, m] x_{t+1} for each position t
        positions = torch.arange(start, start + m)[None]  # [1, m]
        mask = torch.ones(m, start + m, dtype=torch.bool).tril(start)[None, None]  # causal over past + new
        out, _ = self.head(hidden, self.embed(ids), positions, mask, self.cache)  # [1, m, d]
        self.cached, self.pending = start + m, []
        return out[:, -1:]

    @torch.no_grad()
    def propose(self, committed: List[int], k: int, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> Proposal:
        hidden = self.feed_pending(committed)  # [1, 1, d] predicts the token after the newest committed one
        position = self.cached  # the first drafted pair sits right after the fed positions
        draft_ids = self.head.draft_ids  # [Vd] target id of each draft-vocabulary entry
        indices, rows = [], []
        for step in range(k):
            # sampled in the draft vocabulary: the other target tokens have q = 0 (logit −inf) anyway
            index, q = draw(self.head.logits(hidden)[0, -1], params, generator)  # q [Vd] or None (greedy)
            indices.append(index)
            rows.append(q)
            if step == k - 1:
                break
            token = draft_ids[index:index + 1][None]  # [1, 1]
            hidden, _ = self.head(hidden, self.embed(token), torch.tensor([[position + step]]), None, self.cache)
        tokens = draft_ids[indices]  # [k]
        if params.greedy:
            return Proposal(tokens, None)
        probs = torch.zeros(k, self.vocab_size, dtype=torch.float64)
        probs[:, draft_ids] = torch.stack(rows)  # [k, V] the q rows in the target's vocabulary
        return Proposal(tokens, probs)

    def rollback(self, num_committed: int) -> None:
        drafted = self.cache.get_seq_length() - self.cached
        if drafted:
            self.cache.crop(-drafted)  # rollback: drop the drafted pairs; accepted ones return as target features


class EagleTreeProposer(EagleProposer):
    """EAGLE-2 dynamic tree drafted by the EAGLE-3 head (docs/algorithms.md §Dynamic trees), with
    `DynamicTreeProposer`'s selection rules: score = cumulative draft log-prob (log-softmax over the draft
    vocabulary) along the path; each depth, every frontier node proposes its top_k children, the top_k of those k²
    become the next frontier; the tree is the `total_tokens` best nodes overall (closed under ancestors; ties
    towards shallower nodes).

    A frontier node at depth d is fed as the pair (output hidden state of its parent — for d = 1 the last output
    of `feed_pending` —, embedding of its token) at position cached + d − 1, seeing the committed pairs and its
    fed ancestors: exactly what the chain proposer feeds for the same path. The tree entries are cropped before
    returning, so the cache again holds only the `cached` committed pairs.
    """

    def __init__(self, head: Eagle3Head, target, depth: int = 5, top_k: int = 8, total_tokens: int = 60, tuner=None):
        if min(depth, top_k, total_tokens) < 1:
            raise SpecdrafterError(f"dynamic tree needs depth, top_k, total_tokens >= 1, got {depth}, {top_k}, {total_tokens}")
        if top_k > len(head.d2t):
            raise SpecdrafterError(f"dynamic tree top_k ({top_k}) exceeds the EAGLE head's draft vocabulary "
                                   f"({len(head.d2t)} tokens)")
        super().__init__(head, target)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.tuner = tuner  # a TreeSizeTuner: verify only as many of the total_tokens candidates as pay (None: all)
        self.max_tree_size = total_tokens + 1

    @torch.no_grad()
    def propose_tree(self, committed: list[int]) -> tuple[TreeShape, torch.Tensor]:
        """The tree's shape and node tokens [N+1] (target ids; node 0 = the newest committed token)."""
        hidden = self.feed_pending(committed)[0]  # [1, d] predicts the depth-1 children
        past = self.cached  # committed pairs in the cache; depth-d nodes sit at position past + d − 1
        draft_ids = self.head.draft_ids  # [Vd]
        # candidate nodes: (score, depth, parent candidate or -1 for the root, draft-vocabulary index)
        nodes: list[tuple[float, int, int, int]] = []
        frontier, fed_ancestry = [-1], {-1: []}
        outputs = {-1: hidden[0]}  # output hidden state [d] of each fed node: its children's input
        fed_order: list[int] = []  # candidate ids in the order they were fed to the head
        levels = self.tuner.draft_depth(self.depth) if self.tuner is not None else self.depth
        for depth in range(1, levels + 1):
            logp = self.head.logits(hidden).log_softmax(-1)  # [F, Vd] one row per frontier node
            top = logp.topk(self.top_k, dim=-1)
            children = []
            for row, parent in enumerate(frontier):
                base = nodes[parent][0] if parent >= 0 else 0.0
                for lp, index in zip(top.values[row].tolist(), top.indices[row].tolist()):
                    nodes.append((base + lp, depth, parent, index))
                    children.append(len(nodes) - 1)
            if depth == levels:
                break
            frontier = sorted(children, key=lambda c: -nodes[c][0])[: self.top_k]
            # feed the new frontier: each node sees the committed pairs, its fed ancestors and itself
            slot = {c: past + i for i, c in enumerate(fed_order + frontier)}  # cache slot of each tree node
            mask = torch.zeros(len(frontier), past + len(slot), dtype=torch.bool)  # [F, S]
            mask[:, :past] = True
            for row, c in enumerate(frontier):
                fed_ancestry[c] = fed_ancestry[nodes[c][2]] + [c]
                mask[row, [slot[a] for a in fed_ancestry[c]]] = True
            parent_out = torch.stack([outputs[nodes[c][2]] for c in frontier])[None]  # [1, F, d]
            ids = draft_ids[[nodes[c][3] for c in frontier]][None]  # [1, F] target ids
            positions = torch.full((1, len(frontier)), past + depth - 1)  # [1, F]
            out, _ = self.head(parent_out, self.embed(ids), positions, mask[None, None], self.cache)  # [1, F, d]
            hidden = out[0]  # [F, d]
            outputs.update(zip(frontier, hidden))
            fed_order += frontier
        self.cache.crop(-len(fed_order))  # rollback: drop the tree nodes, keep the `cached` committed pairs
        shape, keep, self.node_probs = select_dynamic_tree(nodes, self.total_tokens, self.tuner)
        return shape, torch.tensor([committed[-1]] + draft_ids[[nodes[c][3] for c in keep]].tolist())
